"""PD disaggregation: which rows a prefill server and a decode server each ship.

With ``--disaggregation-mode prefill`` / ``decode`` one request runs on two engines
(sglang-router sends the same body to both, with the same bootstrap room).  The
prefill server computes the prompt's KV, transfers it, and answers with the first
output token; the decode server receives that KV and generates the rest.  SGLang
0.5.23 records routing rows wherever the forward pass runs, by device KV slot:

- prefill: rows ``[start_len, P)`` are real (collected when the KV transfer
  succeeds, ``disaggregation/prefill.py:1222-1224``); a radix hit there holds rows
  computed there.  The plugin ships them as on any server: from the rollout's
  stored length, after checking the prompt extends the stored trajectory.
- decode: the prompt's slots are filled by the transfer, never by a forward, so
  their capturer rows are whatever the buffer held (0 on a fresh engine); rows
  ``[P, P + N - 1)`` are computed there.  A tagged request on a decode server is
  therefore always sent with ``routed_experts_start_len = P`` (upstream honours it,
  ``batch_result_processor.py:154-160``) and ships only those rows.

Both land in the rollout's segments under the one rollout id, in either order: the
decode segment may be stored before the prefill segment below it (the cache keeps
a gap of up to ``R3_CACHE_MAX_GAP_ROWS`` rows, which the prefill segment fills).
So on decode the stored end may be below ``P``, and the lookup tolerates gaps; it
still refuses a prompt that does not extend what is stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r3_client import token_digest
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server import metrics
from sglang_r3.http_server.continuation import Continuation
from sglang_r3.http_server.tagging import OutputTag


def is_decode_server(tokenizer_manager: Any) -> bool:
    """True on a ``--disaggregation-mode decode`` server."""
    server_args = getattr(tokenizer_manager, "server_args", None)
    return str(getattr(server_args, "disaggregation_mode", None) or "null") == "decode"


def check_decode_prefix(
    tag: OutputTag, cont: Continuation | None, input_ids: Sequence[int]
) -> None:
    """409 unless the prompt ``input_ids`` extends what is stored of the rollout.

    Unlike a continuation on a single server, the stored end may equal the prompt
    length (this turn's prefill segment landed first) and rows below it may be
    missing (the previous turn's prefill segment has not landed yet).
    """
    if cont is None:
        return
    if cont.end > len(input_ids) or token_digest(input_ids[: cont.end]) != cont.digest:
        metrics.CONFLICTS.inc()
        raise R3RequestError(
            409,
            f"r3: rollout {tag.rollout_id!r} has rows stored up to position {cont.end}, and "
            f"this request's {len(input_ids)} prompt tokens do not start with that "
            "trajectory; send the full conversation so far, or start a new rollout id",
        )


def decode_start(tag: OutputTag, cont: Continuation | None, input_ids: Sequence[int]) -> int:
    """The ``routed_experts_start_len`` of a tagged request on a decode server: the
    prompt length, after :func:`check_decode_prefix`."""
    check_decode_prefix(tag, cont, input_ids)
    return len(input_ids)


def check_decode_retractions(tag: OutputTag, meta_info: dict[str, Any]) -> None:
    """503 for an output the decode scheduler retracted, whatever the retraction policy.

    A retracted decode request keeps its KV in a host backup and gets it back in new
    device slots (``disaggregation/decode.py`` ``resume_retracted_reqs`` ->
    ``restore_kv_cache``) without a forward pass, so the capturer rows at those
    slots belong to other requests: its rows ``[P, ...)`` would be stale, not
    re-computed as after a retraction on a single server.
    """
    retractions = int(meta_info.get("num_retractions") or 0)
    if retractions:
        metrics.GUARD_TRIPS.labels("retraction").inc()
        raise R3RequestError(
            503,
            f"r3: the PD decode scheduler retracted this request {retractions} time(s) and "
            "restored its KV without recomputing it, so its routing rows are stale; not "
            f"stored (rollout {tag.rollout_id!r}): send the turn again, or give the decode "
            "server more KV memory (--max-total-tokens / --mem-fraction-static)",
        )
