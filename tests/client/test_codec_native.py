"""The compiled codec (``r3_client._kernels._r3codec``) against the numpy reference, in one process:
the same frame bytes, the same decoded arrays, the same errors; hostile bodies refused by
both, never a crash.  tests/client/test_codec_sanitized.py runs this module again with the
extension built under AddressSanitizer + UBSan, with more examples (``R3_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3_client._exceptions import ChecksumError, CodecError
from r3_client._kernels import native as _native
from r3_client._routing import Segment
from r3_client.codec import (
    Context,
    decode_frame,
    decode_rollout,
    encode_frame,
    read_header,
    slice_frame,
)
from r3_client.codec.bodies import (
    chunk_body_size,
    gap_dtype,
    raw_decode,
    set_decode,
    set_ok,
    zset_chunk_decode,
)
from r3_client.codec.frame import CODECS, assemble_frame
from r3_client.codec.setrank import pack_bits, ranker
from r3_client.synthetic import synthetic_routing

EXAMPLES = int(os.environ.get("R3_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

pytestmark = pytest.mark.skipif(
    os.environ.get(_native.BACKEND_ENV) == "numpy",
    reason="R3_CODEC_BACKEND=numpy: this run checks the numpy codec alone",
)


def test_the_compiled_codec_is_built_and_in_use() -> None:
    # make bootstrap / pip install builds it; a run without it would compare numpy to itself.
    assert _native.backend() == "native", _native.unavailable_reason()


def test_the_library_named_by_the_environment_is_the_one_loaded() -> None:
    import r3_client._kernels._r3codec as loaded

    path = os.environ.get(_native.LIBRARY_ENV)
    if path:  # the sanitizer run: prove it is not testing the normal build
        assert Path(loaded.__file__ or "").resolve() == Path(path).resolve()
    else:
        assert Path(loaded.__file__ or "").parent == Path(_native.__file__).parent


@pytest.fixture(autouse=True)
def _no_disagreement() -> Iterator[None]:
    """The compiled module never refuses what the reference accepts."""
    before = _native.disagreements
    yield
    assert _native.disagreements == before


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn``'s outcome on numpy and on native: its value, or (exception type, message)."""
    out = []
    for name in ("numpy", "native"):
        with _native.use(name):
            try:
                out.append(fn())
            except Exception as exc:
                out.append((type(exc), str(exc)))
    return out[0], out[1]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    return bool(a == b)


# (E, K) pairs over every kernel path: u8 / u16 gaps and tables, 64-bit and 128-bit ranks,
# C(E, K) past 128 bits (set refused, raw / set-zstd only), K = 1, K = E.
PAIRS = [
    (8, 2), (16, 4), (64, 8), (128, 8), (300, 3), (384, 8), (1024, 16), (600, 40), (5, 1), (4, 4)
]  # fmt: skip
DTYPES = ["int64", "int32", "int16", "uint8", "uint16"]


def routing(rows: int, nl: int, e: int, k: int, seed: int, skew: float, empty: float) -> Any:
    return synthetic_routing(rows, nl, e, k, skew=skew, rho=0.6, empty=empty, seed=seed)


@FUZZ
@given(
    rows=st.integers(1, 90),
    nl=st.integers(1, 5),
    pair=st.sampled_from(PAIRS),
    codec=st.sampled_from(["auto", "raw", "set", "set-zstd"]),
    version=st.sampled_from([1, 2, 3, 3]),
    block_rows=st.sampled_from([None, 1, 7, 32]),
    groups=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    skew=st.sampled_from([0.0, 1.5]),
    empty=st.sampled_from([0.0, 0.2]),
    dtype=st.sampled_from(DTYPES),
)
def test_frames_are_byte_identical_and_decode_alike(
    rows: int,
    nl: int,
    pair: tuple[int, int],
    codec: Any,
    version: int,
    block_rows: int | None,
    groups: int,
    seed: int,
    skew: float,
    empty: float,
    dtype: str,
) -> None:
    e, k = pair
    idx = routing(rows, nl, e, k, seed, skew, empty)
    if dtype.startswith("uint") and (idx < 0).any():
        dtype = "int32"  # -1 has no unsigned spelling
    if np.iinfo(dtype).max < e:
        dtype = "int32"
    arr = idx.astype(dtype)
    layers = tuple(range(2, 2 + nl))
    seg = Segment(5, 5 + rows, "m", "v1", "")
    v2: dict[str, Any] = (
        {"block_rows": block_rows, "layer_groups": min(groups, nl)} if version >= 2 else {}
    )

    def enc() -> bytes:
        return encode_frame(
            arr, num_experts=e, layer_ids=layers, start=5, segment=seg, codec=codec,
            version=version, **v2,
        )  # fmt: skip

    a, b = both(enc)
    assert same(a, b), (a if isinstance(a, tuple) else "bytes", b if isinstance(b, tuple) else "")
    if not isinstance(a, bytes):
        return
    da, db = both(lambda: decode_frame(a).routing.indices)
    assert same(da, db)
    assert np.array_equal(np.sort(da, -1), np.sort(idx, -1))
    if version == 1:
        return
    ctx = read_header(a).context
    assert ctx is not None
    full = Context.parse(ctx.raw)
    more = routing(rows, nl, e, k, seed + 1, skew, empty)
    ca, cb = both(
        lambda: encode_frame(
            more,
            num_experts=e,
            layer_ids=layers,
            start=5 + rows,
            codec=codec,
            base=full,
            version=version,
            **v2,
        )
    )
    assert same(ca, cb)
    if isinstance(ca, bytes):
        ra, rb = both(lambda: decode_rollout([a, ca]).indices)
        assert same(ra, rb)
    lo, hi = 5 + seed % rows, 5 + rows - (seed // 7) % rows
    pick = layers[seed % nl :: 2]
    sa, sb = both(lambda: slice_frame(a, start=lo, end=max(hi, lo + 1), layers=pick))
    assert same(sa, sb)
    if isinstance(sa, bytes):
        xa, xb = both(lambda: decode_frame(sa).routing.indices)
        assert same(xa, xb)


@FUZZ
@given(
    rows=st.integers(1, 40),
    nl=st.integers(1, 4),
    pair=st.sampled_from(PAIRS),
    seed=st.integers(0, 2**16),
    fault=st.sampled_from(["dup", "partial", "range", "low"]),
    dtype=st.sampled_from(["int64", "int32", "int16"]),
)
def test_invalid_rows_raise_the_same_error(
    rows: int, nl: int, pair: tuple[int, int], seed: int, fault: str, dtype: str
) -> None:
    e, k = pair
    idx = routing(rows, nl, e, k, seed, 0.0, 0.0)
    r, layer = seed % rows, (seed // 3) % nl
    if fault == "dup" and k > 1:
        idx[r, layer, 1] = idx[r, layer, 0]
    elif fault == "partial" and k > 1:
        idx[r, layer, 0] = -1
    elif fault == "range":
        idx[r, layer, k - 1] = e + seed % 5
    else:
        idx[r, layer, 0] = -2 - seed % 3
    if np.iinfo(dtype).max < idx.max():
        dtype = "int32"
    arr = idx.astype(dtype)
    a, b = both(lambda: encode_frame(arr, num_experts=e, layer_ids=range(nl)))
    assert same(a, b)


# ---- hostile bodies straight into each decoder -------------------------------------------
@FUZZ
@given(
    rows=st.integers(1, 30),
    nl=st.integers(1, 4),
    pair=st.sampled_from(PAIRS),
    data=st.data(),
)
def test_hostile_set_and_raw_bodies_are_refused_alike(
    rows: int, nl: int, pair: tuple[int, int], data: st.DataObject
) -> None:
    e, k = pair
    shape = (rows, nl, k)
    for codec, decode in (("raw", raw_decode), ("set", set_decode)):
        if codec == "set" and not set_ok(e, k):
            continue
        want = chunk_body_size(codec, rows, nl, e, k)
        assert want is not None
        # mostly the exact length (what reaches the kernels), sometimes not
        size = data.draw(st.sampled_from([want, want, want, max(0, want - 1), want + 1]))
        body = data.draw(st.binary(min_size=size, max_size=size))
        if codec == "set" and data.draw(st.booleans()):
            body = _ranks_near_the_sentinel(rows * nl, e, k, data)
        # and at an odd address: a body sits anywhere inside a frame
        view = memoryview(b"\x00" + body)[1:]
        a, b = both(lambda d=decode, v=view: d(v, shape, e))  # type: ignore[misc]
        assert same(a, b), codec


def _ranks_near_the_sentinel(n: int, e: int, k: int, data: st.DataObject) -> bytes:
    """A set body of ranks where the checks sit: 0, C(E, K) - 1, C(E, K) (the -1 row),
    C(E, K) + 1 and the field's largest value."""
    rk = ranker(e, k)
    edge = [0, 1, rk.sentinel - 1, rk.sentinel, rk.sentinel + 1, (1 << rk.bits) - 1]
    ranks = data.draw(st.lists(st.sampled_from(edge), min_size=n, max_size=n))
    lo = np.array([r & ((1 << 64) - 1) for r in ranks], dtype=np.uint64)
    if not rk.wide:
        return pack_bits(lo, rk.bits)
    hi = np.array([r >> 64 for r in ranks], dtype=np.uint64)
    return pack_bits(lo, 64) + pack_bits(hi, rk.bits - 64)


@FUZZ
@given(
    rows=st.integers(1, 30),
    nl=st.integers(1, 4),
    pair=st.sampled_from(PAIRS),
    relabel=st.booleans(),
    data=st.data(),
)
def test_hostile_gap_planes_are_refused_alike(
    rows: int, nl: int, pair: tuple[int, int], relabel: bool, data: st.DataObject
) -> None:
    e, k = pair
    n = rows * nl * k * gap_dtype(e, k).itemsize
    style = data.draw(st.sampled_from(["bytes", "small", "edge"]))
    if style == "bytes":
        payload = data.draw(st.binary(min_size=n, max_size=n))
    else:  # gaps near the limits, where the checks sit
        top = e - k + 1
        vals = data.draw(
            st.lists(
                st.sampled_from([0, 1, top - 1, top, top + 1] if style == "edge" else [0, 1, 2]),
                min_size=n // gap_dtype(e, k).itemsize,
                max_size=n // gap_dtype(e, k).itemsize,
            )
        )
        g = np.array(vals, dtype=np.int64).clip(0, 255 if gap_dtype(e, k).itemsize == 1 else 65535)
        if gap_dtype(e, k).itemsize == 1:
            payload = g.astype(np.uint8).tobytes()
        else:
            payload = (g & 0xFF).astype(np.uint8).tobytes() + (g >> 8).astype(np.uint8).tobytes()
    body = zstandard.ZstdCompressor(write_content_size=True).compress(payload)
    order = None
    if relabel:
        rng = np.random.default_rng(rows * 7919 + e)
        dt = np.uint8 if e <= 255 else np.uint16
        order = np.stack([rng.permutation(e) for _ in range(nl)]).astype(dt)
    a, b = both(lambda: zset_chunk_decode(memoryview(body), (rows, nl, k), e, order))
    assert same(a, b)


def test_every_decoder_writes_only_its_own_chunk() -> None:
    """A chunk decoded in place fills exactly its block and layer group of the frame array."""
    idx = synthetic_routing(50, 6, 64, 8, skew=1.0, rho=0.6, seed=3)
    for codec in ("raw", "set", "set-zstd"):
        frame = encode_frame(
            idx, num_experts=64, layer_ids=range(6), codec=codec, block_rows=7, layer_groups=4
        )
        with _native.use("native"):
            got = decode_frame(frame).routing.indices
        with _native.use("numpy"):
            ref = decode_frame(frame).routing.indices
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("codec", ["raw", "set"])
def test_a_body_shorter_than_its_rows_is_refused_before_allocating(
    backend: str, codec: str
) -> None:
    """A v1 frame declaring 2**28 rows (1 GiB decoded, under the default cap) over a 4-byte
    body: refused with the reference's error, nothing of the declared size allocated."""
    header = {"E": 8, "K": 2, "layers": [0], "start": 0, "end": 1 << 28, "params": {}}
    frame = assemble_frame(1, CODECS[codec], header, [b"\x00\x01\x02\x03"])
    tracemalloc.start()
    try:
        with _native.use(backend), pytest.raises(CodecError, match="bytes, expected"):
            decode_frame(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"


# ---- a whole frame in one call (decode_chunks) -------------------------------------------------
def test_the_kernels_inflate_set_zstd_where_libzstd_is_installed() -> None:
    """setup.py links libzstd where its header is (bootstrap installs Debian's libzstd-dev):
    a build here that lost it would decode set-zstd chunk by chunk again, silently."""
    import r3_client._kernels._r3codec as loaded

    if any(Path(d, "zstd.h").exists() for d in ("/usr/include", "/usr/local/include")):
        assert loaded.HAVE_ZSTD == 1


@pytest.mark.parametrize("codec", ["raw", "set", "set-zstd"])
def test_a_frame_decodes_in_one_compiled_call(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-chunk frame: one ``decode_chunks`` call, no per-chunk kernel and no Python
    inflation, and the rows the chunk-by-chunk path decodes."""
    calls: dict[str, int] = {}

    def counted(name: str) -> Any:
        real = getattr(_native, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return run

    for name in ("decode_chunks", "zset_decode", "set_decode", "raw_decode"):
        monkeypatch.setattr(_native, name, counted(name))
    idx = routing(300, 16, 128, 8, seed=4, skew=1.5, empty=0.05)
    frame = encode_frame(
        idx, num_experts=128, layer_ids=range(16), codec=codec, block_rows=64, layer_groups=8
    )
    assert len(read_header(frame).chunks) == 5 * 8
    got = decode_frame(frame).routing.indices
    assert calls == {"decode_chunks": 1}
    with _native.use("numpy"):
        want = decode_frame(frame).routing.indices
    assert same(got, want)


def _with_chunk(frame: bytes, i: int, body: bytes) -> bytes:
    """``frame`` (v3) with chunk ``i``'s bytes replaced by ``body``, its length and CRC (and
    the frame's) made to match: what a writer holding the key could store."""
    from r3_client.codec.frame import CRC, PREFIX, chunk_crc

    hdr = read_header(frame)
    head = msgpack.unpackb(frame[PREFIX.size : hdr.frame_length - CRC.size - hdr.body_length])
    at = hdr.frame_length - CRC.size - hdr.body_length
    bodies = []
    for length, _ in hdr.chunks:
        bodies.append(frame[at : at + length])
        at += length
    bodies[i] = body
    head["chunks"] = [[len(b), chunk_crc(3, b)] for b in bodies]
    return assemble_frame(3, CODECS[hdr.codec], head, bodies)


@FUZZ
@given(
    which=st.integers(0, 11),
    how=st.sampled_from(["size", "unsized", "trailing", "truncated", "garbage", "gaps", "two"]),
    seed=st.integers(0, 2**16),
)
def test_hostile_chunks_are_refused_alike_by_the_one_call(which: int, how: str, seed: int) -> None:
    """One chunk of a many-chunk set-zstd frame replaced by hostile bytes (CRCs forged): a
    zstd frame declaring another size or none, trailing bytes, cut short, not zstd, gaps no
    routing has, two frames: the one compiled call and the numpy reference refuse it with the
    same error, and neither reads outside its buffers (the sanitizer run of this module)."""
    rng = np.random.default_rng(seed)
    e, k = (128, 8) if which % 2 else (1024, 16)
    idx = routing(120, 6, e, k, seed=seed, skew=1.5, empty=0.1)
    frame = encode_frame(
        idx, num_experts=e, layer_ids=range(6), codec="set-zstd", block_rows=32, layer_groups=3
    )
    hdr = read_header(frame)
    i = which % len(hdr.chunks)
    rows, nl = hdr.blocks[i // len(hdr.groups)], hdr.groups[i % len(hdr.groups)]
    want = rows * nl * k * gap_dtype(e, k).itemsize
    zc = zstandard.ZstdCompressor()
    payload = rng.integers(0, 3, want, dtype=np.uint8).tobytes()
    body = {
        "size": zc.compress(payload + b"\0" * int(rng.integers(1, 64))),
        "unsized": zstandard.ZstdCompressor(write_content_size=False).compress(payload),
        "trailing": zc.compress(payload) + b"\0",
        "truncated": zc.compress(payload)[: -int(rng.integers(1, 4))],
        "garbage": rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes(),
        "gaps": zc.compress(b"\xff" * want),
        "two": zc.compress(payload[: want // 2]) + zc.compress(payload[want // 2 :]),
    }[how]
    hostile = _with_chunk(frame, i, body)
    numpy_out, native_out = both(lambda: decode_frame(hostile).routing.indices)
    assert same(numpy_out, native_out), (numpy_out, native_out)
    assert isinstance(native_out, tuple), "a hostile chunk decoded"


def test_a_slice_with_a_layer_subset_decodes_in_one_call_with_its_relabel_rows() -> None:
    """A sliced frame holding layers 3..8 of 12 (its relabel rows are not its context's first):
    the one call reads each chunk's own rows of the table."""
    idx = routing(500, 12, 128, 8, seed=9, skew=1.5, empty=0.0)
    frame = encode_frame(idx, num_experts=128, layer_ids=range(12), block_rows=64, layer_groups=4)
    cut = slice_frame(frame, start=70, end=300, layers=[3, 4, 5, 6, 7, 8])
    got = decode_frame(cut).routing
    with _native.use("numpy"):
        want = decode_frame(cut).routing
    assert got.layer_ids == want.layer_ids == (3, 4, 5, 6, 7, 8)
    assert same(got.indices, want.indices)


@FUZZ
@given(data=st.binary(min_size=0, max_size=300), cut=st.integers(0, 7))
def test_the_kernels_crc32c_is_google_crc32c(data: bytes, cut: int) -> None:
    """decode_chunks checks v3 chunk CRCs itself (the GIL released); its CRC-32C (the CPU's
    instruction, or the table of a build without SIMD: the portable run of this module)
    equals google-crc32c's on any bytes, at any alignment."""
    import google_crc32c
    import r3_client._kernels._r3codec as loaded

    view = memoryview(data)[min(cut, len(data)) :]
    assert loaded.crc32c(view) == google_crc32c.value(bytes(view))


def test_a_damaged_chunk_is_a_checksum_error_from_the_one_call() -> None:
    idx = routing(200, 6, 128, 8, seed=2, skew=1.5, empty=0.0)
    frame = bytearray(encode_frame(idx, num_experts=128, layer_ids=range(6), block_rows=32))
    frame[-10] ^= 0x40  # in the last chunk's bytes
    with pytest.raises(ChecksumError, match="chunk checksum mismatch"):
        decode_frame(bytes(frame))
