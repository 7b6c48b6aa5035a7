"""Integrity end to end on the range path (issue 42, defect 8), against the real service
and real Redis (both backends), with damaged bytes planted in Redis directly.

Before: a ranged read parsed the stored header without its trailer, sliced, and signed
the slice with a fresh trailer, so a stored v3 header whose rows were moved by one read
back as rows shifted by one with no error; a context frame stored in a segment field
read back as a gap of ``-1`` rows.  Now the service verifies a stored frame (trailer,
and the CRC of each chunk it returns) before it slices, and a segment field holding a
context frame is refused: every reader raises an :class:`R3Error`, never wrong rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import numpy as np
import pytest

from r3_client import (
    AsyncRoutingClient,
    ChecksumError,
    Context,
    DirectReader,
    R3Error,
    Routing,
    RoutingClient,
    Segment,
    StoreError,
    encode_context,
    encode_frame,
    read_header,
    slice_frame,
    token_digest,
)
from r3_client.codec.frame import PREFIX
from r3_client.synthetic import synthetic_routing
from tests.support.frames import rid, same_sets
from tests.support.service_process import KEY_A, Service, url_of
from tests.support.stored import admin_redis, read_stored, write_stored

E, K, LAYERS = 64, 4, (1, 3, 5, 7)
N, M = 5000, 5600  # [0, N): three blocks of rows by four layer groups; [N, M) continues it
ROWS = synthetic_routing(M, len(LAYERS), E, K, skew=1.0, rho=0.8, seed=42)
RANGE = (100, 200)  # inside block 0: the service cuts (and signs) a slice


def _segment(lo: int, hi: int, weights: str) -> Segment:
    return Segment(lo, hi, "tiny-moe", weights, token_digest(range(hi)))


def _frames(version: int, weights: str = "w1") -> tuple[bytes, bytes]:
    """The rollout's two segments: rows ``[0, N)`` with its context, ``[N, M)`` continuing it
    (``weights``: their weight version, which decides which rollouts share a blob)."""
    # 2,048-row blocks (a size the store takes; the writer's default is 512 since issue 44):
    # the damage below is placed by that grid
    kw = {"num_experts": E, "layer_ids": LAYERS, "version": version, "block_rows": 2048}
    first = encode_frame(ROWS[:N], segment=_segment(0, N, weights), **kw)  # type: ignore[arg-type]
    own = read_header(first).context
    assert own is not None
    base = Context.parse(own.raw)
    cont = encode_frame(ROWS[N:M], segment=_segment(N, M, weights), base=base, **kw)  # type: ignore[arg-type]
    hdr = read_header(first)
    assert len(hdr.blocks) == 3 and len(hdr.groups) == len(LAYERS)  # ranges and layers cut it
    return first, cont


def _store(svc: Service, *, version: int = 3, whole: bool = True) -> str:
    """A fresh rollout of one segment ``[0, N)`` or (``whole``) both segments."""
    r = rid()
    first, cont = _frames(version, weights=r)  # no blob shared with another test's rollout
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        for frame in (first, cont) if whole else (first,):
            assert client.put(r, frame).status == "stored"
    return r


def _plant(
    svc: Service, r: str, field: str, damage: Callable[[bytes], bytes], *, in_field: bool = False
) -> None:
    """Replace the stored bytes of ``field`` of rollout ``r`` with ``damage(stored)``: where
    they lie (a shared segment's blob), or written into the field itself (``in_field``)."""
    conn = admin_redis(svc.redis_url)
    try:
        key, at = f"r3:tenant-a:{{{r}}}", field
        ref = conn.hget(key, field)
        assert isinstance(ref, bytes)
        if ref[:1] == b"@":  # a shared segment (a prompt's rows): its blob holds the frame
            blob = ref[1:].decode()
            stored, where = read_stored(conn, blob, "f")
            if not in_field:
                key, at = blob, "f"
        else:
            stored, where = read_stored(conn, key, field)
        if in_field:  # a whole value planted in the segment's field itself
            conn.hset(key, at, damage(stored))
        else:  # damaged where the bytes lie, in the layout they were stored in
            write_stored(conn, key, at, damage(stored), where)
    finally:
        conn.close()


def _header_edit(frame: bytes, **change: int) -> bytes:
    """``frame`` with header fields set to ``change`` (re-packed at the same length) and
    its trailer left as it was."""
    hlen = PREFIX.unpack_from(frame)[4]
    head = msgpack.unpackb(frame[PREFIX.size : PREFIX.size + hlen], raw=False)
    head.update(change)
    packed = bytes(msgpack.packb(head, use_bin_type=True))
    assert len(packed) == hlen
    return frame[: PREFIX.size] + packed + frame[PREFIX.size + hlen :]


def _start_one(frame: bytes) -> bytes:
    """The report's damage: the header's start 0 -> 1."""
    return _header_edit(frame, start=1)


def _rows_moved(frame: bytes) -> bytes:
    """The rows moved by one (start 0 -> 1, end N -> N + 1): a header that still adds up."""
    hdr = read_header(frame)
    return _header_edit(frame, start=hdr.start + 1, end=hdr.end + 1)


def _chunk_flip(index: int) -> Callable[[bytes], bytes]:
    """A byte of chunk ``index``'s body flipped; every checksum left as it was."""

    def damage(frame: bytes) -> bytes:
        hdr = read_header(frame)
        at = hdr.frame_length - 4 - hdr.body_length + sum(c[0] for c in hdr.chunks[:index])
        out = bytearray(frame)
        out[at + hdr.chunks[index][0] // 2] ^= 0x21
        return bytes(out)

    return damage


def _context_frame(frame: bytes) -> bytes:
    """The rollout's context frame (codec ``context``: no rows) in place of a segment."""
    own = read_header(_frames(3)[0]).context  # every rollout here has the rows, so the context
    assert own is not None and read_header(frame).num_rows
    return encode_context(Context.parse(own.raw))


def _refused(got: Routing | R3Error | None, want: np.ndarray) -> None:
    """``got`` is an error, never rows (the rows it would be are not ``want``'s)."""
    assert isinstance(got, R3Error), (
        "rows were answered from damaged bytes"
        + ("" if got is None or not isinstance(got, Routing) else f": {got.start}..{got.end}")
        + ("" if got is None or same_sets(got.indices, want) else " (not the rows stored)")
    )


def _service_refusal(exc: R3Error, r: str, seg: str = f"[0, {N})") -> None:
    """The service's answer: a StoreError naming the rollout and the damaged segment."""
    assert isinstance(exc, StoreError), f"{type(exc).__name__}: {exc}"
    assert r in str(exc) and seg in str(exc) and "damaged" in str(exc), str(exc)


def _try(read: Callable[[], Routing]) -> Routing | R3Error:
    try:
        return read()
    except R3Error as exc:
        return exc


def _client_reads(client: RoutingClient, r: str, good: str) -> Iterator[tuple[str, object]]:
    """Every synchronous client read of ``r`` that cuts segment ``[0, N)``: (what, answer)."""
    a, b = RANGE
    yield "range", _try(lambda: client.get(r, start=a, end=b))
    yield "layers", _try(lambda: client.get(r, layers=[LAYERS[1]]))
    yield "range+layers", _try(lambda: client.get(r, start=a, end=b, layers=[LAYERS[2]]))
    many = dict(client.get_many([r, good], start=a, end=b, return_errors=True))
    assert same_sets(many[good].indices, ROWS[a:b])  # type: ignore[union-attr]
    yield "get_many", many[r]
    ranges = dict(client.get_ranges([(r, a, b), (good, a, b)], return_errors=True))
    assert same_sets(ranges[good].indices, ROWS[a:b])  # type: ignore[union-attr]
    yield "get_ranges", ranges[r]


@pytest.mark.parametrize("damage", [_start_one, _rows_moved], ids=["start-0-to-1", "rows-moved"])
async def test_a_damaged_stored_header_is_refused_by_every_ranged_reader(
    svc: Service, transport: str, damage: Callable[[bytes], bytes]
) -> None:
    r, good = _store(svc), _store(svc)
    a, b = RANGE
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        assert same_sets(client.get(r, start=a, end=b).indices, ROWS[a:b])  # cached, intact
        _plant(svc, r, f"s:0:{N}", damage)
        for what, got in _client_reads(client, r, good):
            _refused(got, ROWS[a:b])  # type: ignore[arg-type]
            _service_refusal(got, r)  # type: ignore[arg-type]
            assert what  # (named for the failure message above)
        # the undamaged segment still reads, alone
        assert same_sets(client.get(r, start=N + 10, end=N + 90).indices, ROWS[N + 10 : N + 90])
    async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as ac:
        with pytest.raises(R3Error) as info:
            await ac.get(r, start=a, end=b)
        _service_refusal(info.value, r)
        with pytest.raises(R3Error) as info:
            await ac.get(r, layers=[LAYERS[0]])
        _service_refusal(info.value, r)
        got = {x: y async for x, y in ac.get_many([r, good], start=a, end=b, return_errors=True)}
        _refused(got[r], ROWS[a:b])
        _service_refusal(got[r], r)  # type: ignore[arg-type]
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        with pytest.raises(R3Error):
            reader.get(r, start=a, end=b)
        with pytest.raises(R3Error):
            reader.get(r, layers=[LAYERS[1]])
        direct = dict(reader.get_ranges([(r, a, b), (good, a, b)], return_errors=True))
        _refused(direct[r], ROWS[a:b])
        assert same_sets(direct[good].indices, ROWS[a:b])  # type: ignore[union-attr]


def test_a_damaged_trailer_alone_is_refused_even_after_the_header_was_cached(
    svc: Service,
) -> None:
    """The header cache keeps verified headers only, keyed by header and trailer: a read
    of the intact frame first cannot let damaged bytes through later."""
    r = _store(svc)
    a, b = RANGE
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        assert same_sets(client.get(r, start=a, end=b).indices, ROWS[a:b])
        _plant(svc, r, f"s:0:{N}", lambda f: f[:-4] + bytes(x ^ 0xFF for x in f[-4:]))
        for _ in range(2):  # errors are not cached either
            with pytest.raises(StoreError, match="checksum") as info:
                client.get(r, start=a, end=b)
            _service_refusal(info.value, r)
    with svc.http() as c:  # the status: the service's fault (5xx), said in a sentence
        resp = c.get(f"/v1/rollouts/{r}", params={"start": a, "end": b})
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "store_error"
    assert "Traceback" not in resp.text and "damaged" in resp.json()["error"]["message"]


@pytest.mark.parametrize("version", [3, 2])
def test_a_damaged_chunk_under_a_ranged_read_is_refused(svc: Service, version: int) -> None:
    """A chunk the range returns is checked against its CRC before it is copied into a
    slice (v2 too: its trailer covers the body, but a header-cache hit does not re-read
    it); a damaged chunk the range does not need leaves the other rows readable."""
    r = _store(svc, version=version)
    a, b = RANGE
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        assert same_sets(client.get(r, start=a, end=b).indices, ROWS[a:b])  # header cached
        _plant(svc, r, f"s:0:{N}", _chunk_flip(1))  # block 0, layer group 1
        with pytest.raises(StoreError, match="chunk checksum") as info:
            client.get(r, start=a, end=b)
        _service_refusal(info.value, r)
        with pytest.raises(StoreError, match="chunk checksum"):
            client.get(r, layers=[LAYERS[1]])
        got = dict(client.get_ranges([(r, a, b)], return_errors=True))
        _refused(got[r], ROWS[a:b])
        if version == 3:  # the rows of other blocks are right: answered
            lo, hi = 4100, 4200  # block 2
            assert same_sets(client.get(r, start=lo, end=hi).indices, ROWS[lo:hi])
            part = client.get(r, layers=[LAYERS[0]])  # group 0 of every block
            assert same_sets(part.indices, ROWS[:, :1])


@pytest.mark.parametrize("whole", [True, False], ids=["continuation", "only-segment"])
async def test_a_context_frame_in_a_segment_field_is_an_error_never_a_gap(
    svc: Service, transport: str, whole: bool
) -> None:
    """Every reader, whole and ranged reads: a StoreError naming the segment, no -1 rows."""
    r, good = _store(svc, whole=whole), _store(svc)
    lo, hi = (N, M) if whole else (0, N)
    _plant(svc, r, f"s:{lo}:{hi}", _context_frame, in_field=True)
    seg = f"[{lo}, {hi})"
    a, b = lo + 10, lo + 90
    want = ROWS[a:b]
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        for read in (
            lambda: client.get(r),
            lambda: client.get(r, start=a, end=b),
            lambda: client.get(r, start=lo),
            lambda: client.get(r, layers=[LAYERS[3]]),
        ):
            got = _try(read)
            _refused(got, want)
            _service_refusal(got, r, seg)  # type: ignore[arg-type]
        many = dict(client.get_many([r, good], start=a, end=b, return_errors=True))
        _service_refusal(many[r], r, seg)  # type: ignore[arg-type]
        assert same_sets(many[good].indices, want)  # type: ignore[union-attr]
        ranges = dict(client.get_ranges([(r, a, b)], return_errors=True))
        _service_refusal(ranges[r], r, seg)  # type: ignore[arg-type]
        if whole:  # the rows before the planted field are right: answered
            assert same_sets(client.get(r, start=0, end=N).indices, ROWS[:N])
    async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as ac:
        with pytest.raises(StoreError) as info:
            await ac.get(r, start=a, end=b)
        _service_refusal(info.value, r, seg)
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        for read in (lambda: reader.get(r), lambda: reader.get(r, start=a, end=b)):
            with pytest.raises(StoreError) as info:
                read()
            _service_refusal(info.value, r, seg)
        direct = dict(reader.get_many([r, good], start=a, end=b, return_errors=True))
        _service_refusal(direct[r], r, seg)  # type: ignore[arg-type]
        assert same_sets(direct[good].indices, want)  # type: ignore[union-attr]


def test_slice_frame_verify_checks_the_trailer_and_every_chunk_it_returns() -> None:
    """The codec's part: ``slice_frame(verify=True)`` refuses what it would otherwise cut
    and sign anew; without ``verify`` (the default) it still cuts without checking."""
    frame, _ = _frames(3)
    a, b = RANGE
    good = slice_frame(frame, start=a, end=b, verify=True)
    assert read_header(good).blocks == (2048,)
    with pytest.raises(ChecksumError, match="header checksum"):
        slice_frame(_rows_moved(frame), start=a, end=b, verify=True)
    damaged = _chunk_flip(1)(frame)  # block 0, group 1
    with pytest.raises(ChecksumError, match="chunk checksum"):
        slice_frame(damaged, start=a, end=b, verify=True)
    with pytest.raises(ChecksumError, match="chunk checksum"):
        slice_frame(damaged, verify=True)  # everything kept: returned whole, still checked
    assert slice_frame(damaged, start=4100, end=4200, verify=True)  # block 2 is intact
    assert slice_frame(damaged, start=a, end=b)  # unchecked: the caller's choice
