"""Direct reads under the view policies: the same answers as the relay, from Redis itself.

Against the real service on a single Redis and on a Redis Cluster: rollouts with views
(written with ``RoutingClient.put(..., view=serves)``), without, and with a view whose own
segment was never stored, read by a :class:`DirectReader` holding the read plan's
credentials under ``generated``, ``latest`` and ``exact``, whole and by range and layer,
one by one and in batches, and compared with what ``RoutingClient`` answers for the same
rollout.  The view hashes are read only for the rollouts that need them, and the plan's
user reaches them (they match its namespace's key pattern) and no other tenant's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import redis

from cache_service.redis_proc import RedisProcess
from r3_client import (
    AuthError,
    DirectReader,
    InvalidRequestError,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    StoreError,
)
from r3_client._views import POLICIES, ServedRouting
from tests.service.test_views import RECOMPUTED, three_turns
from tests.support.frames import LAYERS, TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, KEY_B, Service

#: Ranges every rollout of :func:`_rollouts` holds (the shortest has 71 rows).
RANGES: list[dict[str, Any]] = [
    {},
    {"layers": [LAYERS[1]]},
    {"start": 5, "end": 40},
    {"start": 50, "end": 71, "layers": [LAYERS[0], LAYERS[2]]},
    {"start": 20},
]


class RecordingReader(DirectReader):
    """A DirectReader that notes the keys of every round of hash reads it sends."""

    rounds: list[list[str]]

    def _read(self, keys: list[str]) -> list[dict[bytes, Any]]:
        self.rounds.append(list(keys))
        return super()._read(keys)


def _reader(svc: Service, key: str = KEY_A) -> RecordingReader:
    with svc.http(key=key) as c:
        plan = c.post("/v1/read-plan").json()
    reader = RecordingReader(plan)
    reader.rounds = []
    return reader


def _rollouts(c: RoutingClient) -> tuple[str, str, str]:
    """A rollout with two views (three_turns), one without, and one whose only view
    serves a segment that was never stored (so it applies to no read)."""
    viewed, plain, orphan = rid(), rid(), rid()
    three_turns(c, viewed)
    c.put(plain, frame_for(TRAJ[:71], 0))
    c.put(plain, frame_for(TRAJ[71:200], 71))
    c.put(orphan, frame_for(TRAJ[:71], 0))
    c.put(orphan, frame_for(RECOMPUTED[10:71], 10, version="v2"), view=71)
    return viewed, plain, orphan


def assert_same(got: Routing, want: Routing, where: str) -> None:
    assert (got.start, got.end, got.layer_ids, got.num_experts) == (
        want.start,
        want.end,
        want.layer_ids,
        want.num_experts,
    ), where
    assert np.array_equal(got.indices, want.indices), where
    assert got.segments == want.segments, where


def assert_same_served(got: list[ServedRouting], want: list[ServedRouting], where: str) -> None:
    assert [(s.serves_start, s.serves_end, s.views) for s in got] == [
        (s.serves_start, s.serves_end, s.views) for s in want
    ], where
    for g, w in zip(got, want, strict=True):
        assert_same(g.routing, w.routing, f"{where}, state [{w.serves_start}, {w.serves_end})")


def test_direct_reads_answer_what_the_client_answers_under_each_policy(svc: Service) -> None:
    with RoutingClient(svc.http_url, api_key=KEY_A) as c, _reader(svc) as reader:
        ids = list(_rollouts(c))
        viewed = ids[0]
        for policy in ("generated", "latest"):
            for rng in RANGES:
                where = f"view={policy} {rng}"
                batch = dict(reader.get_many(ids, view=policy, chunk_size=2, **rng))  # type: ignore[arg-type]
                assert list(batch) == ids
                for r in ids:
                    want = c.get(r, view=policy, **rng)  # type: ignore[arg-type]
                    assert_same(batch[r], want, f"{r} {where}")  # type: ignore[arg-type]
                    assert_same(reader.get(r, view=policy, **rng), want, f"{r} {where}")  # type: ignore[arg-type]
        # The views really apply: latest differs from generated where the third call
        # recomputed, and holds what it recomputed.
        latest = reader.get(viewed, view="latest")
        assert same_sets(latest.indices[:200], c.get(viewed, view="latest").indices[:200])
        assert not np.array_equal(latest.indices, reader.get(viewed).indices)
        for policy in POLICIES:
            for layers in (None, [LAYERS[2]]):
                for r in ids:
                    assert_same_served(
                        reader.get_served(r, view=policy, layers=layers),  # type: ignore[arg-type]
                        c.get_served(r, view=policy, layers=layers),  # type: ignore[arg-type]
                        f"{r} get_served(view={policy}, layers={layers})",
                    )
        assert [(s.serves_start, s.serves_end) for s in reader.get_served(viewed)] == [
            (0, 71),
            (71, 200),
            (200, 250),
        ]


def test_view_hashes_are_read_only_for_the_rollouts_that_need_them(svc: Service) -> None:
    with RoutingClient(svc.http_url, api_key=KEY_A) as c, _reader(svc) as reader:
        viewed, plain, orphan = _rollouts(c)
        ids = [plain, viewed, orphan]
        keys = [reader.key(r) for r in ids]
        views = [reader.view_key(viewed, 71), reader.view_key(viewed, 200)]

        list(reader.get_many(ids, concurrency=1))  # generated: the rollout hashes only
        assert reader.rounds == [keys]
        reader.rounds.clear()
        list(reader.get_many(ids, view="latest", chunk_size=16, concurrency=1))
        # Then each view of the one rollout that has views serving stored segments (the
        # orphan's serves nothing stored), one hash at a time as the decode applies it (so
        # one view's rows are held at a time: issue 42).
        assert reader.rounds == [keys, [views[0]], [views[1]]]
        reader.rounds.clear()
        list(reader.get_many(ids, view="latest", chunk_size=1, concurrency=1))
        # The decode worker reads the views while the next chunk is fetched: any order.
        assert sorted(reader.rounds) == sorted([[k] for k in keys] + [[v] for v in views])
        reader.rounds.clear()
        # A range past both views' rows reads no view.
        assert reader.get(viewed, start=200, view="latest").end == 250
        assert reader.rounds == [[keys[1]]]
        reader.rounds.clear()
        # A range inside the first view's rows reads both: the second one's rows [0, 200)
        # overlap it too (and apply after it).
        reader.get(viewed, start=10, end=60, view="latest")
        assert reader.rounds == [[keys[1]], [views[0]], [views[1]]]
        reader.rounds.clear()
        reader.get_served(plain)
        reader.get_served(viewed, view="generated")
        assert reader.rounds == [[keys[0]], [keys[1]]]


def test_the_read_plan_user_reads_its_views_and_no_one_elses(svc: Service) -> None:
    mine, theirs = rid(), rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        three_turns(c, mine)
    with RoutingClient(svc.http_url, api_key=KEY_B) as c:
        three_turns(c, theirs)
    with svc.http() as h:
        plan = h.post("/v1/read-plan").json()
    with svc.http(key=KEY_B) as h:
        plan_b = h.post("/v1/read-plan").json()
    kw = {"username": plan["username"], "password": plan["password"]}
    conn: Any = (
        redis.RedisCluster.from_url(plan["redis_url"], **kw)
        if plan["cluster"]
        else redis.Redis.from_url(plan["redis_url"], **kw)
    )
    try:
        view = f"{plan['key_prefix']}{{{mine}}}:v:71"
        assert conn.hgetall(view)  # its namespace's pattern covers the view keys
        assert conn.hget(view, "m")
        with pytest.raises(redis.exceptions.NoPermissionError):
            conn.hgetall(f"{plan_b['key_prefix']}{{{theirs}}}:v:71")
        with pytest.raises(redis.exceptions.NoPermissionError):
            conn.hset(view, "x", b"1")  # and never writes them
    finally:
        conn.close()
    with DirectReader(plan) as reader:
        assert len(reader.get_served(mine)) == 3
        reader.key_prefix = plan_b["key_prefix"]
        with pytest.raises(AuthError, match="refused"):
            reader.get_served(theirs)


def test_policies_are_checked_and_errors_name_the_rollout(
    service_single: Service, redis_single: RedisProcess
) -> None:
    with (
        RoutingClient(service_single.http_url, api_key=KEY_A) as c,
        _reader(service_single) as reader,
        redis.Redis.from_url(redis_single.url) as admin,
    ):
        viewed, plain, _ = _rollouts(c)
        with pytest.raises(InvalidRequestError, match="get_served"):
            reader.get(viewed, view="exact")
        with pytest.raises(InvalidRequestError, match="get_served"):
            list(reader.get_many([viewed], view="exact"))
        with pytest.raises(InvalidRequestError, match="view must be one of"):
            reader.get(viewed, view="newest")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="view must be one of"):
            reader.get_served(viewed, view="newest")  # type: ignore[arg-type]
        missing = rid()
        got = dict(reader.get_many([missing, plain], view="latest", return_errors=True))
        assert isinstance(got[missing], RolloutNotFoundError)
        assert isinstance(got[plain], Routing)
        with pytest.raises(RolloutNotFoundError):
            reader.get_served(missing)

        # A view gone since its rollout hash listed it (rewound, deleted, expired): that
        # rollout's read fails as the relay's does; its batch neighbours are unharmed.
        admin.delete(reader.view_key(viewed, 71))
        with pytest.raises(RolloutNotFoundError, match="no view serving row 71"):
            c.get(viewed, view="latest")
        with pytest.raises(RolloutNotFoundError, match="no view serving row 71"):
            reader.get(viewed, view="latest")
        got = dict(reader.get_many([viewed, plain], view="latest", return_errors=True))
        assert isinstance(got[viewed], RolloutNotFoundError)
        assert_same(got[plain], c.get(plain), plain)  # type: ignore[arg-type]
        assert_same(reader.get(viewed), c.get(viewed), viewed)  # generated reads no view

        # A registration that is not [start, end, version, nbytes]: refused under the
        # policies that read views, ignored by generated.
        admin.hset(reader.key(plain), "v:999", b"\xc1")
        with pytest.raises(StoreError, match="view registration"):
            reader.get(plain, view="latest")
        assert_same(reader.get(plain), c.get(plain), plain)
