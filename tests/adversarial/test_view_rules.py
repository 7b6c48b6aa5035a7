"""Views held to the segment rules (issue 42, defects 1 to 4), against the real service on a
single Redis and a Redis Cluster, over HTTP, gRPC, the async client and ``DirectReader``.

* geometry: a view of a rollout not stored yet sets the rollout's geometry (later segments
  must match it); a view with another geometry is refused; a view serving rows far past the
  rollout is refused; a view hash planted in Redis with another K is refused by every reader
  with an ``R3Error`` per id, before anything is written over the rollout's rows; a view
  hash the rollout does not register is not readable;
* a fixed view (a segment starts at its ``serves``) cannot be changed, not even by rows
  that do not overlap the stored view;
* one lifetime: every write and touch of the rollout sets its views' TTL too, ``delete``
  takes them, and ``memory_bytes`` counts them; views per rollout are bounded;
* ``latest`` / ``exact`` hold one view's rows at a time beside the answer, and refuse an
  answer over ``max_bytes`` before reading any view.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from r3_client import (
    AsyncRoutingClient,
    DirectReader,
    InvalidRequestError,
    LimitExceededError,
    R3Error,
    RoutingClient,
    SegmentConflictError,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, K, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, Service, url_of

NAMESPACE = "tenant-a"  # KEY_A's


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.cluster)])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[Service, Any]]:
    """The service and an admin Redis client on the Redis it uses (to plant damage)."""
    svc: Service = request.getfixturevalue(f"service_{request.param}")
    admin: Any = (
        redis.RedisCluster.from_url(svc.redis_url)
        if request.param == "cluster"
        else redis.Redis.from_url(svc.redis_url)
    )
    yield svc, admin
    admin.close()


def key(r: str) -> str:
    return f"r3:{NAMESPACE}:{{{r}}}"


def reader(svc: Service, **kw: Any) -> DirectReader:
    with svc.http() as c:
        plan = c.post("/v1/read-plan").json()
    return DirectReader(plan, **kw)


def rows(n: int, k: int = K, seed: int = 3) -> np.ndarray:
    return synthetic_routing(n, len(LAYERS), E, k, skew=1.0, rho=0.7, seed=seed)


# ---- 1. geometry --------------------------------------------------------------------------


def test_view_of_a_new_rollout_sets_its_geometry(
    backend: tuple[Service, Any], transport: str
) -> None:
    svc, _ = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        # A first call retracted and re-prefilled: its view is written before any segment.
        c.put(r, frame_for(rows(40, seed=5), 0, version="v2"), view=40)
        info = c.stat(r)  # the rollout exists (its geometry), with no rows yet
        assert (info.num_experts, info.topk, info.layer_ids, info.num_rows) == (E, K, LAYERS, 0)
        assert [(v.serves, v.start, v.end) for v in info.views] == [(40, 0, 40)]
        with pytest.raises(SegmentConflictError, match="K=4"):
            c.put(r, frame_for(rows(40, k=2), 0))  # another K: refused, as for a segment
        with pytest.raises(SegmentConflictError, match="K=4"):
            c.put(r, frame_for(rows(10, k=2), 40), view=50)
        c.put(r, frame_for(TRAJ[:40], 0))
        c.put(r, frame_for(TRAJ[40:60], 40, version="v2"))
        served = c.get_served(r)
        assert [(s.serves_start, s.serves_end) for s in served] == [(0, 40), (40, 60)]
        assert same_sets(served[1].routing.indices[:40], rows(40, seed=5))


def test_view_far_past_the_rollout_is_refused(backend: tuple[Service, Any], transport: str) -> None:
    svc, _ = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:150], 0))
        far = 1 << 19  # more than max_gap_rows (131,072) past the 150 stored rows
        with pytest.raises(InvalidRequestError, match="R3_CACHE_MAX_GAP_ROWS"):
            c.put(r, frame_for(rows(100), far - 100), view=far)
        with pytest.raises(InvalidRequestError, match="R3_CACHE_MAX_ROLLOUT_ROWS"):
            c.put(r, frame_for(rows(100), 0), view=(1 << 20) + 1)
        assert c.stat(r).views == ()


def _plant_view(admin: Any, svc: Service, victim: str, serves: int, k: int) -> None:
    """Copy a donor rollout's view (rows [0, 40) with top-``k``) into ``victim``'s view key
    and registration, as damage at rest would (the service refuses to store it)."""
    donor = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        c.put(donor, frame_for(rows(40, k=k), 0))
        c.put(donor, frame_for(rows(40, k=k, seed=11), 0, version="v2"), view=40)
    fields = admin.hgetall(f"{key(donor)}:v:40")
    admin.hset(f"{key(victim)}:v:{serves}", mapping=fields)
    admin.hset(key(victim), f"v:{serves}", admin.hget(key(donor), "v:40"))


@pytest.mark.parametrize("k", [1, 16])
def test_planted_view_of_another_k_is_an_error_per_id(
    backend: tuple[Service, Any], transport: str, k: int
) -> None:
    svc, admin = backend
    victim, good = rid(), rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in (victim, good):
            c.put(r, frame_for(TRAJ[:40], 0))
            c.put(r, frame_for(TRAJ[40:80], 40, version="v2"))
        _plant_view(admin, svc, victim, 40, k)
        assert c.get(good, view="latest").indices.shape == (80, len(LAYERS), K)
        for read in (
            lambda: c.get(victim, view="latest"),
            lambda: c.get(victim, start=10, end=60, view="latest"),
            lambda: c.get_served(victim),
        ):
            with pytest.raises(R3Error, match="view serving row 40"):
                read()
        got = dict(c.get_many([victim, good], view="latest", return_errors=True))
        assert isinstance(got[victim], R3Error) and not isinstance(got[good], R3Error)

    async def async_reads() -> None:
        async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as ac:
            with pytest.raises(R3Error, match="view serving row 40"):
                await ac.get(victim, view="latest")
            with pytest.raises(R3Error, match="view serving row 40"):
                await ac.get_served(victim)

    asyncio.run(async_reads())
    with reader(svc) as d:
        with pytest.raises(R3Error, match="view serving row 40"):
            d.get(victim, view="latest")
        with pytest.raises(R3Error, match="view serving row 40"):
            d.get_served(victim)
        got = dict(d.get_many([victim, good, victim], view="latest", return_errors=True))
        assert isinstance(got[victim], R3Error)
        assert got[good].indices.shape == (80, len(LAYERS), K)  # type: ignore[union-attr]


def test_view_hash_the_rollout_does_not_register_is_not_read(
    backend: tuple[Service, Any], transport: str
) -> None:
    svc, admin = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:40], 0))
        c.put(r, frame_for(rows(40), 0, version="v2"), view=40)
        admin.hdel(key(r), "v:40")  # the registration lost: the hash is not the rollout's
        with pytest.raises(R3Error, match="no view serving row 40"):
            c.get_frame(r, view=40)
        c.delete(r)
        assert admin.exists(f"{key(r)}:v:40") == 1  # unregistered: delete cannot see it
        admin.delete(f"{key(r)}:v:40")
        with pytest.raises(R3Error, match=r"no view serving row 40|not found"):
            c.get_frame(r, view=40)


# ---- 2. a fixed view -----------------------------------------------------------------------


def test_fixed_view_cannot_change(backend: tuple[Service, Any], transport: str) -> None:
    svc, _ = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:100], 0))
        c.put(r, frame_for(rows(40), 0, version="v2"), view=100)
        c.put(r, frame_for(TRAJ[100:150], 100, version="v2"))  # the view is now fixed
        before = c.get(r, view="latest")
        for frame in (
            frame_for(rows(60, seed=4), 40, version="v2"),  # rows [40, 100): no overlap
            frame_for(rows(40, seed=4), 0, version="v2"),  # the same rows, other routing
            frame_for(rows(100, seed=4), 0, version="v2"),  # more rows
        ):
            with pytest.raises(SegmentConflictError, match="fixed"):
                c.put(r, frame, view=100)
        assert c.put(r, frame_for(rows(40), 0, version="v2"), view=100).status == "duplicate"
        assert [(v.start, v.end) for v in c.stat(r).views] == [(0, 40)]
        assert np.array_equal(c.get(r, view="latest").indices, before.indices)


def test_unfixed_view_is_replaced_whole(backend: tuple[Service, Any], transport: str) -> None:
    svc, admin = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:100], 0))
        c.put(r, frame_for(rows(40), 0, version="v2"), view=100)
        c.put(r, frame_for(rows(60, seed=4), 40, version="v2"), view=100)  # the retry's rows
        assert [(v.start, v.end) for v in c.stat(r).views] == [(40, 100)]
        fields = admin.hkeys(f"{key(r)}:v:100")
        assert sorted(f for f in fields if f.startswith(b"s:")) == [b"s:40:100"]


# ---- 3. one lifetime ------------------------------------------------------------------------


def _ttls(admin: Any, r: str, serves: int) -> tuple[int, int]:
    return admin.pttl(key(r)), admin.pttl(f"{key(r)}:v:{serves}")


def test_views_live_as_long_as_their_rollout(backend: tuple[Service, Any], transport: str) -> None:
    svc, admin = backend
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:40], 0))
        c.put(r, frame_for(rows(40), 0, version="v2"), view=40)
        c.touch(r, ttl_s=0)
        assert _ttls(admin, r, 40) == (-1, -1)
        c.put(r, frame_for(TRAJ[40:80], 40, version="v2"))  # a write: default TTL on both
        rollout, view = _ttls(admin, r, 40)
        assert rollout > 0 and abs(rollout - view) < 5_000
        c.touch(r, ttl_s=5)
        c.put(r, frame_for(TRAJ[80:120], 80, version="v2"))  # a later turn refreshes the view
        rollout, view = _ttls(admin, r, 40)
        assert view > 60_000 and abs(rollout - view) < 5_000
        c.put(r, frame_for(rows(40, seed=6), 80, version="v3"), view=120)  # a view write too
        ttls = (*_ttls(admin, r, 40), *_ttls(admin, r, 120))
        # One write set all four: within a few seconds of each other (rounding the TTLs to
        # 10 s buckets was flaky when they straddled a bucket edge).
        assert min(ttls) > 60_000 and max(ttls) - min(ttls) < 5_000, ttls

        # A hash Redis is still rehashing incrementally holds both tables (128 B more here,
        # a 16-bucket table) until serverCron finishes it: read both sides again until they
        # agree, within a second (seen flaky once in CI and once here: 6456 == 3408 + 2920)
        for _ in range(20):
            info = c.stat(r)
            alone = admin.memory_usage(key(r), samples=0)
            views = sum(admin.memory_usage(f"{key(r)}:v:{s}", samples=0) for s in (40, 120))
            if info.memory_bytes == alone + views:
                break
            time.sleep(0.05)
        assert info.memory_bytes == alone + views

        assert c.delete(r)
        assert admin.exists(key(r), f"{key(r)}:v:40", f"{key(r)}:v:120") == 0


def test_views_per_rollout_are_bounded(backend: tuple[Service, Any]) -> None:
    svc, _ = backend
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:2], 0))
        one = frame_for(rows(1), 0, version="v2")
        for serves in range(1, 257):  # the default limit: 256 views
            c.put(r, one, view=serves)
        with pytest.raises(InvalidRequestError, match="R3_CACHE_MAX_VIEWS"):
            c.put(r, one, view=257)
        assert c.put(r, one, view=256).status == "duplicate"  # a stored one still answers
        assert len(c.stat(r).views) == 256


# ---- 4. latest / exact bounded ---------------------------------------------------------------

ROWS, TURNS = 8192, 64  # 64 turns of 128 rows, each after the first recomputing every row


def _many_views(c: RoutingClient) -> str:
    r = rid()
    traj = rows(ROWS, seed=21)
    step = ROWS // TURNS
    c.put(r, frame_for(traj[:step], 0))
    for t in range(1, TURNS):
        s = t * step
        c.put(r, frame_for(rows(s, seed=100 + t), 0, version=f"v{t}"), view=s)
        c.put(r, frame_for(traj[s : s + step], s, version=f"v{t}"))
    return r


def _peak(read: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        got = read()
        peak = tracemalloc.get_traced_memory()[1] - base
        del got
    finally:
        tracemalloc.stop()
    return peak


def test_latest_and_exact_within_max_bytes(backend: tuple[Service, Any], transport: str) -> None:
    svc, _ = backend
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as big:
        r = _many_views(big)
        want = big.get(r, view="latest")
        states = big.get_served(r)
    # int16 ids: the answer is 192 KiB; the views' rows decoded at once would be 63 views x
    # 4,096 rows on average: 6 MiB.
    limit = 4 * want.indices.nbytes
    last = ROWS - ROWS // TURNS
    assert same_sets(want.indices[:last], rows(last, seed=100 + TURNS - 1))
    assert len(states) == TURNS

    with RoutingClient(url_of(svc, transport), api_key=KEY_A, max_bytes=limit) as c:
        got = c.get(r, view="latest")  # warm the code paths before measuring
        assert np.array_equal(got.indices, want.indices)
        assert _peak(lambda: c.get(r, view="latest")) < limit + (1 << 20)
        with pytest.raises(LimitExceededError, match="max_bytes"):
            c.get_served(r)  # 64 states of up to 8,192 rows: ~6 MiB, over the limit
    with reader(svc, max_bytes=limit) as d:
        assert np.array_equal(d.get(r, view="latest").indices, want.indices)
        assert _peak(lambda: d.get(r, view="latest")) < limit + (1 << 20)
        with pytest.raises(LimitExceededError, match="max_bytes"):
            d.get_served(r)
    with reader(svc) as d:
        for a, b in zip(d.get_served(r), states, strict=True):
            assert np.array_equal(a.routing.indices, b.routing.indices)

    async def async_reads() -> None:
        async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A, max_bytes=limit) as ac:
            assert np.array_equal((await ac.get(r, view="latest")).indices, want.indices)
            with pytest.raises(LimitExceededError, match="max_bytes"):
                await ac.get_served(r)

    asyncio.run(async_reads())


def test_engine_continues_a_rollout_that_holds_only_views(service_single: Service) -> None:
    """A first call whose own rows failed to ship after its view was stored leaves a rollout
    with a geometry and a view, no rows: the engine's retry starts it anew (its lookup
    answers None, as for a new rollout) instead of refusing it for gaps."""
    from types import SimpleNamespace

    from sglang_r3.config import EngineConfig
    from sglang_r3.http_server.shipping import Shipper
    from sglang_r3.layers import moe_shape

    shape = moe_shape(
        SimpleNamespace(
            num_hidden_layers=3, num_experts_per_tok=K, num_experts=E, model_type="qwen3_moe"
        )
    )
    r = rid()
    with RoutingClient(service_single.http_url, api_key=KEY_A) as c:
        layers = tuple(shape.moe_layer_ids)
        idx = synthetic_routing(30, len(layers), E, K, seed=2)
        c.put(r, frame_for(idx, 0, layers=layers, version="v2"), view=30)
        assert c.stat(r).num_rows == 0
    shipper = Shipper(
        EngineConfig(routing_cache=service_single.http_url, api_key=KEY_A), shape, "tiny"
    )
    assert asyncio.run(shipper.continuation(r)) is None
