"""What the engine writes leaves the store whole: deletes and drops free shared blobs.

Frames are written by the engine's own :class:`~sglang_r3.http_server.shipping.Shipper`
(the code SGLang's HTTP process runs) through the real service, on a real Redis and a
real 3-master Redis Cluster: GRPO groups of samples sharing a prompt, multi-turn agents
whose second turn recomputed the first (a view).  After ``delete_many`` or
``drop_consumed`` of every rollout no key of theirs is left, blobs included, and Redis's
``used_memory`` falls by what the calls report (issue 52); with half a group deleted the
rest read bit for bit; a writer putting a group's prompt while its sharers are deleted
never leaves a rollout pointing at a missing blob; a full Redis (``noeviction``) takes as
much again once the trained-on rollouts are dropped.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from redis.asyncio.cluster import RedisCluster

from cache_service.redis_proc import RedisProcess, free_port
from cache_service.store import SegmentStore, StoreSettings
from r3_client import AsyncRoutingClient, Deleted, InvalidRequestError, SegmentConflictError
from r3_client.synthetic import synthetic_routing
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.shipping import Shipper
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import moe_shape
from sglang_r3.scheduler.row_transport import EngineRows
from tests.support.frames import TRAJ, frame_for, rid
from tests.support.service_process import KEY_A, Service, start_service

pytestmark = pytest.mark.timeout(600)

# Qwen3-MoE-like, scaled down: 12 MoE layers, 64 experts, top-8 (~60 B a row in frames).
SHAPE = moe_shape(
    SimpleNamespace(
        num_hidden_layers=12, num_experts_per_tok=8, num_experts=64, model_type="qwen3_moe"
    )
)
L, E, K = SHAPE.num_layers, 64, 8
NAMESPACE = "tenant-a"  # KEY_A's


def _rows(n: int, seed: int) -> np.ndarray:
    return synthetic_routing(n, L, E, K, skew=1.0, seed=seed).astype(np.int32)


def _tag(rollout: str, share_prompt: bool) -> OutputTag:
    return OutputTag(0, 0, rollout, "", False, share_prompt)


class Fleet:
    """Rollouts written as the engine writes them, and what each reads back."""

    def __init__(self, svc: Service, seed: int) -> None:
        self.shipper = Shipper(
            EngineConfig(routing_cache=svc.http_url, api_key=KEY_A), SHAPE, "tiny-moe"
        )
        self.rng = np.random.default_rng(seed)
        self.tag = f"b{seed}-{self.rng.integers(1 << 40):x}"
        self.groups: list[list[str]] = []
        self.agents: list[str] = []
        self.nbytes: dict[str, int] = {}
        self.prompt_bytes: list[int] = []  # each group's shared prompt segment

    async def group(self, n: int, prompt_len: int, out_len: int, version: str = "3") -> list[str]:
        """A GRPO group: n samples of one prompt (one request each, prompt rows shared)."""
        g = len(self.groups)
        ids: list[str] = []
        self.groups.append(ids)  # filled as samples are stored (a group may be cut short)
        self.prompt_bytes.append(0)
        prompt = [int(t) for t in self.rng.integers(0, 50_000, prompt_len)]
        prompt_rows = _rows(prompt_len - 1, seed=int(self.rng.integers(1 << 30)))
        for i in range(n):
            rid = f"{self.tag}-g{g}-s{i}"
            output = [int(t) for t in self.rng.integers(0, 50_000, out_len)]
            own = _rows(out_len + 1, seed=int(self.rng.integers(1 << 30)))
            rows = np.concatenate([prompt_rows, own])[: prompt_len + out_len - 1]
            ref = await self.shipper.ship(
                _tag(rid, True), 0, EngineRows(rows), prompt, output, {"weight_version": version}
            )
            assert ref["stored"], ref
            if i == 0:
                assert ref["segments"][0]["end"] == prompt_len - 1
                self.prompt_bytes[g] = ref["segments"][0]["nbytes"]
            self.nbytes[rid] = ref["nbytes"]
            ids.append(rid)
        return ids

    async def agent(self, turn_len: int, version: str = "3") -> str:
        """A two-turn agent whose second turn recomputed the first (a view)."""
        rid = f"{self.tag}-a{len(self.agents)}"
        tokens = [int(t) for t in self.rng.integers(0, 50_000, 2 * turn_len + 1)]
        first = _rows(turn_len, seed=int(self.rng.integers(1 << 30)))
        meta = {"weight_version": version}
        ref = await self.shipper.ship(
            _tag(rid, False),
            0,
            EngineRows(first),
            tokens[: turn_len // 2],
            tokens[turn_len // 2 : turn_len + 1],
            meta,
        )
        assert ref["stored"], ref
        second = EngineRows(_rows(2 * turn_len, seed=int(self.rng.integers(1 << 30))), 0, (0,))
        ref2 = await self.shipper.ship(
            _tag(rid, False),
            turn_len,
            second,
            tokens[: turn_len + 10],
            tokens[turn_len + 10 :],
            meta,
        )
        assert ref2["stored"] and ref2["views"], ref2
        self.nbytes[rid] = ref["nbytes"] + ref2["nbytes"] + sum(v["nbytes"] for v in ref2["views"])
        self.agents.append(rid)
        return rid

    @property
    def ids(self) -> list[str]:
        return [r for g in self.groups for r in g] + self.agents

    async def close(self) -> None:
        await self.shipper.client.aclose()


@pytest.fixture(
    scope="module", params=["single", pytest.param("cluster", marks=pytest.mark.cluster)]
)
def svc(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """A service of this module's own (a key prefix nobody else writes, so a drop by
    version walks only these rollouts), over the session's Redis or Redis Cluster."""
    prefix = f"blobs{uuid.uuid4().hex[:8]}"
    env = {"R3_CACHE_KEY_PREFIX": prefix}
    tmp = tmp_path_factory.mktemp(f"blobs-{request.param}")
    if request.param == "single":
        server: RedisProcess = request.getfixturevalue("redis_single")
        service = start_service(tmp, server.url, env=env)
    else:
        nodes: list[RedisProcess] = request.getfixturevalue("redis_cluster")
        service = start_service(tmp, nodes[0].url, cluster=True, env=env)
    service.extra["prefix"] = prefix
    service.extra["cluster"] = "1" if request.param == "cluster" else ""
    yield service
    service.stop()


@pytest.fixture
async def inspect(svc: Service) -> AsyncIterator[SegmentStore]:
    """The service's own Redis, read directly (its namespace's keys, ``used_memory``)."""
    settings = StoreSettings(
        redis_url=svc.redis_url, cluster=bool(svc.extra["cluster"]), key_prefix=svc.extra["prefix"]
    )
    st = (await SegmentStore.connect(settings)).for_namespace(NAMESPACE)
    yield st
    await st.close()


async def _keys_of(st: SegmentStore, ids: list[str]) -> set[str]:
    """Every key these rollouts occupy: their hashes, their views' and the blobs they
    reference."""
    r: Any = st._r
    out: set[str] = set()
    for rollout in ids:
        key = st.key(rollout)
        fields = await r.hgetall(key)
        if not fields:
            continue
        out.add(key)
        for f, v in fields.items():
            if f.startswith(b"v:"):
                out.add(f"{key}:v:{f[2:].decode()}")
            elif f.startswith(b"r:"):
                out.add(v.decode())
    return out


async def _existing(st: SegmentStore, keys: set[str]) -> set[str]:
    r: Any = st._r
    return {k for k in keys if await r.exists(k)}


async def _used(st: SegmentStore) -> int:
    r: Any = st._r
    if isinstance(r, RedisCluster):
        infos = await r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(i["used_memory"]) for i in infos.values())
    return int((await r.info("memory"))["used_memory"])


def await_stored(fleet: Fleet) -> int:
    """Frame bytes the fleet's rollouts hold in Redis: each ship's reported bytes, a
    group's prompt counted once."""
    return sum(fleet.nbytes.values()) - sum(
        max(len(g) - 1, 0) * fleet.prompt_bytes[i] for i, g in enumerate(fleet.groups)
    )


async def _settled(st: SegmentStore) -> int:
    """``used_memory`` once Redis has shrunk the buffers of the burst before (its client
    cron runs each 100 ms): a second of quiet first."""
    await asyncio.sleep(1.0)
    return await _used(st)


@pytest.mark.parametrize("how", ["delete_many", "drop_consumed"])
async def test_engine_written_rollouts_leave_no_key_and_free_what_they_report(
    svc: Service, inspect: SegmentStore, how: str
) -> None:
    fleet = Fleet(svc, seed=1 if how == "delete_many" else 2)
    try:
        # ~10 MB: at a megabyte, Redis's own buffers move used_memory by 10-30 % of it
        for _ in range(32):
            await fleet.group(n=4, prompt_len=1500, out_len=600)
        for _ in range(24):
            await fleet.agent(turn_len=900)
    finally:
        await fleet.close()
    keys = await _keys_of(inspect, fleet.ids)
    blobs = {k for k in keys if ":blob:" in k}
    # One blob per group (its prompt); a sample's own rows and an agent's turns are private.
    assert len(blobs) == len(fleet.groups)
    assert sum(":v:" in k for k in keys) == len(fleet.agents)

    async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as client:
        # Warm the service's connection pool to every node first: each new connection
        # adds ~20 KB of client buffers to used_memory (~130 KB a node for a first batch
        # on a Cluster), which is not what a delete frees.
        await client.delete_many([f"{fleet.tag}-none-{i}" for i in range(64)], chunk_size=64)
        before = await _settled(inspect)
        if how == "delete_many":
            got = await client.delete_many(fleet.ids, chunk_size=64)  # the service's max_batch
            assert all(isinstance(g, Deleted) and g.existed for g in got)
            freed = sum(g.freed_bytes or 0 for g in got)
        else:
            res = await client.drop_consumed(3)
            assert res.done and res.dropped >= len(fleet.ids)
            freed = res.freed_bytes or 0
    fall = before - await _settled(inspect)
    assert await _existing(inspect, keys) == set(), "keys left behind"
    assert abs(freed - fall) <= 0.05 * fall, (freed, fall)
    # what Redis gave back is at least the frames stored: every sample's own rows and
    # views, and each group's prompt once
    assert fall >= await_stored(fleet), (fall, await_stored(fleet))


async def test_half_a_group_deleted_the_rest_read_bit_for_bit(
    svc: Service, inspect: SegmentStore
) -> None:
    fleet = Fleet(svc, seed=3)
    try:
        ids = await fleet.group(n=6, prompt_len=700, out_len=300)
    finally:
        await fleet.close()
    async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as client:
        before = {r: await client.get(r) for r in ids}
        blobs = {k for k in await _keys_of(inspect, ids) if ":blob:" in k}
        assert len(blobs) == 1
        got = await client.delete_many(ids[::2])
        assert all(g.existed for g in got)
        assert await _existing(inspect, blobs) == blobs  # still referenced
        for r in ids[1::2]:
            after = await client.get(r)
            assert np.array_equal(after.indices, before[r].indices)
        await client.delete_many(ids[1::2])
        assert await _existing(inspect, blobs) == set()


async def test_a_writer_racing_deletes_never_leaves_a_dangling_reference(
    svc: Service, inspect: SegmentStore
) -> None:
    """One prompt, written again and again by new samples while the samples before them
    are deleted: the blob is freed and re-created many times, and every rollout that
    exists reads whole; once all are deleted, the blob is gone too."""
    fleet = Fleet(svc, seed=4)
    prompt = [int(t) for t in fleet.rng.integers(0, 50_000, 400)]
    prompt_rows = _rows(399, seed=44)
    written: asyncio.Queue[str | None] = asyncio.Queue()
    deleted: list[str] = []
    broken: list[str] = []
    seen: set[str] = set()  # every key the rollouts occupied (their blob included)

    async def writer() -> None:
        for i in range(40):
            rid = f"{fleet.tag}-race{i}"
            rows = np.concatenate([prompt_rows, _rows(100, seed=i)])
            out = [int(t) for t in fleet.rng.integers(0, 50_000, 100)]
            ref = await fleet.shipper.ship(_tag(rid, True), 0, EngineRows(rows), prompt, out, {})
            assert ref["stored"]
            await written.put(rid)
        await written.put(None)

    async def deleter(client: AsyncRoutingClient) -> None:
        nonlocal seen
        while (rid := await written.get()) is not None:
            got = await client.get(rid)  # readable whole right after its put
            if got.indices.shape[0] != 499 or (got.indices < 0).any():
                broken.append(rid)
            seen |= await _keys_of(inspect, [rid])
            await client.delete_many([rid])
            deleted.append(rid)

    async def reader(client: AsyncRoutingClient) -> None:
        for _ in range(200):
            for gone in list(deleted[-3:]):
                try:
                    await client.get(gone)
                except Exception as exc:  # deleted: must say not found, never "expired"
                    if "not found" not in str(exc):
                        broken.append(f"{gone}: {exc}")
            await asyncio.sleep(0)

    try:
        async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as client:
            await asyncio.gather(writer(), deleter(client), reader(client))
    finally:
        await fleet.close()
    assert not broken
    assert any(":blob:" in k for k in seen)
    assert await _existing(inspect, seen) == set()
    r: Any = inspect._r
    pattern = inspect._prefix + ":blob:*"
    scan = (
        r.scan_iter(match=pattern, target_nodes=RedisCluster.PRIMARIES)
        if isinstance(r, RedisCluster)
        else r.scan_iter(match=pattern)
    )
    for k in [k async for k in scan]:
        f = await r.hget(k, "f")
        assert f is not None  # no blob without its frame


async def test_a_full_redis_takes_as_much_again_after_a_drop(tmp_path: Path) -> None:
    """Fill a ``noeviction`` Redis with engine-written GRPO groups until the service
    answers 503, drop what was trained on (the runbook's fix), and write again: at least
    90% of the dropped frame bytes go in before the next 503."""
    proc = RedisProcess(
        free_port(),
        tmp_path / "redis",
        appendonly=False,
        extra_args=("--maxmemory", "12mb", "--maxmemory-policy", "noeviction"),
    ).start()
    (tmp_path / "svc").mkdir()
    svc = start_service(tmp_path / "svc", proc.url)
    try:

        async def fill(fleet: Fleet, version: str) -> int:
            """Groups until the service refuses one; the frame bytes stored."""
            refused: R3RequestError | None = None
            for _ in range(1000):
                try:
                    await fleet.group(n=4, prompt_len=600, out_len=300, version=version)
                except R3RequestError as exc:
                    refused = exc
                    break
            assert refused is not None, "never full"
            assert refused.status_code == 503 and "Redis is full" in str(refused), refused
            return await_stored(fleet)

        first = Fleet(svc, seed=5)
        try:
            dropped_bytes = await fill(first, "3")
        finally:
            await first.close()
        async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as client:
            res = await client.drop_consumed(3)
            # (and the sample whose response was refused: its prompt segment was stored)
            assert res.done and res.dropped >= len(first.nbytes)
        second = Fleet(svc, seed=6)
        try:
            again = await fill(second, "4")
        finally:
            await second.close()
        assert again >= 0.9 * dropped_bytes, (again, dropped_bytes)
    finally:
        svc.stop()
        proc.stop()


# ---- the reference rules on the store itself (single Redis and Cluster) ----------------


async def _blob_of(st: SegmentStore, rollout_id: str, a: int, b: int) -> str:
    r: Any = st._r
    ref = await r.hget(st.key(rollout_id), f"r:{a}:{b}")
    assert ref is not None, "not a shared segment"
    return str(ref.decode())


async def _refs(st: SegmentStore, blob: str) -> int:
    r: Any = st._r
    fields = await r.hgetall(blob)
    count = sum(f.startswith(b"x:") for f in fields)
    assert count == int(fields.get(b"rc", b"0"))
    return count


async def test_a_rewind_releases_the_blobs_of_the_segments_it_drops(store: SegmentStore) -> None:
    a, b = rid(), rid()
    for r in (a, b):
        await store.put_segment(r, frame_for(TRAJ[:50], 0), share=False)
        put = await store.put_segment(r, frame_for(TRAJ[50:90], 50), share=True)
        assert put.shared
    blob = await _blob_of(store, a, 50, 90)
    assert await _refs(store, blob) == 2
    assert await store.rewind(a, 50) == 1
    assert await _refs(store, blob) == 1
    got = await store.get(b)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ[:90], -1))
    await store.rewind(b, 50)
    r: Any = store._r
    assert not await r.exists(blob)
    assert not await r.hexists(store.key(b), "t:50:90")


async def test_refused_and_duplicate_shared_puts_hold_no_reference(store: SegmentStore) -> None:
    r: Any = store._r
    a = rid()
    first = await store.put_segment(a, frame_for(TRAJ[:60], 0), share=True)
    blob = await _blob_of(store, a, 0, 60)
    again = await store.put_segment(a, frame_for(TRAJ[:60], 0), share=True)  # a retry
    assert (first.status, again.status) == ("stored", "duplicate")
    assert await _refs(store, blob) == 1  # the retry's reference was released
    # a refused put (another rollout holding other rows at that range) takes none either
    other = rid()
    await store.put_segment(other, frame_for(np.roll(TRAJ[:60], 1, axis=0), 0), share=False)
    with pytest.raises(SegmentConflictError, match="different content digest"):
        await store.put_segment(other, frame_for(TRAJ[:60], 0), share=True)
    assert await _refs(store, blob) == 1
    # a share=True put whose blob was created for it and then refused leaves no blob
    fresh = rid()
    await store.put_segment(fresh, frame_for(TRAJ[:30], 0), share=False)
    with pytest.raises(SegmentConflictError, match="overlap"):
        await store.put_segment(fresh, frame_for(TRAJ[10:70], 10), share=True)
    pattern = store._prefix + ":blob:*"
    scan = (
        r.scan_iter(match=pattern, target_nodes=RedisCluster.PRIMARIES)
        if isinstance(r, RedisCluster)
        else r.scan_iter(match=pattern)
    )
    assert {k.decode() async for k in scan} == {blob}
    deleted = await store.delete_many([a, other, fresh])
    assert all(isinstance(d, Deleted) and d.existed for d in deleted)
    assert not await r.exists(blob)
    # the delete that freed the blob counted its bytes
    assert (deleted[0].freed_bytes or 0) > first.nbytes


async def test_a_view_is_never_shared(store: SegmentStore) -> None:
    with pytest.raises(InvalidRequestError, match="never shared"):
        await store.put_segment(rid(), frame_for(TRAJ[5:40], 5), view=40, share=True)


async def test_a_blob_from_before_references_is_left_to_its_ttl(store: SegmentStore) -> None:
    """Rolling upgrade: a blob an older service wrote has rollouts pointing at it with no
    token; a new rollout sharing it and then deleted must not take it with it."""
    r: Any = store._r
    old, new = rid(), rid()
    await store.put_segment(old, frame_for(TRAJ[:40], 0), share=True)
    blob = await _blob_of(store, old, 0, 40)
    # what an older service left: no reference fields, no token beside the pointer
    token = (await r.hget(store.key(old), "t:0:40")).decode()
    await r.hdel(blob, f"x:{token}", "rc")
    await r.hdel(store.key(old), "t:0:40")
    await store.put_segment(new, frame_for(TRAJ[:40], 0), share=True)
    await store.delete_many([new])
    assert await r.exists(blob)
    got = await store.get(old)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ[:40], -1))
    assert (await store.remove(old)).existed
    assert await r.exists(blob)  # no token: left to its TTL
    assert await r.pttl(blob) > 0
