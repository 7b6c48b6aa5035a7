"""Hooks that carry a tagged request's rows to the HTTP process: marked in the scheduler,
compacted in the detokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_r3 import releases
from sglang_r3.config import engine_config
from sglang_r3.scheduler.hicache import after_in_flight
from sglang_r3.scheduler.row_transport import TaggedRows, compact_rows
from sglang_r3.tags import carries_tag

log = logging.getLogger("sglang_r3")


def _marks_rows() -> bool:
    """Whether a tagged request's rows may go to the detokenizer marked: only by pickle
    IPC (msgpack types the field).  The detokenizer runs our hooks on every release (its
    own plugin loader from 0.5.22, :func:`sglang_r3.hooks.run_detokenizer` before)."""
    return releases.pickle_ipc()


def _tagged(req: Any) -> bool:
    return carries_tag(getattr(getattr(req, "sampling_params", None), "custom_params", None))


def before_prepare_for_extend(self: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``ScheduleBatch.prepare_for_extend``: note where each tagged request's
    prefill starts computing (its radix-cache hit), per retraction epoch.

    A position below the stored end that a prefill computes again gets new KV, and the
    tokens sampled after it attend to the new computation: the rows from the lowest
    start of each epoch up are shipped as a view (:mod:`sglang_r3.http_server.views`).
    One ``min`` per tagged request in the batch; nothing proportional to rows.

    A re-prefill (epoch >= 1) also notes how many output tokens the request resumes
    with: :func:`around_collect_routed_experts` refuses the rows if a token was kept
    after the retraction whose rows the retraction did not keep.
    """
    if not engine_config().enabled:
        return None
    for req in getattr(self, "reqs", None) or ():
        if not _tagged(req):
            continue
        epoch = int(getattr(req, "retraction_count", 0) or 0)
        starts: dict[int, int] = req.__dict__.setdefault("_r3_starts", {})
        prefix = releases.req_prefix_len(req)
        starts[epoch] = min(starts.get(epoch, prefix), prefix)
        if epoch:
            resumed: dict[int, int] = req.__dict__.setdefault("_r3_resumed", {})
            resumed.setdefault(epoch, len(req.output_ids))
    return None


def around_release_req(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``schedule_batch.release_req`` (retraction, preemption): before a tagged,
    unfinished request's KV is freed, keep the rows its tokens so far were sampled with.

    The re-prefill recomputes (some of) them; the rows computed before the retraction are
    what the tokens sampled before it attended to, so they stay the request's first
    computation and the re-prefill's rows become a view.  The KV slots are noted now
    (before they are freed) and read once the forwards in flight have written their
    rows (overlap scheduling: the capture of the last forward lands later,
    :func:`sglang_r3.scheduler.hicache.after_in_flight`); a later forward that reuses a
    freed slot writes its rows when it is finalized, after that read (outputs are
    finalized in launch order).  O(rows), only on a retraction.

    Which rows: ``[0, n)`` with ``n = min(seqlen - 1, kv_committed_len)``.  Every token
    kept so far was sampled after them.  The position a decode still in flight computes
    (``seqlen - 1``) is left out: upstream discards that forward's token for a retracted
    request (``batch_result_processor``: ``req.is_retracted`` -> ``continue``), so the
    re-prefill's computation of it is the one the next token is sampled after.
    ``/pause_generation`` ``retract`` processes the forward in flight first, so its
    token is in ``output_ids`` and its position inside ``n``.  A prompt whose chunked
    prefill was cut short holds KV only up to ``kv_committed_len``: the slots past it
    are another request's, never read.  The output count is noted as well;
    :func:`around_collect_routed_experts` checks it against the re-prefill's.
    """
    req = kwargs.get("req")
    if req is not None:
        _keep_rows(req, kwargs.get("req_to_token_pool"))
    return original(*args, **kwargs)


def around_release_req_method(
    original: Callable[..., Any],
    self: Any,
    idx: int,
    remaing_req_count: int,
    server_args: Any,
) -> Any:
    """:func:`around_release_req` where the target is the method
    ``ScheduleBatch.release_req(self, idx, remaing_req_count, server_args)`` (before
    SGLang 0.5.13, :mod:`sglang_r3.releases`)."""
    _keep_rows(self.reqs[idx], getattr(self, "req_to_token_pool", None))
    return original(self, idx, remaing_req_count, server_args)


def _keep_rows(req: Any, pool: Any) -> None:
    """The retraction's work for :func:`around_release_req` (its docstring says which rows)."""
    if engine_config().enabled and _tagged(req) and not req.finished():
        from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

        capturer = get_global_experts_capturer()
        kv: Any = releases.req_kv(req)
        seqlen = len(req.origin_input_ids) + len(req.output_ids)
        idx = kv.req_pool_idx
        computed = 0 if idx is None else min(seqlen - 1, int(kv.kv_committed_len))
        if capturer is not None and pool is not None:
            req.__dict__.setdefault("_r3_retracted_outputs", []).append(len(req.output_ids))
            slots = pool.req_to_token[idx or 0][: max(computed, 0)].cpu().clone()
            kept: list[Any] = [max(computed, 0), None]
            req.__dict__.setdefault("_r3_snapshots", []).append(kept)

            def read() -> None:
                kept[1] = capturer.host_cache.buffer[slots]

            after_in_flight(read)


def around_collect_routed_experts(original: Callable[..., Any], self: Any, req: Any) -> Any:
    """AROUND the scheduler's ``_maybe_collect_routed_experts``: mark a tagged request's
    rows for the detokenizer (:class:`TaggedRows`).

    Upstream's gather is unchanged but for where it starts: when a prefill of this
    request recomputed positions below ``routed_experts_start_len`` (the stored end), the
    rows from the lowest recomputed position are gathered (they become a view), and any
    rows kept at a retraction travel along.  Otherwise nothing proportional to rows is
    added to the scheduler.
    """
    tagged = (
        getattr(req, "routed_experts", None) is None
        and _tagged(req)
        and engine_config().enabled
        and _marks_rows()
    )
    starts: dict[int, int] = req.__dict__.get("_r3_starts") or {} if tagged else {}
    stored = int(getattr(req, "routed_experts_start_len", 0) or 0)
    first = min([stored, *starts.values()])
    if first < stored:
        req.routed_experts_start_len = first
        try:
            result = original(self, req)
        finally:
            req.routed_experts_start_len = stored
    else:
        result = original(self, req)
    rows = getattr(req, "routed_experts", None)
    if tagged and rows is not None and not isinstance(rows, TaggedRows):
        epochs = tuple(starts.get(e, stored) for e in range(max(starts, default=0) + 1))
        kept = req.__dict__.get("_r3_snapshots") or []
        snaps = tuple((int(n), held) for n, held in kept)
        problem = retraction_problem(req, snaps)
        if problem:
            log.warning("%s (request %s)", problem, req.rid)
        req.routed_experts = TaggedRows(rows, first, epochs, snaps, problem)
    return result


def retraction_problem(req: Any, snaps: tuple[tuple[int, Any], ...]) -> str | None:
    """Why the rows kept at a request's retractions are not exactly what its kept tokens
    were sampled after, or ``None``.

    Refused, not guessed: rows that never landed (not seen on SGLang 0.5.23), or a
    re-prefill that resumed with another number of output tokens than the request had at
    its retraction (a token sampled by a forward whose rows the retraction did not keep;
    upstream 0.5.23 discards it, :func:`around_release_req`).
    """
    outputs: list[int] = req.__dict__.get("_r3_retracted_outputs") or []
    resumed: dict[int, int] = req.__dict__.get("_r3_resumed") or {}
    if any(held is None for _, held in snaps):
        return "r3: the rows kept at a retraction of this request never landed"
    for i, before in enumerate(outputs):
        after = resumed.get(i + 1, before)
        if after != before:
            return (
                f"r3: after retraction {i + 1} this request resumed with {after} output "
                f"tokens, {before} when it was retracted: the rows the later ones were "
                "sampled after were not kept, so its routing cannot be stored exactly"
            )
    return None


def around_detokenize(original: Callable[..., Any], self: Any, recv_obj: Any) -> Any:
    """AROUND ``DetokenizerManager.handle_batch_token_id_out``: tagged rows cross to
    the HTTP process compact (uint8/uint16), not as base64 int32."""
    items = getattr(recv_obj, "routed_experts", None)
    marked = [i for i, x in enumerate(items or ()) if isinstance(x, TaggedRows)]
    if not marked:
        return original(self, recv_obj)
    assert items is not None
    compact = {i: compact_rows(items[i]) for i in marked}
    for i in marked:
        items[i] = None  # upstream base64-encodes the others, as before
    out = original(self, recv_obj)
    for i, rows in compact.items():
        out.routed_experts[i] = rows
    return out


def around_stream_output_generation(
    original: Callable[..., Any], self: Any, reqs: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND the scheduler mixin's ``stream_output_generation`` before SGLang 0.5.13: a
    batch's ``routed_experts`` lists every request, ``None`` for those that did not ask.

    0.5.12 appends only the rows of requests that asked
    (``scheduler_output_processor_mixin.py:1237-1240``), and the tokenizer manager reads
    the list by batch position (``tokenizer_manager.py:1726-1727``): a tagged request
    batched with an untagged one (a warm-up, a health probe, any request that asks for
    no routing) gets an ``IndexError`` or another request's rows.  For this call every
    request of a batch in which one asked is marked as asking, which makes upstream list
    its ``req.routed_experts`` (``None``: nothing is collected for it, and ``None`` puts
    nothing in its output); the marks are taken back after.
    """
    asked = [bool(getattr(r, "return_routed_experts", False)) for r in reqs]
    if all(asked) or not any(asked):
        return original(self, reqs, *args, **kwargs)
    marked = [r for r, a in zip(reqs, asked, strict=True) if not a]
    for req in marked:
        req.return_routed_experts = True
    try:
        return original(self, reqs, *args, **kwargs)
    finally:
        for req in marked:
            req.return_routed_experts = False
