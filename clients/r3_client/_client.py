"""``RoutingClient`` and ``AsyncRoutingClient``: one core, two thin shells.

The core (:class:`_Core`) does no I/O: it validates arguments, builds frames,
decides on retries, decodes answers.  The shells only drive a transport
(HTTP or gRPC, chosen by the URL scheme) and sleep between retries.

    with RoutingClient("http://cache:8080", api_key=KEY) as client:
        client.put("rollout-1", routing)                     # Routing, array, or a frame
        r = client.get("rollout-1", start=0, end=512, layers=[3, 5])  # server-side slice
        for rid, routing in client.get_many(ids, progress=True): ...
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import aclosing, closing
from typing import Any, TypeVar

import numpy.typing as npt
from tqdm import tqdm

from r3_client._codec import CodecName, decode_rollout, encode_frame, read_header
from r3_client._config import Retry, Timeout
from r3_client._exceptions import (
    ConnectError,
    FormatError,
    FrameError,
    ProtocolError,
    R3Error,
    RequestTimeoutError,
    ShapeError,
    StoreUnavailableError,
    error_for_code,
)
from r3_client._format import Routing, Segment, check_rollout_id
from r3_client._models import PutResult, RolloutInfo
from r3_client._stream import StreamItem
from r3_client._transports import (
    AsyncGrpcTransport,
    AsyncHTTPTransport,
    AsyncTransport,
    GrpcTransport,
    HTTPTransport,
    Transport,
)

__all__ = ["AsyncRoutingClient", "RoutingClient"]

T = TypeVar("T")
#: Failures that say nothing about the request: worth another try.
RETRYABLE = (ConnectError, RequestTimeoutError, StoreUnavailableError)
Result = tuple[str, Routing | R3Error]
#: Frames above this size are decoded off the event loop (AsyncRoutingClient.get_many).
_THREAD_DECODE_BYTES = 64 << 10


class _Core:
    """Everything both clients share; no I/O."""

    def __init__(self, retry: Retry) -> None:
        self.retry = retry

    def backoff(self, exc: Exception, failures: int) -> float:
        """Seconds to wait before trying again after the ``failures``-th failure.

        Re-raises ``exc`` when it is not worth retrying or the attempts are spent.
        """
        if not isinstance(exc, RETRYABLE) or failures >= self.retry.attempts:
            raise exc
        return self.retry.delay(failures - 1)

    @staticmethod
    def frame(
        routing: Routing | npt.ArrayLike | bytes,
        *,
        num_experts: int | None,
        layer_ids: Sequence[int] | None,
        start: int | None,
        segment: Segment | None,
        codec: CodecName,
    ) -> bytes:
        """The frame to send: bytes are checked and sent as they are, anything else encoded."""
        if isinstance(routing, bytes | bytearray | memoryview):
            read_header(routing)  # fail here, with the reason, rather than as a 400
            return bytes(routing)
        return encode_frame(
            routing,
            num_experts=num_experts,
            layer_ids=layer_ids,
            start=start,
            segment=segment,
            codec=codec,
        )

    @staticmethod
    def check_range(start: int, end: int | None) -> None:
        if start < 0 or (end is not None and end <= start):
            raise ShapeError(f"token range [{start}, {end}) is empty or negative")

    @staticmethod
    def decode(
        data: bytes, rollout_id: str, start: int, end: int | None, layers: Sequence[int] | None
    ) -> Routing:
        """A read's frames, stitched and trimmed to the request (the service never decodes)."""
        return decode_rollout(data, start=start, end=end, layers=layers, rollout_id=rollout_id)

    def result(
        self, item: StreamItem, start: int, end: int | None, layers: Sequence[int] | None
    ) -> Result:
        """An item's routing, or its error: a service error, or a stored body that does not
        decode (a :class:`FrameError` naming the rollout and segment; the batch goes on)."""
        rid, got = self.raw(item)
        return rid, self.decoded(rid, got, start, end, layers)

    @staticmethod
    def raw(item: StreamItem) -> tuple[str, bytes | R3Error]:
        """An item's undecoded bytes, or the error the service sent for it."""
        if item.frame is not None:
            return item.rollout_id, item.frame
        err = error_for_code(
            item.error_code or "service_error", item.error_message or "", status=item.status
        )
        return item.rollout_id, err

    def decoded(
        self,
        rid: str,
        got: bytes | R3Error,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> Routing | R3Error:
        """``got`` decoded (errors pass through; a decode failure becomes the result)."""
        if isinstance(got, R3Error):
            return got
        try:
            return self.decode(got, rid, start, end, layers)
        except (FormatError, FrameError) as exc:
            return exc

    @staticmethod
    def chunks(ids: Sequence[str], size: int) -> list[list[str]]:
        """``ids`` (each checked against the id rule first, before any I/O) in batches."""
        if size < 1:
            raise ValueError("chunk_size must be >= 1")
        if isinstance(ids, str):
            raise TypeError("rollout_ids must be a sequence of ids, not one string")
        ids = [check_rollout_id(r) for r in ids]
        return [ids[i : i + size] for i in range(0, len(ids), size)]


class _Cursor:
    """Where one batch of ``get_many`` stands: which ids are answered, failures since.

    No I/O: the shells feed it each stream item (:meth:`take`) and each
    retryable failure (:meth:`failed`) and do what it says.  Every id is
    answered exactly once, in order: a retry resumes *at* the first unanswered
    id, including one whose item was itself a retryable error (Redis briefly
    down), so no path can skip an id.
    """

    def __init__(
        self,
        core: _Core,
        ids: list[str],
        return_errors: bool,
        rows: tuple[int, int | None, Sequence[int] | None] = (0, None, None),
    ) -> None:
        self._core = core
        self._rows = rows
        self._ids = ids
        self._return_errors = return_errors
        self._done = 0
        self._failures = 0
        self._item_error: R3Error | None = None

    @property
    def remaining(self) -> list[str]:
        """The ids still to ask for."""
        return self._ids[self._done :]

    def take(self, item: StreamItem, *, decode: bool = True) -> tuple[str, Any]:
        """The result the stream's next item gives the next id.

        Raises a retryable item error (for the shell to retry from this id), a
        non-retryable one unless ``return_errors``, and :class:`ProtocolError`
        when the service answers for an id out of order.  With ``decode=False``
        the result is the item's bytes or error, never raised (the caller decodes,
        in order, and raises there).
        """
        if self._done >= len(self._ids) or item.rollout_id != self._ids[self._done]:
            expected = self._ids[self._done] if self._done < len(self._ids) else None
            raise ProtocolError(
                f"batch stream answered for {item.rollout_id!r} where {expected!r} was next"
            )
        rid, res = self._core.result(item, *self._rows) if decode else self._core.raw(item)
        if isinstance(res, RETRYABLE):
            self._item_error = res
            raise res
        self._advance()
        if decode and isinstance(res, R3Error) and not self._return_errors:
            raise res
        return rid, res

    def ended(self) -> None:
        """The stream closed cleanly: raise :class:`ProtocolError` if it left ids unanswered."""
        if self.remaining:
            raise ProtocolError(
                f"batch stream ended with {len(self.remaining)} rollouts unanswered"
            )

    def failed(self, exc: R3Error) -> tuple[float, Result | None]:
        """After a retryable failure: ``(delay, None)`` to retry from the same id.

        When the attempts are spent on an id whose own item was the error and
        ``return_errors`` is set, that id is answered with its error:
        ``(0, (rid, error))``.  Otherwise re-raises ``exc``.
        """
        self._failures += 1
        try:
            return self._core.backoff(exc, self._failures), None
        except R3Error:
            if not (self._return_errors and exc is self._item_error):
                raise
        rid = self._ids[self._done]
        self._advance()
        return 0.0, (rid, exc)

    def _advance(self) -> None:
        self._done += 1
        self._failures = 0
        self._item_error = None


def _sync_transport(url: str, api_key: str | None, timeout: Timeout) -> Transport:
    if url.startswith("grpc://"):
        return GrpcTransport(url, api_key=api_key, timeout=timeout)
    if url.startswith(("http://", "https://")):
        return HTTPTransport(url, api_key=api_key, timeout=timeout)
    raise ValueError(f"unsupported URL {url!r}: use http://, https:// or grpc://")


def _async_transport(url: str, api_key: str | None, timeout: Timeout) -> AsyncTransport:
    if url.startswith("grpc://"):
        return AsyncGrpcTransport(url, api_key=api_key, timeout=timeout)
    if url.startswith(("http://", "https://")):
        return AsyncHTTPTransport(url, api_key=api_key, timeout=timeout)
    raise ValueError(f"unsupported URL {url!r}: use http://, https:// or grpc://")


class RoutingClient:
    """Blocking client of the routing cache.

    ``url``: ``http://host:8080`` (HTTP) or ``grpc://host:50051`` (gRPC); the
    API is identical.  ``api_key`` is sent as a bearer token.  Every call is
    idempotent and retried per ``retry`` on connection failures, timeouts and
    503s.  Errors are :class:`R3Error` subclasses whatever the transport.
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        *,
        api_key: str | None = None,
        timeout: Timeout = Timeout(),
        retry: Retry = Retry(),
        transport: Transport | None = None,
    ) -> None:
        self._t = transport or _sync_transport(url, api_key, timeout)
        self._core = _Core(retry)

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
    ) -> PutResult:
        """Store one segment: a :class:`Routing`, an array ``[rows, L, K]`` (with
        ``num_experts`` and ``layer_ids``), or an encoded frame."""
        check_rollout_id(rollout_id)
        frame = self._core.frame(
            routing,
            num_experts=num_experts,
            layer_ids=layer_ids,
            start=start,
            segment=segment,
            codec=codec,
        )
        return PutResult.from_dict(self._retrying(lambda: self._t.put(rollout_id, frame)))

    def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> bytes:
        """The stored frames for the rollout, or for rows ``[start, end)`` of absolute MoE
        ``layers``, concatenated as the service returns them (decode with
        :func:`r3_client.decode_rollout` and the same arguments)."""
        check_rollout_id(rollout_id)
        self._core.check_range(start, end)
        return self._retrying(lambda: self._t.get(rollout_id, start, end, layers))

    def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> Routing:
        """The rollout's routing, cut on the server to the blocks and layer groups that
        ``start``/``end``/``layers`` need, decoded and trimmed here."""
        data = self.get_frame(rollout_id, start=start, end=end, layers=layers)
        return self._core.decode(data, rollout_id, start, end, layers)

    def stat(self, rollout_id: str) -> RolloutInfo:
        """What is stored for the rollout (no rows)."""
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(self._retrying(lambda: self._t.stat(rollout_id)))

    def delete(self, rollout_id: str) -> bool:
        """Delete the rollout; True if it existed."""
        check_rollout_id(rollout_id)
        return self._retrying(lambda: self._t.delete(rollout_id))

    def touch(self, rollout_id: str, ttl_s: int | None = None) -> None:
        """Reset the rollout's TTL (None = the service default, 0 = never expire)."""
        check_rollout_id(rollout_id)
        self._retrying(lambda: self._t.touch(rollout_id, ttl_s))

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
    ) -> Iterator[Result]:
        """``(rollout_id, Routing)`` for each id, streamed in request order.

        One batch request per ``chunk_size`` ids.  Every id is answered exactly
        once: a failed stream, or an item that failed for a retryable reason
        (Redis briefly unavailable), is retried from that id per ``retry``.  A
        rollout that cannot be served or decoded raises its error, or with
        ``return_errors=True`` is yielded as ``(rollout_id, R3Error)``.  Ids are
        checked before any request.  Rollouts decode in ``decode_workers`` threads
        while the stream goes on; at most ``2 * decode_workers`` wait decoded.
        """
        self._core.check_range(start, end)
        chunks = self._core.chunks(rollout_ids, chunk_size)
        width = max(1, decode_workers)
        bar = tqdm(total=len(rollout_ids), disable=not progress, unit="rollout", leave=False)
        pending: deque[tuple[str, Future[Routing | R3Error]]] = deque()

        def ready(limit: int) -> Iterator[Result]:
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
                    cur = _Cursor(self._core, chunk, return_errors, (start, end, layers))
                    while cur.remaining:
                        try:
                            with closing(
                                self._t.batch_get(cur.remaining, start, end, layers)
                            ) as items:
                                for item in items:
                                    rid, got = cur.take(item, decode=False)
                                    job = pool.submit(
                                        self._core.decoded, rid, got, start, end, layers
                                    )
                                    pending.append((rid, job))
                                    yield from ready(2 * width)
                        except RETRYABLE as exc:
                            delay, given_up = cur.failed(exc)
                            if given_up is not None:
                                done: Future[Routing | R3Error] = Future()
                                done.set_result(given_up[1])
                                pending.append((given_up[0], done))
                            time.sleep(delay)
                            continue
                        cur.ended()
                yield from ready(0)
        finally:
            bar.close()


class AsyncRoutingClient:
    """Asyncio client of the routing cache: the same API as :class:`RoutingClient`."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8080",
        *,
        api_key: str | None = None,
        timeout: Timeout = Timeout(),
        retry: Retry = Retry(),
        transport: AsyncTransport | None = None,
    ) -> None:
        self._t = transport or _async_transport(url, api_key, timeout)
        self._core = _Core(retry)

    async def __aenter__(self) -> AsyncRoutingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the transport's connections."""
        await self._t.aclose()

    async def _retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        failures = 0
        while True:
            try:
                return await fn()
            except RETRYABLE as exc:
                failures += 1
                await asyncio.sleep(self._core.backoff(exc, failures))

    async def put(
        self,
        rollout_id: str,
        routing: Routing | npt.ArrayLike | bytes,
        *,
        num_experts: int | None = None,
        layer_ids: Sequence[int] | None = None,
        start: int | None = None,
        segment: Segment | None = None,
        codec: CodecName = "auto",
    ) -> PutResult:
        """See :meth:`RoutingClient.put`."""
        check_rollout_id(rollout_id)
        frame = self._core.frame(
            routing,
            num_experts=num_experts,
            layer_ids=layer_ids,
            start=start,
            segment=segment,
            codec=codec,
        )
        return PutResult.from_dict(await self._retrying(lambda: self._t.put(rollout_id, frame)))

    async def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> bytes:
        """See :meth:`RoutingClient.get_frame`."""
        check_rollout_id(rollout_id)
        self._core.check_range(start, end)
        return await self._retrying(lambda: self._t.get(rollout_id, start, end, layers))

    async def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> Routing:
        """See :meth:`RoutingClient.get`."""
        data = await self.get_frame(rollout_id, start=start, end=end, layers=layers)
        if len(data) > _THREAD_DECODE_BYTES:
            return await asyncio.to_thread(self._core.decode, data, rollout_id, start, end, layers)
        return self._core.decode(data, rollout_id, start, end, layers)

    async def stat(self, rollout_id: str) -> RolloutInfo:
        """See :meth:`RoutingClient.stat`."""
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(await self._retrying(lambda: self._t.stat(rollout_id)))

    async def delete(self, rollout_id: str) -> bool:
        """See :meth:`RoutingClient.delete`."""
        check_rollout_id(rollout_id)
        return await self._retrying(lambda: self._t.delete(rollout_id))

    async def touch(self, rollout_id: str, ttl_s: int | None = None) -> None:
        """See :meth:`RoutingClient.touch`."""
        check_rollout_id(rollout_id)
        await self._retrying(lambda: self._t.touch(rollout_id, ttl_s))

    async def _chunk(
        self,
        chunk: list[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        return_errors: bool,
    ) -> AsyncIterator[Result]:
        cur = _Cursor(self._core, chunk, return_errors, (start, end, layers))
        while cur.remaining:
            try:
                async with aclosing(self._t.batch_get(cur.remaining, start, end, layers)) as items:
                    async for item in items:
                        # Big frames decode in a worker thread (zstd and numpy release the
                        # GIL), so concurrent streams decode in parallel with the event loop.
                        if item.frame is not None and len(item.frame) > _THREAD_DECODE_BYTES:
                            yield await asyncio.to_thread(cur.take, item)
                        else:
                            yield cur.take(item)
            except RETRYABLE as exc:
                delay, given_up = cur.failed(exc)
                if given_up is not None:
                    yield given_up
                await asyncio.sleep(delay)
                continue
            cur.ended()

    async def get_many(
        self,
        rollout_ids: Sequence[str],
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        chunk_size: int = 64,
        concurrency: int = 4,
        progress: bool = False,
        return_errors: bool = False,
    ) -> AsyncIterator[Result]:
        """``(rollout_id, Routing)`` as they arrive, ``concurrency`` batch streams at once.

        Order follows arrival (ids of one chunk stay in order).  At most
        ``concurrency`` streams run and at most ``2 * chunk_size`` decoded
        results wait for the consumer, so memory is bounded whatever the number
        of ids.  Errors as in :meth:`RoutingClient.get_many`.
        """
        self._core.check_range(start, end)
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        chunks = self._core.chunks(rollout_ids, chunk_size)
        queue: asyncio.Queue[Result | Exception | None] = asyncio.Queue(2 * chunk_size)
        gate = asyncio.Semaphore(concurrency)

        async def run(chunk: list[str]) -> None:
            async with gate:
                try:
                    async for res in self._chunk(chunk, start, end, layers, return_errors):
                        await queue.put(res)
                except Exception as exc:  # handed to the consumer, which re-raises
                    # Only Exception: a CancelledError (the consumer went away) must
                    # propagate, or this task would wait on a full queue forever.
                    await queue.put(exc)

        async def produce() -> None:
            await asyncio.gather(*(run(c) for c in chunks))
            await queue.put(None)

        producer = asyncio.ensure_future(produce())
        bar = tqdm(total=len(rollout_ids), disable=not progress, unit="rollout", leave=False)
        try:
            while (got := await queue.get()) is not None:
                if isinstance(got, Exception):
                    raise got
                bar.update()
                yield got
        finally:
            producer.cancel()
            # Wait for the workers to finish unwinding, so none outlives the call
            # (asyncio.wait neither raises the producer's CancelledError nor swallows ours).
            await asyncio.wait([producer])
            bar.close()
