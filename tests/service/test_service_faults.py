"""Faults against the real service: Redis SIGKILLed under write load, service restarts, races."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import decode_frame, decode_rollout
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, frame_for, rid, same_sets
from tests.support.prometheus import value
from tests.support.service_process import KEY_A, METRICS_KEY, Service, WriteLoad, start_service

HEADERS = {"Authorization": f"Bearer {KEY_A}"}


def _put_all(svc: Service, frames: dict[str, bytes]) -> None:
    with svc.http() as c:
        for r, f in frames.items():
            assert c.put(f"/v1/rollouts/{r}/segments", content=f).status_code == 201


def _assert_all_readable(svc: Service, frames: dict[str, bytes]) -> None:
    with svc.http() as c:
        for r, f in frames.items():
            assert c.get(f"/v1/rollouts/{r}").content == f


def _wait_ready(svc: Service, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{svc.http_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("service did not become ready again")


async def test_redis_sigkill_under_write_load_loses_no_acknowledged_write(tmp_path: Path) -> None:
    redis = RedisProcess(free_port(), tmp_path / "redis", appendonly=True).start()
    svc = start_service(tmp_path, redis.url)
    routing = synthetic_routing(64, len(LAYERS), 64, 4, seed=1)
    load = WriteLoad(routing, "load")

    try:
        async with httpx.AsyncClient(base_url=svc.http_url, headers=HEADERS, timeout=30) as c:
            tasks = [asyncio.create_task(load.writer(c, n)) for n in range(8)]
            await asyncio.sleep(1.5)
            before_kill = len(load.acked)
            redis.kill()  # SIGKILL: no shutdown, only what the AOF fsynced survives
            await asyncio.sleep(1.5)
            assert (await c.get("/readyz")).status_code == 503
            redis.start()  # same port, same AOF
            await asyncio.to_thread(_wait_ready, svc)  # the service recovers by itself
            await asyncio.sleep(1.0)
            load.stop.set()
            await asyncio.gather(*tasks)
            assert before_kill > 0
            assert len(load.acked) > before_kill  # writes resumed after the restart
            assert 503 in load.statuses  # the outage was seen…
            assert set(load.statuses) <= {201, 503}  # …and reported as 503, never a 500
            for r, frame in load.acked.items():  # every acknowledged write is still there
                resp = await c.get(f"/v1/rollouts/{r}")
                assert resp.status_code == 200, r
                assert same_sets(
                    decode_rollout(resp.content).indices, decode_frame(frame).routing.indices
                )
    finally:
        svc.stop()
        redis.stop()


def _metrics(svc: Service) -> str:
    """One scrape of the service's /metrics (which must answer 200)."""
    resp = httpx.get(
        f"{svc.http_url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    return resp.text


def test_metrics_answer_while_redis_is_down(tmp_path: Path) -> None:
    """/metrics answers 200 whatever Redis does, and says whether Redis answered
    (``r3_store_up``); the memory gauges read Redis's own figures, limit included."""
    redis = RedisProcess(
        free_port(), tmp_path / "redis", appendonly=False, extra_args=("--maxmemory", "64mb")
    ).start()
    svc = start_service(tmp_path, redis.url)
    try:
        _put_all(svc, {rid(): frame_for(synthetic_routing(40, len(LAYERS), 64, 4, seed=1), 0)})
        text = _metrics(svc)
        assert value(text, "r3_store_up") == 1
        assert value(text, "r3_store_maxmemory_bytes") == 64 << 20
        used = value(text, "r3_store_used_memory_bytes")
        assert used is not None and used > 0
        assert value(text, "r3_store_fullest_ratio") == pytest.approx(used / (64 << 20))
        for stop in (signal.SIGSTOP, signal.SIGKILL):  # hung, then gone
            os.kill(redis.pid, stop)
            t0 = time.monotonic()
            text = _metrics(svc)
            assert time.monotonic() - t0 < 8  # within Prometheus's default scrape timeout
            assert value(text, "r3_store_up") == 0
            assert value(text, "r3_store_used_memory_bytes") == used  # the last figure read
            if stop == signal.SIGSTOP:
                os.kill(redis.pid, signal.SIGCONT)
                text = _metrics(svc)
                assert value(text, "r3_store_up") == 1
                used = value(text, "r3_store_used_memory_bytes")
        redis.stop()
        redis.start()
        _wait_ready(svc)
        assert value(_metrics(svc), "r3_store_up") == 1
    finally:
        svc.stop()
        redis.stop()


def test_service_restart_with_embedded_redis_loses_nothing(tmp_path: Path) -> None:
    """`r3 serve --data-dir D` twice: the second process reads what the first stored."""
    ports = {"http_port": free_port(), "grpc_port": free_port()}
    frames = {
        rid(): frame_for(synthetic_routing(50, len(LAYERS), 64, 4, seed=i), 0) for i in range(10)
    }
    svc = start_service(tmp_path, None, **ports)
    try:
        _put_all(svc, frames)
    finally:
        svc.stop(signal.SIGTERM)
    assert svc.proc.returncode == 0
    svc = start_service(tmp_path, None, **ports)
    try:
        _assert_all_readable(svc, frames)
    finally:
        svc.stop()


def test_service_sigkill_and_restart_loses_nothing(
    tmp_path: Path, redis_single: RedisProcess
) -> None:
    svc = start_service(tmp_path, redis_single.url)
    frames = {
        rid(): frame_for(synthetic_routing(40, len(LAYERS), 64, 4, seed=i), 0) for i in range(10)
    }
    try:
        _put_all(svc, frames)
    finally:
        svc.stop(signal.SIGKILL)
    svc = start_service(tmp_path, redis_single.url)
    try:
        _assert_all_readable(svc, frames)
    finally:
        svc.stop()


async def test_concurrent_http_writers_on_one_rollout_stay_consistent(svc: Service) -> None:
    r = rid()
    n_seg, width = 30, 5
    traj = synthetic_routing(n_seg * width, len(LAYERS), 64, 4, seed=9)
    frames = [frame_for(traj[i * width : (i + 1) * width], i * width) for i in range(n_seg)]
    rivals = [
        frame_for(synthetic_routing(width, len(LAYERS), 64, 4, seed=50 + i), 0) for i in range(5)
    ]  # compete with frames[0] for rows [0, 5)
    jobs = frames * 3 + rivals
    order = np.random.default_rng(3).permutation(len(jobs))
    async with httpx.AsyncClient(base_url=svc.http_url, headers=HEADERS, timeout=30) as c:
        resps = await asyncio.gather(
            *(c.put(f"/v1/rollouts/{r}/segments", content=jobs[i]) for i in order)
        )
        codes = {int(i): resp.status_code for i, resp in zip(order, resps, strict=True)}
        first_range = [codes[i] for i in range(len(jobs)) if i % n_seg == 0 and i < 3 * n_seg]
        first_range += [codes[3 * n_seg + j] for j in range(len(rivals))]
        assert first_range.count(201) == 1  # exactly one writer won rows [0, 5)
        assert set(codes.values()) <= {200, 201, 409}
        for i in range(1, n_seg):  # every other range: one 201, two 200 (duplicates)
            assert sorted(codes[i + k * n_seg] for k in range(3)) == [200, 200, 201]
        st = (await c.get(f"/v1/rollouts/{r}/stat")).json()
        assert [(s["segment"]["start"], s["segment"]["end"]) for s in st["segments"]] == [
            (i * width, (i + 1) * width) for i in range(n_seg)
        ]
        got = decode_rollout(
            (await c.get(f"/v1/rollouts/{r}", params={"start": 5})).content, start=5
        )
        assert same_sets(got.indices, traj[5:])
