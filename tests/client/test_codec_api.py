"""Codec round trips (hypothesis) and corruption handling: errors, never wrong arrays."""

from __future__ import annotations

import math
import struct
import zlib

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from r3_client import (
    ChecksumError,
    CodecError,
    FormatError,
    FrameError,
    Routing,
    Segment,
    ShapeError,
    TruncatedFrameError,
    UnsupportedFrameError,
    decode_frame,
    encode_frame,
    read_header,
    token_digest,
)
from r3_client.codec.setrank import pack_bits, ranker, unpack_bits
from r3_client.synthetic import synthetic_routing
from tests.support.frames import forge_checksums

CODECS = ["raw", "set", "set-zstd", "auto"]


@st.composite
def routings(draw: st.DrawFn, max_experts: int = 1024, max_topk: int = 16) -> tuple:
    """(indices [T, L, K], E) with random shapes, -1 rows, E > 256 and K = 1 reachable."""
    e = draw(
        st.one_of(
            st.integers(1, 16),
            st.integers(17, max_experts),
            st.sampled_from([255, 256, 257, 300, 384, 1024]),
        )
    )
    e = min(e, max_experts)
    k = draw(st.one_of(st.just(1), st.integers(1, min(e, max_topk))))
    t = draw(st.integers(1, 40))
    nl = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    empty = draw(st.sampled_from([0.0, 0.1, 1.0]))
    skew = draw(st.sampled_from([0.0, 1.5]))
    idx = synthetic_routing(t, nl, e, k, skew=skew, rho=0.5, empty=empty, seed=seed)
    return idx, e


def _same_sets(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(np.sort(a, -1), np.sort(b, -1)))


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=routings(), start=st.integers(0, 10**6))
def test_round_trip(codec: str, data: tuple, start: int) -> None:
    idx, e = data
    layers = list(range(3, 3 + 2 * idx.shape[1], 2))
    frame = encode_frame(idx, num_experts=e, layer_ids=layers, start=start, codec=codec)  # type: ignore[arg-type]
    dec = decode_frame(frame)
    r = dec.routing
    assert (r.num_experts, r.layer_ids, r.start, r.end) == (
        e,
        tuple(layers),
        start,
        start + idx.shape[0],
    )
    assert _same_sets(r.indices, idx)
    assert ((r.indices == -1).all(-1) == (idx == -1).all(-1)).all()
    if dec.header.codec == "raw":
        assert np.array_equal(r.indices, idx)  # raw keeps the engine's order
    if dec.header.codec == "set":
        assert (np.diff(r.indices, axis=-1) > 0).all() or (r.indices == -1).any()


@pytest.mark.parametrize(
    ("e", "k"),
    [(1, 1), (2, 1), (2, 2), (1024, 1), (1024, 16), (16, 16), (600, 64), (65535, 4), (70, 35)],
)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_edge_shapes(e: int, k: int, codec: str) -> None:
    idx = synthetic_routing(50, 2, e, k, empty=0.1, seed=e + k)
    if codec == "set" and math.comb(e, k).bit_length() > 128:
        with pytest.raises(CodecError, match="use the raw codec"):
            encode_frame(idx, num_experts=e, layer_ids=[0, 1], codec=codec)
        return
    frame = encode_frame(idx, num_experts=e, layer_ids=[0, 1], codec=codec)  # type: ignore[arg-type]
    assert _same_sets(decode_frame(frame).routing.indices, idx)


def test_set_codec_refuses_more_than_128_bits() -> None:
    idx = synthetic_routing(2, 1, 65535, 16, seed=0)
    with pytest.raises(CodecError, match="use the raw codec"):
        encode_frame(idx, num_experts=65535, layer_ids=[0], codec="set")
    frame = encode_frame(idx, num_experts=65535, layer_ids=[0])  # auto falls back
    assert read_header(frame).codec == "raw"


def test_header_carries_segment_and_params() -> None:
    idx = synthetic_routing(10, 2, 64, 4, seed=3)
    seg = Segment(5, 15, "tiny-moe", "w7", token_digest(range(15)))
    frame = encode_frame(idx, num_experts=64, layer_ids=[1, 2], segment=seg, codec="set")
    hdr = read_header(frame)
    assert hdr.segment == seg
    assert (hdr.start, hdr.end) == (5, 15)
    assert hdr.codec == "set"
    assert hdr.frame_length == len(frame)
    with pytest.raises(ShapeError, match="does not match"):
        encode_frame(idx, num_experts=64, layer_ids=[1, 2], segment=Segment(0, 9))


@pytest.mark.parametrize(("e", "k"), [(128, 8), (1024, 16), (5, 2), (2, 1)])
def test_set_rank_is_a_bijection_at_the_edges(e: int, k: int) -> None:
    rk = ranker(e, k)
    top = np.arange(e - k, e)[None, :]  # the last set in colex order
    bottom = np.arange(k)[None, :]
    rows = np.concatenate([bottom, top, bottom])
    lo, hi = rk.rank(rows, np.array([False, False, True]))
    ranks = [int(a) + (int(hi[i]) << 64 if hi is not None else 0) for i, a in enumerate(lo)]
    assert ranks == [0, math.comb(e, k) - 1, math.comb(e, k)]
    back = rk.unrank(lo, hi)
    assert back[:2].tolist() == rows[:2].tolist()
    assert (back[2] == -1).all()


@given(width=st.integers(1, 64), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_bit_packing_round_trip(width: int, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = (
        rng.integers(0, 2**width, size=n, dtype=np.uint64, endpoint=False)
        if width < 64
        else rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2)
    )
    packed = pack_bits(v, width)
    assert len(packed) == (n * width + 7) // 8
    assert np.array_equal(unpack_bits(packed, n, width), v)


def test_compact_codec_is_near_the_bound_on_uniform_data() -> None:
    e, k, nl, t = 128, 8, 4, 4096
    idx = synthetic_routing(t, nl, e, k, seed=0)
    frame = encode_frame(idx, num_experts=e, layer_ids=range(nl))
    bound = t * nl * math.log2(math.comb(e, k)) / 8
    assert read_header(frame).codec == "set"
    assert len(frame) <= 1.02 * bound + 200  # + the fixed header


def test_compact_codec_beats_the_bound_on_skewed_data() -> None:
    e, k, nl, t = 128, 8, 4, 4096
    idx = synthetic_routing(t, nl, e, k, skew=1.0, rho=0.9, seed=0)
    frame = encode_frame(idx, num_experts=e, layer_ids=range(nl))
    bound = t * nl * math.log2(math.comb(e, k)) / 8
    assert read_header(frame).codec == "set-zstd"
    assert len(frame) < 0.9 * bound


# ---- corruption ------------------------------------------------------------------------------
def _frames() -> list[bytes]:
    out = []
    for i, codec in enumerate(["raw", "set", "set-zstd"]):
        for e, k in [(128, 8), (1024, 16), (300, 1)]:
            idx = synthetic_routing(12, 3, e, k, skew=1.0, rho=0.8, empty=0.1, seed=i)
            for version in (2, 3):
                out.append(
                    encode_frame(
                        idx,
                        num_experts=e,
                        layer_ids=[0, 5, 9],
                        codec=codec,
                        segment=Segment(0, 12, "m", "v1"),
                        version=version,
                    )
                )
    return out


FRAMES = _frames()


@settings(max_examples=600, deadline=None)
@given(
    which=st.integers(0, len(FRAMES) - 1),
    flips=st.lists(st.integers(0, 10**9), min_size=1, max_size=3),
)
def test_bit_flips_raise_never_decode(which: int, flips: list[int]) -> None:
    frame = bytearray(FRAMES[which])
    positions = {p % (len(frame) * 8) for p in flips}
    for p in positions:
        frame[p // 8] ^= 1 << (p % 8)
    with pytest.raises(FrameError):
        decode_frame(bytes(frame))


@pytest.mark.parametrize("which", range(len(FRAMES)))
def test_every_truncation_raises(which: int) -> None:
    frame = FRAMES[which]
    for n in range(len(frame)):
        with pytest.raises(FrameError):
            decode_frame(frame[:n])
    with pytest.raises(FrameError):
        decode_frame(frame + b"\0")
    with pytest.raises(TruncatedFrameError):
        decode_frame(frame[:-1])


def _recrc(frame: bytearray) -> bytes:
    return forge_checksums(frame)


@settings(max_examples=600, deadline=None)
@given(which=st.integers(0, len(FRAMES) - 1), pos=st.integers(20, 10**9), val=st.integers(0, 255))
def test_forged_crc_still_yields_error_or_valid_routing(which: int, pos: int, val: int) -> None:
    """Even with a recomputed CRC, a damaged body never decodes to invalid routing."""
    frame = bytearray(FRAMES[which])
    pos = 20 + pos % (len(frame) - 24)
    assume(frame[pos] != val)
    frame[pos] = val
    try:
        r = decode_frame(_recrc(frame)).routing
    except FrameError:
        return
    _assert_valid(r.indices, r.num_experts)


def _assert_valid(idx: np.ndarray, e: int) -> None:
    ok_rows = (idx == -1).all(-1) | ((idx >= 0) & (idx < e)).all(-1)
    assert ok_rows.all()
    srt = np.sort(idx, -1)
    assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()


def test_unsupported_frames_are_named() -> None:
    frame = bytearray(FRAMES[0])
    bad_magic = bytearray(frame)
    bad_magic[0:4] = b"XXXX"
    with pytest.raises(UnsupportedFrameError, match="magic"):
        decode_frame(_recrc(bad_magic))
    bad_version = bytearray(frame)
    bad_version[4] = 9
    with pytest.raises(UnsupportedFrameError, match="version 9"):
        decode_frame(_recrc(bad_version))
    bad_codec = bytearray(frame)
    bad_codec[5] = 77
    with pytest.raises(UnsupportedFrameError, match="codec id 77"):
        decode_frame(_recrc(bad_codec))
    with pytest.raises(ChecksumError):
        decode_frame(bytes(frame[:-1]) + bytes([frame[-1] ^ 1]))
    with pytest.raises(TruncatedFrameError):
        decode_frame(b"R3")


def test_not_a_frame_is_a_frame_error() -> None:
    for junk in [b"", b"\0" * 100, b"GET / HTTP/1.1\r\n\r\n" * 3, np.arange(100).tobytes()]:
        with pytest.raises(FrameError):
            decode_frame(junk)


def _assemble(codec_id: int, header: bytes, body: bytes) -> bytes:
    """A frame from hand-made parts, with a correct CRC (to reach the checks behind it)."""
    prefix = struct.pack("<4sBBHIQ", b"R3RF", 1, codec_id, 0, len(header), len(body))
    head = prefix + header + body
    return head + struct.pack("<I", zlib.crc32(head))


def _zset_header(rows: int, relabel: bool = False) -> bytes:
    return msgpack.packb(
        {"E": 8, "K": 2, "layers": [0], "start": 0, "end": rows, "params": {"relabel": relabel}}
    )


def test_repeated_header_key_is_refused() -> None:
    # msgpack map with "E" twice; a lenient parser would keep the last one.
    header = b"\x87" + b"".join(
        msgpack.packb(k) + msgpack.packb(v)
        for k, v in [
            ("E", 8),
            ("K", 2),
            ("layers", [0]),
            ("start", 0),
            ("end", 1),
            ("params", {}),
            ("E", 9),
        ]
    )
    with pytest.raises(FrameError, match="repeats a map key"):
        decode_frame(_assemble(0, header, bytes([0, 1])))


def test_zstd_body_must_be_exactly_one_frame_of_the_declared_size() -> None:
    gaps = bytes([0, 0] * 3)  # three rows {0, 1}
    good = zstandard.ZstdCompressor().compress(gaps)
    assert (
        decode_frame(_assemble(2, _zset_header(3), good)).routing.indices.tolist() == [[[0, 1]]] * 3
    )
    with pytest.raises(CodecError, match="exactly one complete zstd frame"):
        decode_frame(_assemble(2, _zset_header(3), good + good))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(gaps)
    with pytest.raises(CodecError, match="declares -1 content bytes"):
        decode_frame(_assemble(2, _zset_header(3), unsized))
    bomb = zstandard.ZstdCompressor().compress(bytes(300_000_000 // 1000) * 1000)
    with pytest.raises(CodecError, match="expected 6"):
        decode_frame(_assemble(2, _zset_header(3), bomb))


def test_digest_and_text_fields_are_strict() -> None:
    digest = token_digest([1, 2])
    with pytest.raises(FormatError, match="tokens_digest must be printable"):
        Segment(0, 1, tokens_digest=digest + "\n")
    with pytest.raises(FormatError, match="64 lowercase hex"):
        Segment(0, 1, tokens_digest=digest.upper())
    with pytest.raises(FormatError, match="must be a string"):
        Segment(0, 1, tokens_digest=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("which", range(len(FRAMES)))
def test_every_body_byte_substitution_yields_error_or_valid_routing(which: int) -> None:
    """Deterministic sweep: each header/body byte replaced by two other values, CRC forged."""
    frame = FRAMES[which]
    for pos in range(20, len(frame) - 4):
        for delta in (1, 0x80):
            forged = bytearray(frame)
            forged[pos] ^= delta
            try:
                r = decode_frame(_recrc(forged)).routing
            except FrameError:
                continue
            _assert_valid(r.indices, r.num_experts)


def test_assembled_routing_carries_its_segments_as_provenance() -> None:
    idx = synthetic_routing(30, 2, 16, 2, seed=4)
    segs = (Segment(0, 10, "m", "w1"), Segment(10, 40, "m", "w2"))
    r = Routing.from_array(idx, num_experts=16, layer_ids=[0, 1], start=5, segments=segs)
    dec = decode_frame(encode_frame(r))
    assert dec.header.segment is None
    assert dec.routing.segments == segs
    with pytest.raises(ShapeError, match="must overlap"):
        encode_frame(
            Routing.from_array(idx, num_experts=16, layer_ids=[0, 1], segments=(Segment(50, 60),))
        )
    one = Routing.from_array(idx, num_experts=16, layer_ids=[0, 1], segments=(Segment(0, 30),))
    assert decode_frame(encode_frame(one)).header.segment == Segment(0, 30)
