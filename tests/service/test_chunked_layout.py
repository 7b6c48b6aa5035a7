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
    RolloutNotFoundError,
    RoutingClient,
    Segment,
    StoreError,
    encode_frame,
    read_header,
)
from r3_client.codec import split_frames
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
    try:  # what HKEYS would send: every field name of the hash, RESP-framed
        listing = sum(len(f) + 8 for f in conn.hkeys(f"r3:tenant-a:{{{r}}}"))
    finally:
        conn.close()
    # the service names the chunks in a script; a direct reader names them from the heads
    # (HSCAN of the small fields), never listing every chunk field's name
    info = -redis_sent(redis_single.url) + redis_sent(redis_single.url)  # INFO's own reply
    assert relay_sent < share + head + 4096, (relay_sent, share, head)  # names, framing
    # a direct reader: the chunks, the head, the meta and RESP framing (HKEYS: + listing)
    assert direct_sent - info < share + head + 512, (direct_sent, info, share, head, listing)
    assert max(relay_sent, direct_sent) < stored / 8


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
            # the continuation alone: the whole first frame not read, its stored context is
            got = dict(reader.get_ranges([(r, N + 100, N + 200)], layers=[16]))[r]
            assert same_sets(got.indices, ROWS[N + 100 : N + 200][:, [15]])  # type: ignore[union-attr]
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
        for read in (lambda: reader.get(r),):
            got = _try(read)
            assert isinstance(got, R3Error), got
        got = dict(reader.get_ranges([(r, 1000, 1100)], return_errors=True))[r]
        assert isinstance(got, StoreError) and r in str(got), got
        assert same_sets(
            dict(reader.get_ranges([(r, 3000, 3100)]))[r].indices,  # type: ignore[union-attr]
            ROWS[3000:3100],
        )


def _try(read: object) -> object:
    try:
        return read()  # type: ignore[operator]
    except R3Error as exc:
        return exc


def test_a_direct_reader_names_exactly_the_stored_chunks_a_read_needs(svc: Service) -> None:
    """``head_chunks`` (a direct reader's chunk names, computed from a segment's head and
    the rollout's layer ids, never listed from Redis) against the fields the store wrote:
    every name it gives is stored, and they are the chunks ``needed_chunks`` keeps, for the
    first frame and for a continuation head (which names no layer ids of its own)."""
    from r3_client.codec import chunk_spans, needed_chunks
    from r3_client.stored import head_chunks

    r = _agent(svc)
    conn = admin_redis(svc.redis_url)
    try:
        fields = conn.hgetall(f"r3:tenant-a:{{{r}}}")
    finally:
        conn.close()
    stored = {f for f in fields if parse_chunk_field(f) is not None}
    first = read_header(fields[f"s:0:{N}".encode()], head=True)
    reads = [
        ([(0, 100)], None),
        ([(100, 2000), (5000, 9000)], [5, 16]),
        ([(6100, 6200)], [1, 2, 9]),
        ([(511, 513)], [16]),
    ]
    for a, b in ((0, N), (N, N + 2500)):
        head = fields[f"s:{a}:{b}".encode()]
        hdr = read_header(head, head=True, context=first.context)
        for spans, layers in reads:
            names = head_chunks(a, b, head, LAYERS, spans, layers)
            want = set()
            for lo, hi in spans:
                if max(lo, a) < min(hi, b):
                    want |= set(needed_chunks(hdr, start=max(lo, a), end=min(hi, b), layers=layers))
            picked = [parse_chunk_field(n) for n in names]
            assert set(names) <= stored, (a, spans, layers)
            assert sorted(p.index for p in picked if p is not None) == sorted(want)
            assert {c.index for c in chunk_spans(hdr)} >= want
    with pytest.raises(R3Error):  # the rollout's layer ids must match a continuation's groups
        head_chunks(
            N, N + 2500, fields[f"s:{N}:{N + 2500}".encode()], LAYERS[:3], reads[0][0], None
        )


def test_a_reader_granted_before_hscan_reads_the_same(svc: Service) -> None:
    """A read plan's Redis user from a service before ``HSCAN`` was granted (a rolling
    upgrade: readers first): the reader lists the names with ``HKEYS`` instead and answers
    the same rows."""
    r = _agent(svc)
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        conn = admin_redis(svc.redis_url)
        try:
            cmd = ("ACL", "SETUSER", "r3-read-tenant-a", "-hscan")  # on every node
            if isinstance(conn, redis.RedisCluster):
                conn.execute_command(*cmd, target_nodes=redis.RedisCluster.ALL_NODES)
            else:
                conn.execute_command(*cmd)
        finally:
            conn.close()
        for spans, layers in (([(r, 100, 300), (r, 7000, 8000)], None), ([(r, 5000, 8000)], [16])):
            cols = [LAYERS.index(x) for x in layers] if layers else slice(None)
            for (_, a, b), (_, got) in zip(
                spans, reader.get_ranges(spans, layers=layers), strict=True
            ):
                assert same_sets(got.indices, ROWS[a:b][:, cols])  # type: ignore[union-attr]
        assert reader._scan is False


def test_a_rollout_deleted_between_a_direct_reads_rounds_is_not_found(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout deleted after the reader scanned its heads and before it asked for the
    chunks (the race forced: the real Redis deletes it at that moment): the read is tried
    again once and answers not found, never rows or a damaged-store error."""
    r = _agent(svc)
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        real = reader._small_fields
        calls = []

        def small(keys: list[str]) -> list[dict[bytes, object]]:
            got = real(keys)
            if not calls:
                with RoutingClient(svc.http_url, api_key=KEY_A) as client:
                    client.delete(r)
            calls.append(keys)
            return got

        monkeypatch.setattr(reader, "_small_fields", small)
        got = dict(reader.get_ranges([(r, 100, 300)], return_errors=True))[r]
        assert isinstance(got, RolloutNotFoundError), got
        assert len(calls) == 2


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_read_by_layer_carries_its_layers_context_only(svc: Service, transport: str) -> None:
    """A ranged read by layer (a pipeline stage's) answers each frame with its context
    trimmed to the layer groups it keeps (the relabel table of those layers, not all 16):
    a first frame carries the trim, a continuation frame names it and it comes first; the
    rows equal what was written, and a read without layers carries the whole context."""
    r = _agent(svc)
    full = Context.parse(read_header(_first(r, N)).context.raw)  # type: ignore[union-attr]
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        for a, b, layers in [(100, 300, [5, 6]), (5000, 8000, [16]), (6100, 6200, [1, 2, 9])]:
            data = client._t.get(r, a, b, layers)
            heads = [read_header(f) for f in split_frames(data)]
            carried = [h.context for h in heads if h.context is not None and not h.base]
            named = {h.base for h in heads if h.base}
            # groups of 2 layers: each read keeps the groups of its layers
            kept = sorted({lid for x in layers for lid in LAYERS if (lid - 1) // 2 == (x - 1) // 2})
            assert carried and all(c.layer_ids == tuple(kept) for c in carried), (a, b)
            assert named <= {c.digest for c in carried}
            assert all(len(c.raw) < len(full.raw) for c in carried)
            assert all(
                np.array_equal(
                    Context.parse(c.raw).table,
                    full.table[[LAYERS.index(x) for x in kept]],  # type: ignore[index]
                )
                for c in carried
            )
            cols = [LAYERS.index(x) for x in layers]
            got = client.get(r, start=a, end=b, layers=layers)
            assert same_sets(got.indices, ROWS[a:b][:, cols])
        whole = [read_header(f) for f in split_frames(client._t.get(r, 100, 300, None))]
        assert [h.context.digest for h in whole if h.context] == [full.digest]


def test_a_context_subset_is_its_layers_rows() -> None:
    """``Context.subset``: the same E and K, the table's rows of those layers, a new digest;
    itself when nothing is dropped; a layer it does not hold is refused."""
    frame = _first("subset", 600)
    ctx = Context.parse(read_header(frame).context.raw)  # type: ignore[union-attr]
    assert ctx.table is not None
    sub = ctx.subset([3, 4, 9, 10])
    assert (sub.num_experts, sub.topk, sub.layer_ids) == (E, K, (3, 4, 9, 10))
    assert np.array_equal(sub.table, ctx.table[[2, 3, 8, 9]])
    assert sub.digest != ctx.digest and Context.parse(sub.raw).digest == sub.digest
    assert ctx.subset(LAYERS) is ctx
    with pytest.raises(R3Error, match="not the context's"):
        ctx.subset([3, 99])
