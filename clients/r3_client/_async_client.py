"""``AsyncRoutingClient``: the asyncio shell over the shared core, run on the caller's loop.

The same API as :class:`~r3_client.RoutingClient` (:mod:`r3_client._sync_client`), as
coroutines, over the same no-I/O core (:class:`~r3_client._client_core.ClientCore`): this
shell only awaits an async transport and sleeps between retries.  Frames over
``THREAD_DECODE_BYTES`` decode in a worker thread, so several batch streams (``get_many``'s
``concurrency``) decode in parallel with the event loop.  What the SGLang plugin's shipper
and the rollout-side glue use.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import numpy.typing as npt
from tqdm import tqdm

from r3_client._answers import Deleted, DropResult, PutResult, RolloutInfo, ViewInfo
from r3_client._client_core import (
    RETRYABLE,
    THREAD_DECODE_BYTES,
    ClientCore,
    Cursor,
    Result,
    T,
    async_transport,
)
from r3_client._config import Retry, Timeout
from r3_client._exceptions import InvalidRequestError, R3Error, RolloutNotFoundError
from r3_client._routing import Routing, Segment, check_rollout_id
from r3_client._transports import AsyncTransport
from r3_client._views import (
    ServedRouting,
    ViewPolicy,
    arun_steps,
    check_policy,
    one_routing_policy,
)
from r3_client.codec import MAX_DECODED_BYTES, CodecName

__all__ = ["AsyncRoutingClient"]


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
        max_bytes: int = MAX_DECODED_BYTES,
    ) -> None:
        self._t = transport or async_transport(url, api_key, timeout)
        self._core = ClientCore(retry, max_bytes)

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
        view: int | None = None,
        share: bool | None = None,
    ) -> PutResult:
        """See :meth:`RoutingClient.put`."""
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
        return PutResult.from_dict(
            await self._retrying(lambda: self._t.put(rollout_id, frame, **opts))
        )

    async def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: int | None = None,
    ) -> bytes:
        """See :meth:`RoutingClient.get_frame`."""
        self._core.check_read(rollout_id, start, end)
        if view is None:
            return await self._retrying(lambda: self._t.get(rollout_id, start, end, layers))
        return await self._retrying(lambda: self._t.get(rollout_id, start, end, layers, view=view))

    async def _decoded(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        view: int | None = None,
    ) -> Routing:
        data = await self.get_frame(rollout_id, start=start, end=end, layers=layers, view=view)
        if len(data) > THREAD_DECODE_BYTES:
            return await asyncio.to_thread(self._core.decode, data, rollout_id, start, end, layers)
        return self._core.decode(data, rollout_id, start, end, layers)

    async def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "generated",
    ) -> Routing:
        """See :meth:`RoutingClient.get`."""
        one_routing_policy(view)
        base = await self._decoded(rollout_id, start, end, layers)
        if view == "generated":
            return base
        return await self._latest(rollout_id, base, layers)

    async def _latest(
        self, rollout_id: str, base: Routing, layers: Sequence[int] | None
    ) -> Routing:
        """See :meth:`RoutingClient._latest`."""
        steps = self._core.latest_steps(base, await self.stat(rollout_id), rollout_id)
        return await arun_steps(steps, lambda v: self._view_rows(rollout_id, v, base, layers))

    async def _view_rows(
        self, rollout_id: str, v: ViewInfo, base: Routing, layers: Sequence[int] | None
    ) -> Routing:
        """See :meth:`RoutingClient._view_rows`."""
        window = self._core.view_window(v, base)
        if isinstance(window, Routing):
            return window
        return await self._decoded(rollout_id, *window, layers, v.serves)

    async def get_served(
        self,
        rollout_id: str,
        *,
        view: ViewPolicy = "exact",
        layers: Sequence[int] | None = None,
    ) -> list[ServedRouting]:
        """See :meth:`RoutingClient.get_served`."""
        policy = check_policy(view)
        info = await self.stat(rollout_id)
        base = await self.get(rollout_id, layers=layers)
        steps = self._core.served_steps(base, info, policy, rollout_id)
        return await arun_steps(steps, lambda v: self._view_rows(rollout_id, v, base, layers))

    async def stat(self, rollout_id: str) -> RolloutInfo:
        """See :meth:`RoutingClient.stat`."""
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(await self._retrying(lambda: self._t.stat(rollout_id)))

    async def stat_many(
        self, rollout_ids: Sequence[str], *, chunk_size: int = 1024
    ) -> list[RolloutInfo | R3Error]:
        """See :meth:`RoutingClient.stat_many`."""
        out: list[RolloutInfo | R3Error] = []
        for chunk in self._core.chunks(rollout_ids, chunk_size):
            while chunk:  # until the service's reply budget has answered every id
                res = self._core.stats(chunk, await self._stat_batch(chunk))
                n = self._core.answered(res)
                if n == 0:  # one stat over the batch budget alone: asked for by itself
                    res, n = self._core.stats(chunk[:1], [await self._stat_or_error(chunk[0])]), 1
                out += res[:n]
                chunk = chunk[n:]
        return out

    async def _stat_batch(self, chunk: list[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :meth:`RoutingClient._stat_batch` (the stats one per id run concurrently)."""
        try:
            return await self._retrying(functools.partial(self._t.stat_many, chunk))
        except R3Error as exc:
            if not self._core.no_batch_stat(exc):
                raise
        return list(await asyncio.gather(*(self._stat_or_error(r) for r in chunk)))

    async def _stat_or_error(self, rollout_id: str) -> tuple[str, dict[str, Any] | R3Error]:
        try:
            return rollout_id, await self._retrying(lambda: self._t.stat(rollout_id))
        except (RolloutNotFoundError, InvalidRequestError) as exc:
            return rollout_id, exc

    async def delete(self, rollout_id: str) -> bool:
        """See :meth:`RoutingClient.delete`."""
        check_rollout_id(rollout_id)
        return await self._retrying(lambda: self._t.delete(rollout_id))

    async def delete_many(
        self, rollout_ids: Sequence[str], *, chunk_size: int = 1024
    ) -> list[Deleted]:
        """See :meth:`RoutingClient.delete_many`."""
        out: list[Deleted] = []
        for chunk in self._core.chunks(rollout_ids, chunk_size):
            got = await self._retrying(functools.partial(self._t.delete_many, chunk))
            out += self._core.deleted(chunk, got)
        return out

    async def drop_consumed(
        self, upto: int | str, *, max_rollouts: int | None = None, max_calls: int | None = None
    ) -> DropResult:
        """See :meth:`RoutingClient.drop_consumed`."""
        version = self._core.drop_version(upto)
        total: DropResult | None = None
        calls = 0
        while (cursor := self._core.next_drop(total, calls, max_calls)) is not None:
            step = await self._retrying(
                functools.partial(self._t.drop_consumed, version, cursor, max_rollouts)
            )
            total = self._core.dropped(total, step)
            calls += 1
        assert total is not None  # (the first call is always made)
        return total

    async def rewind(self, rollout_id: str, rows: int) -> RolloutInfo:
        """See :meth:`RoutingClient.rewind`."""
        check_rollout_id(rollout_id)
        return RolloutInfo.from_dict(await self._retrying(lambda: self._t.rewind(rollout_id, rows)))

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
    ) -> AsyncGenerator[Result, None]:
        cur = Cursor(self._core, chunk, return_errors, (start, end, layers))
        while cur.remaining:
            try:
                async with aclosing(self._t.batch_get(cur.remaining, start, end, layers)) as items:
                    async for item in items:
                        # Big frames decode in a worker thread (zstd and numpy release the
                        # GIL), so concurrent streams decode in parallel with the event loop.
                        if item.frame is not None and len(item.frame) > THREAD_DECODE_BYTES:
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
        view: ViewPolicy = "generated",
    ) -> AsyncGenerator[Result, None]:
        """``(rollout_id, Routing)`` as they arrive, ``concurrency`` batch streams at once.

        Order follows arrival (ids of one chunk stay in order).  At most
        ``concurrency`` streams run and at most ``2 * chunk_size`` decoded
        results wait for the consumer, so memory is bounded whatever the number
        of ids.  Errors and ``view`` as in :meth:`RoutingClient.get_many`.
        """
        self._core.check_range(start, end)
        latest = one_routing_policy(view) == "latest"
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        chunks = self._core.chunks(rollout_ids, chunk_size)
        queue: asyncio.Queue[Result | Exception | None] = asyncio.Queue(2 * chunk_size)
        gate = asyncio.Semaphore(concurrency)

        async def run(chunk: list[str]) -> None:
            async with gate:
                try:
                    # Closed on every exit, a cancel included (the consumer refused or went
                    # away): its stream is released before the refusal reaches the caller,
                    # never by the loop's finalizer of an abandoned generator.
                    async with aclosing(
                        self._chunk(chunk, start, end, layers, return_errors)
                    ) as results:
                        async for res in results:
                            if latest and isinstance(res[1], Routing):
                                try:
                                    res = (res[0], await self._latest(res[0], res[1], layers))
                                except R3Error as exc:
                                    if not return_errors:
                                        raise
                                    res = (res[0], exc)
                            await queue.put(res)
                except Exception as exc:  # handed to the consumer, which re-raises
                    # Only Exception: a CancelledError (the consumer went away) must
                    # propagate, or this task would wait on a full queue forever.
                    await queue.put(exc)

        workers: list[asyncio.Future[None]] = []

        async def produce() -> None:
            workers.extend(asyncio.ensure_future(run(c)) for c in chunks)
            await asyncio.gather(*workers)
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
            for worker in workers:
                worker.cancel()
            # Wait for every worker to finish unwinding (its stream closed), so none outlives
            # the call: the producer's gather ends as soon as one worker is cancelled, while
            # the others may still be closing theirs (asyncio.wait neither raises their
            # CancelledError nor swallows ours).
            await asyncio.wait([producer, *workers])
            bar.close()
