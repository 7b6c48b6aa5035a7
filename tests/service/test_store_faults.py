"""The store when its redis-server dies: clear errors, then recovery without a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from cache_service.store import SegmentStore, StoreSettings
from r3_client import Segment, StoreUnavailableError, encode_frame
from r3_client.synthetic import synthetic_routing

ROUTING = synthetic_routing(64, 2, 32, 4, seed=3)


def _frame(a: int, b: int) -> bytes:
    return encode_frame(ROUTING[a:b], num_experts=32, layer_ids=[0, 1], segment=Segment(a, b))


async def test_sigkill_then_restart_keeps_acknowledged_writes(tmp_path: Path) -> None:
    """AOF with fsync=always: a write acknowledged before SIGKILL is readable after restart."""
    server = RedisProcess(free_port(), tmp_path / "aof", appendonly=True).start()
    store = await SegmentStore.connect(StoreSettings(redis_url=server.url, connect_retries=0))
    try:
        await store.put_segment("durable", _frame(0, 32))
        server.kill()
        with pytest.raises(StoreUnavailableError, match="unreachable"):
            await store.put_segment("durable", _frame(32, 64))
        with pytest.raises(StoreUnavailableError):
            await store.get("durable")
        server.start()  # same port, same AOF directory
        got = await store.get("durable")  # the same store object reconnects by itself
        assert got.end == 32
        assert np.array_equal(np.sort(got.indices, -1), np.sort(ROUTING[:32], -1))
        await store.put_segment("durable", _frame(32, 64))
        assert (await store.get("durable")).end == 64
    finally:
        await store.close()
        server.stop()
