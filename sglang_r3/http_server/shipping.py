"""From a finished output to stored segments and the reference put in the response.

Runs in SGLang's HTTP process (the tokenizer manager's event loop), never in the
scheduler: encoding goes to a worker thread and the write is an async call, so the
scheduler keeps stepping while routing is shipped, and the response is released
only once its routing is stored.  The stages of one ship: accept the hand-over (the
retraction policy), split off the views a call recomputed
(:mod:`~sglang_r3.http_server.views`), cut the rows into segments by weight version
(:mod:`~sglang_r3.http_server.weight_versions`), plan the frames in a worker thread,
write them, and answer (:mod:`~sglang_r3.http_server.outcomes`); a rollout assumed new
that turns out to be stored is resolved against what the cache holds
(:mod:`~sglang_r3.http_server.continuation`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from r3_client import (
    AsyncRoutingClient,
    Context,
    FormatError,
    LimitExceededError,
    PutResult,
    Retry,
    Segment,
    SegmentConflictError,
    Timeout,
    encode_frame,
    read_header,
    token_digest,
)
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError, samples_conflict
from sglang_r3.http_server import metrics
from sglang_r3.http_server.continuation import Continuation, check_prefix, look_up
from sglang_r3.http_server.outcomes import (
    CACHE_DOWN,
    failed,
    new_reference,
    no_routing,
    stored,
    stored_segments,
)
from sglang_r3.http_server.output_rows import (
    FORMS,
    EngineOutput,
    check_engine_rows,
    check_row_count,
    count_rows,
    engine_rows_of,
)
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.http_server.views import Computations, ViewRows, split_computations
from sglang_r3.http_server.weight_versions import (
    Versions,
    segment_cuts,
    version_at,
    version_runs,
)
from sglang_r3.layers import MoeShape
from sglang_r3.scheduler.row_transport import EngineRows

#: Rollout contexts a process remembers for continuation frames (~6 KB each at 48x128).
_CONTEXTS = 4096
#: Rollout ids a process remembers having written or looked up (see Shipper.seen).
_SEEN = 1 << 16


@dataclass(frozen=True, slots=True)
class _Plan:
    """The frames of one output, ready to write (built off the event loop)."""

    moe: npt.NDArray[Any]  # the output's rows of the MoE layers, from its start
    segs: list[Segment]
    parts: list[npt.NDArray[Any]]
    frames: list[bytes]
    bases: list[Context | None]  # the context each frame continues (None: its own)
    own: Context | None  # the first frame's own context, when it carries one


class Shipper:
    """Owns the cache client of one process and turns outputs into stored segments."""

    _cuts = staticmethod(segment_cuts)  # where a store cuts rows into segments

    def __init__(self, config: EngineConfig, shape: MoeShape, model_id: str) -> None:
        self.config = config
        self.shape = shape
        self.model_id = config.model_id or model_id
        self.client = AsyncRoutingClient(
            config.routing_cache,
            api_key=config.api_key,
            timeout=Timeout(connect=min(5.0, config.put_timeout_s), read=config.put_timeout_s),
            retry=Retry(attempts=config.put_attempts, backoff=0.1, max_backoff=1.0),
        )
        # rollout id -> the context (E, K, layers, relabel table) of its first segment
        # this process wrote, so later turns ship as continuation frames; LRU-bounded.
        self._contexts: OrderedDict[str, Context] = OrderedDict()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._all_moe = shape.moe_layer_ids == tuple(range(shape.num_layers))

    async def continuation(self, rollout_id: str, *, gaps: bool = False) -> Continuation | None:
        """The stored trajectory of ``rollout_id`` (None: new rollout, or one that holds
        views and no rows yet): :func:`~sglang_r3.http_server.continuation.look_up`
        against this model's geometry; the rollout counts as seen from now on."""
        self._remember(rollout_id)
        return await look_up(self.client, self.shape, rollout_id, gaps=gaps)

    def _worth(self, ctx: Context, rows: int) -> bool:
        return ctx.has_table or rows < self.shape.num_experts

    def seen(self, rollout_id: str) -> bool:
        """True when this process wrote or looked up ``rollout_id`` (recently)."""
        return rollout_id in self._seen

    def _remember(self, rollout_id: str) -> None:
        self._seen[rollout_id] = None
        self._seen.move_to_end(rollout_id)
        while len(self._seen) > _SEEN:
            self._seen.popitem(last=False)

    def _encode(self, rows: npt.NDArray[Any], seg: Segment, base: Context | None) -> bytes:
        return encode_frame(
            rows,
            num_experts=self.shape.num_experts,
            layer_ids=self.shape.moe_layer_ids,
            start=seg.start,
            segment=seg,
            base=base,
            version=self.config.format_version,
        )

    def _plan(
        self,
        rollout_id: str,
        routing: EngineOutput,
        start: int,
        cuts: list[int],
        tokens: list[int],
        versions: Versions,
    ) -> _Plan:
        """Everything proportional to rows, run in a worker thread (numpy, zstd and
        sha256 release the GIL there): rows of the MoE layers, per-segment token
        digests, frames.  Raises :class:`R3RequestError` (500) on misaligned rows,
        :class:`FormatError` on invalid ones."""
        rows = engine_rows_of(routing, self.shape)
        check_engine_rows(rows, cuts[-1] - start)
        moe = self._moe(rows)
        return self._frames(rollout_id, moe, start, cuts, tokens, versions)

    def _frames(
        self,
        rollout_id: str,
        moe: npt.NDArray[Any],
        start: int,
        cuts: list[int],
        tokens: list[int],
        versions: Versions,
    ) -> _Plan:
        """Encode ``moe`` (rows from ``start``) as one segment per pair of ``cuts``.

        The first segment continues the rollout's cached context when that is worth
        it, else carries its own; later segments continue the cached context, or
        the first segment's own, so that they can be written at the same time as
        the first: the service refuses a continuation frame whose context is not
        stored, so a later segment can never land in a rollout where the first one
        did not.
        """
        segs = [
            Segment(a, b, self.model_id, version_at(versions, a), token_digest(tokens[:b]))
            for a, b in itertools.pairwise(cuts)
        ]
        parts = [moe[a - start : b - start] for a, b in itertools.pairwise(cuts)]
        stored = self._contexts.get(rollout_id)
        base = stored if stored is not None and self._worth(stored, len(parts[0])) else None
        first = self._encode(parts[0], segs[0], base)
        own = None
        if base is None:
            head = read_header(first, verify=False).context
            assert head is not None
            own = Context.parse(head.raw)
        frames = [first]
        bases = [base]
        for seg, part in zip(segs[1:], parts[1:], strict=True):
            b: Context | None = None
            if stored is not None and self._worth(stored, len(part)):
                b = stored
            elif own is not None and self._worth(own, len(part)):
                b = own
            frames.append(self._encode(part, seg, b))
            bases.append(b)
        return _Plan(moe, segs, parts, frames, bases, own)

    async def _write(self, rollout_id: str, plan: _Plan, share_end: int) -> list[PutResult]:
        """Store the plan's segments, all at once when they can be.

        Segments ending at or before ``share_end`` (a GRPO group's prompt rows: the
        tag's ``share_prompt``; 0 when nothing is shared) are put as shared, so the
        service keeps them once for the whole group; every other segment (a sample's
        own rows, a later turn) is put as the rollout's own, freed with it.

        Segments that continue the first one's context are sent with it; if one
        reaches the service first (refused: its context is not stored yet), it is
        sent again once the first is stored.  Segments coded on their own are only
        sent after the first one, for the same reason.  A continuation of a cached
        context the service no longer holds (the rollout was deleted or rewritten
        elsewhere) is re-encoded with its own context and sent again.
        """
        share = [seg.end <= share_end for seg in plan.segs]
        first = asyncio.ensure_future(self._put_one(rollout_id, plan, 0, None, share[0]))
        if any(b is None for b in plan.bases[1:]):
            # A later segment with its own context could be stored where the first
            # is refused; keep the order.
            await asyncio.gather(first, return_exceptions=True)
        rest = [
            self._put_one(rollout_id, plan, i, first, share[i]) for i in range(1, len(plan.frames))
        ]
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        if plan.own is not None and rollout_id not in self._contexts:
            self._contexts[rollout_id] = plan.own  # with its table
            while len(self._contexts) > _CONTEXTS:
                self._contexts.popitem(last=False)
        self._remember(rollout_id)
        return [r for r in results if not isinstance(r, BaseException)]

    async def _put_one(
        self,
        rollout_id: str,
        plan: _Plan,
        i: int,
        first: asyncio.Future[PutResult] | None,
        share: bool,
    ) -> PutResult:
        frame = plan.frames[i]
        try:
            return await self.client.put(rollout_id, frame, share=share)
        except SegmentConflictError as exc:
            if plan.bases[i] is None or "holds no context" not in str(exc):
                raise
        if first is not None and plan.bases[i] is plan.own:
            # Sent before the first segment (which carries the context) was stored.
            await first  # raises the first segment's error, if any
            return await self.client.put(rollout_id, frame, share=share)
        # The cached context is gone from the service: code the rows on their own.
        self._contexts.pop(rollout_id, None)
        frame = await asyncio.to_thread(self._encode, plan.parts[i], plan.segs[i], None)
        return await self.client.put(rollout_id, frame, share=share)

    async def ship(
        self,
        tag: OutputTag,
        start: int,
        routing: EngineOutput | None,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        meta_info: dict[str, Any],
        *,
        assumed_new: bool = False,
        may_continue: bool = True,
    ) -> dict[str, Any]:
        """Store the output's new rows; return the reference for the response.

        Nothing proportional to rows runs on the event loop: decoding, checks, the
        layer gather, digests and encoding run in one worker thread, then the
        segments are written concurrently.  ``assumed_new``: the rollout was not
        looked up before generation (this process had not seen it) and ``start``
        is 0; if the cache turns out to hold it, the output is checked against
        the stored trajectory now and only the rows past it are stored (a 409 if
        it does not extend it, or if ``may_continue`` is false: n>1 samples).
        Under the ``inline`` policy a cache failure returns a reference with
        ``stored: false`` and the routing in ``meta_info`` as upstream's base64.
        """
        t0 = time.perf_counter()
        tokens = [*prompt_ids, *output_ids]
        end = len(tokens) - 1
        ref = new_reference(tag.rollout_id, start, max(end, start))
        if routing is None:
            return no_routing(meta_info, ref)
        wv = self._accept(tag, routing, meta_info, max(end - start, 0), ref)
        versions = version_runs(meta_info, len(prompt_ids), wv)
        ref["weight_version"] = version_at(versions, max(end - 1, 0))
        split: Computations | None = None
        if (
            isinstance(routing, EngineRows)
            and routing.first is not None
            and (routing.first < start or routing.snapshots)
        ):
            split = await asyncio.to_thread(self._split, routing, start, end)
            routing = EngineRows(split.rows)
        if end <= start:
            check_row_count(count_rows(routing, self.shape), 0)
            self._remember(tag.rollout_id)
            return stored(ref)
        try:
            if split is not None and split.views:
                # Views first: a segment must never be readable without the view its
                # tokens attended to.  A view whose segment then fails to store serves
                # nothing (reads skip it) and the retry may replace it.
                ref["views"] = await self._store_views(tag, split.views, tokens, versions)
            plan, puts, start = await self._store_rows(
                tag,
                routing,
                start,
                tokens,
                len(prompt_ids),
                versions,
                assumed_new,
                may_continue,
                () if split is None else split.cuts,
            )
        except (FormatError, SegmentConflictError, LimitExceededError, *CACHE_DOWN) as exc:
            policy = tag.on_cache_error or self.config.on_cache_error
            return failed(exc, ref, on_cache_error=policy, attempts=self.config.put_attempts)
        ref["start"] = start
        if not puts:  # the stored trajectory already covers every row
            return stored(ref)
        return stored_segments(ref, plan.segs, puts, rows=end - start, since=t0)

    def _split(self, routing: EngineRows, start: int, end: int) -> Computations:
        """The output's first computations and views (a worker thread): 500 when the rows
        do not cover ``[first, end)``."""
        assert routing.first is not None
        check_engine_rows(engine_rows_of(routing, self.shape), end - routing.first)
        return split_computations(
            routing.array, routing.first, start, routing.epochs, routing.snapshots
        )

    def _moe(self, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The MoE layers of rows ``[rows, all layers, K]`` (no copy when every layer is)."""
        return rows if self._all_moe else rows[:, list(self.shape.moe_layer_ids), :]

    async def _store_views(
        self, tag: OutputTag, views: Sequence[ViewRows], tokens: list[int], versions: Versions
    ) -> list[dict[str, Any]]:
        """Store each view (rows the request recomputed) as a self-contained frame; the
        references' entries."""
        out = []
        for v in views:
            seg = Segment(
                v.start,
                v.end,
                self.model_id,
                version_at(versions, v.serves),
                token_digest(tokens[: v.end]),
            )
            frame = await asyncio.to_thread(self._encode, self._moe(v.rows), seg, None)
            put = await self.client.put(tag.rollout_id, frame, view=v.serves)
            metrics.VIEWS.inc()
            metrics.VIEW_ROWS.inc(v.end - v.start)
            out.append(
                {
                    "serves": v.serves,
                    "start": v.start,
                    "end": v.end,
                    "nbytes": put.nbytes,
                    "weight_version": seg.weight_version,
                }
            )
        return out

    def _accept(
        self,
        tag: OutputTag,
        routing: EngineOutput,
        meta_info: dict[str, Any],
        expected: int,
        ref: dict[str, Any],
    ) -> str:
        """Count the hand-over, apply the retraction policy; the weight version to store."""
        metrics.BYTES_UPSTREAM.inc(expected * self.shape.num_layers * self.shape.topk * 4)
        metrics.HANDOVER.labels(FORMS.get(type(routing), "other")).inc()
        retractions = int(meta_info.get("num_retractions") or 0)
        if retractions:
            metrics.RETRACTED.inc()
            ref["retractions"] = retractions
            if (tag.on_retraction or self.config.on_retraction) == "fail":
                metrics.GUARD_TRIPS.labels("retraction").inc()
                raise R3RequestError(
                    503,
                    f"r3: the scheduler retracted this request {retractions} time(s); its rows "
                    "may be re-prefilled rather than those sampled with (policy: fail)",
                )
        problem = getattr(routing, "problem", None)
        if problem:
            # The scheduler could not keep the rows some kept tokens were sampled after
            # (sglang_r3.scheduler.row_hooks): storing what the KV held would be wrong rows.
            metrics.GUARD_TRIPS.labels("retraction_rows").inc()
            raise R3RequestError(500, problem)
        return tag.weight_version or str(meta_info.get("weight_version") or "")

    async def _store_rows(
        self,
        tag: OutputTag,
        routing: EngineOutput,
        start: int,
        tokens: list[int],
        prompt_len: int,
        versions: Versions,
        assumed_new: bool,
        may_continue: bool,
        extra_cuts: Sequence[int] = (),
    ) -> tuple[_Plan, list[PutResult], int]:
        """Plan (in a worker thread) and write the segments; ``(plan, puts, start)``.

        An ``assumed_new`` rollout the cache already holds is checked against the
        stored trajectory and only the rows past it are written: ``start`` moves
        there, and ``puts`` is empty when nothing is past it.
        """
        end, prompt_end = len(tokens) - 1, prompt_len - 1
        # only a first turn's prompt rows are shared (_cuts), and only by a GRPO group
        share_end = prompt_end if tag.share_prompt and start == 0 else 0
        cuts = sorted({*self._cuts(tag, start, prompt_end, end, versions), *extra_cuts})
        plan = await asyncio.to_thread(
            self._plan, tag.rollout_id, routing, start, cuts, tokens, versions
        )
        try:
            return plan, await self._write(tag.rollout_id, plan, share_end), start
        except SegmentConflictError:
            if not assumed_new:
                raise
            cont = await self._stored_prefix(tag, tokens[:prompt_len], may_continue)
            if cont is None:
                raise
        start = cont.end  # only the rows past the stored trajectory are new
        if start >= end:  # nothing past it (no token generated)
            return plan, [], start
        cuts = self._cuts(tag, start, prompt_end, end, versions)
        plan = await asyncio.to_thread(
            self._frames, tag.rollout_id, plan.moe[start:], start, cuts, tokens, versions
        )
        return plan, await self._write(tag.rollout_id, plan, share_end), start

    async def _stored_prefix(
        self, tag: OutputTag, prompt_ids: Sequence[int], may_continue: bool
    ) -> Continuation | None:
        """After a conflict on a rollout assumed new: what is stored, if this output
        extends it (else the 409 a lookup before generation would have given)."""
        cont = await self.continuation(tag.rollout_id)
        if cont is None:
            return None
        if not may_continue:
            metrics.CONFLICTS.inc()
            raise samples_conflict(tag.rollout_id)
        check_prefix(tag, cont, prompt_ids)
        return cont
