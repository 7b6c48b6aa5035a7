"""Format v3 (docs/format.md section 18): what differs from v2, and v2/v3 in one rollout.

v3 shares v2's layout, so the chunked suite (test_codec_v2.py) runs on both versions; this
file checks what is v3's own: CRC-32C per chunk as the body's only checksum, a trailer over
the header alone, the BLAKE3 digest over the ids as stored, slices that keep the version,
and rollouts that mix v2 and v3 frames and contexts.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import blake3
import msgpack
import numpy as np
import pytest

from r3_client import (
    ChecksumError,
    Context,
    FrameError,
    Segment,
    UnsupportedFrameError,
    content_digest,
    decode_frame,
    decode_rollout,
    encode_context,
    encode_frame,
    read_header,
    slice_frame,
)
from r3_client.codec import FORMAT_VERSION
from r3_client.codec.frame import PREFIX, crc32c
from r3_client.codec.v2_read import check_chunks
from r3_client.synthetic import synthetic_routing
from tests.support.frames import forge_checksums


def _sets(a: Any) -> Any:
    return np.sort(np.asarray(a), axis=-1)


def _body_at(frame: bytes) -> int:
    hdr = read_header(frame)
    return hdr.frame_length - 4 - hdr.body_length


ROWS = synthetic_routing(300, 4, 64, 4, skew=1.0, rho=0.7, seed=11)


def test_writers_default_to_v3_and_v3_decodes_like_v2() -> None:
    assert FORMAT_VERSION == 3
    for codec in ("raw", "set", "set-zstd", "auto"):
        v3 = encode_frame(ROWS, num_experts=64, layer_ids=range(4), codec=codec)  # type: ignore[arg-type]
        v2 = encode_frame(ROWS, num_experts=64, layer_ids=range(4), codec=codec, version=2)  # type: ignore[arg-type]
        assert (read_header(v3).version, read_header(v2).version) == (3, 2)
        a, b = decode_frame(v3).routing.indices, decode_frame(v2).routing.indices
        assert np.array_equal(_sets(a), _sets(ROWS)) and np.array_equal(a, b)


def test_the_trailer_covers_the_prefix_and_header_only() -> None:
    frame = encode_frame(ROWS, num_experts=64, layer_ids=range(4), block_rows=64)
    hlen = PREFIX.unpack_from(frame)[4]
    assert struct.unpack("<I", frame[-4:])[0] == crc32c(frame[: PREFIX.size + hlen])
    hdr = read_header(frame)
    at = _body_at(frame)
    for length, crc in hdr.chunks:  # each chunk's CRC-32C, as listed
        assert crc32c(frame[at : at + length]) == crc
        at += length


def test_a_damaged_header_fails_the_trailer() -> None:
    frame = bytearray(encode_frame(ROWS, num_experts=64, layer_ids=range(4)))
    frame[PREFIX.size + 3] ^= 0x01
    with pytest.raises(ChecksumError, match="header checksum"):
        read_header(bytes(frame))


@pytest.mark.parametrize("codec", ["raw", "set", "set-zstd"])
def test_a_damaged_body_is_caught_by_its_chunk_crc_on_read_and_on_store(codec: str) -> None:
    frame = bytearray(encode_frame(ROWS, num_experts=64, layer_ids=range(4), codec=codec))  # type: ignore[arg-type]
    hdr = read_header(bytes(frame))
    frame[_body_at(bytes(frame)) + 1] ^= 0x01  # the trailer still matches: it skips the body
    read_header(bytes(frame))
    with pytest.raises(ChecksumError, match="chunk"):
        decode_frame(bytes(frame))
    with pytest.raises(ChecksumError, match="chunk"):
        check_chunks(bytes(frame), hdr)  # what the service runs before storing


def test_a_v3_context_frame_is_refused() -> None:
    ctx = encode_context(Context.build(8, 2, (1, 3)))
    forged = bytearray(ctx)
    forged[4] = 3
    hlen = PREFIX.unpack_from(forged)[4]
    forged[-4:] = struct.pack("<I", crc32c(bytes(forged[: PREFIX.size + hlen])))
    with pytest.raises(UnsupportedFrameError, match="unknown codec id 3"):  # contexts are v2
        read_header(bytes(forged))


def test_a_version_past_3_is_unsupported() -> None:
    frame = bytearray(encode_frame(ROWS[:4], num_experts=64, layer_ids=range(4)))
    frame[4] = 4
    with pytest.raises(UnsupportedFrameError, match="reads 1, 2 and 3"):
        read_header(bytes(frame))


@pytest.mark.parametrize("e", [64, 300])
def test_the_v3_digest_is_blake3_over_the_ids_as_stored(e: int) -> None:
    rows = synthetic_routing(40, 3, e, 4, seed=5)
    rows[7, 1] = -1
    seg = Segment(10, 50, "m", "w1")
    srt = np.sort(rows, axis=-1)
    srt[7, 1] = -1
    dtype = np.uint8 if e <= 255 else np.dtype("<u2")
    meta = msgpack.packb([e, [2, 4, 6], seg.to_dict()])
    want = blake3.blake3(meta + srt.astype(dtype).tobytes()).hexdigest()
    assert content_digest(e, (2, 4, 6), seg, rows) == want
    assert content_digest(e, (2, 4, 6), seg, rows, version=2) != want
    digests = set()
    for codec in ("raw", "set", "set-zstd"):
        frame = encode_frame(rows, num_experts=e, layer_ids=(2, 4, 6), segment=seg, codec=codec)  # type: ignore[arg-type]
        digests.add(read_header(frame).digest)
    assert digests == {want}  # the same rows, whatever codec: one digest


def test_a_v3_slice_stays_v3_and_keeps_its_chunks() -> None:
    frame = encode_frame(ROWS, num_experts=64, layer_ids=range(4), block_rows=64, layer_groups=2)
    part = slice_frame(frame, start=70, end=130, layers=[3])
    hdr = read_header(part)
    assert hdr.version == 3 and hdr.blocks == (64, 64) and hdr.layer_ids == (2, 3)
    got = decode_frame(part).routing
    assert np.array_equal(got.indices, decode_frame(frame).routing.indices[64:192, 2:4])


def _mixed(first: int, later: tuple[int, ...]) -> tuple[bytes, np.ndarray]:
    """One rollout's frames as a read returns them: the context frame, then a first frame of
    version ``first`` and continuation frames of ``later`` versions against its context."""
    rows = synthetic_routing(400, 4, 64, 4, skew=1.0, rho=0.9, seed=3)
    cuts = [0, 100, *[100 + 300 * (i + 1) // len(later) for i in range(len(later))]]
    head = encode_frame(
        rows[:100], num_experts=64, layer_ids=range(4), segment=Segment(0, 100), version=first
    )
    ctx = read_header(head).context
    assert ctx is not None and ctx.has_table  # set-zstd with a relabel table to continue
    ctx = Context.parse(ctx.raw)
    frames = [encode_context(ctx), head]
    for (lo, hi), version in zip(itertools.pairwise(cuts[1:]), later, strict=True):
        cont = encode_frame(
            rows[lo:hi], num_experts=64, layer_ids=range(4), segment=Segment(lo, hi),
            base=ctx, version=version,
        )  # fmt: skip
        assert read_header(cont).version == version and read_header(cont).base == ctx.digest
        frames.append(cont)
    return b"".join(frames), rows


@pytest.mark.parametrize(("first", "later"), [(2, (3, 2, 3)), (3, (2, 3)), (3, (3,))])
def test_a_rollout_mixing_v2_and_v3_frames_reads_back(first: int, later: tuple[int, ...]) -> None:
    data, rows = _mixed(first, later)
    got = decode_rollout(data)
    assert got.indices.shape == rows.shape and np.array_equal(_sets(got.indices), _sets(rows))
    part = decode_rollout(data, start=90, end=260, layers=[1, 3])
    assert np.array_equal(_sets(part.indices), _sets(rows[90:260][:, [1, 3]]))


@pytest.mark.parametrize("codec", ["raw", "set", "set-zstd"])
def test_forged_checksums_reach_the_decoders(codec: str) -> None:
    """The fuzz suites forge v3 checksums (tests.support.frames.forge_checksums) to reach the
    body decoders behind them: a forged frame passes every checksum."""
    frame = bytearray(encode_frame(ROWS, num_experts=64, layer_ids=range(4), codec=codec))  # type: ignore[arg-type]
    frame[_body_at(bytes(frame)) + 2] ^= 0x40
    try:
        decode_frame(forge_checksums(frame))
    except ChecksumError:  # pragma: no cover - the failure this test exists to catch
        pytest.fail("a forged v3 frame still fails a checksum")
    except FrameError:
        pass  # the body decoder refused the damage: what the fuzz suites want to reach


@pytest.mark.parametrize(
    ("e", "k", "nl"), [(128, 8, 12), (384, 8, 12), (512, 22, 8)], ids=["qwen3", "kimi", "e512"]
)
@pytest.mark.parametrize("rows", [16, 200, 1500])
def test_v3_is_no_larger_than_v2_first_frames_and_continuations(
    e: int, k: int, nl: int, rows: int
) -> None:
    """The zstd setting follows relabelling (18.3): short first frames (fewer rows than
    experts: no table) and continuations of a table both stay at or below v2's size."""
    for skew, rho in ((1.0, 0.9), (0.0, 0.0)):
        big = synthetic_routing(2048 + rows, nl, e, k, skew=skew, rho=rho, seed=rows)
        kw: dict[str, Any] = {"num_experts": e, "layer_ids": range(nl)}
        head = encode_frame(big[:2048], **kw)
        raw = read_header(head).context
        assert raw is not None
        ctx = Context.parse(raw.raw)
        part = big[2048:]
        for base in (None, ctx):
            v2 = encode_frame(part, base=base, version=2, start=2048, **kw)
            v3 = encode_frame(part, base=base, start=2048, **kw)
            assert len(v3) <= len(v2), (skew, base is not None, len(v3), len(v2))
