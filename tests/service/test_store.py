"""SegmentStore against a real redis-server and a real 3-master Redis Cluster."""

from __future__ import annotations

import asyncio
import itertools

import msgpack
import numpy as np
import pytest

from cache_service.redis_proc import free_port
from cache_service.store import SegmentStore, StoreSettings
from r3_client import (
    ChecksumError,
    InvalidRequestError,
    RolloutNotFoundError,
    Segment,
    SegmentConflictError,
    StoreUnavailableError,
    decode_rollout,
    encode_frame,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, K, frame_for, rid


async def test_put_get_round_trip_over_turns(store: SegmentStore) -> None:
    r = rid()
    turns = [(0, 120), (120, 200), (200, 300)]
    for a, b in turns:
        res = await store.put_segment(r, frame_for(TRAJ[a:b], a))
        assert res.status == "stored"
        assert res.segment.start == a
    got = await store.get(r)
    assert (got.start, got.end, got.layer_ids, got.num_experts) == (0, 300, LAYERS, E)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ, -1))
    assert [(s.start, s.end) for s in got.segments] == turns


async def test_range_and_layer_subset_read_only_overlapping_rows(store: SegmentStore) -> None:
    r = rid()
    await store.put_segment(r, frame_for(TRAJ[:150], 0))
    await store.put_segment(r, frame_for(TRAJ[150:], 150))
    got = await store.get(r, start=140, end=160, layers=[5, 1])
    assert got.start == 140
    assert got.layer_ids == (1, 5)  # ascending, as stored
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ[140:160][:, [0, 2]], -1))
    assert [(s.start, s.end) for s in got.segments] == [(0, 150), (150, 300)]
    only_first = await store.get(r, start=0, end=10)
    assert [(s.start, s.end) for s in only_first.segments] == [(0, 150)]


async def test_gaps_read_as_minus_one(store: SegmentStore) -> None:
    r = rid()
    await store.put_segment(r, frame_for(TRAJ[200:300], 200))
    got = await store.get(r)
    assert got.end == 300
    assert (got.indices[:200] == -1).all()
    assert (got.indices[200:] >= 0).all()


async def test_same_segment_twice_is_a_no_op_even_in_another_codec(store: SegmentStore) -> None:
    r = rid()
    first = await store.put_segment(r, frame_for(TRAJ[:100], 0, codec="set"))
    again = await store.put_segment(r, frame_for(TRAJ[:100], 0, codec="raw"))
    assert (first.status, again.status) == ("stored", "duplicate")
    st = await store.stat(r)
    assert len(st.segments) == 1
    assert st.segments[0].codec == "set"
    assert st.stored_bytes == first.nbytes


async def test_conflicts_are_refused_and_leave_data_unchanged(store: SegmentStore) -> None:
    r = rid()
    await store.put_segment(r, frame_for(TRAJ[:100], 0))
    other = TRAJ[:100].copy()
    other[50, 0] = np.roll(np.arange(E), 1)[other[50, 0]]  # a different set, still valid
    assert not np.array_equal(np.sort(other, -1), np.sort(TRAJ[:100], -1))
    with pytest.raises(
        SegmentConflictError, match="same range with a different content digest: different routing"
    ):
        await store.put_segment(r, frame_for(other, 0))
    with pytest.raises(SegmentConflictError, match="same range with a different content digest"):
        await store.put_segment(r, frame_for(TRAJ[:100], 0, version="v2"))
    with pytest.raises(SegmentConflictError, match=r"overlaps it; send only rows"):
        await store.put_segment(r, frame_for(TRAJ[50:150], 50))
    idx = synthetic_routing(10, len(LAYERS), 128, K, seed=1)
    with pytest.raises(SegmentConflictError, match="E=64, K=4"):
        await store.put_segment(r, frame_for(idx, 100, e=128))
    with pytest.raises(SegmentConflictError, match="layers"):
        await store.put_segment(r, frame_for(TRAJ[100:110][:, :2], 100, layers=(1, 3)))
    got = await store.get(r)
    assert got.end == 100
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ[:100], -1))
    assert len((await store.stat(r)).segments) == 1


async def test_bad_frames_and_ids_are_refused(store: SegmentStore) -> None:
    r = rid()
    frame = bytearray(frame_for(TRAJ[:10], 0))
    frame[-10] ^= 0xFF
    with pytest.raises(ChecksumError):
        await store.put_segment(r, bytes(frame))
    for bad in ["", "a b", "x{y}", "é", "a" * 201, "abc\n"]:
        with pytest.raises(InvalidRequestError, match="invalid rollout id"):
            await store.put_segment(bad, frame_for(TRAJ[:10], 0))
    with pytest.raises(RolloutNotFoundError):
        await store.get(r)


async def test_invalid_reads(store: SegmentStore) -> None:
    r = rid()
    await store.put_segment(r, frame_for(TRAJ[:100], 0))
    with pytest.raises(InvalidRequestError, match=r"outside rollout .* rows \[0, 100\)"):
        await store.get(r, start=90, end=101)
    with pytest.raises(InvalidRequestError, match="empty or negative"):
        await store.get(r, start=5, end=5)
    with pytest.raises(InvalidRequestError, match="past the last stored row"):
        await store.get(r, start=100)
    with pytest.raises(InvalidRequestError, match="not MoE layers"):
        await store.get(r, layers=[2])
    with pytest.raises(RolloutNotFoundError, match="not found"):
        await store.stat(rid())


async def test_stat_delete_and_ttl(store: SegmentStore) -> None:
    r = rid()
    res = await store.put_segment(r, frame_for(TRAJ[:100], 0), ttl_s=100)
    st = await store.stat(r)
    assert (st.num_experts, st.topk, st.layer_ids, st.num_rows) == (E, K, LAYERS, 100)
    assert st.stored_bytes == res.nbytes
    assert st.memory_bytes
    assert st.memory_bytes >= res.nbytes
    assert st.ttl_s is not None
    assert 95 < st.ttl_s <= 100
    seg = st.segments[0]
    assert (seg.segment.model_id, seg.segment.weight_version) == ("tiny-moe", "v1")
    # a write refreshes the TTL (to the default)
    await store.put_segment(r, frame_for(TRAJ[100:200], 100))
    st = await store.stat(r)
    assert st.ttl_s is not None
    assert st.ttl_s > 100
    await store.touch(r, ttl_s=0)
    assert (await store.stat(r)).ttl_s is None
    await store.touch(r, ttl_s=1)
    assert (await store.stat(r)).ttl_s is not None
    mem = await store.memory()
    assert mem["used_memory"] > 0
    assert mem["keys"] >= 1
    assert mem["maxmemory"] == mem["fullest_ratio"] == 0  # the test servers set no limit
    assert await store.delete(r) is True
    assert await store.delete(r) is False
    with pytest.raises(RolloutNotFoundError):
        await store.touch(r)


async def test_expired_rollout_is_gone(store: SegmentStore) -> None:
    r = rid()
    await store.put_segment(r, frame_for(TRAJ[:10], 0), ttl_s=1)
    await asyncio.sleep(1.3)
    with pytest.raises(RolloutNotFoundError):
        await store.get(r)


async def _shuffled_gather(jobs: list) -> list:
    """Run ``jobs`` concurrently in a shuffled start order; results in the original order."""
    order = np.random.default_rng(len(jobs)).permutation(len(jobs))
    results = await asyncio.gather(*(jobs[i] for i in order), return_exceptions=True)
    out: list = [None] * len(jobs)
    for pos, i in enumerate(order):
        out[i] = results[pos]
    return out


async def test_many_concurrent_writers_on_one_rollout(store: SegmentStore) -> None:
    """40 distinct segments, each put 3x concurrently: none lost, none doubled."""
    r = rid()
    n_seg, width = 40, 7
    traj = synthetic_routing(n_seg * width, len(LAYERS), E, K, seed=11)
    frames = [frame_for(traj[i * width : (i + 1) * width], i * width) for i in range(n_seg)]
    results = await _shuffled_gather([store.put_segment(r, f) for f in frames * 3])
    statuses = [x.status for x in results]
    assert statuses.count("stored") == n_seg
    assert statuses.count("duplicate") == 2 * n_seg
    st = await store.stat(r)
    assert [(s.segment.start, s.segment.end) for s in st.segments] == [
        (i * width, (i + 1) * width) for i in range(n_seg)
    ]
    assert st.stored_bytes == sum(s.nbytes for s in st.segments)
    got = await store.get(r)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(traj, -1))


async def test_concurrent_different_writers_exactly_one_wins(store: SegmentStore) -> None:
    r = rid()
    variants = [synthetic_routing(50, len(LAYERS), E, K, seed=100 + i) for i in range(12)]
    results = await _shuffled_gather([store.put_segment(r, frame_for(v, 0)) for v in variants])
    winners = [i for i, x in enumerate(results) if not isinstance(x, Exception)]
    assert len(winners) == 1
    assert all(
        isinstance(x, SegmentConflictError) for i, x in enumerate(results) if i != winners[0]
    )
    got = await store.get(r)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(variants[winners[0]], -1))


async def test_concurrent_overlapping_writers_never_leave_overlaps(store: SegmentStore) -> None:
    r = rid()
    traj = synthetic_routing(400, len(LAYERS), E, K, seed=5)
    ranges = [(i, i + 10) for i in range(0, 390, 10)] + [(i + 5, i + 25) for i in range(0, 370, 20)]
    frames = {rg: frame_for(traj[rg[0] : rg[1]], rg[0]) for rg in ranges}
    results = await _shuffled_gather([store.put_segment(r, frames[rg]) for rg in ranges])
    stored = sorted(
        rg for rg, x in zip(ranges, results, strict=True) if not isinstance(x, Exception)
    )
    assert all(isinstance(x, SegmentConflictError) for x in results if isinstance(x, Exception))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(stored))
    st = await store.stat(r)
    assert [(s.segment.start, s.segment.end) for s in st.segments] == stored
    got = await store.get(r)
    for a, b in stored:  # each stored range holds exactly what its writer sent
        assert np.array_equal(np.sort(got.indices[a:b], -1), np.sort(traj[a:b], -1))


async def test_segment_limit(store: SegmentStore) -> None:
    limited = SegmentStore(
        store._r,
        StoreSettings(  # same client, tighter limit
            redis_url=store.settings.redis_url,
            cluster=store.settings.cluster,
            key_prefix=store.settings.key_prefix,
            max_segments=2,
        ),
    )
    r = rid()
    await limited.put_segment(r, frame_for(TRAJ[:1], 0))
    await limited.put_segment(r, frame_for(TRAJ[1:2], 1))
    with pytest.raises(InvalidRequestError, match="already has 2 segments"):
        await limited.put_segment(r, frame_for(TRAJ[2:3], 2))


@pytest.mark.cluster
async def test_cluster_keys_share_the_rollout_slot(
    redis_cluster: list,
) -> None:
    st = await SegmentStore.connect(StoreSettings(redis_url=redis_cluster[0].url, cluster=True))
    try:
        slots = {await st._r.cluster_keyslot(st.key(f"r-{i}")) for i in range(50)}
        assert len(slots) > 10  # rollouts spread over the cluster…
        key = st.key("same")
        assert key == "r3:{same}"  # …and a rollout's key is hash-tagged
    finally:
        await st.close()


async def test_unreachable_redis_is_a_clear_error() -> None:
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        await SegmentStore.connect(
            StoreSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", connect_retries=1)
        )


async def test_grpo_prompt_segments_are_stored_once(store: SegmentStore) -> None:
    """n samples of one prompt: the prompt segment is shared, each response is private."""
    prompt = TRAJ[:100]
    ids = [rid() for _ in range(4)]
    puts = [await store.put_segment(r, frame_for(prompt, 0)) for r in ids]
    assert [p.shared for p in puts] == [True] * 4
    assert [p.dedupe_hit for p in puts] == [False, True, True, True]
    for i, r in enumerate(ids):
        resp = synthetic_routing(20, len(LAYERS), E, K, seed=200 + i)
        await store.put_segment(r, frame_for(resp, 100))
        got = await store.get(r)
        assert np.array_equal(np.sort(got.indices[:100], -1), np.sort(prompt, -1))
        assert np.array_equal(np.sort(got.indices[100:], -1), np.sort(resp, -1))
    st = await store.stat(ids[0])
    # by the store's rule only a segment from row 0 is kept in a blob (issue 52: segments
    # nobody shares are not blobs); the response is the rollout's own
    assert [s.shared for s in st.segments] == [True, False]
    assert st.shared_bytes == puts[0].nbytes < st.stored_bytes
    bare = await store.put_segment(rid(), encode_frame(prompt, num_experts=E, layer_ids=LAYERS))
    assert not bare.shared  # no digest: nothing to share by
    # same share key, different rows (non-deterministic numerics): a private copy, not a lie
    other = np.roll(prompt, 1, axis=0)
    res = await store.put_segment(rid(), frame_for(other, 0))
    assert not res.shared


async def test_shared_blob_lives_as_long_as_its_rollouts(store: SegmentStore) -> None:
    a, b = rid(), rid()
    await store.put_segment(a, frame_for(TRAJ[:50], 0), ttl_s=2)
    await store.put_segment(b, frame_for(TRAJ[:50], 0), ttl_s=2)
    await store.touch(b, ttl_s=0)  # b never expires now, so neither may its prompt rows
    await asyncio.sleep(2.3)
    with pytest.raises(RolloutNotFoundError):
        await store.get(a)
    got = await store.get(b)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ[:50], -1))


async def test_namespaces_are_isolated(store: SegmentStore) -> None:
    tenant_a, tenant_b = store.for_namespace("tenant-a"), store.for_namespace("tenant-b")
    r = rid()
    await tenant_a.put_segment(r, frame_for(TRAJ[:10], 0))
    with pytest.raises(RolloutNotFoundError):
        await tenant_b.get(r)
    # b can write the same id without touching a's data, and shares no blob with a
    res = await tenant_b.put_segment(r, frame_for(TRAJ[:10], 0))
    assert res.status == "stored"
    assert not res.dedupe_hit
    assert await tenant_b.delete(r)
    assert (await tenant_a.get(r)).end == 10
    with pytest.raises(InvalidRequestError, match="invalid namespace"):
        store.for_namespace("A B")


async def test_get_frame_returns_stored_bytes_or_a_deterministic_assembly(
    store: SegmentStore,
) -> None:
    r = rid()
    first = frame_for(TRAJ[:100], 0, codec="raw")
    await store.put_segment(r, first)
    assert await store.get_frame(r) == first  # untouched fast path
    await store.put_segment(r, frame_for(TRAJ[100:300], 100))
    whole = await store.get_frame(r)
    assert whole == await store.get_frame(r)  # deterministic
    dec = decode_rollout(whole)
    assert [(s.start, s.end) for s in dec.segments] == [(0, 100), (100, 300)]
    assert np.array_equal(np.sort(dec.indices, -1), np.sort(TRAJ, -1))
    part = decode_rollout(
        await store.get_frame(r, start=90, end=110, layers=[3]), start=90, end=110, layers=[3]
    )
    assert (part.start, part.end, part.layer_ids) == (90, 110, (3,))


async def test_rollouts_stored_before_format_v2_still_read(store: SegmentStore) -> None:
    """A rollout the v1 service wrote (v1 frames in its hash) reads back whole and cut."""
    r = rid()
    key = store.key(r)
    meta = msgpack.packb([E, K, list(LAYERS)], use_bin_type=True)
    for a, b in ((0, 100), (100, 300)):
        v1 = encode_frame(
            TRAJ[a:b], num_experts=E, layer_ids=LAYERS, segment=Segment(a, b), version=1
        )
        await store._r.hset(key, mapping={"m": meta, f"s:{a}:{b}": v1, f"d:{a}:{b}": "x"})
    got = decode_rollout(await store.get_frame(r))
    assert got.end == 300 and np.array_equal(np.sort(got.indices, -1), np.sort(TRAJ, -1))
    part = await store.get(r, start=150, end=160, layers=[LAYERS[0]])
    assert np.array_equal(np.sort(part.indices, -1), np.sort(TRAJ[150:160, :1], -1))
