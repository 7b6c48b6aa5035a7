"""Direct reads: the service issues a read plan, the trainer reads Redis itself.

Checked against real Redis and Redis Cluster: the same routing as the relay, and
the credentials can read only their own namespace, and never write.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    AuthError,
    Context,
    DirectReader,
    InvalidRequestError,
    RolloutNotFoundError,
    RoutingClient,
    Segment,
    StoreError,
    encode_context,
    encode_frame,
    read_header,
)
from tests.support.frames import LAYERS, TRAJ, E, frame_for, rid
from tests.support.service_process import KEY_A, KEY_B, Service, start_service


def _put(svc: Service, r: str, frame: bytes) -> None:
    with svc.http() as c:
        assert c.put(f"/v1/rollouts/{r}/segments", content=frame).status_code in (200, 201)


def _rollouts(svc: Service) -> list[str]:
    """A multi-turn rollout with continuation frames, two sharing a prompt blob, a gap."""
    agent, a, b, gap = rid(), rid(), rid(), rid()
    first = frame_for(TRAJ[:100], 0)
    _put(svc, agent, first)
    ctx = Context.parse(read_header(first).context.raw)  # type: ignore[union-attr]
    for lo, hi in ((100, 180), (180, 300)):
        seg = Segment(lo, hi, "tiny-moe", "v1")
        cont = encode_frame(TRAJ[lo:hi], num_experts=E, layer_ids=LAYERS, segment=seg, base=ctx)
        _put(svc, agent, cont)
    for r in (a, b):  # the prompt is stored once, as a shared blob
        _put(svc, r, frame_for(TRAJ[:60], 0))
        _put(svc, r, frame_for(TRAJ[60:120], 60, digest=False))
    _put(svc, gap, frame_for(TRAJ[200:220], 200, digest=False))
    return [agent, a, b, gap]


def test_direct_reads_match_the_relay(svc: Service) -> None:
    ids = _rollouts(svc)
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        relay = dict(client.get_many(ids))
        direct = dict(reader.get_many(ids))
        assert list(direct) == ids
        for r in ids:
            assert relay[r].same_sets(direct[r]), r  # type: ignore[union-attr]
            assert relay[r].segments == direct[r].segments  # type: ignore[union-attr]
        part = dict(reader.get_many(ids[:1], start=150, end=250, layers=[LAYERS[1]]))
        assert part[ids[0]].same_sets(  # type: ignore[union-attr]
            client.get(ids[0], start=150, end=250, layers=[LAYERS[1]])
        )
        missing = rid()
        got = dict(reader.get_many([ids[0], missing], return_errors=True))
        assert isinstance(got[missing], RolloutNotFoundError)
        with pytest.raises(RolloutNotFoundError):
            list(reader.get_many([missing]))


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_fetch_many_returns_what_the_whole_rollout_get_returns(
    svc: Service, chunk_size: int
) -> None:
    ids = _rollouts(svc)
    missing = rid()
    asked = [ids[1], missing, *ids, ids[2]]  # shared-blob refs early, late and twice in a chunk
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        got = list(reader.fetch_many(asked, chunk_size=chunk_size, concurrency=2))
        assert [r for r, _ in got] == asked
        for r, frames in got:
            if r == missing:
                assert isinstance(frames, RolloutNotFoundError)
            else:
                assert b"".join(frames) == client.get_frame(r), r  # type: ignore[arg-type]


def test_a_refused_chunk_leaves_no_replies_behind_on_the_connection(svc: Service) -> None:
    ids = _rollouts(svc)
    with svc.http(key=KEY_B) as c:
        plan_b = c.post("/v1/read-plan").json()
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        want = [b"".join(f) for _, f in reader.fetch_many(ids, concurrency=1)]  # type: ignore[arg-type]
        mine = reader.key_prefix
        reader.key_prefix = plan_b["key_prefix"]  # every HGETALL of the chunk is refused
        with pytest.raises(AuthError, match="refused"):
            list(reader.fetch_many(ids, concurrency=1))
        reader.key_prefix = mine  # the same pool: a reused connection must be clean
        for _ in range(3):
            got = [b"".join(f) for _, f in reader.fetch_many(ids, concurrency=1)]  # type: ignore[arg-type]
            assert got == want


def test_an_expired_shared_segment_is_an_error_for_its_rollouts_only(
    service_single: Service, redis_single: RedisProcess
) -> None:
    version = f"expiring-{rid()}"  # a blob no other test shares
    a, b, plain = rid(), rid(), rid()
    for r in (a, b):
        _put(service_single, r, frame_for(TRAJ[:60], 0, version=version))
        _put(service_single, r, frame_for(TRAJ[60:120], 60, version=version, digest=False))
    _put(service_single, plain, frame_for(TRAJ[:40], 0, digest=False))
    with (
        DirectReader.from_service(service_single.http_url, api_key=KEY_A) as reader,
        redis.Redis.from_url(redis_single.url) as admin,
    ):
        refs = {v for v in admin.hgetall(reader.key(a)).values() if v[:1] == b"@"}
        assert len(refs) == 1
        admin.delete(refs.pop()[1:])
        got = dict(reader.fetch_many([a, plain, b], chunk_size=3))
    assert isinstance(got[a], StoreError) and "expired" in str(got[a])
    assert isinstance(got[b], StoreError)
    assert isinstance(got[plain], list) and got[plain]


def test_contexts_travel_only_for_continuations_whose_carrier_is_not_read() -> None:
    first = frame_for(TRAJ[:100], 0)
    ctx = Context.parse(read_header(first).context.raw)  # type: ignore[union-attr]
    seg = Segment(100, 180, "tiny-moe", "v1")
    cont = encode_frame(TRAJ[100:180], num_experts=E, layer_ids=LAYERS, segment=seg, base=ctx)
    other = frame_for(TRAJ[:50], 180, e=2 * E, digest=False)  # another context
    other_ctx = read_header(other).context
    assert other_ctx is not None and other_ctx.digest != ctx.digest
    c, c2 = f"c:{ctx.digest}".encode(), f"c:{other_ctx.digest}".encode()
    ctx_frame = encode_context(Context.parse(ctx.raw, tables=False))
    cases = [
        ({b"s:0:100": first, b"s:100:180": cont, c: ctx.raw}, [first, cont]),
        ({b"s:100:180": cont, c: ctx.raw}, [ctx_frame, cont]),  # its carrier is gone
        ({b"s:0:100": first, b"s:100:180": cont}, [first, cont]),  # no context stored
        (
            {b"s:100:180": cont, b"s:180:230": other, c: ctx.raw, c2: other_ctx.raw},
            [ctx_frame, cont, other],
        ),
        ({b"s:0:100": first, b"s:180:230": other, c: ctx.raw, c2: other_ctx.raw}, [first, other]),
    ]
    for fields, want in cases:
        assert DirectReader._assemble("r", {b"m": b"", **fields}) == want


def test_read_plan_credentials_read_only_their_namespace(svc: Service) -> None:
    mine, theirs = rid(), rid()
    _put(svc, mine, frame_for(TRAJ[:20], 0, digest=False))
    with svc.http(key=KEY_B) as c:
        assert (
            c.put(
                f"/v1/rollouts/{theirs}/segments", content=frame_for(TRAJ[:20], 0, digest=False)
            ).status_code
            == 201
        )
        plan_b = c.post("/v1/read-plan").json()
    with svc.http() as c:
        plan = c.post("/v1/read-plan").json()
    assert plan["username"] != plan_b["username"] and plan["password"] != plan_b["password"]
    assert "@" not in plan["redis_url"]  # never the service's own credentials
    with DirectReader(plan) as reader:
        assert dict(reader.get_many([mine]))[mine].end == 20  # type: ignore[union-attr]
        reader.key_prefix = plan_b["key_prefix"]  # try the other tenant's keys
        with pytest.raises(AuthError, match="refused"):
            list(reader.get_many([theirs]))
    conn = (
        redis.RedisCluster.from_url(
            plan["redis_url"], username=plan["username"], password=plan["password"]
        )
        if plan["cluster"]
        else redis.Redis.from_url(
            plan["redis_url"], username=plan["username"], password=plan["password"]
        )
    )
    key = f"{plan['key_prefix']}{{{mine}}}"
    try:
        for attempt in (
            lambda: conn.hset(key, "x", b"1"),  # no writes, even to its own keys
            lambda: conn.delete(key),
            lambda: conn.execute_command("FLUSHALL"),
            lambda: conn.execute_command("KEYS", "*"),
            lambda: conn.execute_command("CONFIG", "GET", "*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert conn.hgetall(key)  # and reads still work
    finally:
        conn.close()


def test_read_plan_is_refused_when_not_enabled_and_without_a_key(
    tmp_path: Path, service_single: Service
) -> None:
    with service_single.http(key=None) as c:
        assert c.post("/v1/read-plan").status_code == 401
    redis_proc = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    off = start_service(tmp_path, redis_proc.url, env={"R3_CACHE_DIRECT_READS": "false"})
    try:
        with off.http() as c:
            resp = c.post("/v1/read-plan")
        assert resp.status_code == 400
        assert "not enabled" in resp.json()["error"]["message"]
        with pytest.raises(InvalidRequestError, match="not enabled"):
            DirectReader.from_service(off.http_url, api_key=KEY_A)
    finally:
        off.stop()
        redis_proc.stop()
