"""The one service layer both front ends (HTTP and gRPC) call.

Transports only translate: they authenticate (API key → namespace), parse
their request, call a method here, and serialise the answer or the
:class:`R3Error`.  Limits, dedupe accounting and batch streaming live here, so
HTTP and gRPC behave, and answer with bytes, identically.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from cache_service.metrics import Metrics
from cache_service.settings import ServiceSettings
from cache_service.store.segment_store import SegmentStore
from r3_client import (
    InvalidRequestError,
    LimitExceededError,
    PutResult,
    R3Error,
    RolloutInfo,
    read_header,
)
from r3_client.wire import MAX_LAYER_ID, quote_items

#: The largest row index a frame may end at (the codec refuses ``end > 2**40``).
_MAX_ROWS = 1 << 40

__all__ = ["MAX_TTL_S", "RoutingService"]

T = TypeVar("T")
#: Longest TTL a rollout may be given (ten years), on every transport.
MAX_TTL_S = 10 * 365 * 24 * 3600


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
    ids: Sequence[str], spans: list[tuple[int, int | None]], by_rollout: bool
) -> Iterator[tuple[str, list[tuple[int, int | None]]]]:
    """The batch's items in order, consecutive ranges of one rollout grouped (up to
    ``_GROUP_RANGES``) when ``by_rollout``; else one item per group."""
    rid_prev: str | None = None
    parts: list[tuple[int, int | None]] = []
    for rid, span in zip(ids, spans, strict=True):
        if parts and (not by_rollout or rid != rid_prev or len(parts) == _GROUP_RANGES):
            assert rid_prev is not None
            yield rid_prev, parts
            parts = []
        rid_prev = rid
        parts.append(span)
    if parts:
        assert rid_prev is not None
        yield rid_prev, parts


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
        self, namespace: str, rollout_id: str, frame: bytes, *, view: int | None = None
    ) -> PutResult:
        """Validate limits, then store one segment frame (see :meth:`SegmentStore.put_segment`;
        ``view``: as the rows of the rollout's view serving that row)."""
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
        res = await self._ns(namespace).put_segment(rollout_id, frame, view=view)
        if res.dedupe_hit:
            self.metrics.dedupe_hits.inc()
            self.metrics.dedupe_bytes.inc(res.nbytes)
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
        ``batch_concurrency`` stats run at once; at most ``max_batch`` ids."""
        if len(rollout_ids) > self.settings.max_batch:
            raise LimitExceededError(
                f"batch of {len(rollout_ids)} rollouts; the limit is {self.settings.max_batch}"
            )
        store = self._ns(namespace)
        gate = asyncio.Semaphore(self.settings.batch_concurrency)

        async def one(rid: str) -> RolloutInfo | R3Error:
            async with gate:
                try:
                    return await store.stat(rid)
                except R3Error as exc:
                    return exc

        return list(await asyncio.gather(*(one(r) for r in rollout_ids)))

    async def delete(self, namespace: str, rollout_id: str) -> bool:
        """Delete a rollout; True if it existed."""
        return await self._ns(namespace).delete(rollout_id)

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

        todo = _groups(rollout_ids, spans, ranges is not None)
        window: deque[tuple[str, int, asyncio.Task[list[bytes | R3Error]]]] = deque()

        def launch() -> None:
            nxt = next(todo, None)
            if nxt is not None:
                rid, parts = nxt
                window.append((rid, len(parts), asyncio.ensure_future(group(rid, parts))))

        for _ in range(self.settings.batch_concurrency):
            launch()
        try:
            while window:
                rid, _, task = window.popleft()
                results = await task
                launch()
                for result in results:
                    self.metrics.batch_items.labels(
                        "ok" if isinstance(result, bytes) else result.code
                    ).inc()
                    yield rid, result
        finally:
            for _, _, task in window:  # the consumer went away: stop fetching
                task.cancel()

    async def ready(self) -> bool:
        """True when Redis answers."""
        return await self.store.ping()

    async def refresh_store_gauges(self) -> None:
        """Update the store size gauges (called on each /metrics scrape)."""
        mem = await self.store.memory()
        self.metrics.store_memory.set(mem["used_memory"])
        self.metrics.store_keys.set(mem["keys"])
