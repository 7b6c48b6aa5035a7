"""Format v2 round trips: chunked frames, continuation frames, slicing at every boundary,
stitching, and v1 compatibility (property tests over random geometry)."""

from __future__ import annotations

import itertools
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3_client import (
    ChecksumError,
    Context,
    FrameError,
    Segment,
    decode_frame,
    decode_rollout,
    encode_context,
    encode_frame,
    read_header,
    slice_frame,
    split_frames,
)
from r3_client.synthetic import synthetic_routing


def _sets(a: np.ndarray) -> np.ndarray:
    return np.sort(a, axis=-1)


geometry = st.tuples(
    st.integers(1, 40),  # rows
    st.integers(1, 6),  # layers
    st.sampled_from([(8, 2), (16, 4), (64, 8), (300, 3)]),  # (E, K): u8 and u16 gaps
    st.integers(1, 9),  # block rows
    st.integers(1, 6),  # layer groups (clipped to layers)
    st.sampled_from(["auto", "raw", "set", "set-zstd"]),
    st.integers(0, 2**16),  # seed
)


def _routing(rows: int, nl: int, e: int, k: int, seed: int) -> np.ndarray:
    idx = synthetic_routing(rows, nl, e, k, skew=1.0, rho=0.5, seed=seed)
    if rows > 2:
        idx[seed % rows] = -1  # a whole -1 row somewhere
    return idx


@pytest.mark.parametrize("version", [2, 3])
@settings(max_examples=120, deadline=None)
@given(g=geometry)
def test_chunked_round_trip_and_every_slice(g: tuple, version: int) -> None:  # type: ignore[type-arg]
    rows, nl, (e, k), br, ng, codec, seed = g
    ng = min(ng, nl)
    layers = tuple(range(3, 3 + 2 * nl, 2))
    idx = _routing(rows, nl, e, k, seed)
    start = seed % 50
    frame = encode_frame(
        idx,
        num_experts=e,
        layer_ids=layers,
        start=start,
        codec=codec,  # type: ignore[arg-type]
        block_rows=br,
        layer_groups=ng,
        version=version,
    )
    hdr = read_header(frame)
    assert hdr.version == version and sum(hdr.blocks) == rows and len(hdr.groups) == ng
    assert np.array_equal(_sets(decode_frame(frame).routing.indices), _sets(idx))
    # every (start, end) boundary pair and a layer subset: slice, decode, trim
    for a in range(start, start + rows):
        for b in (a + 1, start + rows):
            want_layers = [layers[(seed + a) % nl]]
            for lay in (None, want_layers):
                cut = slice_frame(frame, start=a, end=b, layers=lay)
                got = decode_rollout(cut, start=a, end=b, layers=lay)
                cols = list(range(nl)) if lay is None else [layers.index(lay[0])]
                assert got.start == a and got.end == b
                assert np.array_equal(
                    _sets(got.indices), _sets(idx[a - start : b - start][:, cols])
                )
                assert len(cut) <= len(frame) + 64 * len(read_header(cut).chunks) + 200


@settings(max_examples=60, deadline=None)
@given(geometry, st.lists(st.integers(1, 30), min_size=1, max_size=5))
def test_continuation_segments_stitch(g: tuple, turns: list[int]) -> None:  # type: ignore[type-arg]
    rows, nl, (e, k), br, ng, codec, seed = g
    ng = min(ng, nl)
    layers = tuple(range(nl))
    total = rows + sum(turns)
    idx = _routing(total, nl, e, k, seed)
    bounds = [0, rows]
    for t in turns:
        bounds.append(bounds[-1] + t)
    first = encode_frame(
        idx[:rows], num_experts=e, layer_ids=layers, segment=Segment(0, rows), block_rows=br
    )
    ctx = Context.parse(read_header(first).context.raw)  # type: ignore[union-attr]
    frames = [first]
    for a, b in itertools.pairwise(bounds[1:]):
        cont = encode_frame(
            idx[a:b],
            num_experts=e,
            layer_ids=layers,
            segment=Segment(a, b),
            base=ctx,
            codec=codec,  # type: ignore[arg-type]
            block_rows=br,
            layer_groups=ng,
        )
        head = read_header(cont)
        assert head.base == ctx.digest and not head.resolved  # no E/K/layers repeated
        with pytest.raises(FrameError, match="context"):
            decode_frame(cont)
        frames.append(cont)
    data = encode_context(ctx) + b"".join(reversed(frames))  # order does not matter
    got = decode_rollout(data)
    assert np.array_equal(_sets(got.indices), _sets(idx))
    assert [(s.start, s.end) for s in got.segments] == list(itertools.pairwise(bounds))
    mid = total // 2
    part = decode_rollout(data, start=mid, end=total, layers=[layers[-1]])
    assert np.array_equal(_sets(part.indices), _sets(idx[mid:, [nl - 1]]))
    # slices of continuation frames, as the service cuts them, read back too
    cut = b"".join(
        slice_frame(f, start=mid, end=total, context=ctx)
        for f in frames
        if read_header(f, context=ctx if read_header(f).base else None).end > mid
    )
    again = decode_rollout(encode_context(ctx) + cut, start=mid, end=total)
    assert np.array_equal(_sets(again.indices), _sets(idx[mid:]))


@settings(max_examples=40, deadline=None)
@given(geometry)
def test_v1_and_v2_frames_still_decode_and_match_v3(g: tuple) -> None:  # type: ignore[type-arg]
    rows, nl, (e, k), _, _, codec, seed = g
    idx = _routing(rows, nl, e, k, seed)
    kw = {"num_experts": e, "layer_ids": range(nl), "codec": codec}
    v1 = encode_frame(idx, version=1, **kw)  # type: ignore[arg-type]
    v2 = encode_frame(idx, version=2, **kw)  # type: ignore[arg-type]
    v3 = encode_frame(idx, **kw)  # type: ignore[arg-type]
    assert [read_header(f).version for f in (v1, v2, v3)] == [1, 2, 3]
    a, b = decode_frame(v1).routing, decode_rollout(v1)
    assert np.array_equal(_sets(a.indices), _sets(decode_frame(v2).routing.indices))
    assert np.array_equal(_sets(a.indices), _sets(decode_frame(v3).routing.indices))
    assert np.array_equal(_sets(a.indices), _sets(b.indices))


def test_gaps_read_as_minus_one_and_overlaps_are_refused() -> None:
    idx = synthetic_routing(30, 2, 16, 2, seed=1)
    a = encode_frame(idx[:10], num_experts=16, layer_ids=(0, 1), segment=Segment(0, 10))
    b = encode_frame(idx[20:], num_experts=16, layer_ids=(0, 1), segment=Segment(20, 30))
    got = decode_rollout(a + b)
    assert (got.indices[10:20] == -1).all() and got.end == 30
    gap = decode_rollout(encode_context(read_header(a).context), start=12, end=15)  # type: ignore[arg-type]
    assert gap.indices.shape == (3, 2, 2) and (gap.indices == -1).all()
    over = encode_frame(idx[5:15], num_experts=16, layer_ids=(0, 1), segment=Segment(5, 15))
    with pytest.raises(FrameError, match="overlap"):
        decode_rollout(a + over)
    assert len(split_frames(a + b)) == 2


def test_damage_behind_a_forged_outer_crc_is_caught_by_chunk_crcs() -> None:
    idx = synthetic_routing(20, 2, 16, 2, seed=2)
    kw = {"num_experts": 16, "layer_ids": (0, 1), "codec": "raw", "version": 2}
    frame = bytearray(encode_frame(idx, **kw))  # type: ignore[arg-type]
    hdr = read_header(bytes(frame))
    at = hdr.frame_length - 4 - hdr.body_length
    frame[at] ^= 1  # a still-valid expert id: only a checksum can tell
    frame[-4:] = struct.pack("<I", zlib.crc32(bytes(frame[:-4])))
    with pytest.raises(ChecksumError, match="chunk"):
        decode_frame(bytes(frame))


def test_declared_size_over_the_callers_limit_is_refused_before_decoding() -> None:
    idx = synthetic_routing(64, 4, 16, 2, seed=3)
    frame = encode_frame(idx, num_experts=16, layer_ids=range(4))
    with pytest.raises(FrameError, match="limit"):
        decode_frame(frame, max_bytes=1000)
    with pytest.raises(FrameError):
        decode_rollout(frame, max_bytes=1000)
