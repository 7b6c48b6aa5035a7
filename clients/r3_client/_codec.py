"""The routing frame's entry points: encode, read the header, decode (spec: docs/format.md).

With ``_frame``, ``_codec_gaps``, ``_codec_v1``, ``_codec_v2``, ``_codec_v2_read`` and
``_codec_rollout`` this is the only code that knows the bytes.

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

import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from r3_client._codec_v1 import (
    _auto_encode,
    _encode_body,
    _raw_decode,
    _set_decode,
    _zset_decode,
)
from r3_client._codec_v2 import (
    Context,
    _encode_v2,
    content_digest,
    encode_context,
)
from r3_client._codec_v2_read import (
    _decode_v2,
    _parse_v2,
)
from r3_client._exceptions import (
    ChecksumError,
    FormatError,
    FrameError,
    ShapeError,
    TruncatedFrameError,
    UnsupportedFrameError,
)
from r3_client._frame import (
    _CODEC_NAMES,
    _CRC,
    _PREFIX,
    CODECS,
    CONTEXT_CODEC,
    FORMAT_VERSION,
    MAGIC,
    MAX_DECODED_BYTES,
    MAX_HEADER,
    CodecName,
    Frame,
    FrameHeader,
    _check_provenance,
    _expect_params,
    _int,
    _provenance_field,
    _unique_map,
    _unpack_map,
    provenance_field,
)
from r3_client._routing import (
    Routing,
    Segment,
    canonical_rows,
    check_layer_ids,
    check_params,
    index_dtype,
)
from r3_client._setrank import ranker

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
    "encode_context",
    "encode_frame",
    "read_header",
]


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
    arr, num_experts, layer_ids, start, provenance = _unpack_routing(
        indices, num_experts, layer_ids, start, segment
    )
    rows, nl, k = arr.shape
    check_params(num_experts, k)
    layers = check_layer_ids(layer_ids)
    if nl != len(layers):
        raise ShapeError(f"routing has {nl} layers but {len(layers)} layer_ids")
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
    whole = len(provenance) == 1 and (provenance[0].start, provenance[0].end) == (start, end)
    if segment is None and whole:  # one stored segment covering the rows is the segment
        segment, provenance = provenance[0], ()
    if version == 2:
        return _encode_v2(
            arr, srt, num_experts=num_experts, layers=layers, start=start, segment=segment,
            provenance=provenance, codec=codec, level=level, base=base, block_rows=block_rows,
            layer_groups=layer_groups,
        )  # fmt: skip
    if version != 1 or base is not None:
        raise UnsupportedFrameError(f"cannot write format version {version} (with base={base})")
    return _encode_v1(arr, srt, num_experts, layers, start, segment, provenance, codec, level)


def _unpack_routing(
    indices: npt.ArrayLike | Routing,
    num_experts: int | None,
    layer_ids: Sequence[int] | None,
    start: int | None,
    segment: Segment | None,
) -> tuple[npt.NDArray[Any], int, Sequence[int], int, tuple[Segment, ...]]:
    """``(array, E, layer ids, start, provenance)`` from a Routing or a bare array."""
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
    if arr.shape[0] < 1:
        raise ShapeError("routing must hold at least one token row")
    if not isinstance(start, int) or start < 0:
        raise ShapeError(f"start must be a non-negative int, got {start!r}")
    return arr, num_experts, layer_ids, start, provenance


def _encode_v1(
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    num_experts: int,
    layers: tuple[int, ...],
    start: int,
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    codec: CodecName,
    level: int,
) -> bytes:
    """A format v1 frame: one body, the header listing the segment or the provenance."""
    k = arr.shape[2]
    end = start + arr.shape[0]
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
    if segment is not None:
        header["segment"] = segment.to_dict()
    elif provenance:
        header["segments"] = provenance_field(provenance, start, end)
    packed = msgpack.packb(header, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, 1, CODECS[chosen], 0, len(packed), len(body))
    crc = zlib.crc32(body, zlib.crc32(packed, zlib.crc32(prefix)))
    return b"".join((prefix, packed, body, _CRC.pack(crc)))


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
