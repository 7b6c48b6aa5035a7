"""The routing frame: the only code that knows the bytes (spec: docs/format.md).

Layout (all integers little-endian)::

    0   4  magic  b"R3RF"
    4   1  format version (1)
    5   1  codec id (0 raw, 1 set, 2 set-zstd)
    6   2  reserved, must be 0
    8   4  header length H
    12  8  body length B
    20  H  header: msgpack map (see FrameHeader)
    20+H B  body (codec-specific)
    …   4  CRC-32 (zlib) of every preceding byte

Codecs:

* ``raw`` — ids as the smallest unsigned dtype holding E plus the sentinel
  (uint8 when E <= 255, else uint16), -1 stored as the dtype's maximum, token-
  major ``[R, L, K]``.  Keeps the writer's within-row order.
* ``set`` — each (token, layer) row's top-k *set* ranked in the combinatorial
  number system and bit-packed at ``bit_length(C(E, K))`` bits, i.e. within one
  bit of ``log2 C(E, K)``.  Decodes to ascending rows.
* ``set-zstd`` — the entropy stage: rows as sorted gaps, layer-major, zstd;
  when the frame has at least E rows, each layer's experts are first relabelled
  by popularity (most used → 0) and the table travels in the payload.  16-bit
  gaps are stored as a low-byte plane then a high-byte plane.  Below the set
  bound on skewed, token-correlated routing; a little above it on uniform
  routing.  Decodes to rows in popularity order (relabelled) or ascending.

``codec="auto"`` (the default) picks ``set-zstd`` when a trial on the data says
it is smaller than ``set``, else ``set``; it falls back to ``raw`` when
``C(E, K)`` needs more than 128 bits.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgpack
import numpy as np
import numpy.typing as npt
import zstandard

from r3_client._exceptions import (
    ChecksumError,
    CodecError,
    FormatError,
    FrameError,
    ShapeError,
    TruncatedFrameError,
    UnsupportedFrameError,
)
from r3_client._format import (
    Routing,
    Segment,
    canonical_rows,
    check_layer_ids,
    check_params,
    index_dtype,
)
from r3_client._setrank import pack_bits, ranker, unpack_bits
from r3_client._sortnet import sort_rows

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "CodecName",
    "Frame",
    "FrameHeader",
    "decode_frame",
    "encode_frame",
    "read_header",
]

MAGIC: Final = b"R3RF"
FORMAT_VERSION: Final = 1
CodecName = Literal["auto", "raw", "set", "set-zstd"]
CODECS: Final[dict[str, int]] = {"raw": 0, "set": 1, "set-zstd": 2}
_CODEC_NAMES: Final = {v: k for k, v in CODECS.items()}
_PREFIX = struct.Struct("<4sBBHIQ")
_CRC = struct.Struct("<I")
#: Headers hold layer ids and short strings; anything larger is not a frame of ours.
MAX_HEADER: Final = 1 << 20
#: Provenance entries a frame may list (the store's per-rollout segment limit).
MAX_SEGMENTS: Final = 4096
#: Rows the ``auto`` trial compresses before choosing (contiguous tokens, all layers).
_TRIAL_ROWS: Final = 1 << 16


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame says about itself, readable without decoding the body."""

    codec: str
    num_experts: int
    topk: int
    layer_ids: tuple[int, ...]
    start: int
    end: int
    segment: Segment | None
    segments: tuple[Segment, ...]
    params: dict[str, Any]
    body_length: int
    frame_length: int

    @property
    def num_rows(self) -> int:
        """Token rows in the frame."""
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: its header and the routing it carries."""

    header: FrameHeader
    routing: Routing


# ---------------------------------------------------------------------------------------------
# encoding
# ---------------------------------------------------------------------------------------------
def encode_frame(
    indices: npt.ArrayLike | Routing,
    *,
    num_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
    start: int | None = None,
    segment: Segment | None = None,
    codec: CodecName = "auto",
    level: int = 3,
) -> bytes:
    """Validate routing ``[R, L, K]`` and encode it as one frame.

    ``indices`` may be a :class:`Routing` (its experts, layers and start are
    used) or an integer array with ``num_experts`` and ``layer_ids`` given.
    ``segment``, when given, must cover exactly ``[start, start + R)``: it is
    the unit the store keeps.  A :class:`Routing` assembled from several stored
    segments instead carries them as provenance (header ``segments``); a
    Routing holding exactly one segment that covers its rows is written as
    ``segment``.
    ``level`` is the zstd level of the ``set-zstd`` stage.  Raises a
    :class:`FormatError` subclass for invalid routing, :class:`CodecError` when
    ``codec="set"`` cannot represent ``C(E, K)`` in 128 bits, and
    :class:`UnsupportedFrameError` for an unknown codec name.
    """
    provenance: tuple[Segment, ...] = ()
    if isinstance(indices, Routing):
        arr = indices.indices
        provenance = indices.segments
        num_experts = indices.num_experts if num_experts is None else num_experts
        layer_ids = indices.layer_ids if layer_ids is None else layer_ids
        start = indices.start if start is None else start
    else:
        arr = np.asarray(indices)
    if num_experts is None or layer_ids is None:
        raise ShapeError("num_experts and layer_ids are required for a bare array")
    if start is None:
        start = segment.start if segment is not None else 0
    if arr.ndim != 3:
        raise ShapeError(f"routing must be [tokens, layers, topk], got shape {arr.shape}")
    rows, nl, k = arr.shape
    check_params(num_experts, k)
    layers = check_layer_ids(layer_ids)
    if nl != len(layers):
        raise ShapeError(f"routing has {nl} layers but {len(layers)} layer_ids")
    if rows < 1:
        raise ShapeError("routing must hold at least one token row")
    if not isinstance(start, int) or start < 0:
        raise ShapeError(f"start must be a non-negative int, got {start!r}")
    end = start + rows
    if segment is not None and (segment.start, segment.end) != (start, end):
        raise ShapeError(
            f"segment [{segment.start}, {segment.end}) does not match the {rows} rows "
            f"starting at {start}"
        )
    if codec not in ("auto", *CODECS):
        raise UnsupportedFrameError(f"unknown codec {codec!r}; choose from auto, {list(CODECS)}")
    srt = canonical_rows(arr, num_experts)  # validates every row

    chosen, params, body = (
        _auto_encode(arr, srt, num_experts, k, level)
        if codec == "auto"
        else (codec, *_encode_body(codec, arr, srt, num_experts, k, level))
    )

    header: dict[str, Any] = {
        "E": int(num_experts),
        "K": int(k),
        "layers": list(layers),
        "start": start,
        "end": end,
        "params": params,
    }
    whole = len(provenance) == 1 and (provenance[0].start, provenance[0].end) == (start, end)
    if segment is None and whole:
        segment, provenance = provenance[0], ()
    if segment is not None:
        header["segment"] = segment.to_dict()
    elif provenance:
        if len(provenance) > MAX_SEGMENTS or not all(p.overlaps(start, end) for p in provenance):
            raise ShapeError(
                f"segments must overlap the rows [{start}, {end}) and number at most {MAX_SEGMENTS}"
            )
        header["segments"] = [p.to_dict() for p in provenance]
    packed = msgpack.packb(header, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, CODECS[chosen], 0, len(packed), len(body))
    crc = zlib.crc32(body, zlib.crc32(packed, zlib.crc32(prefix)))
    return b"".join((prefix, packed, body, _CRC.pack(crc)))


def _encode_body(
    codec: str, arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[dict[str, Any], bytes]:
    if codec == "raw":
        return _raw_encode(arr, e)
    if codec == "set":
        return _set_encode(srt, e, k)
    return _zset_encode(srt, e, k, level)


def _auto_encode(
    arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[str, dict[str, Any], bytes]:
    """``set`` or ``set-zstd``, whichever a trial says is smaller; ``raw`` if set cannot.

    The trial compresses the first ``_TRIAL_ROWS`` rows (contiguous tokens,
    all layers) with ``set-zstd`` and compares with ``set``'s exact fixed width.
    When the trial is the whole input its body is reused.
    """
    try:
        bits = ranker(e, k).bits
    except CodecError:
        return ("raw", *_raw_encode(arr, e))
    rows, nl, _ = srt.shape
    trial_rows = max(1, _TRIAL_ROWS // nl)
    params, zbody = _zset_encode(srt[:trial_rows], e, k, level)
    if len(zbody) >= min(trial_rows, rows) * nl * bits / 8:
        return ("set", *_set_encode(srt, e, k))
    if trial_rows >= rows:
        return "set-zstd", params, zbody
    return ("set-zstd", *_zset_encode(srt, e, k, level))


def _raw_dtype(num_experts: int) -> np.dtype[Any]:
    return np.dtype("u1") if num_experts <= 255 else np.dtype("<u2")


def _raw_encode(arr: npt.NDArray[Any], e: int) -> tuple[dict[str, Any], bytes]:
    dt = _raw_dtype(e)
    # -1 wraps to the dtype's maximum, which is never a valid id (E <= max).
    return {}, np.ascontiguousarray(arr).astype(dt).tobytes()


def _set_encode(srt: npt.NDArray[Any], e: int, k: int) -> tuple[dict[str, Any], bytes]:
    rk = ranker(e, k)
    flat = srt.reshape(-1, k)
    lo, hi = rk.rank(flat, flat[:, 0] < 0)
    if hi is None:
        return {}, pack_bits(lo, rk.bits)
    return {}, pack_bits(lo, 64) + pack_bits(hi, rk.bits - 64)


def _gap_planes(gaps: npt.NDArray[Any], dtype: np.dtype[Any]) -> bytes:
    """Gaps as bytes; 16-bit gaps as a low-byte plane then a high-byte plane.

    The high bytes are almost all zero, so splitting them out lets zstd code
    each plane with its own statistics: ~17% smaller and ~5x faster to compress
    than interleaved uint16 on E=384 routing (measured in bench/codec_bench.py).
    """
    if dtype.itemsize == 1:
        return gaps.astype(dtype).tobytes()
    wide = gaps.astype(np.uint16)
    return (wide & 0xFF).astype(np.uint8).tobytes() + (wide >> 8).astype(np.uint8).tobytes()


def _gap_dtype(e: int, k: int) -> np.dtype[Any]:
    return np.dtype("u1") if e - k + 1 <= 255 else np.dtype("<u2")


def _zset_encode(srt: npt.NDArray[Any], e: int, k: int, level: int) -> tuple[dict[str, Any], bytes]:
    rows, nl, _ = srt.shape
    # Work layer-major ([L, R, K], contiguous) in the narrow index dtype: every pass
    # below is memory-bound, so fewer bytes is faster.
    ids = np.ascontiguousarray(srt.transpose(1, 0, 2), dtype=index_dtype(e))
    empty = ids[..., 0] < 0
    table_bytes = b""
    relabel = rows >= e  # a popularity table pays for itself only with enough tokens
    if relabel:
        # Flat (layer, expert) indices; -1 rows go to one extra bin that is dropped.
        offset = (np.arange(nl, dtype=np.int32) * e)[:, None, None]
        flat = np.where(ids < 0, nl * e, ids + offset)
        counts = np.bincount(flat.reshape(-1), minlength=nl * e + 1)[: nl * e].reshape(nl, e)
        order = np.argsort(-counts, axis=1, kind="stable")  # order[l, rank] = expert
        to_rank = np.empty((nl, e), dtype=ids.dtype)
        np.put_along_axis(to_rank, order, np.arange(e, dtype=ids.dtype)[None, :], axis=1)
        lookup = np.append(to_rank.reshape(-1), ids.dtype.type(-1))
        ids = sort_rows(lookup.take(flat))
        table_bytes = order.astype(_raw_dtype(e)).tobytes()
    gaps = np.empty_like(ids)
    gaps[..., 0] = ids[..., 0]
    np.subtract(ids[..., 1:], ids[..., :-1], out=gaps[..., 1:])
    gaps[..., 1:] -= 1
    gaps[empty] = 0
    gaps[..., 0][empty] = e - k + 1  # an impossible first gap marks a -1 row
    payload = table_bytes + _gap_planes(gaps, _gap_dtype(e, k))
    body = zstandard.ZstdCompressor(level=level).compress(payload)
    return {"relabel": relabel}, body


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
def read_header(data: bytes | bytearray | memoryview, *, verify: bool = True) -> FrameHeader:
    """Parse and check a frame's prefix, header and (if ``verify``) CRC; body untouched.

    Raises :class:`TruncatedFrameError`, :class:`ChecksumError`,
    :class:`UnsupportedFrameError` or :class:`FrameError` with the reason.
    """
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _CRC.size:
        raise TruncatedFrameError(
            f"frame is {len(view)} bytes; the smallest frame is {_PREFIX.size + _CRC.size}"
        )
    magic, version, codec_id, reserved, hlen, blen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise UnsupportedFrameError(f"not a routing frame: magic {bytes(magic)!r} != {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise UnsupportedFrameError(
            f"frame format version {version} is not supported (this library reads {FORMAT_VERSION})"
        )
    if codec_id not in _CODEC_NAMES:
        raise UnsupportedFrameError(f"unknown codec id {codec_id}")
    if reserved:
        raise FrameError("reserved prefix bits are set")
    if hlen > MAX_HEADER:
        raise FrameError(f"header length {hlen} exceeds {MAX_HEADER}")
    total = _PREFIX.size + hlen + blen + _CRC.size
    if len(view) != total:
        kind = TruncatedFrameError if len(view) < total else FrameError
        raise kind(f"frame is {len(view)} bytes but declares {total}")
    if verify:
        (want,) = _CRC.unpack_from(view, total - _CRC.size)
        if zlib.crc32(view[: total - _CRC.size]) != want:
            raise ChecksumError("frame checksum mismatch: the bytes were corrupted")
    raw = bytes(view[_PREFIX.size : _PREFIX.size + hlen])
    try:
        hdr = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_bin_len=0, object_pairs_hook=_unique_map
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"frame header is not valid msgpack: {exc}") from None
    return _parse_header(hdr, _CODEC_NAMES[codec_id], blen, total)


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack map hook: a repeated key is an error, not "last one wins"."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise FrameError("frame header repeats a map key")
    return out


def _parse_header(hdr: object, codec: str, blen: int, total: int) -> FrameHeader:
    if not isinstance(hdr, dict):
        raise FrameError("frame header must be a map")
    required = {"E", "K", "layers", "start", "end", "params"}
    keys = set(hdr)
    if not required <= keys or not keys <= required | {"segment", "segments"}:
        raise FrameError(
            f"frame header keys {sorted(map(str, keys))} differ from {sorted(required)}"
            " (+ optional segment or segments)"
        )
    try:
        e, k, start, end = (_int(hdr[n], n) for n in ("E", "K", "start", "end"))
        check_params(e, k)
        if not isinstance(hdr["layers"], list):
            raise FrameError("header layers must be a list")
        layers = check_layer_ids(hdr["layers"])
        seg = None if "segment" not in hdr else Segment.from_dict(hdr["segment"])
        prov = hdr.get("segments", [])
        if not isinstance(prov, list) or len(prov) > MAX_SEGMENTS:
            raise FrameError(f"header segments must be a list of at most {MAX_SEGMENTS}")
        segs = tuple(Segment.from_dict(p) for p in prov)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None
    if not 0 <= start < end:
        raise FrameError(f"frame token range [{start}, {end}) is empty or negative")
    if seg is not None and (seg.start, seg.end) != (start, end):
        raise FrameError("frame segment range differs from its token range")
    if seg is not None and segs:
        raise FrameError("a frame carries either segment or segments, not both")
    if not all(p.overlaps(start, end) for p in segs):
        raise FrameError("a provenance segment does not overlap the frame's rows")
    params = hdr["params"]
    if not isinstance(params, dict):
        raise FrameError("header params must be a map")
    return FrameHeader(codec, e, k, layers, start, end, seg, segs, params, blen, total)


def _int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"header field {name} must be an int")
    return value


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Check and decode one frame.  Never returns wrong data: any inconsistency raises.

    Raises a :class:`FrameError` subclass (see ``_exceptions``).
    """
    hdr = read_header(data)
    view = memoryview(data).cast("B")
    body_at = hdr.frame_length - _CRC.size - hdr.body_length
    body = view[body_at : hdr.frame_length - _CRC.size]
    shape = (hdr.num_rows, len(hdr.layer_ids), hdr.topk)
    if hdr.codec == "raw":
        _expect_params(hdr.params, set())
        arr = _raw_decode(body, shape, hdr.num_experts)
    elif hdr.codec == "set":
        _expect_params(hdr.params, set())
        arr = _set_decode(body, shape, hdr.num_experts)
    else:
        _expect_params(hdr.params, {"relabel"})
        relabel = hdr.params["relabel"]
        if not isinstance(relabel, bool):
            raise FrameError("set-zstd param relabel must be a bool")
        arr = _zset_decode(body, shape, hdr.num_experts, relabel)
    arr.flags.writeable = False
    segs = hdr.segments if hdr.segment is None else (hdr.segment,)
    return Frame(hdr, Routing(arr, hdr.num_experts, hdr.layer_ids, hdr.start, segs))


def _expect_params(params: dict[str, Any], keys: set[str]) -> None:
    if set(params) != keys:
        raise FrameError(f"codec params {sorted(map(str, params))} differ from {sorted(keys)}")


def _check_rows(rows: int, per_row: int, what: str) -> None:
    # Guard allocations against absurd declared sizes before touching numpy.
    if rows * per_row > (1 << 34):
        raise FrameError(f"{what}: frame declares {rows} rows, too many to decode")


def _raw_decode(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    dt = _raw_dtype(e)
    _check_rows(shape[0], shape[1] * shape[2], "raw")
    want = shape[0] * shape[1] * shape[2] * dt.itemsize
    if len(body) != want:
        raise CodecError(f"raw body is {len(body)} bytes, expected {want}")
    u = np.frombuffer(body, dtype=dt).reshape(shape)
    out = u.astype(index_dtype(e))
    out[u == np.iinfo(dt).max] = -1
    try:
        canonical_rows(out, e)
    except FormatError as exc:
        raise CodecError(f"raw body holds invalid routing: {exc}") from None
    return out


def _set_decode(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    rows, nl, k = shape
    _check_rows(rows, nl, "set")
    rk = ranker(e, k)
    n = rows * nl
    if rk.wide:
        split = n * 8
        if len(body) < split:
            raise CodecError(f"set body is {len(body)} bytes, expected more than {split}")
        lo = unpack_bits(body[:split], n, 64)
        hi = unpack_bits(body[split:], n, rk.bits - 64)
    else:
        lo, hi = unpack_bits(body, n, rk.bits), None
    return rk.unrank(lo, hi).reshape(shape)


def _zset_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, relabel: bool
) -> npt.NDArray[Any]:
    rows, nl, k = shape
    _check_rows(rows, nl * k, "set-zstd")
    gdt = _gap_dtype(e, k)
    tdt = _raw_dtype(e)
    table_len = nl * e * tdt.itemsize if relabel else 0
    want = table_len + rows * nl * k * gdt.itemsize
    try:
        # Check the declared size before inflating anything: a small crafted body must
        # not make us allocate more than the header's shape allows.
        declared = zstandard.frame_content_size(body)
        if declared != want:
            raise CodecError(
                f"set-zstd frame declares {declared} content bytes (-1 = unknown), expected {want}"
            )
        dobj = zstandard.ZstdDecompressor().decompressobj()
        payload = dobj.decompress(body)
        if not dobj.eof or dobj.unused_data:
            raise CodecError("set-zstd body is not exactly one complete zstd frame")
    except zstandard.ZstdError as exc:
        raise CodecError(f"set-zstd body does not decompress: {exc}") from None
    if len(payload) != want:
        raise CodecError(f"set-zstd payload is {len(payload)} bytes, expected {want}")
    n = rows * nl * k
    if gdt.itemsize == 1:
        gaps = np.frombuffer(payload, dtype=np.uint8, offset=table_len).reshape(nl, rows, k)
    else:
        planes = np.frombuffer(payload, dtype=np.uint8, offset=table_len)
        gaps = planes[:n].astype(np.uint16)
        gaps |= planes[n:].astype(np.uint16) << 8
        gaps = gaps.reshape(nl, rows, k)
    empty = gaps[..., 0] == e - k + 1
    if empty.any() and gaps[empty][:, 1:].any():
        raise CodecError("set-zstd body has a malformed empty-row marker")
    if gaps.max(initial=0) > e - k + 1:
        raise CodecError("set-zstd gap larger than the expert count allows: body is corrupt")
    # ids = cumsum(gap + 1) - 1 along K, column by column, in the narrow index dtype
    # unless K gaps of up to E-K+1 could overflow it.
    dt = index_dtype(e) if k * (e - k + 2) < np.iinfo(np.int16).max else np.dtype(np.int32)
    ids = np.empty((nl, rows, k), dtype=dt)
    ids[..., 0] = gaps[..., 0]
    for j in range(1, k):
        np.add(ids[..., j - 1], gaps[..., j], out=ids[..., j], dtype=dt)
        ids[..., j] += 1
    ids[empty] = 0
    if ids[..., -1].max(initial=0) >= e:
        raise CodecError("set-zstd gaps run past the expert count: body is corrupt")
    if relabel:
        order = np.frombuffer(payload, dtype=tdt, count=nl * e).reshape(nl, e)
        if not (np.sort(order, axis=1) == np.arange(e)).all():
            raise CodecError("set-zstd relabel table is not a permutation")
        offset = (np.arange(nl, dtype=np.int32) * e)[:, None, None]
        ids = order.astype(dt).reshape(-1).take(ids + offset)
    ids[empty] = -1
    return np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=index_dtype(e))
