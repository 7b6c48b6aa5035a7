"""Views: rows the engine recomputed, stored beside each position's first computation.

Against the real service over both transports, on a single Redis and on a Redis Cluster:
a two-turn rollout whose second call recomputed rows ``[10, 71)`` under weights ``v2``
(stored as the view serving row 71), read under each policy; the view's life with its
rollout (stat, touch, rewind, delete); a view whose own segment was never stored; bad
view puts refused with a reason.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from r3_client import (
    AsyncRoutingClient,
    InvalidRequestError,
    RolloutNotFoundError,
    RoutingClient,
    SegmentConflictError,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, K, frame_for, rid, same_sets
from tests.support.prometheus import value
from tests.support.service_process import KEY_A, METRICS_KEY, Service, url_of

#: What the second call computed for rows it recomputed (other routing than the first).
RECOMPUTED = synthetic_routing(300, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=8)
#: What a third call recomputed after a second push.
THIRD = synthetic_routing(300, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=9)


@pytest.fixture(params=["single", "cluster"])
def service(request: pytest.FixtureRequest) -> Service:
    return request.getfixturevalue(f"service_{request.param}")  # type: ignore[no-any-return]


def three_turns(c: RoutingClient, r: str) -> None:
    """Turn 1 [0, 71) v1; turn 2 recomputed [10, 71) under v2 and added [71, 200);
    turn 3 recomputed [0, 200) under v3 and added [200, 250)."""
    c.put(r, frame_for(TRAJ[:71], 0))
    c.put(r, frame_for(RECOMPUTED[10:71], 10, version="v2"), view=71)
    c.put(r, frame_for(TRAJ[71:200], 71, version="v2"))
    c.put(r, frame_for(THIRD[0:200], 0, version="v3"), view=200)
    c.put(r, frame_for(TRAJ[200:250], 200, version="v3"))


def test_policies_read_each_computation(service: Service, transport: str) -> None:
    r = rid()
    with RoutingClient(url_of(service, transport), api_key=KEY_A) as c:
        three_turns(c, r)
        info = c.stat(r)
        assert [(v.serves, v.start, v.end, v.weight_version) for v in info.views] == [
            (71, 10, 71, "v2"),
            (200, 0, 200, "v3"),
        ]
        assert info.num_rows == 250  # views add no rows
        generated = c.get(r)
        assert same_sets(generated.indices, TRAJ[:250])
        assert same_sets(c.get(r, view="generated").indices, TRAJ[:250])
        latest = c.get(r, view="latest")
        assert same_sets(latest.indices[:200], THIRD[:200])
        assert same_sets(latest.indices[200:], TRAJ[200:250])
        # A range and a layer subset read the same rows of the view.
        part = c.get(r, start=50, end=220, layers=[LAYERS[1]], view="latest")
        assert same_sets(part.indices, latest.indices[50:220, 1:2])

        served = c.get_served(r)  # exact
        assert [(s.serves_start, s.serves_end) for s in served] == [(0, 71), (71, 200), (200, 250)]
        first, second, third = (s.routing.indices for s in served)
        assert same_sets(first, TRAJ[:71])
        assert same_sets(second[:10], TRAJ[:10])
        assert same_sets(second[10:71], RECOMPUTED[10:71])
        assert same_sets(second[71:200], TRAJ[71:200])
        assert same_sets(third[:200], THIRD[:200]) and same_sets(third[200:], TRAJ[200:250])
        assert [len(s.views) for s in served] == [0, 1, 2]
        (only,) = c.get_served(r, view="latest")
        assert (only.serves_start, only.serves_end) == (0, 250)
        assert np.array_equal(only.routing.indices, latest.indices)
        with pytest.raises(InvalidRequestError, match="get_served"):
            c.get(r, view="exact")
        with pytest.raises(InvalidRequestError, match="view must be one of"):
            c.get(r, view="newest")  # type: ignore[arg-type]


def test_a_rollout_without_views_reads_the_same_under_every_policy(
    service_single: Service, transport: str
) -> None:
    r = rid()
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:71], 0))
        c.put(r, frame_for(TRAJ[71:200], 71))
        assert c.stat(r).views == ()
        base = c.get(r).indices
        assert np.array_equal(c.get(r, view="latest").indices, base)
        (only,) = c.get_served(r)
        assert (only.serves_start, only.serves_end, only.views) == (0, 200, ())
        assert np.array_equal(only.routing.indices, base)


def test_views_live_and_die_with_their_rollout(service: Service, transport: str) -> None:
    r = rid()
    with RoutingClient(url_of(service, transport), api_key=KEY_A) as c:
        three_turns(c, r)
        c.touch(r, 500)
        raw = c.get_frame(r, start=10, end=71, view=71)
        assert raw  # the view's own frames, readable directly
        # Rewinding to 71 rows drops the segments from 71 on and the views serving them.
        assert c.rewind(r, 71).views == ()
        with pytest.raises(RolloutNotFoundError, match="no view serving row 71"):
            c.get_frame(r, view=71)
        three_turns_rest = frame_for(TRAJ[71:200], 71, version="v2")
        c.put(r, frame_for(RECOMPUTED[10:71], 10, version="v2"), view=71)
        c.put(r, three_turns_rest)
        assert [v.serves for v in c.stat(r).views] == [71]
        assert c.delete(r)
        with pytest.raises(RolloutNotFoundError):
            c.get_frame(r, view=71)
        with pytest.raises(RolloutNotFoundError):
            c.stat(r)


def test_views_and_deletes_are_counted(service_single: Service, transport: str) -> None:
    """``r3_views_stored_total`` / ``r3_view_rows_stored_total`` count the views stored (a
    duplicate is no new view), ``r3_rollouts_dropped_total{how="delete"}`` the rollouts
    deleted (a delete of none drops nothing), over either transport."""

    def counts() -> tuple[float, float, float]:
        with service_single.http(METRICS_KEY) as m:
            text = m.get("/metrics").text
        return (
            value(text, "r3_views_stored_total") or 0,
            value(text, "r3_view_rows_stored_total") or 0,
            value(text, "r3_rollouts_dropped_total", how="delete") or 0,
        )

    r = rid()
    before = counts()
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        three_turns(c, r)  # views of rows [10, 71) and [0, 200)
        assert c.put(r, frame_for(THIRD[0:200], 0, version="v3"), view=200).status == "duplicate"
        assert c.delete(r)
        assert not c.delete(r)
    after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 61 + 200, 1]


def test_a_view_is_fixed_once_its_segment_is_stored(service_single: Service) -> None:
    r = rid()
    with RoutingClient(url_of(service_single, "http"), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:71], 0))
        # A call stored its view, then failed before its own segment: nothing read it yet,
        # so its retry may store other recomputed rows in its place.
        c.put(r, frame_for(RECOMPUTED[10:71], 10, version="v2"), view=71)
        assert c.get_served(r)[-1].views == ()  # serves no stored segment: not applied
        c.put(r, frame_for(THIRD[10:71], 10, version="v2"), view=71)
        c.put(r, frame_for(TRAJ[71:200], 71, version="v2"))
        assert same_sets(c.get(r, view="latest").indices[10:71], THIRD[10:71])
        # Now tokens were served by it: the same rows again are a duplicate, others a conflict.
        assert c.put(r, frame_for(THIRD[10:71], 10, version="v2"), view=71).status == "duplicate"
        with pytest.raises(SegmentConflictError):
            c.put(r, frame_for(RECOMPUTED[10:71], 10, version="v2"), view=71)


def test_bad_view_puts_are_refused_with_a_reason(service_single: Service, transport: str) -> None:
    r = rid()
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:71], 0))
        with pytest.raises(InvalidRequestError, match="holds rows below it"):
            c.put(r, frame_for(RECOMPUTED[10:80], 10), view=71)
        other = synthetic_routing(61, len(LAYERS) - 1, E, K, seed=3)
        with pytest.raises(SegmentConflictError, match="this view has"):
            c.put(r, frame_for(other, 10, layers=LAYERS[:2]), view=71)
        with pytest.raises(InvalidRequestError):
            c.get_frame(r, view=-1)
        assert c.stat(r).views == ()


def test_batch_reads_take_the_policy(service_single: Service, transport: str) -> None:
    with_views, plain = rid(), rid()
    url = url_of(service_single, transport)
    with RoutingClient(url, api_key=KEY_A) as c:
        three_turns(c, with_views)
        c.put(plain, frame_for(TRAJ[:71], 0))
        ids = [with_views, plain]
        latest = dict(c.get_many(ids, view="latest", chunk_size=1))
        generated = dict(c.get_many(ids))
        for r in ids:
            assert np.array_equal(latest[r].indices, c.get(r, view="latest").indices)
            assert np.array_equal(generated[r].indices, c.get(r).indices)
        assert not np.array_equal(latest[with_views].indices, generated[with_views].indices)
        with pytest.raises(InvalidRequestError, match="get_served"):
            list(c.get_many(ids, view="exact"))

    async def run() -> dict[str, np.ndarray]:
        async with AsyncRoutingClient(url, api_key=KEY_A) as a:
            return {r: got.indices async for r, got in a.get_many(ids, view="latest")}

    got = asyncio.run(run())
    for r in ids:
        assert np.array_equal(got[r], latest[r].indices)


def test_views_are_never_shared_blobs(service_single: Service) -> None:
    """Two rollouts whose views hold the same rows under the same key each keep their own
    copy: touch extends the blobs of a rollout's segments only, and a view must not
    outlive its rows."""
    with RoutingClient(url_of(service_single, "http"), api_key=KEY_A) as c:
        for r in (rid(), rid()):
            c.put(r, frame_for(TRAJ[:71], 0))
            put = c.put(r, frame_for(RECOMPUTED[0:71], 0, version="v2"), view=71)
            assert (put.status, put.shared, put.dedupe_hit) == ("stored", False, False)
            c.put(r, frame_for(TRAJ[71:100], 71, version="v2"))
            c.touch(r, 0)
            assert same_sets(c.get(r, view="latest").indices[:71], RECOMPUTED[:71])
