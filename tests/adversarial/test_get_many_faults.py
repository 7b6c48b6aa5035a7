"""``get_many`` under store faults and cancellation: every id answered exactly once, no task left.

Faults are the real thing: the service's own ``redis-server`` is SIGKILLed in the
middle of a batch and restarted a moment later, so the stream carries
``store_unavailable`` items for the ids fetched while it was down.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    AsyncRoutingClient,
    R3Error,
    Retry,
    Routing,
    RoutingClient,
    StoreUnavailableError,
)
from tests.support.frames import TRAJ, frame_for
from tests.support.service_process import KEY_A, Service, start_service

N = 96
#: Patient enough to ride out a one-second outage, with no retry budget to spare for skips.
PATIENT = Retry(attempts=40, backoff=0.05, max_backoff=0.3)


@dataclass
class Faulty:
    """A service over its own redis-server, which tests may kill and restart."""

    svc: Service
    redis: RedisProcess
    ids: list[str]

    def url(self, transport: str) -> str:
        return self.svc.http_url if transport == "http" else f"grpc://{self.svc.grpc_target}"

    def outage(self, seconds: float = 1.0) -> threading.Timer:
        """SIGKILL Redis now (AOF keeps the data) and start it again after ``seconds``."""
        self.redis.kill()
        timer = threading.Timer(seconds, self.redis.start)
        timer.start()
        return timer


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    tmp = Path(tmp_path_factory.mktemp("faulty"))
    redis = RedisProcess(free_port(), tmp / "redis", appendonly=True).start()
    svc = start_service(tmp, redis.url)
    ids = [f"fault-{i:03d}" for i in range(N)]
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        for i, r in enumerate(ids):
            c.put(r, frame_for(np.roll(TRAJ[:24], i, axis=0), 0))
    yield Faulty(svc, redis, ids)
    svc.stop()
    redis.stop()


def _check_all_answered(ids: list[str], got: list[tuple[str, Routing | R3Error]]) -> None:
    assert [r for r, _ in got] == ids, "every id exactly once, in request order"
    for _, res in got:
        assert isinstance(res, Routing), res


@pytest.mark.parametrize("return_errors", [False, True])
def test_sync_get_many_answers_every_id_through_a_redis_outage(
    faulty: Faulty, transport: str, return_errors: bool
) -> None:
    got: list[tuple[str, Routing | R3Error]] = []
    timer = None
    with RoutingClient(faulty.url(transport), api_key=KEY_A, retry=PATIENT) as c:
        for item in c.get_many(faulty.ids, chunk_size=32, return_errors=return_errors):
            got.append(item)
            if len(got) == 40:  # mid-chunk: the items fetched next meet a dead Redis
                timer = faulty.outage()
    assert timer is not None
    timer.join()
    _check_all_answered(faulty.ids, got)


@pytest.mark.parametrize("return_errors", [False, True])
async def test_async_get_many_answers_every_id_through_a_redis_outage(
    faulty: Faulty, transport: str, return_errors: bool
) -> None:
    got: list[tuple[str, Routing | R3Error]] = []
    timer = None
    async with AsyncRoutingClient(faulty.url(transport), api_key=KEY_A, retry=PATIENT) as c:
        async for item in c.get_many(
            faulty.ids, chunk_size=16, concurrency=2, return_errors=return_errors
        ):
            got.append(item)
            if len(got) == 40:
                timer = faulty.outage()
    assert timer is not None
    await asyncio.to_thread(timer.join)
    assert sorted(r for r, _ in got) == faulty.ids  # arrival order across chunks
    for _, res in got:
        assert isinstance(res, Routing), res


def test_exhausted_retries_answer_the_id_or_raise_never_skip(
    faulty: Faulty, transport: str
) -> None:
    """With too few attempts to outlast the outage, the failed id comes back as an error
    item (``return_errors``) or the call raises; no id is ever missing from what came back."""
    impatient = Retry(attempts=2, backoff=0.01, max_backoff=0.01)
    got: list[tuple[str, Routing | R3Error]] = []
    timer = None
    with RoutingClient(faulty.url(transport), api_key=KEY_A, retry=impatient) as c:
        for item in c.get_many(faulty.ids, chunk_size=32, return_errors=True):
            got.append(item)
            if len(got) == 10:
                timer = faulty.outage(1.5)
    assert timer is not None
    timer.join()
    assert [r for r, _ in got] == faulty.ids
    errors = [res for _, res in got if isinstance(res, R3Error)]
    assert errors and all(isinstance(e, StoreUnavailableError) for e in errors)

    timer = None
    seen: list[str] = []

    def consume(c: RoutingClient) -> None:
        nonlocal timer
        for r, _ in c.get_many(faulty.ids, chunk_size=32):
            seen.append(r)
            if len(seen) == 10:
                timer = faulty.outage(1.5)

    with (
        RoutingClient(faulty.url(transport), api_key=KEY_A, retry=impatient) as c,
        pytest.raises(StoreUnavailableError),
    ):
        consume(c)
    assert timer is not None
    timer.join()
    assert seen == faulty.ids[: len(seen)], "what came back before the error is a prefix"


def _our_tasks(before: set[asyncio.Task[object]]) -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t not in before and not t.done()}


async def _settle(before: set[asyncio.Task[object]]) -> set[asyncio.Task[object]]:
    for _ in range(50):
        left = _our_tasks(before)
        if not left or left == {asyncio.current_task()}:
            return set()
        await asyncio.sleep(0.02)
    return _our_tasks(before) - {asyncio.current_task()}  # type: ignore[operator]


async def test_async_get_many_stopped_early_leaves_no_task(faulty: Faulty, transport: str) -> None:
    """A consumer that stops after one item (queue full, streams busy) ends every worker."""
    before = set(asyncio.all_tasks())
    async with AsyncRoutingClient(faulty.url(transport), api_key=KEY_A) as c:
        stream = c.get_many(faulty.ids, chunk_size=1, concurrency=4)
        assert isinstance(stream, AsyncIterator)
        first = await anext(stream)
        assert first[0] in faulty.ids
        await asyncio.sleep(0.3)  # let the workers fill the queue and block on it
        await stream.aclose()  # type: ignore[attr-defined]
        assert await _settle(before) == set()

        # Dropped without aclose: the loop finalises the generator; still no task left.
        stream = c.get_many(faulty.ids, chunk_size=1, concurrency=4)
        await anext(stream)
        await asyncio.sleep(0.3)
        del stream
        gc.collect()
        assert await _settle(before) == set()


async def test_async_get_many_cancelled_consumer_propagates_and_ends_workers(
    faulty: Faulty, transport: str
) -> None:
    before = set(asyncio.all_tasks())
    async with AsyncRoutingClient(faulty.url(transport), api_key=KEY_A) as c:
        started = asyncio.Event()

        async def consume() -> int:
            n = 0
            async for _ in c.get_many(faulty.ids, chunk_size=2, concurrency=4):
                n += 1
                started.set()
                await asyncio.sleep(10)  # a slow consumer, cancelled while it works
            return n

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _settle(before) == set()
