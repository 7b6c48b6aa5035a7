"""One frame, any version: :func:`encode_frame`, :func:`read_header`, :func:`decode_frame`.

They check what is common to every version (arguments, the prefix, the CRC, the size
limit) and hand the rest to :mod:`~r3_client.codec.v1`, :mod:`~r3_client.codec.v2_write`
or :mod:`~r3_client.codec.v2_read`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from r3_client._exceptions import (
    ChecksumError,
    FrameError,
    ShapeError,
    TruncatedFrameError,
    UnsupportedFrameError,
)
from r3_client._routing import (
    Routing,
    Segment,
    canonical_rows,
    check_layer_ids,
    check_params,
    index_dtype,
)
from r3_client.codec.frame import (
    CHUNKED_VERSIONS,
    CODEC_NAMES,
    CODECS,
    CONTEXT_CODEC,
    CRC,
    FORMAT_VERSION,
    MAGIC,
    MAX_DECODED_BYTES,
    MAX_HEADER,
    PREFIX,
    CodecName,
    frame_crc,
    unique_map,
    unpack_map,
)
from r3_client.codec.header import Context, Frame, FrameHeader
from r3_client.codec.setrank import ranker
from r3_client.codec.v1 import decode_v1, encode_v1, parse_v1
from r3_client.codec.v2_read import decode_v2, parse_v2
from r3_client.codec.v2_write import encode_v2

__all__ = ["decode_frame", "encode_frame", "read_header"]


def encode_frame(
    indices: npt.ArrayLike | Routing,
    *,
    num_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
    start: int | None = None,
    segment: Segment | None = None,
    codec: CodecName = "auto",
    level: int | None = None,
    base: Context | None = None,
    block_rows: int | None = None,
    layer_groups: int | None = None,
    version: int = FORMAT_VERSION,
) -> bytes:
    """Validate routing ``[R, L, K]`` and encode it as one frame (format v3 by default).

    v3 is v2's layout with CRC-32C checksums and a BLAKE3 content digest (docs/format.md
    section 18); ``version=2`` writes v2 for readers that predate v3.
    v2 and v3 (docs/format.md): the body is chunks of ``block_rows`` token rows (default
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
    ``level`` is the zstd level of the ``set-zstd`` stage; None (the default) is level 3
    in v1 and v2, and in v3 the tuned fast setting for relabelled gaps and level 3 for
    plain ones (docs/format.md 18.3).  Raises a
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
    if version in CHUNKED_VERSIONS:
        return encode_v2(
            arr, srt, num_experts=num_experts, layers=layers, start=start, segment=segment,
            provenance=provenance, codec=codec, level=level, base=base, block_rows=block_rows,
            layer_groups=layer_groups, version=version,
        )  # fmt: skip
    if version != 1 or base is not None:
        raise UnsupportedFrameError(f"cannot write format version {version} (with base={base})")
    v1_level = 3 if level is None else level
    return encode_v1(arr, srt, num_experts, layers, start, segment, provenance, codec, v1_level)


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


def read_header(
    data: bytes | bytearray | memoryview,
    *,
    verify: bool = True,
    context: Context | None = None,
    head: bool = False,
) -> FrameHeader:
    """Parse and check a frame's prefix, header and (if ``verify``) CRC; body untouched.

    ``head``: ``data`` is a v3 frame's *head* only (prefix, header and trailer: what a
    chunked store keeps in place of the frame, see :func:`frame_head`); the header
    describes the whole frame (its ``frame_length`` is the frame's, not ``len(data)``).

    A v2 continuation frame is fully checked only against its ``context`` (the
    rollout's, named by ``header.base``); without it the header comes back
    unresolved (``num_experts == 0``, see :attr:`FrameHeader.resolved`).  Raises
    :class:`TruncatedFrameError`, :class:`ChecksumError`,
    :class:`UnsupportedFrameError` or :class:`FrameError` with the reason.
    """
    view = memoryview(data).cast("B")
    if len(view) < PREFIX.size + CRC.size:
        raise TruncatedFrameError(
            f"frame is {len(view)} bytes; the smallest frame is {PREFIX.size + CRC.size}"
        )
    magic, version, codec_id, reserved, hlen, blen = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise UnsupportedFrameError(f"not a routing frame: magic {bytes(magic)!r} != {MAGIC!r}")
    if version not in (1, *CHUNKED_VERSIONS):
        raise UnsupportedFrameError(
            f"frame format version {version} is not supported (this library reads 1, 2 and 3)"
        )
    if codec_id not in CODEC_NAMES and not (version == 2 and codec_id == CONTEXT_CODEC):
        raise UnsupportedFrameError(f"unknown codec id {codec_id}")
    if reserved:
        raise FrameError("reserved prefix bits are set")
    if hlen > MAX_HEADER:
        raise FrameError(f"header length {hlen} exceeds {MAX_HEADER}")
    total = PREFIX.size + hlen + blen + CRC.size
    span = PREFIX.size + hlen + CRC.size if head else total
    if head and version < 3:
        raise UnsupportedFrameError(
            f"only a version 3 frame's head stands alone (its trailer covers the header "
            f"only); this is version {version}"
        )
    if len(view) != span:
        kind = TruncatedFrameError if len(view) < span else FrameError
        what = "frame head" if head else "frame"
        raise kind(f"{what} is {len(view)} bytes but declares {span}")
    if verify:
        (want,) = CRC.unpack_from(view, span - CRC.size)
        if frame_crc(version, view, hlen, total) != want:
            what = "frame header" if version >= 3 else "frame"
            raise ChecksumError(f"{what} checksum mismatch: the bytes were corrupted")
    raw = bytes(view[PREFIX.size : PREFIX.size + hlen])
    if version in CHUNKED_VERSIONS:
        return parse_v2(
            unpack_map(raw, "frame header", allow_bin=True), codec_id, blen, total, context,
            version=version,
        )  # fmt: skip
    try:
        hdr = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_bin_len=0, object_pairs_hook=unique_map
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"frame header is not valid msgpack: {exc}") from None
    return parse_v1(hdr, CODEC_NAMES[codec_id], blen, total)


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
    if hdr.version in CHUNKED_VERSIONS:
        if hdr.codec == "context":
            raise FrameError("a context frame holds no routing rows")
        if not hdr.resolved:
            raise FrameError(
                f"continuation frame needs its rollout context {hdr.base[:12]}… to decode"
            )
        if hdr.context is not None and hdr.context.has_table and hdr.context.table is None:
            hdr = read_header(data, verify=False, context=Context.parse(hdr.context.raw))
        # Chunk CRCs too: a slice's outer CRC was computed by whoever cut it, so only the
        # chunk CRCs (the writer's) vouch for the bytes end to end (in v3 they are the
        # body's only checksum).
        arr = decode_v2(view, hdr, max_bytes, verify_chunks=True)
    else:
        if (
            hdr.num_rows * len(hdr.layer_ids) * hdr.topk * index_dtype(hdr.num_experts).itemsize
            > max_bytes
        ):
            raise FrameError(
                f"frame decodes to more than this decoder's limit of {max_bytes} bytes"
            )
        arr = decode_v1(view, hdr)
    arr.flags.writeable = False
    segs = hdr.segments if hdr.segment is None else (hdr.segment,)
    return Frame(hdr, Routing(arr, hdr.num_experts, hdr.layer_ids, hdr.start, segs))
