"""What the cache already holds of a rollout, and whether a new turn extends it.

Runs in SGLang's HTTP process, on the tokenizer manager's event loop: the generate hook
looks a tagged rollout up before generation (one ``stat``, :func:`look_up`), the send
hooks check that a continued rollout's prompt starts with the stored trajectory
(:func:`check_prefix`), and the shipper does both after generation for a rollout it
assumed new when its write finds rows already stored.  A PD decode server checks its
prefix its own way (:mod:`sglang_r3.http_server.pd`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from r3_client import AsyncRoutingClient, R3Error, RolloutNotFoundError, token_digest
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server import metrics
from sglang_r3.http_server.outcomes import CACHE_DOWN, cache_unreachable
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import MoeShape


@dataclass(frozen=True, slots=True)
class Continuation:
    """What is already stored for a rollout: rows ``[0, end)`` over tokens with ``digest``."""

    end: int
    digest: str


async def look_up(
    client: AsyncRoutingClient, shape: MoeShape, rollout_id: str, *, gaps: bool = False
) -> Continuation | None:
    """The stored trajectory of ``rollout_id`` (None: new rollout, or one that holds
    views and no rows yet).

    A stored rollout must be one contiguous run ``[0, end)`` from this model's
    geometry (``shape``); anything else is a 409, since appending to it would misalign
    rows.  ``gaps``: rows may be missing below the end (a PD decode server, whose
    segments land before or after the prefill server's): ``end`` is then the highest
    stored row and ``digest`` that of the segment ending there, which covers every
    token before it.
    """
    try:
        info = await client.stat(rollout_id)
    except RolloutNotFoundError:
        return None
    except CACHE_DOWN as exc:
        raise cache_unreachable(exc, rollout_id) from None
    except R3Error as exc:
        raise R3RequestError(400, f"r3: rollout {rollout_id!r}: {exc}") from None
    geometry = (info.num_experts, info.topk, tuple(info.layer_ids))
    ours = (shape.num_experts, shape.topk, shape.moe_layer_ids)
    if geometry != ours:
        metrics.CONFLICTS.inc()
        raise R3RequestError(
            409,
            f"r3: rollout {rollout_id!r} is stored with (experts, top-k, layers)={geometry}, "
            f"this model has {ours}",
        )
    if not info.segments:
        # Only views: an earlier call stored what it recomputed, then not its own rows
        # (its ship failed). Nothing to continue: its retry starts the rollout, and its
        # views replace those (a view serving no stored segment is not fixed).
        return None
    segs = sorted(info.segments, key=lambda s: s.segment.start)
    covered = 0
    for s in segs:
        if s.segment.start != covered:
            break
        covered = s.segment.end
    if gaps:
        segs = sorted(segs, key=lambda s: s.segment.end)
    elif covered != info.num_rows:
        metrics.CONFLICTS.inc()
        raise R3RequestError(
            409, f"r3: rollout {rollout_id!r} has gaps in its stored rows; cannot continue it"
        )
    digest = segs[-1].segment.tokens_digest
    if not digest:
        metrics.CONFLICTS.inc()
        raise R3RequestError(
            409,
            f"r3: rollout {rollout_id!r} was stored without token digests, so a new turn "
            "cannot be checked against it; use a new rollout id",
        )
    return Continuation(info.num_rows, digest)


def check_prefix(tag: OutputTag, cont: Continuation, input_ids: Sequence[int]) -> None:
    """409 unless ``input_ids`` extends the stored trajectory of the rollout."""
    if len(input_ids) <= cont.end or token_digest(input_ids[: cont.end]) != cont.digest:
        metrics.CONFLICTS.inc()
        raise R3RequestError(
            409,
            f"r3: rollout {tag.rollout_id!r} has {cont.end} stored positions, and this "
            f"request's {len(input_ids)} prompt tokens do not start with that trajectory; "
            "send the full conversation so far, or start a new rollout id (a branch)",
        )
