"""``RoutingClient``: the blocking shell over the shared core, run in the caller's thread.

The core (:class:`~r3_client._client_core.ClientCore`) does no I/O: it validates
arguments, builds requests, decides on retries, parses and decodes answers.  This shell
only drives a transport (HTTP or gRPC, chosen by the URL scheme), sleeps between retries
and decodes a batch stream's rollouts in a small thread pool while the stream goes on.
A ranged read (:meth:`RoutingClient.get_ranges`, a training rank's fetch) is planned by
:mod:`r3_client._range_plan`, also without I/O.  :class:`~r3_client.AsyncRoutingClient`
(:mod:`r3_client._async_client`) is the same shell on an event loop.

    with RoutingClient("http://cache:8080", api_key=KEY) as client:
        client.put("rollout-1", routing)                     # Routing, array, or a frame
        r = client.get("rollout-1", start=0, end=512, layers=[3, 5])  # server-side slice
        for rid, routing in client.get_many(ids, progress=True): ...
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from typing import Any, Literal, overload

import numpy.typing as npt
from tqdm import tqdm

from r3_client._answers import Deleted, DropResult, PutResult, RolloutInfo, ViewInfo
from r3_client._client_core import (
    RETRYABLE,
    ClientCore,
    Cursor,
    Result,
    T,
    sync_transport,
)
from r3_client._config import Retry, Timeout
from r3_client._exceptions import InvalidRequestError, R3Error, RolloutNotFoundError
from r3_client._fetched import FetchedRange, layers_tuple
from r3_client._range_plan import RangePlan, in_state, pieced, plan_range
from r3_client._routing import Routing, Segment, check_rollout_id
from r3_client._transports import Transport
from r3_client._views import (
    RangeRead,
    ServedRouting,
    ViewPolicy,
    check_policy,
    one_routing_policy,
    ranged_reads,
    run_steps,
)
from r3_client.codec import MAX_DECODED_BYTES, CodecName

__all__ = ["RoutingClient"]


class RoutingClient:
    """Blocking client of the routing cache.

    ``url``: ``http://host:8080`` (HTTP) or ``grpc://host:50051`` (gRPC); the
    API is identical.  ``api_key`` is sent as a bearer token.  Every call is
    idempotent and retried per ``retry`` on connection failures, timeouts and
    503s.  Errors are :class:`R3Error` subclasses whatever the transport.
    ``max_bytes`` caps what one read decodes to (checked before allocating; the
    default, 2 GiB, holds the longest rollout the service stores by default).
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        *,
        api_key: str | None = None,
        timeout: Timeout = Timeout(),
        retry: Retry = Retry(),
        transport: Transport | None = None,
        max_bytes: int = MAX_DECODED_BYTES,
    ) -> None:
        self._t = transport or sync_transport(url, api_key, timeout)
        self._core = ClientCore(retry, max_bytes)

    def __enter__(self) -> RoutingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the transport's connections."""
        self._t.close()

    def _retrying(self, fn: Callable[[], T]) -> T:
        failures = 0
        while True:
            try:
                return fn()
            except RETRYABLE as exc:
                failures += 1
                time.sleep(self._core.backoff(exc, failures))

    def put(
        self,
        rollout_id: str,
        routing: Routing | npt.ArrayLike | bytes,
        *,
        num_experts: int | None = None,
        layer_ids: Sequence[int] | None = None,
        start: int | None = None,
        segment: Segment | None = None,
        codec: CodecName = "auto",
        view: int | None = None,
        share: bool | None = None,
    ) -> PutResult:
        """Store one segment: a :class:`Routing`, an array ``[rows, L, K]`` (with
        ``num_experts`` and ``layer_ids``), or an encoded frame.

        ``view``: store it as (part of) the rollout's view serving row ``view``: rows the
        engine recomputed below that row, which the tokens from that row on attended to
        (what the SGLang extension writes; docs/store.md, "Views").

        ``share``: True keeps the segment in a blob every rollout putting the same segment
        shares (a GRPO group's prompt; it needs the segment's token digest, else it is kept
        privately), False keeps it private, None leaves it to the store's rule (segments
        from row 0 are shared); the answer's ``shared`` says which.  A view is never shared
        (``share=True`` with ``view`` is an :class:`InvalidRequestError`)."""
        frame, opts = self._core.put_request(
            rollout_id,
            routing,
            num_experts=num_experts,
            layer_ids=layer_ids,
            start=start,
            segment=segment,
            codec=codec,
            view=view,
            share=share,
        )
        return PutResult.from_dict(self._retrying(lambda: self._t.put(rollout_id, frame, **opts)))

    def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: int | None = None,
    ) -> bytes:
        """The stored frames for the rollout, or for rows ``[start, end)`` of absolute MoE
        ``layers``, concatenated as the service returns them (decode with
        :func:`r3_client.decode_rollout` and the same arguments).  ``view``: the frames of
        the rollout's view serving that row instead."""
        self._core.check_read(rollout_id, start, end)
        if view is None:
            return self._retrying(lambda: self._t.get(rollout_id, start, end, layers))
        return self._retrying(lambda: self._t.get(rollout_id, start, end, layers, view=view))

    def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "generated",
    ) -> Routing:
        """The rollout's routing, cut on the server to the blocks and layer groups that
        ``start``/``end``/``layers`` need, decoded and trimmed here.

        ``view``: ``"generated"`` (each position's first computation) or ``"latest"``
        (what the rollout's last call attended to: its views applied; one ``stat`` and
        one read per view more).  ``"exact"`` answers several routings:
        :meth:`get_served`.
        """
        one_routing_policy(view)
        data = self.get_frame(rollout_id, start=start, end=end, layers=layers)
        base = self._core.decode(data, rollout_id, start, end, layers)
        if view == "generated":
            return base
        return self._latest(rollout_id, base, layers)

    def _latest(self, rollout_id: str, base: Routing, layers: Sequence[int] | None) -> Routing:
        """``base`` with the rollout's views applied (policy ``latest``)."""
        steps = self._core.latest_steps(base, self.stat(rollout_id), rollout_id)
        return run_steps(steps, lambda v: self._view_rows(rollout_id, v, base, layers))

    def _view_rows(
        self, rollout_id: str, v: ViewInfo, base: Routing, layers: Sequence[int] | None
    ) -> Routing:
        """The rows of view ``v`` that fall in ``base``'s range (maybe none)."""
        window = self._core.view_window(v, base)
        if isinstance(window, Routing):
            return window
        return self._view_range(rollout_id, v, *window, layers)

    def _view_range(
        self, rollout_id: str, v: ViewInfo, start: int, end: int, layers: Sequence[int] | None
    ) -> Routing:
        """Rows ``[start, end)`` of view ``v``, read and decoded."""
        data = self.get_frame(rollout_id, start=start, end=end, layers=layers, view=v.serves)
        return self._core.decode(data, rollout_id, start, end, layers)

    def get_served(
        self,
        rollout_id: str,
        *,
        view: ViewPolicy = "exact",
        layers: Sequence[int] | None = None,
    ) -> list[ServedRouting]:
        """The routing each span of the rollout's tokens attended to (docs/store.md, "Views").

        ``"exact"``: one :class:`ServedRouting` per state (one for a rollout without
        views); ``"latest"`` / ``"generated"``: one, over every row, as :meth:`get`
        answers it.  Reads the rollout once and each view once, when it is applied: the
        answer's size is checked against ``max_bytes`` first, and one view's rows at a
        time are held beside it (:class:`LimitExceededError` when it would not fit).
        """
        policy = check_policy(view)
        info = self.stat(rollout_id)
        base = self.get(rollout_id, layers=layers)
        steps = self._core.served_steps(base, info, policy, rollout_id)
        return run_steps(steps, lambda v: self._view_rows(rollout_id, v, base, layers))

    def stat(self, rollout_id: str) -> RolloutInfo:
        """What is stored for the rollout (no rows)."""
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(self._retrying(lambda: self._t.stat(rollout_id)))

    def stat_many(
        self, rollout_ids: Sequence[str], *, chunk_size: int = 1024
    ) -> list[RolloutInfo | R3Error]:
        """Each rollout's :class:`RolloutInfo` or the error its :meth:`stat` would raise,
        in order: one request per ``chunk_size`` ids (the service's ``max_batch`` is 1,024
        by default), metadata only.  Ids past the service's reply budget for one batch stat
        (``R3_CACHE_MAX_BATCH_STAT_BYTES``) are asked for again in the next request.  What a
        driver checks a step with before dispatch (:func:`r3_client.rank_local.check_step`)."""
        out: list[RolloutInfo | R3Error] = []
        for chunk in self._core.chunks(rollout_ids, chunk_size):
            while chunk:  # until the service's reply budget has answered every id
                res = self._core.stats(chunk, self._stat_batch(chunk))
                n = self._core.answered(res)
                if n == 0:  # one stat over the batch budget alone: asked for by itself
                    res, n = self._core.stats(chunk[:1], [self._stat_or_error(chunk[0])]), 1
                out += res[:n]
                chunk = chunk[n:]
        return out

    def _stat_batch(self, chunk: list[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """One batch stat's answers, or (a service without batch stats) one stat per id."""
        try:
            return self._retrying(functools.partial(self._t.stat_many, chunk))
        except R3Error as exc:
            if not self._core.no_batch_stat(exc):
                raise
        return [self._stat_or_error(rid) for rid in chunk]

    def _stat_or_error(self, rollout_id: str) -> tuple[str, dict[str, Any] | R3Error]:
        try:
            return rollout_id, self._retrying(lambda: self._t.stat(rollout_id))
        except (RolloutNotFoundError, InvalidRequestError) as exc:
            return rollout_id, exc

    def delete(self, rollout_id: str) -> bool:
        """Delete the rollout; True if it existed."""
        check_rollout_id(rollout_id)
        return self._retrying(lambda: self._t.delete(rollout_id))

    def delete_many(self, rollout_ids: Sequence[str], *, chunk_size: int = 1024) -> list[Deleted]:
        """Delete rollouts and their views, e.g. a step's once trained on: one request per
        ``chunk_size`` ids (the service's ``max_batch`` is 1,024 by default); each id's
        :class:`Deleted` (whether it existed, the bytes Redis freed), in order.  Every id is
        checked before any I/O; an error the service answers for an id is raised (deleting
        again is harmless)."""
        out: list[Deleted] = []
        for chunk in self._core.chunks(rollout_ids, chunk_size):
            got = self._retrying(functools.partial(self._t.delete_many, chunk))
            out += self._core.deleted(chunk, got)
        return out

    def drop_consumed(
        self, upto: int | str, *, max_rollouts: int | None = None, max_calls: int | None = None
    ) -> DropResult:
        """Drop every rollout of this client's namespace whose every row (segments and
        views) was computed under a weight version ``<= upto``: what a trainer at version
        ``upto`` has consumed, including rollouts it aborted and never trained on.

        Rollouts are dropped whole or kept whole (one with a newer segment or view, or a
        weight version that is not a decimal integer, is kept).  The service bounds each
        call (``max_rollouts`` keys, a deadline); this loops until the walk ends, or for
        ``max_calls`` calls (the answer's ``cursor`` then says where to resume).  The
        totals of every call, with the last call's cursor."""
        version = self._core.drop_version(upto)
        total: DropResult | None = None
        calls = 0
        while (cursor := self._core.next_drop(total, calls, max_calls)) is not None:
            step = self._retrying(
                functools.partial(self._t.drop_consumed, version, cursor, max_rollouts)
            )
            total = self._core.dropped(total, step)
            calls += 1
        assert total is not None  # (the first call is always made)
        return total

    def touch(self, rollout_id: str, ttl_s: int | None = None) -> None:
        """Reset the rollout's TTL (None = the service default, 0 = never expire)."""
        check_rollout_id(rollout_id)
        self._retrying(lambda: self._t.touch(rollout_id, ttl_s))

    def rewind(self, rollout_id: str, rows: int) -> RolloutInfo:
        """Drop the rollout's segments starting at or after ``rows``; what is stored after.

        For a driver that lost the answer to a turn the engine finished and stored
        (a timeout, an abort): every retry of that turn would conflict with the
        stored rows, so it goes back to the ``rows`` it knows it holds (the
        previous turn's ``len(tokens) - 1``) and sends the turn again.  Idempotent,
        so safe to retry.  Raises :class:`SegmentConflictError` when a stored segment
        covers rows on both sides of ``rows`` (segments are dropped whole).
        """
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(self._retrying(lambda: self._t.rewind(rollout_id, rows)))

    def get_many(
        self,
        rollout_ids: Sequence[str],
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        chunk_size: int = 64,
        progress: bool = False,
        return_errors: bool = False,
        decode_workers: int = 2,
        view: ViewPolicy = "generated",
    ) -> Generator[Result, None, None]:
        """``(rollout_id, Routing)`` for each id, streamed in request order.

        One batch request per ``chunk_size`` ids.  Every id is answered exactly
        once: a failed stream, or an item that failed for a retryable reason
        (Redis briefly unavailable), is retried from that id per ``retry``.  A
        rollout that cannot be served or decoded raises its error, or with
        ``return_errors=True`` is yielded as ``(rollout_id, R3Error)``.  Ids are
        checked before any request.  Rollouts decode in ``decode_workers`` threads
        while the stream goes on; at most ``2 * decode_workers`` wait decoded.
        ``view="latest"``: each rollout's views applied as :meth:`get` does (one
        ``stat`` per rollout more, and one read per view).
        """
        self._core.check_range(start, end)
        latest = one_routing_policy(view) == "latest"
        rows = (start, end, layers)
        stream = self._stream(
            rollout_ids, None, rows, chunk_size, progress, return_errors, decode_workers
        )
        with closing(stream):  # a refusal here releases the stream before it raises
            for rid, res in stream:
                assert not isinstance(res, FetchedRange)  # (decoded: the stream's default)
                if latest and isinstance(res, Routing):
                    try:
                        res = self._latest(rid, res, layers)
                    except R3Error as exc:
                        if not return_errors:
                            raise
                        res = exc
                yield rid, res

    @overload
    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 64,
        return_errors: bool = False,
        decode_workers: int = 2,
        decode: Literal[True] = True,
    ) -> Generator[Result, None, None]: ...

    @overload
    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 64,
        return_errors: bool = False,
        decode_workers: int = 2,
        decode: bool,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]: ...

    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 64,
        return_errors: bool = False,
        decode_workers: int = 2,
        decode: bool = True,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]:
        """``(rollout_id, Routing)`` for each ``(rollout_id, start, end[, state])`` read, in
        order: rows ``[start, end)`` of absolute MoE ``layers``.

        ``decode=False``: a read its segments alone answer (under ``generated``, or no view
        applying to its rows) is answered as received, a :class:`~r3_client._fetched.
        FetchedRange` (what a rank-local layout decodes straight into its targets); the
        others as with ``decode=True``.

        A training rank's fetch (:mod:`r3_client.rank_local`): the service cuts each
        item to the blocks and layer groups of its range, so the rank receives about
        its share of the stored bytes, and a rollout may be named once per range it
        needs.  One batch request per ``chunk_size`` reads, retried and decoded as
        :meth:`get_many`.  A read outside the rollout's rows is answered
        :class:`InvalidRequestError` naming them.

        ``view`` (docs/store.md, "Views"): ``"exact"`` (the default) reads each range as
        the tokens of its ``state`` attended to (the state's first row, as
        :meth:`get_served` numbers them; none given: the first state, ``0``) and refuses
        a read that reaches past its state's rows (:func:`~r3_client._views.read_views`:
        a sample of several states is expanded into one training sample per state
        first, :func:`r3_client.expand_states`); ``"latest"`` every view applied;
        ``"generated"`` none.  Under ``exact`` and ``latest`` one batched stat names each
        rollout's views first, and each row of a read is received once, from where its
        answer takes it (:func:`~r3_client._views.read_pieces`): the last applied view
        that holds it (one request per run of rows the view wins in the read), else the
        segments (one batch item per run of such rows; none for a read wholly in views).
        Rollouts without views cost the stat only; the answer's size under ``max_bytes``
        is checked from the stat before a read with views reads anything.
        """
        policy = check_policy(view)
        items = ranged_reads(reads, policy)
        for rid, a, b, _, _ in items:
            self._core.check_read(rid, a, b)
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        infos: dict[str, RolloutInfo | R3Error] = {}
        if policy != "generated":
            ids = list(dict.fromkeys(rid for rid, _, _, _, _ in items))
            infos = dict(zip(ids, self.stat_many(ids), strict=True))
        max_bytes = self._core.max_bytes
        plans = [
            plan_range(rid, a, b, state, upto, infos.get(rid), policy, layers, max_bytes)
            for rid, a, b, state, upto in items
        ]
        stream = self._stream(
            [item[0] for item, plan in zip(items, plans, strict=True) for _ in plan.spans],
            [span for plan in plans for span in plan.spans],
            (0, None, layers),
            chunk_size,
            False,
            True,
            decode_workers,
            decode,
        )
        with closing(stream):
            for (rid, _, _, state, upto), plan in zip(items, plans, strict=True):
                parts = [next(stream)[1] for _ in plan.spans]
                got = self._range_answer(
                    rid, plan, parts, infos.get(rid), policy, (state, upto), layers
                )
                if isinstance(got, R3Error) and not return_errors:
                    raise got
                yield rid, got

    def _range_answer(
        self,
        rollout_id: str,
        plan: RangePlan,
        parts: list[Routing | FetchedRange | R3Error],
        info: RolloutInfo | R3Error | None,
        policy: str,
        state: tuple[int | None, int],
        layers: Sequence[int] | None,
    ) -> Routing | FetchedRange | R3Error:
        """One read's answer (:class:`~r3_client._range_plan.RangePlan`): ``parts`` are
        the batch stream's answers to ``plan.spans``; ``state`` the read's state and the
        end of its sample's rows; ``info`` its rollout's stat (None under ``generated``)."""
        if plan.error is not None:
            return plan.error
        if plan.pieces is not None:
            decoded = [p.routing() if isinstance(p, FetchedRange) else p for p in parts]
            return pieced(
                rollout_id,
                plan,
                decoded,
                lambda v, a, b: self._view_range(rollout_id, v, a, b, layers),
            )
        got = parts[0]
        if isinstance(got, FetchedRange) and not (plan.settled or policy == "generated"):
            got = got.routing()  # views may apply: decoded, as decode=True reads
        if policy == "generated" or not isinstance(got, Routing):
            return got
        assert info is not None  # (a stat per rollout under exact and latest)
        base = got
        return in_state(
            rollout_id,
            base,
            info,
            policy,
            *state,
            self._core.max_bytes,
            lambda v: self._view_rows(rollout_id, v, base, layers),
        )

    def _fetched(
        self,
        rid: str,
        got: bytes | R3Error,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> FetchedRange | R3Error:
        """An item's bytes undecoded (``decode=False``), or the error the service sent."""
        if isinstance(got, R3Error):
            return got
        assert end is not None  # (ranged reads only)
        return FetchedRange(rid, got, start, end, layers_tuple(layers), self._core.max_bytes)

    def _stream(
        self,
        rollout_ids: Sequence[str],
        ranges: list[tuple[int, int]] | None,
        rows: tuple[int, int | None, Sequence[int] | None],
        chunk_size: int,
        progress: bool,
        return_errors: bool,
        decode_workers: int,
        decode: bool = True,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]:
        """:meth:`get_many` and :meth:`get_ranges`: ``rows`` is the one range and layers
        of every item, or ``ranges`` one range per item (with ``rows``' layers).
        ``decode=False``: each item's bytes as a :class:`FetchedRange` (errors as they
        are)."""
        start, end, layers = rows
        chunks = self._core.chunks(rollout_ids, chunk_size)
        width = max(1, decode_workers)
        bar = tqdm(total=len(rollout_ids), disable=not progress, unit="rollout", leave=False)
        pending: deque[tuple[str, Future[Routing | FetchedRange | R3Error]]] = deque()
        offset = 0

        def ready(limit: int) -> Iterator[tuple[str, Routing | FetchedRange | R3Error]]:
            while len(pending) > limit or (pending and pending[0][1].done()):
                rid, fut = pending.popleft()
                res = fut.result()
                if isinstance(res, R3Error) and not return_errors:
                    raise res
                bar.update()
                yield rid, res

        try:
            with ThreadPoolExecutor(width, thread_name_prefix="r3-decode") as pool:
                for chunk in chunks:
                    own = None if ranges is None else ranges[offset : offset + len(chunk)]
                    spans: list[tuple[int, int | None]] = (
                        [(start, end)] * len(chunk) if own is None else list(own)
                    )
                    offset += len(chunk)
                    cur = Cursor(self._core, chunk, return_errors, rows)
                    while cur.remaining:
                        left = None if own is None else own[len(chunk) - len(cur.remaining) :]
                        try:
                            with closing(
                                self._t.batch_get(cur.remaining, start, end, layers, left)
                            ) as items:
                                for item in items:
                                    a, b = spans[len(chunk) - len(cur.remaining)]
                                    rid, got = cur.take(item, decode=False)
                                    job = pool.submit(
                                        self._core.decoded if decode else self._fetched,
                                        rid, got, a, b, layers,
                                    )  # fmt: skip
                                    pending.append((rid, job))
                                    yield from ready(2 * width)
                        except RETRYABLE as exc:
                            delay, given_up = cur.failed(exc)
                            if given_up is not None:
                                done: Future[Routing | FetchedRange | R3Error] = Future()
                                done.set_result(given_up[1])
                                pending.append((given_up[0], done))
                            time.sleep(delay)
                            continue
                        cur.ended()
                yield from ready(0)
        finally:
            bar.close()
