"""The client core through its transport seam: retries and stream resumption, no servers.

``MemoryTransport`` implements the ``Transport`` protocol in memory (the role httpx's
``MockTransport`` plays for httpx) and fails on a script, so every retry and
resumption rule of the core is exercised exactly; the real transports are tested
against real servers elsewhere.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import numpy as np
import pytest

from r3_client import (
    AsyncRoutingClient,
    ConnectError,
    ProtocolError,
    Retry,
    RolloutNotFoundError,
    RoutingClient,
    StoreUnavailableError,
    encode_frame,
)
from r3_client.codec.stream import StreamItem
from r3_client.synthetic import synthetic_routing

NO_WAIT = Retry(attempts=3, backoff=0.0)
E, K, L = 16, 2, (0, 1)


def frame(seed: int, rows: int = 5) -> bytes:
    return encode_frame(
        synthetic_routing(rows, len(L), E, K, seed=seed), num_experts=E, layer_ids=L
    )


class MemoryTransport:
    """Frames in a dict; ``faults[op]`` lists exceptions raised by that op's next calls.

    ``break_after``: a batch stream raises ``ConnectError`` after that many items
    (once).  ``item_errors``: ids answered with ``store_unavailable`` that many times.
    """

    def __init__(self, frames: dict[str, bytes]) -> None:
        self.frames = frames
        self.faults: dict[str, list[Exception]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.break_after: int | None = None
        self.item_errors: dict[str, int] = {}
        self.out_of_order = False

    def _enter(self, op: str, arg: Any) -> None:
        self.calls.append((op, arg))
        if self.faults.get(op):
            raise self.faults[op].pop(0)

    def put(self, rollout_id: str, frame: bytes) -> dict[str, Any]:
        self._enter("put", rollout_id)
        self.frames[rollout_id] = frame
        return {
            "status": "stored",
            "rollout_id": rollout_id,
            "segment": {"start": 0, "end": 5},
            "nbytes": len(frame),
            "shared": False,
            "dedupe_hit": False,
        }

    def get(
        self, rollout_id: str, start: int, end: int | None, layers: Sequence[int] | None
    ) -> bytes:
        self._enter("get", rollout_id)
        if rollout_id not in self.frames:
            raise RolloutNotFoundError(f"no rollout {rollout_id!r}")
        return self.frames[rollout_id]

    def stat(self, rollout_id: str) -> dict[str, Any]:
        raise NotImplementedError

    def delete(self, rollout_id: str) -> bool:
        return self.frames.pop(rollout_id, None) is not None

    def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        return None

    def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Generator[StreamItem, None, None]:
        self._enter("batch_get", list(rollout_ids))
        ids = list(rollout_ids)
        if self.out_of_order:
            ids.reverse()
        for n, rid in enumerate(ids):
            if self.break_after is not None and n == self.break_after:
                self.break_after = None
                raise ConnectError("connection reset mid-stream")
            if self.item_errors.get(rid, 0) > 0:
                self.item_errors[rid] -= 1
                yield StreamItem(rid, None, "store_unavailable", "redis is loading", 503)
            elif rid in self.frames:
                yield StreamItem(rid, self.frames[rid])
            else:
                yield StreamItem(rid, None, "not_found", f"no rollout {rid!r}", 404)

    def close(self) -> None:
        return None


class AsyncMemoryTransport:
    """The same, as an ``AsyncTransport`` (wraps a :class:`MemoryTransport`)."""

    def __init__(self, inner: MemoryTransport) -> None:
        self.inner = inner

    async def put(self, rollout_id: str, frame: bytes) -> dict[str, Any]:
        return self.inner.put(rollout_id, frame)

    async def get(
        self, rollout_id: str, start: int, end: int | None, layers: Sequence[int] | None
    ) -> bytes:
        return self.inner.get(rollout_id, start, end, layers)

    async def stat(self, rollout_id: str) -> dict[str, Any]:
        raise NotImplementedError

    async def delete(self, rollout_id: str) -> bool:
        return self.inner.delete(rollout_id)

    async def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        return None

    async def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        for item in self.inner.batch_get(rollout_ids, start, end, layers, ranges):
            yield item

    async def aclose(self) -> None:
        return None


@pytest.fixture
def store() -> MemoryTransport:
    return MemoryTransport({f"r{i}": frame(i) for i in range(6)})


def test_retryable_failures_are_retried_up_to_the_attempts(store: MemoryTransport) -> None:
    client = RoutingClient(transport=store, retry=NO_WAIT)
    store.faults["get"] = [ConnectError("refused"), StoreUnavailableError("loading")]
    assert client.get("r1").num_rows == 5
    assert [op for op, _ in store.calls] == ["get"] * 3
    store.calls.clear()
    store.faults["put"] = [ConnectError("refused")] * 3
    with pytest.raises(ConnectError):
        client.put("r9", frame(9))
    assert len(store.calls) == 3


def test_an_answer_about_the_request_is_not_retried(store: MemoryTransport) -> None:
    client = RoutingClient(transport=store, retry=NO_WAIT)
    with pytest.raises(RolloutNotFoundError):
        client.get("missing")
    assert len(store.calls) == 1


def test_a_broken_stream_resumes_at_the_first_unanswered_id(store: MemoryTransport) -> None:
    client = RoutingClient(transport=store, retry=NO_WAIT)
    ids = [f"r{i}" for i in range(6)]
    store.break_after = 2
    got = list(client.get_many(ids))
    assert [rid for rid, _ in got] == ids
    for rid, routing in got:
        np.testing.assert_array_equal(routing.indices, client.get(rid).indices)
    batches = [arg for op, arg in store.calls if op == "batch_get"]
    assert batches == [ids, ids[2:]]


def test_a_retryable_item_is_asked_again_and_answered_once(store: MemoryTransport) -> None:
    client = RoutingClient(transport=store, retry=NO_WAIT)
    ids = ["r0", "r1", "r2"]
    store.item_errors["r1"] = 1
    assert [rid for rid, _ in client.get_many(ids)] == ids
    assert [arg for op, arg in store.calls if op == "batch_get"] == [ids, ["r1", "r2"]]
    # attempts spent on the item: with return_errors it is answered with its error
    store.calls.clear()
    store.item_errors["r1"] = 5
    got = dict(client.get_many(ids, return_errors=True))
    assert isinstance(got["r1"], StoreUnavailableError)
    assert got["r0"].num_rows == got["r2"].num_rows == 5
    assert len([op for op, _ in store.calls if op == "batch_get"]) == 4


def test_answers_out_of_order_are_a_protocol_error(store: MemoryTransport) -> None:
    client = RoutingClient(transport=store, retry=NO_WAIT)
    store.out_of_order = True
    with pytest.raises(ProtocolError, match="where 'r0' was next"):
        list(client.get_many(["r0", "r1"]))


async def test_the_async_client_resumes_the_same_way(store: MemoryTransport) -> None:
    client = AsyncRoutingClient(transport=AsyncMemoryTransport(store), retry=NO_WAIT)
    ids = [f"r{i}" for i in range(6)]
    store.break_after = 4
    got = [rid async for rid, _ in client.get_many(ids)]
    assert got == ids
    assert [arg for op, arg in store.calls if op == "batch_get"] == [ids, ids[4:]]
