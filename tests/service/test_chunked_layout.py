"""The chunked store layout (issue 44): a v3 segment is stored as its head and one field per
chunk, so a ranged read makes Redis send only the chunks it needs.

Against a real Redis (and Redis Cluster) and a real service: what lands in Redis, every
reader's rows (relay over HTTP and gRPC, ``DirectReader``; ranges, layers, zigzag pairs,
shared prompt blobs, continuation frames, views) equal to what was written, the bytes Redis
sends for a rank's range against its share, rollouts written whole by an older service (or
``R3_CACHE_STORE_LAYOUT=whole``) read by this one, and rewind / delete leaving no chunk
behind.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis

from cache_service.redis_proc import RedisProcess
from r3_client import (
    Context,
    DirectReader,
    R3Error,
    RoutingClient,
    Segment,
    StoreError,
    encode_frame,
    read_header,
)
from r3_client.synthetic import synthetic_routing
from r3_client.wire import is_frame_head, parse_chunk_field
from tests.support.frames import rid, same_sets
from tests.support.service_process import KEY_A, Service, start_service, url_of
from tests.support.stored import admin_redis, redis_sent

E, K = 64, 4
LAYERS = tuple(range(1, 17))  # 16 MoE layers: 8 groups of 2
N = 6000  # rows: 12 blocks of the default 512 rows (the last 368)
ROWS = synthetic_routing(N + 3000, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=11)


def _first(r: str, end: int, *, digest: str = "") -> bytes:
    seg = Segment(0, end, "tiny-moe", r, digest)
    return encode_frame(ROWS[:end], num_experts=E, layer_ids=LAYERS, segment=seg)


def _cont(r: str, first: bytes, a: int, b: int) -> bytes:
    ctx = Context.parse(read_header(first).context.raw)  # type: ignore[union-attr]
    seg = Segment(a, b, "tiny-moe", r)
    return encode_frame(ROWS[a:b], num_experts=E, layer_ids=LAYERS, segment=seg, base=ctx)


def _agent(svc: Service) -> str:
    """A two-turn agent: a first frame [0, N) and a continuation [N, N + 2500)."""
    r = rid()
    first = _first(r, N)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        assert client.put(r, first).status == "stored"
        assert client.put(r, _cont(r, first, N, N + 2500)).status == "stored"
    return r


def test_a_v3_segment_is_stored_as_head_and_chunks(svc: Service) -> None:
    r = _agent(svc)
    conn = admin_redis(svc.redis_url)
    try:
        fields = conn.hgetall(f"r3:tenant-a:{{{r}}}")
    finally:
        conn.close()
    head = fields[f"s:0:{N}".encode()]
    assert is_frame_head(head)
    hdr = read_header(head, head=True)
    assert len(hdr.blocks) == 12 and len(hdr.groups) == 8
    chunks = [p for f in fields if (p := parse_chunk_field(f)) is not None]
    mine = sorted((c for c in chunks if (c.seg_start, c.seg_end) == (0, N)), key=lambda c: c.index)
    assert [c.index for c in mine] == list(range(96))
    assert (mine[9].start, mine[9].end, mine[9].first_layer, mine[9].last_layer) == (
        512, 1024, 3, 4,
    )  # fmt: skip
    # the head and the chunks are the frame, byte for byte
    frame = head[:-4] + b"".join(fields[_name(fields, c)] for c in mine) + head[-4:]
    assert frame == _first(r, N)


def _name(fields: dict[bytes, bytes], c: object) -> bytes:
    return next(f for f in fields if parse_chunk_field(f) == c)


READS = [
    (0, None, None),  # whole
    (100, 300, None),
    (2000, 2100, [5, 6]),  # across a block boundary, one group
    (5000, 8000, [16]),  # across the two segments, the last layer
    (6100, 6200, [1, 2, 9]),  # inside the continuation, non-adjacent groups
]


@pytest.mark.parametrize("how", ["relay", "direct"])
def test_every_reader_answers_the_rows_written(svc: Service, transport: str, how: str) -> None:
    r = _agent(svc)
    end_all = N + 2500
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        for a, b, layers in READS:
            want = ROWS[a : end_all if b is None else b]
            cols = [LAYERS.index(x) for x in layers] if layers else slice(None)
            if how == "relay":
                got = client.get(r, start=a, end=b, layers=layers)
            else:
                with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
                    got = reader.get(r, start=a, end=b, layers=layers)
            assert same_sets(got.indices, want[:, cols]), (a, b, layers)
        # a CP rank's zigzag pair in one call, per rank's layers
        pairs = [(r, 0, 1000), (r, 7500, 8500)]
        for layers in (None, [9, 10]):
            cols = [LAYERS.index(x) for x in layers] if layers else slice(None)
            if how == "relay":
                got_pairs = list(client.get_ranges(pairs, layers=layers))
            else:
                with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
                    got_pairs = list(reader.get_ranges(pairs, layers=layers))
            for (_, a, b), (_, routing) in zip(pairs, got_pairs, strict=True):
                assert same_sets(routing.indices, ROWS[a:b][:, cols])  # type: ignore[union-attr]


def test_shared_prompts_and_views_read_from_chunks(svc: Service) -> None:
    """Two GRPO samples sharing a chunked prompt blob; a view (recomputed rows) chunked in
    its own hash; every policy's rows as written."""
    digest = "d" * 64
    a, b = rid(), rid()
    prompt = encode_frame(
        ROWS[:4200],
        num_experts=E,
        layer_ids=LAYERS,
        segment=Segment(0, 4200, "tiny-moe", "v", digest),
    )
    recomputed = np.roll(ROWS[:4200], 1, axis=2)  # other routing of the same rows
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        for r in (a, b):
            assert client.put(r, prompt).status == "stored"
        assert client.stat(b).segments[0].shared
        vseg = Segment(0, 4200, "tiny-moe", "v2")
        view = encode_frame(recomputed, num_experts=E, layer_ids=LAYERS, segment=vseg)
        assert client.put(b, view, view=4200).status == "stored"
        resp = encode_frame(
            ROWS[4200:4400],
            num_experts=E,
            layer_ids=LAYERS,
            segment=Segment(4200, 4400, "tiny-moe", "v2"),
        )
        assert client.put(b, resp).status == "stored"
        cols = [LAYERS.index(5), LAYERS.index(6)]
        assert same_sets(
            client.get(a, start=3000, end=4100, layers=[5, 6]).indices, ROWS[3000:4100][:, cols]
        )
        latest = client.get(b, start=3000, end=4300, view="latest", layers=[5, 6])
        assert same_sets(latest.indices[:1200], recomputed[3000:4200][:, cols])
        assert same_sets(latest.indices[1200:], ROWS[4200:4300][:, cols])
        exact = dict(client.get_ranges([(b, 3000, 4300, 4200)], layers=[5, 6]))
        assert same_sets(exact[b].indices, latest.indices)  # type: ignore[union-attr]
        with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
            direct = dict(reader.get_ranges([(b, 3000, 4300, 4200), (a, 100, 2200)], layers=[5, 6]))
            assert same_sets(direct[b].indices, latest.indices)  # type: ignore[union-attr]
            got_a = dict(reader.get_ranges([(a, 100, 2200)], layers=[5, 6]))[a]
            assert same_sets(got_a.indices, ROWS[100:2200][:, cols])  # type: ignore[union-attr]
            assert same_sets(reader.get(a).indices, ROWS[:4200])
        # the blob holds the head and the chunks
        conn = admin_redis(svc.redis_url)
        try:
            blob = conn.hget(f"r3:tenant-a:{{{a}}}", "s:0:4200")
            assert isinstance(blob, bytes) and blob[:1] == b"@"
            blob_fields = conn.hkeys(blob[1:].decode())
            assert sum(parse_chunk_field(f) is not None for f in blob_fields) == 9 * 8
            assert is_frame_head(conn.hget(blob[1:].decode(), "f"))
        finally:
            conn.close()


def test_rewind_and_delete_leave_no_chunk_behind(svc: Service) -> None:
    r = _agent(svc)
    key = f"r3:tenant-a:{{{r}}}"
    conn = admin_redis(svc.redis_url)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        try:
            client.rewind(r, rows=N)
            left = {parse_chunk_field(f) for f in conn.hkeys(key)} - {None}
            assert left and all(c.seg_end == N for c in left)  # type: ignore[union-attr]
            assert same_sets(client.get(r).indices, ROWS[:N])
            client.delete(r)
            assert conn.exists(key) == 0
        finally:
            conn.close()


def test_redis_sends_a_rank_only_its_chunks(
    redis_single: RedisProcess, service_single: Service
) -> None:
    """A pipeline stage's layers of a CP rank's rows: Redis sends about their share of the
    stored bytes (whole-segment reads sent all of them), through the service and direct."""
    svc = service_single
    r = rid()
    frame = encode_frame(
        ROWS[:N], num_experts=E, layer_ids=LAYERS, segment=Segment(0, N, "tiny-moe", r)
    )
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        client.put(r, frame)
        stored = client.stat(r).stored_bytes
        # rows [0, 2048) and layers 1-4: 4 blocks of 12, 2 groups of 8 (1/12 of the chunks)
        share = sum(
            c[0] for i, c in enumerate(read_header(frame).chunks) if i // 8 < 4 and i % 8 < 2
        )
        before = redis_sent(redis_single.url)
        got = client.get(r, start=0, end=2048, layers=[1, 2, 3, 4])
        relay_sent = redis_sent(redis_single.url) - before
        assert same_sets(got.indices, ROWS[:2048, :4])
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        before = redis_sent(redis_single.url)
        direct = dict(reader.get_ranges([(r, 0, 2048)], layers=[1, 2, 3, 4]))[r]
        direct_sent = redis_sent(redis_single.url) - before
        assert same_sets(direct.indices, ROWS[:2048, :4])  # type: ignore[union-attr]
    hdr = read_header(frame)
    head = hdr.frame_length - hdr.body_length  # prefix, header, trailer
    conn = redis.Redis.from_url(redis_single.url)
    try:  # what HKEYS sends a direct reader: every field name of the hash, RESP-framed
        listing = sum(len(f) + 8 for f in conn.hkeys(f"r3:tenant-a:{{{r}}}"))
    finally:
        conn.close()
    # the service names the chunks in a script; a direct reader lists every field name
    for how, sent in (("relay", relay_sent), ("direct", direct_sent - listing)):
        assert sent < share + head + 4096, (how, sent, share, head, listing)  # framing
        assert sent < stored / 8


def test_rollouts_stored_whole_are_read_by_a_chunked_service(
    redis_single: RedisProcess, service_single: Service, tmp_path: Path
) -> None:
    """A rolling upgrade: what a service writing whole frames stored (every service before
    issue 44, or ``R3_CACHE_STORE_LAYOUT=whole``) reads the same through one writing
    chunks, and a rollout may hold segments of both layouts."""
    old = start_service(tmp_path, redis_single.url, env={"R3_CACHE_STORE_LAYOUT": "whole"})
    new = service_single
    try:
        r = rid()
        first = _first(r, N)
        with RoutingClient(old.http_url, api_key=KEY_A) as client:
            client.put(r, first)
        conn = redis.Redis.from_url(redis_single.url)
        try:
            assert conn.hget(f"r3:tenant-a:{{{r}}}", f"s:0:{N}") == first  # whole
        finally:
            conn.close()
        with RoutingClient(new.http_url, api_key=KEY_A) as client:
            assert client.put(r, _cont(r, first, N, N + 2500)).status == "stored"
            for a, b, layers in READS:
                cols = [LAYERS.index(x) for x in layers] if layers else slice(None)
                want = ROWS[a : N + 2500 if b is None else b][:, cols]
                assert same_sets(client.get(r, start=a, end=b, layers=layers).indices, want)
        with DirectReader.from_service(new.http_url, api_key=KEY_A) as reader:
            got = dict(reader.get_ranges([(r, 5000, 8000)], layers=[16]))[r]
            assert same_sets(got.indices, ROWS[5000:8000][:, [15]])  # type: ignore[union-attr]
    finally:
        old.stop()


def test_a_missing_chunk_is_refused_by_every_reader(svc: Service) -> None:
    """A chunk field gone at rest (a bad restore, an operator's HDEL): every read that needs
    it is a StoreError naming the rollout, never rows; reads that do not need it still
    answer."""
    r = _agent(svc)
    key = f"r3:tenant-a:{{{r}}}"
    conn = admin_redis(svc.redis_url)
    try:
        gone = next(
            f
            for f in conn.hkeys(key)
            if (c := parse_chunk_field(f)) is not None and c.seg_end == N and c.start == 1024
        )
        conn.hdel(key, gone)
    finally:
        conn.close()
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        for read in (
            lambda: client.get(r),
            lambda: client.get(r, start=1000, end=1100),
            lambda: dict(client.get_ranges([(r, 1000, 1100)]))[r],
        ):
            got = _try(read)
            assert isinstance(got, StoreError) and r in str(got), got
        assert same_sets(client.get(r, start=3000, end=3100).indices, ROWS[3000:3100])
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        for read in (
            lambda: reader.get(r),
            lambda: dict(reader.get_ranges([(r, 1000, 1100)], return_errors=True))[r],
        ):
            got = _try(read)
            assert isinstance(got, R3Error), got
        assert same_sets(
            dict(reader.get_ranges([(r, 3000, 3100)]))[r].indices,  # type: ignore[union-attr]
            ROWS[3000:3100],
        )


def _try(read: object) -> object:
    try:
        return read()  # type: ignore[operator]
    except R3Error as exc:
        return exc


def test_a_direct_readers_bulk_filter_keeps_exactly_the_chunks_one_at_a_time_would() -> None:
    """``wanted_chunks`` (numpy over every name of a hash at once) against the per-name rule
    the service's script applies, on well-formed names and on hostile ones (too many or
    too few numbers, a letter, a number past int64, an embedded newline) mixed in."""
    from r3_client._stored import chunk_wanted, wanted_chunks

    rng = np.random.default_rng(5)
    names = []
    for i in range(400):
        a, g = int(rng.integers(0, 16000)), int(rng.integers(0, 48))
        names.append(f"k:0:16384:{i}:{a}:{a + 512}:{g}:{g + 5}".encode())
    names += [b"s:0:16384", b"v:7", b"k:1:2", b"k:x:1:2:3:4:5:6", b"k:1:2:3:4:5:6:7:8"]
    hostile = [
        b"k:1:2:3:4:5:6:" + b"9" * 20,
        b"k:1:2:3:4:5:6:7\n",
        b"k:1:2:3:4:5:6:7\n1:2:3:4:5:6:7",
    ]
    for pool in (names, names + hostile):
        order = rng.permutation(len(pool))
        shuffled = [pool[int(j)] for j in order]
        for spans in ([(0, 100)], [(100, 2000), (9000, None)], [(16000, 16384)], []):
            for layers in (None, [0, 5, 23], [47], []):
                one_by_one = [
                    n
                    for n in shuffled
                    if (f := parse_chunk_field(n)) is not None and chunk_wanted(f, spans, layers)
                ]
                assert wanted_chunks(shuffled, spans, layers) == one_by_one
