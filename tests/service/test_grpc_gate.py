"""The gRPC receive budget: a call reserves the largest message while it reads, then
holds what arrived; waiters go first come, first served; a cancelled call gives back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cache_service.grpc_gate import ReceiveBudget


class _Call:
    """Stands in for a grpc.aio servicer context: ``read()`` returns once ``send`` is called."""

    def __init__(self) -> None:
        self.message: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def send(self, size: int) -> None:
        self.message.set_result(bytes(size))

    async def read(self) -> bytes:
        return await self.message


async def _hold(budget: ReceiveBudget, call: Any, done: asyncio.Event) -> int:
    async with budget.receive(call) as raw:
        assert raw is not None
        await done.wait()
        return len(raw)


async def test_reads_wait_while_the_budget_is_spent_and_hold_only_what_arrived() -> None:
    budget = ReceiveBudget(total=30, most=10)
    done = asyncio.Event()
    calls = [_Call() for _ in range(4)]
    tasks = [asyncio.create_task(_hold(budget, c, done)) for c in calls]
    await asyncio.sleep(0)
    assert budget.free == 0  # three reads reserved the largest message each; one waits
    calls[0].send(2)
    await asyncio.sleep(0)
    assert budget.free == 8  # the first holds 2 of its 10; 8 is not enough for the fourth
    calls[1].send(1)
    calls[2].send(1)
    calls[3].send(10)
    await asyncio.sleep(0.01)
    assert budget.free == 30 - (2 + 1 + 1 + 10)
    done.set()
    assert await asyncio.gather(*tasks) == [2, 1, 1, 10]
    assert budget.free == 30


async def test_a_cancelled_read_gives_its_reservation_back() -> None:
    budget = ReceiveBudget(total=10, most=10)
    first, second = _Call(), _Call()
    done = asyncio.Event()
    holder = asyncio.create_task(_hold(budget, first, done))
    waiter = asyncio.create_task(_hold(budget, second, done))
    await asyncio.sleep(0)
    waiter.cancel()  # cancelled while waiting for the budget
    holder.cancel()  # cancelled while reading
    with pytest.raises(asyncio.CancelledError):
        await waiter
    with pytest.raises(asyncio.CancelledError):
        await holder
    assert budget.free == 10
