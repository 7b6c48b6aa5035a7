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

import hashlib
import itertools
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
    layer_positions,
)
from r3_client._setrank import pack_bits, ranker, unpack_bits
from r3_client._sortnet import sort_rows

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DECODED_BYTES",
    "CodecName",
    "Context",
    "Frame",
    "FrameHeader",
    "content_digest",
    "decode_frame",
    "decode_rollout",
    "encode_context",
    "encode_frame",
    "read_header",
    "slice_frame",
    "split_frames",
]

MAGIC: Final = b"R3RF"
#: The version :func:`encode_frame` writes; version 1 frames still decode.
FORMAT_VERSION: Final = 2
#: Codec id of a v2 *context frame*: a rollout's shared context, no rows.
CONTEXT_CODEC: Final = 3
#: Largest decoded array a decoder allocates unless told otherwise (``max_bytes``).
MAX_DECODED_BYTES: Final = 1 << 34
#: Largest relabel table (``L·E`` entries) a context may carry.
MAX_TABLE_ENTRIES: Final = 1 << 22
#: v2 encoder defaults: token rows per block, and at most this many layer groups.
BLOCK_ROWS: Final = 2048
LAYER_GROUPS: Final = 8
#: Below this many entries (``R·L·K``) a v2 frame is one layer group (chunks too small to pay).
_MIN_GROUPED: Final = 1 << 16
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
    version: int = 1
    #: v2: the context this frame carries (``ctx``), or the one it was resolved against.
    context: Context | None = None
    #: v2 continuation: digest of the context the frame needs ("" if it carries its own).
    base: str = ""
    #: v2: writer-supplied content digest of the segment (see :func:`content_digest`).
    digest: str = ""
    #: v2: token rows per block, layers per group, and ``(length, crc32)`` per chunk.
    blocks: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int], ...] = ()

    @property
    def num_rows(self) -> int:
        """Token rows in the frame."""
        return self.end - self.start

    @property
    def resolved(self) -> bool:
        """False for a v2 continuation frame read without its context (E, K, layers unknown)."""
        return self.num_experts > 0

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the array this frame decodes to (``R·L·K`` ids of :func:`index_dtype`)."""
        if not self.resolved:
            raise FrameError("a continuation frame's size is unknown without its context")
        itemsize = index_dtype(self.num_experts).itemsize
        return self.num_rows * len(self.layer_ids) * self.topk * itemsize


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
    base: Context | None = None,
    block_rows: int | None = None,
    layer_groups: int | None = None,
    version: int = FORMAT_VERSION,
) -> bytes:
    """Validate routing ``[R, L, K]`` and encode it as one frame (format v2 by default).

    v2 (docs/format.md): the body is chunks of ``block_rows`` token rows (default
    2048) by ``layer_groups`` layer groups (default: up to 8 when the frame holds
    at least 65536 ids, else 1), each with its length and CRC in the header, so a
    token range or layer subset is cut without decoding (:func:`slice_frame`).  A
    frame carries its rollout context (E, K, layers, relabel table) unless
    ``base`` is given: then it is a *continuation* frame that names ``base`` by
    digest and codes with its table (a later segment of the same rollout).  A
    whole-segment frame carries its content digest.  ``version=1`` writes the old
    single-body format (for compatibility tests).

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
    if codec == "set":
        ranker(num_experts, k)  # raises CodecError (use raw) when C(E, K) needs > 128 bits
    srt = canonical_rows(arr, num_experts)  # validates every row
    if version == 2:
        whole = len(provenance) == 1 and (provenance[0].start, provenance[0].end) == (start, end)
        if segment is None and whole:
            segment, provenance = provenance[0], ()
        return _encode_v2(
            arr,
            srt,
            num_experts=num_experts,
            layers=layers,
            start=start,
            segment=segment,
            provenance=provenance,
            codec=codec,
            level=level,
            base=base,
            block_rows=block_rows,
            layer_groups=layer_groups,
        )
    if version != 1 or base is not None:
        raise UnsupportedFrameError(f"cannot write format version {version} (with base={base})")

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
    prefix = _PREFIX.pack(MAGIC, 1, CODECS[chosen], 0, len(packed), len(body))
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
    """v1 ``set-zstd``: one zstd frame of [relabel table] + gap planes over all rows."""
    relabel = srt.shape[0] >= e  # a popularity table pays for itself only with enough tokens
    order = _popularity(srt, e) if relabel else None
    table_bytes = b"" if order is None else order.tobytes()
    payload = table_bytes + _gap_payload(srt, e, k, None if order is None else _inverse(order))
    return {"relabel": relabel}, zstandard.ZstdCompressor(level=level).compress(payload)


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
def read_header(
    data: bytes | bytearray | memoryview, *, verify: bool = True, context: Context | None = None
) -> FrameHeader:
    """Parse and check a frame's prefix, header and (if ``verify``) CRC; body untouched.

    A v2 continuation frame is fully checked only against its ``context`` (the
    rollout's, named by ``header.base``); without it the header comes back
    unresolved (``num_experts == 0``, see :attr:`FrameHeader.resolved`).  Raises
    :class:`TruncatedFrameError`, :class:`ChecksumError`,
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
    if version not in (1, 2):
        raise UnsupportedFrameError(
            f"frame format version {version} is not supported (this library reads 1 and 2)"
        )
    if codec_id not in _CODEC_NAMES and not (version == 2 and codec_id == CONTEXT_CODEC):
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
    if version == 2:
        return _parse_v2(
            _unpack_map(raw, "frame header", allow_bin=True), codec_id, blen, total, context
        )
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
        segs = _provenance_field(hdr)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None
    if not 0 <= start < end:
        raise FrameError(f"frame token range [{start}, {end}) is empty or negative")
    if seg is not None and (seg.start, seg.end) != (start, end):
        raise FrameError("frame segment range differs from its token range")
    _check_provenance(seg, segs, start, end)
    params = hdr["params"]
    if not isinstance(params, dict):
        raise FrameError("header params must be a map")
    return FrameHeader(codec, e, k, layers, start, end, seg, segs, params, blen, total)


def _provenance_field(hdr: dict[Any, Any]) -> tuple[Segment, ...]:
    """The header's ``segments`` list (provenance), parsed; raises for a bad one."""
    prov = hdr.get("segments", [])
    if not isinstance(prov, list) or len(prov) > MAX_SEGMENTS:
        raise FrameError(f"header segments must be a list of at most {MAX_SEGMENTS}")
    return tuple(Segment.from_dict(p) for p in prov)


def _check_provenance(seg: Segment | None, segs: tuple[Segment, ...], start: int, end: int) -> None:
    """A frame is one segment or lists provenance, and provenance overlaps its rows."""
    if seg is not None and segs:
        raise FrameError("a frame carries either segment or segments, not both")
    if not all(p.overlaps(start, end) for p in segs):
        raise FrameError("a provenance segment does not overlap the frame's rows")


def _int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"header field {name} must be an int")
    return value


def decode_frame(
    data: bytes | bytearray | memoryview,
    *,
    context: Context | None = None,
    max_bytes: int = MAX_DECODED_BYTES,
) -> Frame:
    """Check and decode one frame.  Never returns wrong data: any inconsistency raises.

    A v2 continuation frame needs its rollout's ``context``.  Nothing larger than
    the size the header declares is ever allocated, and a frame declaring more
    than ``max_bytes`` of decoded ids is refused before anything is inflated.
    Raises a :class:`FrameError` subclass (see ``_exceptions``).
    """
    hdr = read_header(data, context=context)
    view = memoryview(data).cast("B")
    if hdr.version == 2:
        if hdr.codec == "context":
            raise FrameError("a context frame holds no routing rows")
        if not hdr.resolved:
            raise FrameError(
                f"continuation frame needs its rollout context {hdr.base[:12]}… to decode"
            )
        if hdr.context is not None and hdr.context.has_table and hdr.context.table is None:
            hdr = read_header(data, verify=False, context=Context.parse(hdr.context.raw))
        # Chunk CRCs too: a slice's outer CRC was computed by whoever cut it, so only the
        # chunk CRCs (the writer's) vouch for the bytes end to end.
        arr = _decode_v2(view, hdr, max_bytes, verify_chunks=True)
        arr.flags.writeable = False
        segs = hdr.segments if hdr.segment is None else (hdr.segment,)
        return Frame(hdr, Routing(arr, hdr.num_experts, hdr.layer_ids, hdr.start, segs))
    if (
        hdr.num_rows * len(hdr.layer_ids) * hdr.topk * index_dtype(hdr.num_experts).itemsize
        > max_bytes
    ):
        raise FrameError(f"frame decodes to more than this decoder's limit of {max_bytes} bytes")
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


def _check_decoded_size(rows: int, per_row: int, what: str) -> None:
    # Guard allocations against absurd declared sizes before touching numpy.
    if rows * per_row > (1 << 34):
        raise FrameError(f"{what}: frame declares {rows} rows, too many to decode")


def _raw_decode(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    dt = _raw_dtype(e)
    _check_decoded_size(shape[0], shape[1] * shape[2], "raw")
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
    _check_decoded_size(rows, nl, "set")
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
    _check_decoded_size(rows, nl * k, "set-zstd")
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
    gaps = _planes_to_gaps(payload, (nl, rows, k), gdt, offset=table_len)
    order = np.frombuffer(payload, dtype=tdt, count=nl * e).reshape(nl, e) if relabel else None
    return _gaps_to_ids(gaps, e, k, order, check_order=True)


# ---------------------------------------------------------------------------------------------
# format v2: declared sizes, chunked bodies, contexts and continuation frames
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, eq=False)
class Context:
    """What a rollout's segments share: E, K, MoE layer ids and the relabel table.

    ``raw`` is the exact msgpack bytes a frame carries as ``ctx``; ``digest`` (SHA-256
    hex of ``raw``) is how a continuation frame names it.  ``table`` is ``[L, E]``,
    ``order[l, rank] = expert``, or None.  :meth:`parse` with ``tables=False`` checks
    the table's declared size without inflating it (what the service does).
    """

    num_experts: int
    topk: int
    layer_ids: tuple[int, ...]
    table: npt.NDArray[Any] | None
    has_table: bool
    raw: bytes
    digest: str

    @classmethod
    def build(
        cls,
        num_experts: int,
        topk: int,
        layer_ids: Sequence[int],
        table: npt.NDArray[Any] | None = None,
        level: int = 3,
    ) -> Context:
        """Validate and serialise a context (the table, if any, zstd-compressed)."""
        check_params(num_experts, topk)
        layers = check_layer_ids(layer_ids)
        doc: dict[str, Any] = {"E": int(num_experts), "K": int(topk), "layers": list(layers)}
        if table is not None:
            table = np.ascontiguousarray(table, dtype=_raw_dtype(num_experts))
            if table.shape != (len(layers), num_experts):
                raise ShapeError(f"relabel table must be [L, E], got {table.shape}")
            doc["table"] = zstandard.ZstdCompressor(level=level).compress(table.tobytes())
        raw: bytes = msgpack.packb(doc, use_bin_type=True)
        return cls.parse(raw) if table is None else cls._from(raw, doc, table)

    @classmethod
    def _from(cls, raw: bytes, doc: dict[str, Any], table: npt.NDArray[Any] | None) -> Context:
        return cls(
            int(doc["E"]),
            int(doc["K"]),
            tuple(int(i) for i in doc["layers"]),
            table,
            "table" in doc,
            raw,
            hashlib.sha256(raw).hexdigest(),
        )

    @classmethod
    def parse(cls, raw: bytes, *, tables: bool = True) -> Context:
        """Check ``ctx`` bytes; inflate the table only when ``tables`` (bounded by its size)."""
        if len(raw) > MAX_HEADER:
            raise FrameError(f"context is {len(raw)} bytes; the limit is {MAX_HEADER}")
        doc = _unpack_map(bytes(raw), "context", allow_bin=True)
        keys = set(doc)
        if not {"E", "K", "layers"} <= keys <= {"E", "K", "layers", "table"}:
            raise FrameError(f"context keys {sorted(map(str, keys))} are not E, K, layers[, table]")
        try:
            e, k = _int(doc["E"], "E"), _int(doc["K"], "K")
            check_params(e, k)
            if not isinstance(doc["layers"], list):
                raise FrameError("context layers must be a list")
            layers = check_layer_ids(doc["layers"])
        except FormatError as exc:
            raise FrameError(f"invalid context: {exc}") from None
        table = None
        if "table" in doc:
            blob = doc["table"]
            if not isinstance(blob, bytes):
                raise FrameError("context table must be bin")
            entries = len(layers) * e
            if entries > MAX_TABLE_ENTRIES:
                raise FrameError(
                    f"a relabel table of {entries} entries exceeds {MAX_TABLE_ENTRIES}"
                )
            want = entries * _raw_dtype(e).itemsize
            payload = _inflate(blob, want, "context table", check_only=not tables)
            if payload is not None:
                table = np.frombuffer(payload, dtype=_raw_dtype(e)).reshape(len(layers), e)
                if not (np.sort(table, axis=1) == np.arange(e)).all():
                    raise CodecError("context relabel table is not a permutation")
        return cls._from(bytes(raw), doc, table)

    def to_rank(self, positions: Sequence[int]) -> npt.NDArray[Any]:
        """``[len(positions), E]`` inverse tables (expert -> rank) for these layer positions."""
        assert self.table is not None
        return _inverse(self.table[list(positions)])


def _unpack_map(raw: bytes, what: str, *, allow_bin: bool = False) -> dict[Any, Any]:
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_HEADER if allow_bin else 0,
            object_pairs_hook=_unique_map,
        )
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(doc, dict):
        raise FrameError(f"{what} must be a map")
    return doc


def _inflate(
    blob: bytes | memoryview, want: int, what: str, *, check_only: bool = False
) -> bytes | None:
    """One complete zstd frame declaring exactly ``want`` bytes, inflated to at most ``want``.

    The declared content size is checked before anything is allocated, and the
    output is capped at ``want`` whatever the frame claims, so a crafted frame
    cannot make a decoder allocate more than the header it was checked against.
    ``check_only`` stops after the declaration (no inflation).
    """
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: not a zstd frame: {exc}") from None
    if declared != want:
        raise CodecError(f"{what}: zstd frame declares {declared} bytes (-1 = unknown), not {want}")
    if check_only:
        return None
    try:
        dobj = zstandard.ZstdDecompressor().decompressobj()
        out = dobj.decompress(blob) if want else b""
        if want and (not dobj.eof or dobj.unused_data):
            raise CodecError(f"{what}: not exactly one complete zstd frame")
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: does not decompress: {exc}") from None
    if len(out) != want:
        raise CodecError(f"{what}: inflated to {len(out)} bytes, not {want}")
    return out


def content_digest(
    num_experts: int,
    layer_ids: Sequence[int],
    segment: Segment,
    rows: npt.NDArray[Any],
    *,
    canonical: bool = False,
) -> str:
    """SHA-256 over a segment's meta and its rows as *sets*: codec- and order-independent.

    What a v2 writer puts in the header (``digest``) and the store uses for
    idempotence and dedupe without decoding: two frames of the same rows under
    the same segment have the same digest whatever codec wrote them.
    """
    srt = rows if canonical else sort_rows(np.asarray(rows))
    h = hashlib.sha256()
    h.update(msgpack.packb([int(num_experts), [int(i) for i in layer_ids], segment.to_dict()]))
    # Hash the array's own buffer: no bytes copy, and hashlib releases the GIL over
    # it (a 16k-row rollout at 48x8 is 25 MB; .tobytes() held the GIL ~20 ms).
    h.update(np.ascontiguousarray(srt, dtype="<i4").data.cast("B"))
    return h.hexdigest()


def _plan(
    rows: int, nl: int, k: int, block_rows: int | None, groups: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rows per block and layers per group for an encoder (balanced layer groups)."""
    br = BLOCK_ROWS if block_rows is None else block_rows
    if br < 1:
        raise ShapeError("block_rows must be >= 1")
    ng = (
        (min(nl, LAYER_GROUPS) if rows * nl * k >= _MIN_GROUPED else 1)
        if groups is None
        else groups
    )
    if not 1 <= ng <= nl:
        raise ShapeError(f"layer_groups must be in [1, {nl}]")
    blocks = tuple(min(br, rows - a) for a in range(0, rows, br))
    per, extra = divmod(nl, ng)
    return blocks, tuple(per + (1 if g < extra else 0) for g in range(ng))


def _popularity(srt: npt.NDArray[Any], e: int) -> npt.NDArray[Any]:
    """``[L, E]`` order table: each layer's experts by descending count (ties by id)."""
    nl = srt.shape[1]
    counts = np.empty((nl, e), dtype=np.int64)
    for layer in range(nl):
        # One layer at a time: each bincount holds the GIL briefly (a single one over
        # 6M ids held it ~8 ms, stalling the event loop of an engine encoding in a
        # thread).  -1 rows shift to bin 0, which is dropped.
        ids = srt[:, layer, :].astype(np.intp).reshape(-1) + 1
        counts[layer] = np.bincount(ids, minlength=e + 1)[1 : e + 1]
    return np.argsort(-counts, axis=1, kind="stable").astype(_raw_dtype(e))


def _inverse(order: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Inverse relabel tables: ``order[l, rank] = expert`` -> ``to_rank[l, expert] = rank``."""
    inv = np.empty_like(order)
    np.put_along_axis(inv, order.astype(np.intp), np.arange(order.shape[1])[None, :], axis=1)
    return inv


def _gap_payload(srt: npt.NDArray[Any], e: int, k: int, to_rank: npt.NDArray[Any] | None) -> bytes:
    """Gap planes of canonical rows ``[rows, layers, K]``, layer-major, relabelled by
    ``to_rank`` (``[layers, E]``) when given; a -1 row is the impossible first gap."""
    # Work layer-major ([L, R, K], contiguous) in the narrow index dtype: every pass
    # below is memory-bound, so fewer bytes is faster.
    ids = np.ascontiguousarray(srt.transpose(1, 0, 2), dtype=index_dtype(e))
    empty = ids[..., 0] < 0
    if to_rank is not None:
        # Flat (layer, expert) indices; -1 rows go to one extra slot that maps to -1.
        nl = ids.shape[0]
        offset = (np.arange(nl, dtype=np.int64) * e)[:, None, None]
        flat = np.where(ids < 0, nl * e, ids + offset)
        lookup = np.append(to_rank.astype(ids.dtype).reshape(-1), ids.dtype.type(-1))
        ids = sort_rows(lookup.take(flat))
    gaps = np.empty_like(ids)
    gaps[..., 0] = ids[..., 0]
    np.subtract(ids[..., 1:], ids[..., :-1], out=gaps[..., 1:])
    gaps[..., 1:] -= 1
    gaps[empty] = 0
    gaps[..., 0][empty] = e - k + 1
    return _gap_planes(gaps, _gap_dtype(e, k))


def _zset_chunk(
    sub: npt.NDArray[Any], e: int, k: int, level: int, to_rank: npt.NDArray[Any] | None
) -> bytes:
    """One v2 set-zstd chunk: ``sub`` is ``[rows, layers, K]`` canonical (ascending) rows."""
    return zstandard.ZstdCompressor(level=level).compress(_gap_payload(sub, e, k, to_rank))


def _encode_chunk(
    codec: str,
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    e: int,
    k: int,
    level: int,
    to_rank: npt.NDArray[Any] | None,
) -> bytes:
    if codec == "raw":
        return _raw_encode(arr, e)[1]
    if codec == "set":
        return _set_encode(srt, e, k)[1]
    return _zset_chunk(srt, e, k, level, to_rank)


def _encode_v2(
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    *,
    num_experts: int,
    layers: tuple[int, ...],
    start: int,
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    codec: str,
    level: int,
    base: Context | None,
    block_rows: int | None,
    layer_groups: int | None,
) -> bytes:
    rows, nl, k = arr.shape
    e = num_experts
    if base is not None:
        if (base.num_experts, base.topk) != (e, k) or not set(layers) <= set(base.layer_ids):
            raise ShapeError(
                f"routing (E={e}, K={k}, layers={list(layers)}) does not fit the base context "
                f"(E={base.num_experts}, K={base.topk}, layers={list(base.layer_ids)})"
            )
        if base.has_table and base.table is None:
            raise ShapeError("a base context must be parsed with its table to encode against it")
    blocks, groups = _plan(rows, nl, k, block_rows, layer_groups)
    auto = codec == "auto"
    if auto:
        codec = "set-zstd" if _set_ok(e, k) else "raw"  # set-zstd vs set: a trial, below
    own: Context | None = None
    ctx = base
    if base is None:
        relabel_own = codec == "set-zstd" and rows >= e and nl * e <= MAX_TABLE_ENTRIES
        table = _popularity(srt, e) if relabel_own else None
        own = ctx = Context.build(e, k, layers, table)
    assert ctx is not None
    relabel = codec == "set-zstd" and ctx.table is not None
    ctx_pos = [ctx.layer_ids.index(lid) for lid in layers]
    to_rank = ctx.to_rank(ctx_pos) if relabel else None
    gbounds = list(itertools.accumulate(groups, initial=0))
    if auto and codec == "set-zstd" and _trial_says_set(srt, e, k, level, to_rank):
        codec, relabel, to_rank = "set", False, None
        if own is not None and own.has_table:  # set needs no table: do not ship one
            own = ctx = Context.build(e, k, layers)
    chunks: list[bytes] = []
    a = 0
    for br in blocks:
        for g in range(len(groups)):
            lo, hi = gbounds[g], gbounds[g + 1]
            sub_rank = None if to_rank is None else to_rank[lo:hi]
            chunks.append(
                _encode_chunk(
                    codec, arr[a : a + br, lo:hi], srt[a : a + br, lo:hi], e, k, level, sub_rank
                )
            )
        a += br
    header: dict[str, Any] = {"start": start, "end": start + rows}
    if own is not None:
        header["ctx"] = own.raw
    else:
        assert base is not None
        header["base"] = bytes.fromhex(base.digest)
        if layers != base.layer_ids:
            header["layers"] = list(layers)
    header["params"] = {"relabel": relabel} if codec == "set-zstd" else {}
    header["blocks"] = list(blocks)
    header["groups"] = list(groups)
    header["chunks"] = [[len(c), zlib.crc32(c)] for c in chunks]
    seg = segment if segment is not None else (None if provenance else Segment(start, start + rows))
    if seg is not None:
        header["segment"] = _segment_fields(seg)
        header["digest"] = bytes.fromhex(content_digest(e, layers, seg, srt, canonical=True))
    else:
        if len(provenance) > MAX_SEGMENTS or not all(
            p.overlaps(start, start + rows) for p in provenance
        ):
            raise ShapeError(
                f"segments must overlap the rows [{start}, {start + rows}) "
                f"and number at most {MAX_SEGMENTS}"
            )
        header["segments"] = [p.to_dict() for p in provenance]
    return _assemble_frame(2, CODECS[codec], header, chunks)


_SEGMENT_TEXT = ("model_id", "weight_version", "tokens_digest")


def _segment_fields(seg: Segment) -> dict[str, str]:
    """A v2 ``segment`` map: the non-empty text fields (its rows are the frame's)."""
    return {name: getattr(seg, name) for name in _SEGMENT_TEXT if getattr(seg, name)}


def _trial_says_set(
    srt: npt.NDArray[Any], e: int, k: int, level: int, to_rank: npt.NDArray[Any] | None
) -> bool:
    """``auto``'s choice: True when a set-zstd trial is no smaller than ``set``'s fixed width."""
    rows, nl, _ = srt.shape
    trial_rows = min(rows, max(1, _TRIAL_ROWS // nl))
    body = _zset_chunk(srt[:trial_rows], e, k, level, to_rank)
    return bool(len(body) >= trial_rows * nl * ranker(e, k).bits / 8)


def _assemble_frame(
    version: int, codec_id: int, header: dict[str, Any], body: Sequence[bytes]
) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER:
        raise ShapeError(f"frame header would be {len(packed)} bytes; the limit is {MAX_HEADER}")
    blen = sum(len(b) for b in body)
    prefix = _PREFIX.pack(MAGIC, version, codec_id, 0, len(packed), blen)
    crc = zlib.crc32(packed, zlib.crc32(prefix))
    for b in body:
        crc = zlib.crc32(b, crc)
    return b"".join((prefix, packed, *body, _CRC.pack(crc)))


def encode_context(context: Context) -> bytes:
    """A context frame: the rollout context continuation frames name, with no rows."""
    return _assemble_frame(2, CONTEXT_CODEC, {"ctx": context.raw}, ())


_V2_KEYS = {"start", "end", "params", "ctx", "base", "layers", "blocks", "groups", "chunks"}
_V2_OPTIONAL = {"segment", "segments", "digest"}


def _parse_v2(
    hdr: dict[Any, Any], codec_id: int, blen: int, total: int, context: Context | None
) -> FrameHeader:
    if codec_id == CONTEXT_CODEC:
        if set(hdr) != {"ctx"} or blen:
            raise FrameError("a context frame has exactly the header key ctx and no body")
        own = _ctx_field(hdr["ctx"])
        return FrameHeader(
            "context",
            own.num_experts,
            own.topk,
            own.layer_ids,
            0,
            0,
            None,
            (),
            {},
            0,
            total,
            version=2,
            context=own,
        )
    keys = set(hdr)
    required = {"start", "end", "params", "blocks", "groups", "chunks"}
    if not required <= keys or not keys <= _V2_KEYS | _V2_OPTIONAL:
        raise FrameError(f"frame header keys {sorted(map(str, keys))} are not a v2 header's")
    if ("ctx" in keys) == ("base" in keys):
        raise FrameError("a v2 frame carries exactly one of ctx (its context) or base")
    codec = _CODEC_NAMES[codec_id]
    try:
        start, end = _int(hdr["start"], "start"), _int(hdr["end"], "end")
        seg = None
        if "segment" in hdr:
            fields = hdr["segment"]
            if not isinstance(fields, dict) or not set(fields) <= set(_SEGMENT_TEXT):
                raise FrameError(f"a v2 segment is a map of some of {list(_SEGMENT_TEXT)}")
            seg = Segment(start, end, **fields) if end > start else None
        segs = _provenance_field(hdr)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None
    if not 0 <= start < end:
        raise FrameError(f"frame token range [{start}, {end}) is empty or negative")
    if end > 2**40:
        raise FrameError(f"frame end {end} is implausibly large")
    _check_provenance(seg, segs, start, end)  # (a v2 segment's rows are the frame's)
    digest = _sha_field(hdr.get("digest", b""), "digest")
    if digest and (seg is None or (seg.start, seg.end) != (start, end)):
        raise FrameError("a content digest belongs to a whole segment frame")
    base = ""
    ctx: Context | None
    if "ctx" in hdr:
        ctx = _ctx_field(hdr["ctx"])
        if context is not None:
            if context.digest != ctx.digest:
                raise FrameError("frame carries a different context than the one given")
            ctx = context  # the caller's copy may hold the inflated table
    else:
        base = _sha_field(hdr["base"], "base")
        if not base:
            raise FrameError("header base must name a context (its 32-byte SHA-256)")
        if context is not None and context.digest != base:
            raise FrameError(f"frame needs context {base[:12]}…, not {context.digest[:12]}…")
        ctx = context
    layers_field = hdr.get("layers")
    if layers_field is not None:
        if not isinstance(layers_field, list):
            raise FrameError("header layers must be a list")
        try:
            layer_subset: tuple[int, ...] | None = check_layer_ids(layers_field)
        except FormatError as exc:
            raise FrameError(f"invalid frame header: {exc}") from None
    else:
        layer_subset = None
    blocks, groups = _int_list(hdr["blocks"], "blocks"), _int_list(hdr["groups"], "groups")
    chunks_field = hdr["chunks"]
    if not isinstance(chunks_field, list) or len(chunks_field) != len(blocks) * len(groups):
        raise FrameError("header chunks must list one [length, crc32] per block and group")
    chunks = []
    for c in chunks_field:
        if not (isinstance(c, list) and len(c) == 2):
            raise FrameError("each chunk entry is [length, crc32]")
        length, crc = _int(c[0], "chunk length"), _int(c[1], "chunk crc32")
        if length < 0 or not 0 <= crc < 1 << 32:
            raise FrameError("chunk length or crc32 out of range")
        chunks.append((length, crc))
    if sum(blocks) != end - start:
        raise FrameError(f"blocks cover {sum(blocks)} rows; the frame holds {end - start}")
    if sum(c[0] for c in chunks) != blen:
        raise FrameError("chunk lengths do not add up to the body length")
    params = hdr["params"]
    if not isinstance(params, dict):
        raise FrameError("header params must be a map")
    _expect_params(params, {"relabel"} if codec == "set-zstd" else set())
    if codec == "set-zstd" and not isinstance(params["relabel"], bool):
        raise FrameError("set-zstd param relabel must be a bool")
    out = FrameHeader(
        codec,
        0,
        0,
        layer_subset or (),
        start,
        end,
        seg,
        segs,
        params,
        blen,
        total,
        version=2,
        context=ctx,
        base=base,
        digest=digest,
        blocks=blocks,
        groups=groups,
        chunks=tuple(chunks),
    )
    return out if ctx is None else _resolve(out, ctx, layer_subset)


def _resolve(hdr: FrameHeader, ctx: Context, subset: tuple[int, ...] | None) -> FrameHeader:
    """Check a v2 header against its context: layers, groups, relabel, declared sizes."""
    layers = ctx.layer_ids if subset is None else subset
    if subset is not None and not set(subset) <= set(ctx.layer_ids):
        raise FrameError(f"frame layers {list(subset)} are not all layers of its context")
    if sum(hdr.groups) != len(layers):
        raise FrameError(f"groups cover {sum(hdr.groups)} layers; the frame holds {len(layers)}")
    if hdr.codec == "set-zstd" and hdr.params["relabel"] and not ctx.has_table:
        raise FrameError("frame asks for relabel but its context has no table")
    e, k = ctx.num_experts, ctx.topk
    if hdr.codec == "set" and not _set_ok(e, k):
        raise FrameError(f"codec set cannot code E={e}, K={k}")
    if hdr.num_rows * len(layers) * k > (1 << 40):
        raise FrameError(f"frame declares {hdr.num_rows} rows, too many to decode")
    for (br, lg), (length, _) in zip(
        itertools.product(hdr.blocks, hdr.groups), hdr.chunks, strict=True
    ):
        want = _chunk_body_size(hdr.codec, br, lg, e, k)
        if want is not None and length != want:
            raise FrameError(f"a {hdr.codec} chunk of {br}x{lg} rows is {length} bytes, not {want}")
    return FrameHeader(
        hdr.codec,
        e,
        k,
        layers,
        hdr.start,
        hdr.end,
        hdr.segment,
        hdr.segments,
        hdr.params,
        hdr.body_length,
        hdr.frame_length,
        version=2,
        context=ctx,
        base=hdr.base,
        digest=hdr.digest,
        blocks=hdr.blocks,
        groups=hdr.groups,
        chunks=hdr.chunks,
    )


def _set_ok(e: int, k: int) -> bool:
    try:
        ranker(e, k)
    except CodecError:
        return False
    return True


def _chunk_body_size(codec: str, rows: int, nl: int, e: int, k: int) -> int | None:
    """Exact body bytes of a raw or set chunk; None for set-zstd (compressed)."""
    if codec == "raw":
        return rows * nl * k * _raw_dtype(e).itemsize
    if codec == "set":
        n, bits = rows * nl, ranker(e, k).bits
        return n * 8 + -(-n * (bits - 64) // 8) if bits > 64 else -(-n * bits // 8)
    return None


def _zchunk_payload(rows: int, nl: int, e: int, k: int) -> int:
    return rows * nl * k * _gap_dtype(e, k).itemsize


def _ctx_field(value: object, *, tables: bool = False) -> Context:
    if not isinstance(value, bytes):
        raise FrameError("header ctx must be bin (the context's msgpack bytes)")
    return Context.parse(value, tables=tables)


def _int_list(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or len(value) > 1 << 20:
        raise FrameError(f"header {name} must be a non-empty list")
    out = tuple(_int(v, name) for v in value)
    if min(out) < 1:
        raise FrameError(f"header {name} entries must be >= 1")
    return out


def _sha_field(value: object, name: str) -> str:
    """A 32-byte SHA-256 header field as lowercase hex ("" when absent/empty)."""
    if not isinstance(value, bytes) or len(value) not in (0, 32):
        raise FrameError(f"header {name} must be a 32-byte SHA-256 (bin)")
    return value.hex()


def check_chunks(data: bytes | bytearray | memoryview, hdr: FrameHeader) -> None:
    """What the service checks of a v2 body without decoding it: each set-zstd chunk's
    zstd frame declares exactly the payload its shape allows (bombs refused at PUT)."""
    if hdr.version != 2 or hdr.codec != "set-zstd":
        return
    view = memoryview(data).cast("B")
    at = hdr.frame_length - _CRC.size - hdr.body_length
    for (br, lg), (length, _) in zip(
        itertools.product(hdr.blocks, hdr.groups), hdr.chunks, strict=True
    ):
        _inflate(
            view[at : at + length],
            _zchunk_payload(br, lg, hdr.num_experts, hdr.topk),
            "set-zstd chunk",
            check_only=True,
        )
        at += length


def _decode_v2(
    view: memoryview, hdr: FrameHeader, max_bytes: int, verify_chunks: bool
) -> npt.NDArray[Any]:
    assert hdr.context is not None
    ctx = hdr.context
    e, k, nl = hdr.num_experts, hdr.topk, len(hdr.layer_ids)
    if hdr.decoded_bytes > max_bytes:
        raise FrameError(
            f"frame decodes to {hdr.decoded_bytes} bytes; this decoder's limit is {max_bytes}"
        )
    relabel = hdr.codec == "set-zstd" and bool(hdr.params["relabel"])
    if relabel and ctx.table is None:
        raise FrameError("frame needs its context's relabel table: parse the context with tables")
    ctx_pos = [ctx.layer_ids.index(lid) for lid in hdr.layer_ids]
    out = np.empty((hdr.num_rows, nl, k), dtype=index_dtype(e))
    gbounds = list(itertools.accumulate(hdr.groups, initial=0))
    at = hdr.frame_length - _CRC.size - hdr.body_length
    r0, i = 0, 0
    for br in hdr.blocks:
        for g in range(len(hdr.groups)):
            length, crc = hdr.chunks[i]
            i += 1
            chunk = view[at : at + length]
            at += length
            if verify_chunks and zlib.crc32(chunk) != crc:
                raise ChecksumError("chunk checksum mismatch: the bytes were corrupted")
            lo, hi = gbounds[g], gbounds[g + 1]
            shape = (br, hi - lo, k)
            if hdr.codec == "raw":
                sub = _raw_decode(chunk, shape, e)
            elif hdr.codec == "set":
                sub = _set_decode(chunk, shape, e)
            else:
                order = ctx.table[ctx_pos[lo:hi]] if relabel else None  # type: ignore[index]
                sub = _zchunk_decode(chunk, shape, e, order)
            out[r0 : r0 + br, lo:hi] = sub
        r0 += br
    return out


def _zchunk_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, order: npt.NDArray[Any] | None
) -> npt.NDArray[Any]:
    rows, nl, k = shape
    gdt = _gap_dtype(e, k)
    n = rows * nl * k
    payload = _inflate(body, n * gdt.itemsize, "set-zstd chunk")
    assert payload is not None
    return _gaps_to_ids(_planes_to_gaps(payload, (nl, rows, k), gdt), e, k, order)


def _planes_to_gaps(
    payload: bytes, shape: tuple[int, int, int], gdt: np.dtype[Any], *, offset: int = 0
) -> npt.NDArray[Any]:
    """Inverse of :func:`_gap_planes`: gaps ``shape`` (layer-major) from ``payload[offset:]``."""
    if gdt.itemsize == 1:
        return np.frombuffer(payload, dtype=np.uint8, offset=offset).reshape(shape)
    n = shape[0] * shape[1] * shape[2]
    planes = np.frombuffer(payload, dtype=np.uint8, offset=offset)
    wide = planes[:n].astype(np.uint16)
    wide |= planes[n:].astype(np.uint16) << 8
    return wide.reshape(shape)


def _gaps_to_ids(
    gaps: npt.NDArray[Any],
    e: int,
    k: int,
    order: npt.NDArray[Any] | None,
    *,
    check_order: bool = False,
) -> npt.NDArray[Any]:
    """Layer-major gaps ``[L, R, K]`` to token-major ids ``[R, L, K]`` (checks every rule).

    ``order`` is the ``[L, E]`` relabel table (rank -> expert), or None; with
    ``check_order`` it is checked to be a permutation first (a v1 body carries its
    own; a v2 context's was checked when it was parsed).
    """
    nl = gaps.shape[0]
    empty = gaps[..., 0] == e - k + 1
    if empty.any() and gaps[empty][:, 1:].any():
        raise CodecError("set-zstd body has a malformed empty-row marker")
    if gaps.max(initial=0) > e - k + 1:
        raise CodecError("set-zstd gap larger than the expert count allows: body is corrupt")
    # ids = cumsum(gap + 1) - 1 along K, column by column, in the narrow index dtype
    # unless K gaps of up to E-K+1 could overflow it.
    dt = index_dtype(e) if k * (e - k + 2) < np.iinfo(np.int16).max else np.dtype(np.int32)
    ids = np.empty(gaps.shape, dtype=dt)
    ids[..., 0] = gaps[..., 0]
    for j in range(1, k):
        np.add(ids[..., j - 1], gaps[..., j], out=ids[..., j], dtype=dt)
        ids[..., j] += 1
    ids[empty] = 0
    if ids[..., -1].max(initial=0) >= e:
        raise CodecError("set-zstd gaps run past the expert count: body is corrupt")
    if order is not None:
        if check_order and not (np.sort(order, axis=1) == np.arange(e)).all():
            raise CodecError("set-zstd relabel table is not a permutation")
        offset = (np.arange(nl, dtype=np.int32) * e)[:, None, None]
        ids = order.astype(dt).reshape(-1).take(ids + offset)
    ids[empty] = -1
    return np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=index_dtype(e))


def slice_frame(
    data: bytes | bytearray | memoryview,
    *,
    start: int | None = None,
    end: int | None = None,
    layers: Sequence[int] | None = None,
    context: Context | None = None,
) -> bytes:
    """Cut a v2 frame down to the blocks and layer groups that cover a range: no decoding.

    The result is a v2 frame whose rows are the blocks overlapping ``[start, end)``
    and whose layers are the groups holding any of ``layers`` (absolute ids); the
    reader trims to the exact range.  Chunk bytes are copied unchanged (their
    CRCs travel in the header); the segment becomes provenance.  A continuation
    frame without a ``layers`` field needs ``context`` to slice by layer.
    """
    hdr = read_header(data, verify=False, context=context)
    if hdr.version != 2 or hdr.codec == "context":
        raise UnsupportedFrameError("only v2 routing frames can be sliced")
    lo = hdr.start if start is None else max(start, hdr.start)
    hi = hdr.end if end is None else min(end, hdr.end)
    if lo >= hi:
        raise ShapeError(f"range [{start}, {end}) does not overlap the frame's rows")
    bstarts = list(itertools.accumulate(hdr.blocks, initial=hdr.start))
    keep_b = [i for i in range(len(hdr.blocks)) if bstarts[i] < hi and lo < bstarts[i + 1]]
    layer_ids = hdr.layer_ids
    if layers is not None and not layer_ids:
        raise FrameError("slicing a continuation frame by layer needs its context")
    gbounds = list(itertools.accumulate(hdr.groups, initial=0))
    if layers is None:
        keep_g = list(range(len(hdr.groups)))
    else:
        pos = set(layer_positions(layer_ids, layers))
        keep_g = [g for g in range(len(hdr.groups)) if pos & set(range(gbounds[g], gbounds[g + 1]))]
    if len(keep_b) == len(hdr.blocks) and len(keep_g) == len(hdr.groups):
        return bytes(data)
    view = memoryview(data).cast("B")
    at = hdr.frame_length - _CRC.size - hdr.body_length
    offsets = list(itertools.accumulate((c[0] for c in hdr.chunks), initial=at))
    ng = len(hdr.groups)
    idx = [b * ng + g for b in keep_b for g in keep_g]
    body = [bytes(view[offsets[i] : offsets[i] + hdr.chunks[i][0]]) for i in idx]
    header: dict[str, Any] = {
        "start": bstarts[keep_b[0]],
        "end": bstarts[keep_b[-1] + 1],
    }
    if hdr.base:
        header["base"] = bytes.fromhex(hdr.base)
    else:
        assert hdr.context is not None
        header["ctx"] = hdr.context.raw
    if layers is not None or _explicit_layers(hdr):
        header["layers"] = [lid for g in keep_g for lid in layer_ids[gbounds[g] : gbounds[g + 1]]]
    header["params"] = hdr.params
    header["blocks"] = [hdr.blocks[b] for b in keep_b]
    header["groups"] = [hdr.groups[g] for g in keep_g]
    header["chunks"] = [list(hdr.chunks[i]) for i in idx]
    prov = (hdr.segment,) if hdr.segment is not None else hdr.segments
    kept = [p for p in prov if p.overlaps(header["start"], header["end"])]
    if kept:
        header["segments"] = [p.to_dict() for p in kept]
    return _assemble_frame(2, CODECS[hdr.codec], header, body)


def _explicit_layers(hdr: FrameHeader) -> bool:
    """Whether a v2 header names its layers (a subset of its context's) rather than all."""
    if hdr.context is None:  # an unresolved continuation knows only an explicit subset
        return bool(hdr.layer_ids)
    return hdr.layer_ids != hdr.context.layer_ids


def split_frames(data: bytes | bytearray | memoryview) -> list[memoryview]:
    """The frames of a concatenation of frames (what a v2 read returns), without checking them."""
    view = memoryview(data).cast("B")
    out, at = [], 0
    while at < len(view):
        if len(view) - at < _PREFIX.size + _CRC.size:
            raise TruncatedFrameError(f"{len(view) - at} trailing bytes are not a frame")
        _, _, _, _, hlen, blen = _PREFIX.unpack_from(view, at)
        total = _PREFIX.size + hlen + blen + _CRC.size
        if hlen > MAX_HEADER or at + total > len(view):
            raise TruncatedFrameError("a frame runs past the end of the data")
        out.append(view[at : at + total])
        at += total
    return out


def decode_rollout(
    data: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview],
    *,
    start: int = 0,
    end: int | None = None,
    layers: Sequence[int] | None = None,
    rollout_id: str = "",
    max_bytes: int = MAX_DECODED_BYTES,
) -> Routing:
    """Decode what a read returns (context frames + segment frames or slices) into one Routing.

    The one implementation of stitching: segments are placed by their rows, rows
    no segment covers are ``-1``, frames that overlap are an error, and the
    result is trimmed to ``[start, end)`` (``end`` defaults to the last row held)
    and to the absolute MoE ``layers``.  ``data`` is the read's bytes, or a list of
    pieces each holding whole frames (what :meth:`DirectReader.fetch_many` yields).
    The output's size is checked against ``max_bytes`` before it is allocated.  A
    frame that fails to decode raises a :class:`FrameError` naming the rollout and
    the segment.
    """
    who = f"rollout {rollout_id}" if rollout_id else "rollout"
    contexts: dict[str, Context] = {}
    heads: list[tuple[memoryview, FrameHeader]] = []
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    for view in (v for piece in pieces for v in split_frames(piece)):
        hdr = read_header(view, verify=True)
        if hdr.codec == "context" or (hdr.context is not None and not hdr.base):
            # A context frame, or a frame carrying its own context (which continuation
            # frames of the read may name): its table inflated once, for every frame.
            assert hdr.context is not None
            if hdr.context.digest not in contexts:
                contexts[hdr.context.digest] = Context.parse(hdr.context.raw)
        if hdr.codec != "context":
            heads.append((view, hdr))
    if not heads:
        # A range that falls wholly in a gap between segments: the read carries only
        # the rollout's context, and every row is -1.
        if end is None or not contexts:
            raise FrameError(f"{who}: the read returned no routing frames")
        ctx = next(iter(contexts.values()))
        want = ctx.layer_ids if layers is None else tuple(int(x) for x in layers)
        kept = tuple(ctx.layer_ids[p] for p in layer_positions(ctx.layer_ids, want))
        if not 0 <= start < end:
            raise ShapeError(f"token range [{start}, {end}) is empty or negative")
        nbytes = (end - start) * len(kept) * ctx.topk * index_dtype(ctx.num_experts).itemsize
        if nbytes > max_bytes:
            raise FrameError(f"{who}: rows [{start}, {end}) decode to {nbytes} bytes")
        empty = np.full((end - start, len(kept), ctx.topk), -1, index_dtype(ctx.num_experts))
        empty.flags.writeable = False
        return Routing(empty, ctx.num_experts, kept, start, ())
    decoded = []
    for view, hdr in heads:
        where = f"{who}, segment [{hdr.start}, {hdr.end})"
        try:
            own = hdr.context.digest if hdr.context is not None and not hdr.base else ""
            needed = contexts.get(hdr.base or own)
            if hdr.base and needed is None:
                raise FrameError(f"its context {hdr.base[:12]}… is missing from the read")
            frame = decode_frame(view, context=needed, max_bytes=max_bytes)
        except FrameError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        decoded.append(frame)
    decoded.sort(key=lambda f: f.header.start)
    first = decoded[0].routing
    e, k = first.num_experts, first.topk
    for f, g in itertools.pairwise(decoded):
        if g.header.start < f.header.end:
            raise FrameError(
                f"{who}: segments [{f.header.start}, {f.header.end}) and "
                f"[{g.header.start}, {g.header.end}) overlap"
            )
    all_layers = sorted({lid for f in decoded for lid in f.routing.layer_ids})
    if any((f.routing.num_experts, f.routing.topk) != (e, k) for f in decoded):
        raise FrameError(f"{who}: its frames disagree on E or K")
    want = tuple(all_layers) if layers is None else tuple(int(x) for x in layers)
    pos_all = layer_positions(all_layers, want)  # raises ShapeError for unknown layers
    kept = tuple(all_layers[p] for p in pos_all)
    # The reader asked for [start, end) and the service checked it against the stored
    # rows; rows past the last frame returned are a gap (-1).  Without an end, the
    # read ends where the last segment does.
    hi = decoded[-1].header.end if end is None else end
    if not 0 <= start < hi:
        raise ShapeError(f"token range [{start}, {hi}) is empty or outside {who}'s rows")
    nbytes = (hi - start) * len(kept) * k * index_dtype(e).itemsize
    if nbytes > max_bytes:
        raise FrameError(f"{who}: rows [{start}, {hi}) decode to {nbytes} bytes, over {max_bytes}")
    out = np.full((hi - start, len(kept), k), -1, dtype=index_dtype(e))
    segs: list[Segment] = []
    for f in decoded:
        a, b = max(start, f.header.start), min(hi, f.header.end)
        segs.extend(f.routing.segments or (Segment(f.header.start, f.header.end),))
        if a >= b:
            continue
        have = f.routing.layer_ids
        missing = [lid for lid in kept if lid not in have]
        if missing:
            raise FrameError(
                f"{who}: segment [{f.header.start}, {f.header.end}) lacks layers {missing}"
            )
        cols = layer_positions(have, kept)
        out[a - start : b - start] = f.routing.indices[a - f.header.start : b - f.header.start][
            :, cols
        ]
    out.flags.writeable = False
    uniq = tuple(dict.fromkeys(s for s in segs if s.overlaps(start, hi)))
    return Routing(out, e, kept, start, uniq)
