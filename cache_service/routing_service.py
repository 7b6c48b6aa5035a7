"""The one service layer both front ends (HTTP and gRPC) call.

Transports only translate: they authenticate (API key → namespace), parse
their request, call a method here, and serialise the answer or the
:class:`R3Error`.  Limits, dedupe accounting and batch streaming live here, so
HTTP and gRPC behave, and answer with bytes, identically.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from cache_service.errors import error_message
from cache_service.metrics import Metrics
from cache_service.settings import ServiceSettings
from cache_service.store.segment_store import SegmentStore
from r3_client import (
    Deleted,
    DropResult,
    InvalidRequestError,
    LimitExceededError,
    PutResult,
    R3Error,
    RolloutInfo,
    read_header,
)
from r3_client.wire import MAX_LAYER_ID, freed_total, quote_items, to_plain

#: The largest row index a frame may end at (the codec refuses ``end > 2**40``).
_MAX_ROWS = 1 << 40

__all__ = ["MAX_TTL_S", "RoutingService"]

T = TypeVar("T")
#: Longest TTL a rollout may be given (ten years), on every transport.
MAX_TTL_S = 10 * 365 * 24 * 3600
#: How long a /metrics scrape waits for Redis's figures (Prometheus's default timeout: 10 s).
_GAUGES_TIMEOUT_S = 5.0


async def _bounded(work: Awaitable[T]) -> T:
    """``await work``, with a ``MemoryError`` reported as the request's size, not a fault.

    A safety net: reads must not allocate past what the request declares (the
    format's job); if one still cannot be served in memory, the client hears a
    :class:`LimitExceededError`, never a server error with numpy's message.
    """
    try:
        return await work
    except MemoryError:
        raise LimitExceededError("the request needs more memory than the service allows") from None


def _item_ranges(
    n: int, start: int, end: int | None, ranges: Sequence[tuple[int, int]] | None
) -> list[tuple[int, int | None]]:
    """Each batch item's ``(start, end)``: the batch's one range, or ``ranges`` (one per
    item, each ``0 <= start < end <= _MAX_ROWS``) when given instead of it."""
    if ranges is None:
        return [(start, end)] * n
    if start != 0 or end is not None:
        raise InvalidRequestError("give either start/end for every item or ranges, not both")
    if len(ranges) != n:
        raise InvalidRequestError(f"ranges names {len(ranges)} row ranges for {n} rollout ids")
    out: list[tuple[int, int | None]] = []
    for i, (a, b) in enumerate(ranges):
        if not 0 <= a < b <= _MAX_ROWS:
            raise InvalidRequestError(
                f"ranges[{i}] = [{a}, {b}) is not a row range within [0, {_MAX_ROWS}]"
            )
        out.append((a, b))
    return out


#: Ranges of one rollout answered from one Redis read (a rank asks two or three of each);
#: bounded, so that a request naming one rollout many times holds few frames at once.
_GROUP_RANGES = 8


def _groups(
    ids: Sequence[str], spans: list[tuple[int, int | None]], by_rollout: bool, most: int
) -> Iterator[tuple[str, list[tuple[int, int | None]]]]:
    """The batch's items in order, consecutive ranges of one rollout grouped (up to
    ``most``) when ``by_rollout``; else one item per group."""
    rid_prev: str | None = None
    parts: list[tuple[int, int | None]] = []
    for rid, span in zip(ids, spans, strict=True):
        if parts and (not by_rollout or rid != rid_prev or len(parts) >= most):
            assert rid_prev is not None
            yield rid_prev, parts
            parts = []
        rid_prev = rid
        parts.append(span)
    if parts:
        assert rid_prev is not None
        yield rid_prev, parts


#: What one batch-stat item adds around its id and its stat or error, at most, on either
#: transport: the HTTP item's keys, nulls and separators (50 bytes; gRPC's field tags
#: and lengths take fewer).
_STAT_ITEM_FRAMING = 64


def _stat_item_bytes(rollout_id: str, answer: RolloutInfo | R3Error) -> int:
    """An upper bound on one batch-stat item's encoded size, the same for both transports.

    Its compact ASCII JSON (HTTP sends the same JSON as UTF-8, never longer than its
    ``\\u`` escapes) plus :data:`_STAT_ITEM_FRAMING`.  It bounds the protobuf form too:
    every JSON field spells its name, quotes and separators where protobuf spends a
    1-byte tag and a length, a decimal number is at least as long as its varint or
    fixed 8-byte double with its key, and no field holds a negative integer (protobuf's
    10-byte case).
    """
    if isinstance(answer, R3Error):
        body: object = {"code": answer.code, "message": error_message(answer), "status": 599}
    else:
        body = to_plain(answer)
    return len(json.dumps([rollout_id, body], separators=(",", ":"))) + _STAT_ITEM_FRAMING


def _past_budget(ids: Sequence[str], at: int, size: int, spent: int, budget: int) -> list[R3Error]:
    """The answers of items ``at`` onwards of a batch stat whose answer reached its budget:
    each its own :class:`LimitExceededError`, saying where to ask again."""
    where = "R3_CACHE_MAX_BATCH_STAT_BYTES); ask for the ids from item"
    if spent:
        return [
            LimitExceededError(
                f"not answered: this batch stat's answer reached {spent:,} bytes at item {at} "
                f"(counting from 0), whose stat would take it past the {budget:,} it may hold "
                f"({where} {at} on in another request"
            )
        ] * (len(ids) - at)
    alone = LimitExceededError(  # the first item: its stat alone is over the budget
        f"rollout {ids[at]}'s stat is {size:,} bytes, more than a batch stat's answer may "
        f"hold ({budget:,} bytes, R3_CACHE_MAX_BATCH_STAT_BYTES): read it with its own stat "
        "(GET /v1/rollouts/<id>/stat, gRPC StatRollout), and the ids after it in another request"
    )
    after = LimitExceededError(
        f"not answered: item {at} (counting from 0) of this batch stat is more than its "
        f"answer may hold ({budget:,} bytes, {where} {at + 1} on in another request"
    )
    return [alone, *[after] * (len(ids) - at - 1)]


def _check_layer_subset(layers: Sequence[int] | None) -> None:
    """Refuse a layer subset no rollout can hold: once per request, before any rollout.

    The store still checks a subset against each rollout's layers; without this
    a batch answered the same error once per id it named.
    """
    if layers is None:
        return
    if not layers:
        raise InvalidRequestError("layer subset is empty")
    outside = [x for x in layers if not 0 <= x <= MAX_LAYER_ID]
    if outside:
        raise InvalidRequestError(
            f"layer ids {quote_items(outside)} are outside [0, {MAX_LAYER_ID}]"
        )
    if len(set(layers)) != len(layers):
        raise InvalidRequestError(f"layer subset repeats ids: {quote_items(layers)}")


class RoutingService:
    """Routing operations over a :class:`SegmentStore`, per tenant namespace."""

    def __init__(self, store: SegmentStore, settings: ServiceSettings, metrics: Metrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._views: dict[str, SegmentStore] = {}

    def _ns(self, namespace: str) -> SegmentStore:
        view = self._views.get(namespace)
        if view is None:
            view = self._views[namespace] = self.store.for_namespace(namespace)
        return view

    async def put_segment(
        self,
        namespace: str,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> PutResult:
        """Validate limits, then store one segment frame (see :meth:`SegmentStore.put_segment`;
        ``view``: as the rows of the rollout's view serving that row; ``share``: True to keep
        it in a blob other rollouts share, False to keep it private, None for the store's
        rule).  A view with ``share=True`` is refused: views are never shared."""
        if view is not None and share:
            raise InvalidRequestError(
                "views are never shared: a view's rows are what one call recomputed, and "
                "they live and go with its rollout; put it without share"
            )
        if len(frame) > self.settings.max_body_bytes:
            raise LimitExceededError(
                f"frame is {len(frame)} bytes; the limit is {self.settings.max_body_bytes}"
            )
        hdr = read_header(frame, verify=False)  # the store verifies the CRC
        if hdr.num_rows > self.settings.max_tokens_per_segment:
            raise LimitExceededError(
                f"segment has {hdr.num_rows} token rows; the limit is "
                f"{self.settings.max_tokens_per_segment} per segment"
            )
        res = await self._ns(namespace).put_segment(rollout_id, frame, view=view, share=share)
        if res.dedupe_hit:
            self.metrics.dedupe_hits.inc()
            self.metrics.dedupe_bytes.inc(res.nbytes)
        if view is not None and res.status == "stored":
            self.metrics.views_stored.inc()
            self.metrics.view_rows_stored.inc(res.segment.end - res.segment.start)
        return res

    async def get_frame(
        self,
        namespace: str,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: int | None = None,
    ) -> bytes:
        """The rollout's stored frames (or slices of them), concatenated, undecoded
        (``view``: those of its view serving that row)."""
        _check_layer_subset(layers)
        return await _bounded(
            self._ns(namespace).get_frame(
                rollout_id, start=start, end=end, layers=layers, view=view
            )
        )

    async def check_direct_reads(self) -> None:
        """At start-up, with direct reads on: refuse (:class:`StoreError`) a Redis that
        admits clients without credentials (:meth:`SegmentStore.refuse_open_redis`)."""
        if self.settings.direct_reads:
            await self.store.refuse_open_redis()

    async def read_plan(self, namespace: str) -> dict[str, object]:
        """Where and how this namespace's trainers read Redis directly (``direct_reads``).

        Auth already decided the namespace; the credentials it gets can only read
        that namespace's keys (see :meth:`SegmentStore.grant_reader`), and are issued
        only while Redis refuses clients without credentials.  The service stays the
        only writer.
        """
        secret = self.settings.read_secret() if self.settings.direct_reads else None
        if secret is None:
            raise InvalidRequestError(
                "direct reads are not enabled on this service (R3_CACHE_DIRECT_READS and "
                "R3_CACHE_DIRECT_READ_SECRET); read through GET or the batch stream"
            )
        user, password, prefix = await self._ns(namespace).grant_reader(secret)
        parts = urlsplit(self.settings.direct_read_url or self.store.settings.redis_url)
        host = parts.hostname or "127.0.0.1"
        netloc = f"[{host}]" if ":" in host else host
        if parts.port:
            netloc += f":{parts.port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))  # no admin credentials
        return {
            "redis_url": url,
            "cluster": self.store.settings.cluster,
            "username": user,
            "password": password,
            "key_prefix": prefix,
        }

    async def stat(self, namespace: str, rollout_id: str) -> RolloutInfo:
        """What is stored for a rollout."""
        return await self._ns(namespace).stat(rollout_id)

    async def batch_stat(
        self, namespace: str, rollout_ids: Sequence[str]
    ) -> list[RolloutInfo | R3Error]:
        """Each rollout's stat or the error it met, in request order: a driver checking a
        whole training step before dispatch (metadata only, no rows).  At most
        ``max_batch`` ids.

        An id named more than once is read once.  The answer is held to
        ``max_batch_stat_bytes`` (each item measured by :func:`_stat_item_bytes`, an
        upper bound on its size on either transport, so both cut at the same item):
        items are answered in order until the next would pass it, and that item and
        every later one are a :class:`LimitExceededError` saying where to resume.
        Stats are read in request order, at most ``batch_concurrency`` ids ahead of
        the item being answered, and none past the cut.
        """
        if len(rollout_ids) > self.settings.max_batch:
            raise LimitExceededError(
                f"batch of {len(rollout_ids)} rollouts; the limit is {self.settings.max_batch}"
            )
        store = self._ns(namespace)
        budget = self.settings.max_batch_stat_bytes

        async def one(rid: str) -> tuple[RolloutInfo | R3Error, int]:
            try:
                res: RolloutInfo | R3Error = await store.stat(rid)
            except R3Error as exc:
                res = exc
            return res, _stat_item_bytes(rid, res)

        unread = iter(dict.fromkeys(rollout_ids))  # each id once, in order of first mention
        window: deque[asyncio.Task[tuple[RolloutInfo | R3Error, int]]] = deque()

        def launch() -> None:
            rid = next(unread, None)
            if rid is not None:
                window.append(asyncio.ensure_future(one(rid)))

        for _ in range(self.settings.batch_concurrency):
            launch()
        read: dict[str, tuple[RolloutInfo | R3Error, int]] = {}
        out: list[RolloutInfo | R3Error] = []
        spent = 0
        try:
            for i, rid in enumerate(rollout_ids):
                if rid not in read:  # its first mention: the oldest read in flight
                    read[rid] = await window.popleft()
                    launch()
                res, size = read[rid]
                if spent + size > budget:
                    out += _past_budget(rollout_ids, i, size, spent, budget)
                    break
                spent += size
                out.append(res)
        finally:
            for task in window:  # past the cut (or the caller went away): not needed
                task.cancel()
        return out

    async def delete(self, namespace: str, rollout_id: str) -> bool:
        """Delete a rollout; True if it existed."""
        gone = await self._ns(namespace).remove(rollout_id)
        self._count_dropped("delete", int(gone.existed), gone.freed_bytes)
        return gone.existed

    def _count_dropped(self, how: str, rollouts: int, freed: int | None) -> None:
        self.metrics.rollouts_dropped.labels(how).inc(rollouts)
        if freed:
            self.metrics.dropped_bytes.labels(how).inc(freed)

    async def batch_delete(
        self, namespace: str, rollout_ids: Sequence[str]
    ) -> list[Deleted | R3Error]:
        """Delete many rollouts (a trainer done with a step): each its :class:`Deleted` or
        the error it met, in request order; an id named twice is deleted once.  At most
        ``max_batch`` ids, refused whole (nothing deleted) past it; an empty list is refused
        too, on gRPC as HTTP's request model refuses it."""
        if not rollout_ids:
            raise InvalidRequestError(
                "rollout_ids: name at least 1 rollout to delete, got none (nothing was deleted)"
            )
        if len(rollout_ids) > self.settings.max_batch:
            raise LimitExceededError(
                f"batch of {len(rollout_ids)} rollouts; the limit is {self.settings.max_batch} "
                "(send the rest in another request: nothing was deleted)"
            )
        out = await self._ns(namespace).delete_many(
            rollout_ids, concurrency=self.settings.batch_concurrency
        )
        gone = {d.rollout_id: d for d in out if isinstance(d, Deleted) and d.existed}
        freed = freed_total(d.freed_bytes for d in gone.values())
        self._count_dropped("batch_delete", len(gone), freed)
        return out

    async def drop_consumed(
        self, namespace: str, upto: int | str, cursor: str = "", max_rollouts: int | None = None
    ) -> DropResult:
        """One bounded step of dropping ``namespace``'s rollouts whose every row was computed
        under a weight version ``<= upto`` (a decimal integer); resume with the answer's
        cursor until it is ``""``.  ``max_rollouts``: rollout keys to examine in this call,
        at most (and by default) ``drop_max_rollouts``; a call also stops after
        ``drop_deadline_s``."""
        limit = self.settings.drop_max_rollouts
        if max_rollouts is not None:
            if not 1 <= max_rollouts <= limit:
                raise InvalidRequestError(
                    f"max_rollouts must be between 1 and {limit} "
                    f"(R3_CACHE_DROP_MAX_ROLLOUTS), got {max_rollouts}"
                )
            limit = max_rollouts
        res = await self._ns(namespace).drop_consumed(
            upto,
            cursor,
            max_rollouts=limit,
            deadline_s=self.settings.drop_deadline_s,
            concurrency=self.settings.batch_concurrency,
        )
        self._count_dropped("drop_version", res.dropped, res.freed_bytes)
        return res

    async def touch(self, namespace: str, rollout_id: str, ttl_s: int | None) -> None:
        """Reset a rollout's TTL (``None``: the default; 0: never expire; at most ten years)."""
        if ttl_s is not None and not 0 <= ttl_s <= MAX_TTL_S:
            raise InvalidRequestError(f"ttl_s must be between 0 and {MAX_TTL_S} s, got {ttl_s}")
        await self._ns(namespace).touch(rollout_id, ttl_s)

    async def rewind(self, namespace: str, rollout_id: str, rows: int) -> RolloutInfo:
        """Drop the segments starting at or after ``rows`` (idempotent); the rollout's stat
        after it.  For a driver that lost the answer to a turn the engine stored."""
        store = self._ns(namespace)
        await store.rewind(rollout_id, rows)
        return await store.stat(rollout_id)

    async def batch_get(
        self,
        namespace: str,
        rollout_ids: Sequence[str],
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> AsyncIterator[tuple[str, bytes | R3Error]]:
        """Frames of many rollouts, in request order, each a frame or the error it met.

        ``ranges``: one ``(start, end)`` of rows per item instead of the batch's one
        ``start``/``end`` (a training rank's slice: an id may be named once per range
        it needs); each item is then what ``GET`` answers for its range.

        At most ``batch_concurrency`` fetches run ahead of the consumer, so
        memory stays bounded whatever the batch size; a slow reader slows the
        fetches instead of piling frames up.
        """
        if len(rollout_ids) > self.settings.max_batch:
            raise LimitExceededError(
                f"batch of {len(rollout_ids)} rollouts; the limit is {self.settings.max_batch}"
            )
        _check_layer_subset(layers)
        spans = _item_ranges(len(rollout_ids), start, end, ranges)
        view = self._ns(namespace)
        # An item asked again is answered the error it already met, not asked again.
        failed: dict[tuple[str, int, int | None], R3Error] = {}

        async def one(rid: str, a: int, b: int | None) -> bytes | R3Error:
            if (rid, a, b) in failed:
                return failed[rid, a, b]
            try:
                return await _bounded(view.get_frame(rid, start=a, end=b, layers=layers))
            except R3Error as exc:
                failed[rid, a, b] = exc
                return exc

        async def group(rid: str, parts: list[tuple[int, int | None]]) -> list[bytes | R3Error]:
            if len(parts) == 1:
                return [await one(rid, *parts[0])]
            # Several ranges of one rollout (a rank's zigzag chunks): one read from Redis.
            spans = [(a, b) for a, b in parts if b is not None]
            return await _bounded(view.get_frames(rid, spans, layers))

        # The read-ahead counts items (ranges), not reads: a group of k ranges takes k of
        # the ``batch_concurrency`` slots, and a slot frees when the consumer takes its
        # item.  Groups hold at most half the slots, so the next read overlaps the
        # consumer's draining of the last one.
        ahead = self.settings.batch_concurrency
        most = max(1, min(_GROUP_RANGES, ahead // 2))
        todo = _groups(rollout_ids, spans, ranges is not None, most)
        window: deque[tuple[str, asyncio.Task[list[bytes | R3Error]]]] = deque()
        nxt = next(todo, None)
        held = 0  # items fetched or being fetched that the consumer has not taken

        def launch() -> None:
            nonlocal nxt, held
            while nxt is not None and held + len(nxt[1]) <= ahead:
                rid, parts = nxt
                held += len(parts)
                window.append((rid, asyncio.ensure_future(group(rid, parts))))
                nxt = next(todo, None)

        launch()
        try:
            while window:
                rid, task = window.popleft()
                results = await task
                del task  # it holds ``results`` too: they are let go one by one below
                results.reverse()
                while results:
                    result = results.pop()  # the consumer's now: its slot is free
                    held -= 1
                    launch()
                    self.metrics.batch_items.labels(
                        "ok" if isinstance(result, bytes) else result.code
                    ).inc()
                    yield rid, result
        finally:
            for _, task in window:  # the consumer went away: stop fetching
                task.cancel()

    async def ready(self) -> bool:
        """True when Redis answers."""
        return await self.store.ping()

    async def refresh_store_gauges(self) -> None:
        """Update the store gauges (called on each /metrics scrape): ``r3_store_up`` 0
        when Redis fails or does not answer within ``_GAUGES_TIMEOUT_S`` (the scrape
        must answer within Prometheus's timeout), the others then keep their last value."""
        try:
            async with asyncio.timeout(_GAUGES_TIMEOUT_S):
                mem = await self.store.memory()
        except (R3Error, TimeoutError):
            self.metrics.store_up.set(0)
            return
        self.metrics.store_up.set(1)
        self.metrics.store_memory.set(mem["used_memory"])
        self.metrics.store_keys.set(mem["keys"])
        self.metrics.store_maxmemory.set(mem["maxmemory"])
        self.metrics.store_fullest_ratio.set(mem["fullest_ratio"])
