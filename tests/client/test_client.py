"""RoutingClient / AsyncRoutingClient against a real service: both transports, sync and async."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    AsyncRoutingClient,
    AuthError,
    ConnectError,
    R3Error,
    Retry,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    Segment,
    SegmentConflictError,
    Timeout,
    token_digest,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, KEY_B, Service, start_service, url_of

FAST = Retry(attempts=1)


def test_sync_client_every_call(service_single: Service, transport: str) -> None:
    url = url_of(service_single, transport)
    r = rid()
    with RoutingClient(url, api_key=KEY_A) as c:
        routing = Routing.from_array(
            TRAJ[:100], num_experts=64, layer_ids=LAYERS, segments=(Segment(0, 100, "m", "w1"),)
        )
        res = c.put(r, routing)
        assert (res.status, res.segment.end, res.shared) == ("stored", 100, False)
        assert c.put(r, routing).status == "duplicate"
        seg = Segment(100, 200, "m", "w2", token_digest(range(200)))
        # past row 0 the store's rule keeps a segment private: shared because the put says so
        res = c.put(r, TRAJ[100:200], num_experts=64, layer_ids=LAYERS, segment=seg, share=True)
        assert res.shared
        assert c.put(r, frame_for(TRAJ[200:], 200)).status == "stored"  # a ready frame
        got = c.get(r)
        assert (got.start, got.end, got.layer_ids) == (0, 300, LAYERS)
        assert same_sets(got.indices, TRAJ)
        assert [s.weight_version for s in got.segments] == ["w1", "w2", "v1"]
        part = c.get(r, start=150, end=160, layers=[5])  # sliced by the server
        assert (part.start, part.layer_ids) == (150, (5,))
        assert same_sets(part.indices, TRAJ[150:160][:, 2:3])
        assert c.get_frame(r, start=150, end=160, layers=[5]) == c.get_frame(
            r, start=150, end=160, layers=[5]
        )
        info = c.stat(r)
        assert (info.num_rows, info.layer_ids, len(info.segments)) == (300, LAYERS, 3)
        assert info.segments[1].shared and info.shared_bytes > 0
        assert info.ttl_s is not None
        c.touch(r, ttl_s=0)
        assert c.stat(r).ttl_s is None
        t = got.to_torch(torch.int64)
        assert t.dtype == torch.int64 and t.shape == (300, 3, 4)
        assert c.delete(r) is True
        assert c.delete(r) is False
        with pytest.raises(RolloutNotFoundError, match="not found"):
            c.get(r)
        c.put(r, frame_for(TRAJ[:10], 0))
        with pytest.raises(SegmentConflictError):
            c.put(r, frame_for(np.roll(TRAJ[:10], 1, axis=0), 0))


def test_sync_get_many(service_single: Service, transport: str) -> None:
    ids = [rid() for _ in range(30)]
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        for i, r in enumerate(ids):
            c.put(r, frame_for(synthetic_routing(20 + i, 3, 64, 4, seed=i), 0))
        got = list(c.get_many(ids, chunk_size=7, progress=True))
        assert [r for r, _ in got] == ids  # request order
        for i, (_, routing) in enumerate(got):
            assert isinstance(routing, Routing)
            assert same_sets(routing.indices, synthetic_routing(20 + i, 3, 64, 4, seed=i))
        sliced = list(c.get_many(ids[:5], start=2, end=10, layers=[1]))
        assert all(r.indices.shape == (8, 1, 4) for _, r in sliced)  # type: ignore[union-attr]
        with pytest.raises(RolloutNotFoundError):
            list(c.get_many([ids[0], "no-such-rollout", ids[1]]))
        mixed = list(c.get_many([ids[0], "no-such-rollout"], return_errors=True))
        assert isinstance(mixed[0][1], Routing)
        assert isinstance(mixed[1][1], RolloutNotFoundError)


async def test_async_client_every_call(service_single: Service, transport: str) -> None:
    r = rid()
    async with AsyncRoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        assert (await c.put(r, frame_for(TRAJ[:50], 0))).status == "stored"
        await c.put(r, TRAJ[50:80], num_experts=64, layer_ids=LAYERS, start=50)
        got = await c.get(r)
        assert same_sets(got.indices, TRAJ[:80])
        assert (await c.get(r, start=60, layers=[1, 3])).indices.shape == (20, 2, 4)
        assert (await c.stat(r)).num_rows == 80
        await c.touch(r)
        ids = [rid() for _ in range(25)]
        for i, x in enumerate(ids):
            await c.put(x, frame_for(synthetic_routing(10, 3, 64, 4, seed=i), 0))
        got_many = [x async for x in c.get_many(ids, chunk_size=4, concurrency=3)]
        assert sorted(x for x, _ in got_many) == sorted(ids)  # arrival order across chunks
        by_id = dict(got_many)
        for i, x in enumerate(ids):
            assert same_sets(
                by_id[x].indices,  # type: ignore[union-attr]
                synthetic_routing(10, 3, 64, 4, seed=i),
            )
        with pytest.raises(RolloutNotFoundError):
            _ = [x async for x in c.get_many([*ids[:5], "missing-x"], chunk_size=2)]
        assert await c.delete(r) is True
        with pytest.raises(RolloutNotFoundError):
            await c.stat(r)


def test_errors_are_translated_on_every_transport(service_single: Service, transport: str) -> None:
    dead = (
        f"http://127.0.0.1:{free_port()}"
        if transport == "http"
        else f"grpc://127.0.0.1:{free_port()}"
    )
    with RoutingClient(dead, retry=FAST, timeout=Timeout(connect=1, read=3)) as c:
        with pytest.raises(ConnectError):
            c.get("x")
        with pytest.raises(ConnectError):
            list(c.get_many(["x"]))
    for key in (None, KEY_B + "wrong"):
        with (
            RoutingClient(url_of(service_single, transport), api_key=key, retry=FAST) as c,
            pytest.raises(AuthError),
        ):
            c.stat("x")
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A, retry=FAST) as c:
        for call in (
            lambda: c.get("bad id!"),
            lambda: c.put("x", b"not a frame"),
            lambda: c.get("x", start=5, end=2),
        ):
            with pytest.raises(R3Error):  # never httpx / grpc / ValueError leaking out
                call()


async def test_async_errors_are_translated(transport: str) -> None:
    dead = (
        f"http://127.0.0.1:{free_port()}"
        if transport == "http"
        else f"grpc://127.0.0.1:{free_port()}"
    )
    async with AsyncRoutingClient(dead, retry=FAST) as c:
        with pytest.raises(ConnectError):
            await c.stat("x")
        with pytest.raises(ConnectError):
            _ = [x async for x in c.get_many(["a", "b"])]


def test_retries_ride_out_a_redis_restart(tmp_path: Path, transport: str) -> None:
    """503 while Redis is down is retried with backoff until it is back."""
    redis = RedisProcess(free_port(), tmp_path / "redis", appendonly=True).start()
    svc = start_service(tmp_path, redis.url)
    try:
        retry = Retry(attempts=20, backoff=0.1, max_backoff=0.5)
        with RoutingClient(url_of(svc, transport), api_key=KEY_A, retry=retry) as c:
            c.put("survivor", frame_for(TRAJ[:20], 0))
            redis.kill()
            restarter = threading.Timer(1.5, redis.start)
            restarter.start()
            t0 = time.monotonic()
            got = c.get("survivor")  # fails with 503/UNAVAILABLE, retried, then succeeds
            assert time.monotonic() - t0 > 1.0
            assert same_sets(got.indices, TRAJ[:20])
            restarter.join()
    finally:
        svc.stop()
        redis.stop()
