"""Batch replies and batch read-ahead stay within the service's budgets (issue 42, defects 5, 6).

Defect 5: a batch stat answered every id it named with the rollout's whole stat, read
from Redis once per mention, so one rollout with 1,024 one-row segments (a 658 KB
stat) named 256 times in a 2.8 KB request answered 161 MiB and grew the service by
700 MiB (here, with 256-character weight versions, a 0.4 MB stat: 99 MiB over HTTP,
72 MiB over gRPC, 256 Redis stats).  Now an id named again is read once per request,
and the answer is held to ``MAX_BATCH_STAT_BYTES``: items are answered in order until
it is spent, every later one with its own ``limit_exceeded`` item, the same on HTTP
and gRPC.

Defect 6: ranged batch gets read up to 8 ranges of one rollout at once and counted
each such group as one of the ``BATCH_CONCURRENCY`` fetches ahead of the reader, so a
stalled reader left 8 x 8 items' frames in the service.  Now the read-ahead counts
items (ranges), whatever their grouping.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cache_service.redis_proc import RedisProcess
from r3_client import Segment, encode_frame
from r3_client._proto import r3_cache_pb2 as pb
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, frame_for, rid
from tests.support.service_process import KEY_A, Service, grpc_md, start_service
from tests.support.stalled_reader import STALL

# ---- batch stat -------------------------------------------------------------------------------
BUDGET = 4 << 20  # the stat service's MAX_BATCH_STAT_BYTES
SEGMENTS = 1024  # one-row segments of the big-stat rollout
WEIGHT_VERSION = "w" * 256  # each segment's: a ~0.4 MB stat in all
NAMED = 256  # times one batch names it
#: What the items past the budget may add: each an id and a limit_exceeded message
#: (at most 1 KiB, cut by the service), plus the reply's own framing.
SLACK = NAMED * 1024 + 4096


@pytest.fixture(scope="module")
def stat_service(
    redis_single: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        tmp_path_factory.mktemp("batch-stat"),
        redis_single.url,
        env={"R3_CACHE_MAX_BATCH": "1024", "R3_CACHE_MAX_BATCH_STAT_BYTES": str(BUDGET)},
    )
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def big_stat(stat_service: Service) -> str:
    """A rollout of ``SEGMENTS`` one-row segments: a large stat from a small rollout."""
    r = rid()
    rows = synthetic_routing(SEGMENTS, len(LAYERS), 64, 4, seed=3)
    stub = stat_service.stub()
    for i in range(SEGMENTS):
        seg = Segment(i, i + 1, "tiny-moe", WEIGHT_VERSION, "")
        frame = encode_frame(rows[i : i + 1], num_experts=64, layer_ids=LAYERS, segment=seg)
        stub.PutSegment(pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md())
    return r


def _http_batch_stat(svc: Service, ids: list[str]) -> tuple[int, list[str], int]:
    """Reply bytes, each item's kind (``stat`` or its error code), request bytes."""
    body = json.dumps({"rollout_ids": ids}).encode()
    with svc.http() as c:
        resp = c.post("/v1/batch/stat", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text[:500]
    items = resp.json()["items"]
    assert [it["rollout_id"] for it in items] == ids
    kinds = []
    for it in items:
        if it["stat"] is not None:
            kinds.append("stat")
            continue
        kinds.append(it["error"]["code"])
        if it["error"]["code"] == "limit_exceeded":
            assert it["status"] == 413, it
            assert "R3_CACHE_MAX_BATCH_STAT_BYTES" in it["error"]["message"], it
            assert "another request" in it["error"]["message"], it
    return len(resp.content), kinds, len(body)


def _grpc_batch_stat(svc: Service, ids: list[str]) -> tuple[int, list[str], int]:
    request = pb.BatchStatRequest(rollout_ids=ids)
    reply = svc.stub().BatchStat(request, metadata=grpc_md(), timeout=60)
    assert [it.rollout_id for it in reply.items] == ids
    kinds = []
    for it in reply.items:
        if it.WhichOneof("result") == "stat":
            kinds.append("stat")
            continue
        kinds.append(it.error.code)
        if it.error.code == "limit_exceeded":
            assert it.error.http_status == 413, it.error
            assert "R3_CACHE_MAX_BATCH_STAT_BYTES" in it.error.message, it.error.message
            assert "another request" in it.error.message, it.error.message
    return reply.ByteSize(), kinds, request.ByteSize()


BATCH_STAT = {"http": _http_batch_stat, "grpc": _grpc_batch_stat}


def test_batch_stat_reply_is_held_to_its_budget(
    stat_service: Service, big_stat: str, transport: str
) -> None:
    """Before: 256 x a 0.4 MB stat, ~100 MiB answered to a 5 KB request."""
    reply, kinds, request = BATCH_STAT[transport](stat_service, [big_stat] * NAMED)
    n = kinds.count("stat")
    print(f"{transport}: {request:,} B request -> {reply:,} B reply, {n} of {NAMED} answered")
    assert n >= 1, "the stat fits the budget: it must be answered"
    # every id answered: the stats first, then each later item its own limit error
    assert kinds == ["stat"] * n + ["limit_exceeded"] * (NAMED - n), kinds
    assert reply <= BUDGET + SLACK, f"{request:,} B request -> {reply:,} B reply"


def test_batch_stat_cuts_at_the_same_item_on_both_transports(
    stat_service: Service, big_stat: str
) -> None:
    """One estimate of each item's size (an upper bound on both encodings), so HTTP and
    gRPC answer the same items; an error item before the big ones counts too."""
    missing = rid()
    ids = [missing, *[big_stat] * 16, missing]
    _, http_kinds, _ = _http_batch_stat(stat_service, ids)
    _, grpc_kinds, _ = _grpc_batch_stat(stat_service, ids)
    assert http_kinds == grpc_kinds
    assert http_kinds[0] == "not_found", http_kinds
    assert http_kinds[1] == "stat" and http_kinds[-1] == "limit_exceeded", http_kinds


def test_clients_ask_again_for_what_the_budget_cut(
    stat_service: Service, big_stat: str, transport: str
) -> None:
    """``stat_many`` answers every id: the items past one reply's budget are asked for in
    the next request (a step's check before dispatch must not fail for the budget)."""
    from r3_client import AsyncRoutingClient, RolloutInfo, RoutingClient

    missing = rid()
    ids = [big_stat] * 40 + [missing] + [big_stat] * 5
    url = stat_service.http_url if transport == "http" else stat_service.grpc_url
    with RoutingClient(url, api_key=KEY_A) as c:
        got = c.stat_many(ids)
    assert [type(g).__name__ for g in got] == ["RolloutInfo"] * 40 + ["RolloutNotFoundError"] + [
        "RolloutInfo"
    ] * 5
    assert all(g.num_rows == SEGMENTS for g in got if isinstance(g, RolloutInfo))

    async def run() -> list[object]:
        async with AsyncRoutingClient(url, api_key=KEY_A) as ac:
            return list(await ac.stat_many(ids))

    assert [type(g).__name__ for g in asyncio.run(run())] == [type(g).__name__ for g in got]


def test_an_id_named_again_is_read_from_redis_once(
    stat_service: Service, big_stat: str, redis_single: RedisProcess
) -> None:
    """Before: one Redis stat (a script over every segment) per mention of the id."""
    r = redis.Redis.from_url(redis_single.url)

    def commands() -> int:
        return int(r.info("stats")["total_commands_processed"])

    def cost(ids: list[str]) -> int:
        before = commands()
        _http_batch_stat(stat_service, ids)
        return commands() - before - 1  # not the INFO that read it

    try:
        once, named = cost([big_stat]), cost([big_stat] * NAMED)
    finally:
        r.close()
    assert named <= once + 8, f"{named:,} Redis commands for {NAMED} mentions, {once:,} for one"


# ---- ranged batch read-ahead ------------------------------------------------------------------
CONCURRENCY = 8  # the service's default BATCH_CONCURRENCY
ITEMS = 128  # items in the batch: more than the 8 groups of 8 ranges read ahead before
BLOCK = 2048  # rows per block of a frame (the unit a range is cut to)
ROWS = 4 * BLOCK  # rows of the one big rollout (one segment, ~8 MiB)
#: What the service holds besides the read-ahead (docs/service.md: ``BATCH_CONCURRENCY``
#: items, each the stored bytes it is read from and its answer): the item being written
#: out and its encoded copies (HTTP chunk; gRPC message and its serialisation), in items,
#: and the heap's and the transports' slack in MiB.
SLACK_ITEMS, SLACK_MIB = 4, 48


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(f"{field}:")) / 1024


@pytest.fixture
def fresh_service(redis_single: RedisProcess, tmp_path: Path) -> Iterator[Service]:
    """A service process of its own, so its RSS growth is this test's."""
    svc = start_service(
        tmp_path,
        redis_single.url,
        env={
            "R3_CACHE_MAX_BATCH": "1024",
            "R3_CACHE_MAX_BODY_BYTES": str(32 << 20),
            "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
        },
    )
    yield svc
    svc.stop()


def _big_rollout(svc: Service) -> tuple[str, int]:
    """One rollout stored as one ~8 MiB segment of 4 blocks (raw ids: no compression)."""
    r = rid()
    layers = tuple(range(64))
    idx = synthetic_routing(ROWS, len(layers), 256, 8, seed=5)
    frame = frame_for(idx, 0, codec="raw", layers=layers, e=256, digest=False)
    svc.stub().PutSegment(pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md())
    return r, len(frame)


def _ranges(n: int) -> list[tuple[int, int]]:
    """Ranges that each leave out a block, so each item is a fresh slice (3 of 4 blocks):
    a range covering every block would be answered with the stored bytes themselves."""
    return [(0, ROWS - BLOCK) if i % 2 else (BLOCK, ROWS) for i in range(n)]


def _request(r: str, n: int, by_range: bool) -> dict[str, object]:
    if by_range:
        return {"rollout_ids": [r] * n, "ranges": [list(s) for s in _ranges(n)]}
    return {"rollout_ids": [r] * n, "start": BLOCK, "end": ROWS}


def test_ranged_batch_read_ahead_is_bounded_in_items_for_a_stalled_reader(
    fresh_service: Service, transport: str
) -> None:
    """Before: 8 groups of 8 ranges read ahead (64 items' frames) for a reader that took
    one item, +520 MiB; the same batch by start/end, +130 MiB (within the bound: it is
    the bench's baseline, bench/readers_bounded_bench.py)."""
    by_range = True
    r, stored = _big_rollout(fresh_service)
    pid = fresh_service.proc.pid
    # Warm the transports and the read path with one item, which also says its size.
    with fresh_service.http() as c:
        one = c.post("/v1/batch/get", json=_request(r, 1, by_range))
        assert one.status_code == 200
    item = len(one.content)
    stub = fresh_service.stub()
    assert next(stub.BatchGet(pb.BatchGetRequest(rollout_ids=[r], end=1), metadata=grpc_md()))
    time.sleep(0.5)
    start = _status_mib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    STALL[transport](fresh_service, _request(r, ITEMS, by_range), item, 3.0)
    peak = _status_mib(pid, "VmHWM") - start
    item_mib = item / (1 << 20)
    stored_mib = stored / (1 << 20)
    bound = CONCURRENCY * (stored_mib + item_mib) + SLACK_ITEMS * item_mib + SLACK_MIB
    print(
        f"{transport} {'ranges' if by_range else 'start/end'}: item {item_mib:.1f} MiB, "
        f"peak +{peak:.0f} MiB (bound {bound:.0f})"
    )
    assert peak <= bound, f"peak +{peak:.0f} MiB over the {bound:.0f} MiB bound"
