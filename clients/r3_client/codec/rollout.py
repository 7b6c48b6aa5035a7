"""Many frames as one rollout: slicing stored frames, splitting a read, stitching it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    index_dtype,
    layer_positions,
)
from r3_client.codec.entry import decode_frame, read_header
from r3_client.codec.frame import (
    CHUNKED_VERSIONS,
    CODECS,
    CRC,
    MAX_DECODED_BYTES,
    MAX_HEADER,
    PREFIX,
    assemble_frame,
    chunk_crc,
)
from r3_client.codec.header import Context, Frame, FrameHeader

__all__ = [
    "ChunkSpan",
    "chunk_spans",
    "decode_rollout",
    "frame_head",
    "join_frame",
    "needed_chunks",
    "slice_frame",
    "split_frames",
]


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """Where one chunk of a chunked frame sits: its index (block-major), the token rows
    ``[start, end)`` and the absolute layer ids ``first_layer`` … ``last_layer`` (inclusive)
    it holds, and its bytes ``[offset, offset + length)`` within the frame."""

    index: int
    start: int
    end: int
    first_layer: int
    last_layer: int
    offset: int
    length: int


def chunk_spans(hdr: FrameHeader) -> list[ChunkSpan]:
    """Every chunk of a resolved v2/v3 routing frame, in body order (block-major)."""
    if hdr.version not in CHUNKED_VERSIONS or hdr.codec == "context":
        raise UnsupportedFrameError("only v2 and v3 routing frames have chunks")
    if not hdr.layer_ids:
        raise FrameError("a continuation frame's chunks need its context (its layer ids)")
    bstarts = list(itertools.accumulate(hdr.blocks, initial=hdr.start))
    gbounds = list(itertools.accumulate(hdr.groups, initial=0))
    offsets = _chunk_offsets(hdr)
    ng = len(hdr.groups)
    return [
        ChunkSpan(
            index=b * ng + g,
            start=bstarts[b],
            end=bstarts[b + 1],
            first_layer=hdr.layer_ids[gbounds[g]],
            last_layer=hdr.layer_ids[gbounds[g + 1] - 1],
            offset=offsets[b * ng + g],
            length=hdr.chunks[b * ng + g][0],
        )
        for b in range(len(hdr.blocks))
        for g in range(ng)
    ]


def _chunk_offsets(hdr: FrameHeader) -> list[int]:
    """Where each chunk of a chunked frame starts in the frame, and (last) where the body
    ends."""
    at = hdr.frame_length - CRC.size - hdr.body_length
    return list(itertools.accumulate((c[0] for c in hdr.chunks), initial=at))


def frame_head(data: bytes | bytearray | memoryview, hdr: FrameHeader) -> bytes:
    """A v3 frame's *head*: its prefix, header and trailer, without the body.

    A v3 trailer covers the prefix and header only, so the head is checkable on its own
    (``read_header(head, head=True)``) and, with the chunks' bytes, gives back the frame
    byte for byte (:func:`join_frame`).  What a chunked store keeps in a segment's place.
    """
    if hdr.version < 3 or hdr.codec == "context":
        raise UnsupportedFrameError("only a version 3 routing frame splits into head and chunks")
    view = memoryview(data).cast("B")
    cut = hdr.frame_length - CRC.size - hdr.body_length
    return bytes(view[:cut]) + bytes(view[-CRC.size :])


def join_frame(head: bytes | bytearray | memoryview, chunks: Sequence[bytes | memoryview]) -> bytes:
    """The frame a :func:`frame_head` and every one of its chunks (in body order) came from."""
    h = memoryview(head).cast("B")
    return b"".join([h[: -CRC.size], *chunks, h[-CRC.size :]])


def _kept(
    hdr: FrameHeader, start: int | None, end: int | None, layers: Sequence[int] | None
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The blocks and groups a slice of ``hdr`` keeps, with the blocks' first rows and the
    groups' first positions (each list one longer than ``hdr``'s blocks / groups)."""
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
    return keep_b, keep_g, bstarts, gbounds


def needed_chunks(
    hdr: FrameHeader,
    *,
    start: int | None = None,
    end: int | None = None,
    layers: Sequence[int] | None = None,
) -> list[int]:
    """The indices of the chunks :func:`slice_frame` copies for this range and layers."""
    keep_b, keep_g, _, _ = _kept(hdr, start, end, layers)
    ng = len(hdr.groups)
    return [b * ng + g for b in keep_b for g in keep_g]


def slice_context(hdr: FrameHeader, context: Context, layers: Sequence[int]) -> Context:
    """The context a slice of the frame ``hdr`` by ``layers`` names when it trims its
    context (``slice_frame(trim_context=True)``): ``context`` (the frame's own, or the one
    a continuation frame continues) for the layer ids of the groups the slice keeps."""
    if not hdr.layer_ids:
        raise FrameError("slicing a continuation frame by layer needs its context")
    _, keep_g, _, gbounds = _kept(hdr, None, None, layers)
    kept = [lid for g in keep_g for lid in hdr.layer_ids[gbounds[g] : gbounds[g + 1]]]
    return context.subset(kept)


def slice_frame(
    data: bytes | bytearray | memoryview,
    *,
    start: int | None = None,
    end: int | None = None,
    layers: Sequence[int] | None = None,
    context: Context | None = None,
    parsed: FrameHeader | None = None,
    verify: bool = False,
    pieces: Mapping[int, bytes | memoryview] | None = None,
    trim_context: bool = False,
) -> bytes:
    """Cut a v2 or v3 frame down to the blocks and layer groups that cover a range: no
    decoding.

    The result is a frame of the same version whose rows are the blocks overlapping ``[start, end)``
    and whose layers are the groups holding any of ``layers`` (absolute ids); the
    reader trims to the exact range.  Chunk bytes are copied unchanged (their
    CRCs travel in the header); the segment becomes provenance.  A continuation
    frame without a ``layers`` field needs ``context`` to slice by layer.  ``parsed``
    is ``read_header(data, verify=False, context=context)`` when the caller holds it
    already (the service keeps parsed headers of stored frames).

    ``pieces``: ``data`` is the frame's head (:func:`frame_head`) and the chunks' bytes
    are these, by chunk index; every chunk :func:`needed_chunks` names must be there
    (:class:`TruncatedFrameError` otherwise).  What a store that keeps a frame as head
    and chunks cuts from.

    ``verify``: check the input before anything is cut from it, since a slice's trailer is
    computed anew and would vouch for whatever it copied: the frame's trailing CRC (unless
    ``parsed`` is given: then the caller checked it, as ``read_header(verify=True)``) and
    the CRC of every chunk returned (raises :class:`ChecksumError`).

    ``trim_context``: a slice by ``layers`` carries (or, a continuation, names) its context
    for the kept groups' layers only (:func:`slice_context`: a new context, ~1/4 of the
    relabel table for a pipeline stage of 4), instead of the whole one.  A continuation
    then needs ``context`` (with its table) and its reader the trimmed context, which
    the caller sends (the service's ranged answers, which then cost a rank its layers'
    share of the table rather than all of it).
    """
    head = pieces is not None
    hdr = read_header(data, verify=verify, context=context, head=head) if parsed is None else parsed
    if hdr.version not in CHUNKED_VERSIONS or hdr.codec == "context":
        raise UnsupportedFrameError("only v2 and v3 routing frames can be sliced")
    keep_b, keep_g, bstarts, gbounds = _kept(hdr, start, end, layers)
    view = memoryview(data).cast("B")
    ng = len(hdr.groups)
    idx = [b * ng + g for b in keep_b for g in keep_g]
    chunk_bytes = _chunk_bytes(hdr, view, idx, pieces, verify)
    if len(keep_b) == len(hdr.blocks) and len(keep_g) == len(hdr.groups):  # the whole frame
        return join_frame(view, [chunk_bytes[i] for i in idx]) if head else bytes(data)
    header: dict[str, Any] = {
        "start": bstarts[keep_b[0]],
        "end": bstarts[keep_b[-1] + 1],
    }
    own = hdr.context if not hdr.base else context
    named = (
        slice_context(hdr, own, layers)
        if trim_context and layers is not None and own is not None
        else None
    )
    if hdr.base:
        header["base"] = bytes.fromhex(hdr.base if named is None else named.digest)
    else:
        assert hdr.context is not None
        header["ctx"] = (hdr.context if named is None else named).raw
    if layers is not None or _explicit_layers(hdr):
        layer_ids = hdr.layer_ids
        header["layers"] = [lid for g in keep_g for lid in layer_ids[gbounds[g] : gbounds[g + 1]]]
    header["params"] = hdr.params
    header["blocks"] = [hdr.blocks[b] for b in keep_b]
    header["groups"] = [hdr.groups[g] for g in keep_g]
    header["chunks"] = [list(hdr.chunks[i]) for i in idx]
    prov = (hdr.segment,) if hdr.segment is not None else hdr.segments
    kept = [p for p in prov if p.overlaps(header["start"], header["end"])]
    if kept:
        header["segments"] = [p.to_dict() for p in kept]
    return assemble_frame(
        hdr.version, CODECS[hdr.codec], header, [bytes(chunk_bytes[i]) for i in idx]
    )


def _chunk_bytes(
    hdr: FrameHeader,
    view: memoryview,
    idx: list[int],
    pieces: Mapping[int, bytes | memoryview] | None,
    verify: bool,
) -> dict[int, memoryview]:
    """The bytes of chunks ``idx`` of a frame (``view``, or, with ``pieces``, its head and
    those chunks), each checked against its length in the header and, with ``verify``,
    its CRC."""
    if pieces is not None:
        missing = [i for i in idx if i not in pieces]
        if missing:
            raise TruncatedFrameError(f"chunks {missing[:8]} of the frame are missing")
        chunk_bytes = {i: memoryview(pieces[i]).cast("B") for i in idx}
    else:
        offsets = _chunk_offsets(hdr)
        chunk_bytes = {i: view[offsets[i] : offsets[i + 1]] for i in idx}
    for i in idx:
        if len(chunk_bytes[i]) != hdr.chunks[i][0]:
            raise TruncatedFrameError(
                f"chunk {i} is {len(chunk_bytes[i])} bytes; the header says {hdr.chunks[i][0]}"
            )
        if verify and chunk_crc(hdr.version, chunk_bytes[i]) != hdr.chunks[i][1]:
            raise ChecksumError("chunk checksum mismatch: the bytes were corrupted")
    return chunk_bytes


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
        if len(view) - at < PREFIX.size + CRC.size:
            raise TruncatedFrameError(f"{len(view) - at} trailing bytes are not a frame")
        _, _, _, _, hlen, blen = PREFIX.unpack_from(view, at)
        total = PREFIX.size + hlen + blen + CRC.size
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
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        contexts, heads = read_frames(pieces)
    except FrameError as exc:
        raise type(exc)(f"{who}: {exc}") from None
    if not heads:
        # A range that falls wholly in a gap between segments: the read carries only
        # the rollout's context, and every row is -1.
        if end is None or not contexts:
            raise FrameError(f"{who}: the read returned no routing frames")
        return _gap_only(next(iter(contexts.values())), start, end, layers, max_bytes, who)
    total = _decoded_total(heads, contexts)
    if total > max_bytes:
        # Refused before any frame is decoded: each frame may be under the limit while
        # together they are not (many segments of a long rollout).
        raise FrameError(f"{who}: its frames decode to {total} bytes, over {max_bytes}")
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
    return _stitch(decoded, start, end, layers, max_bytes, who)


def _decoded_total(
    heads: list[tuple[memoryview, FrameHeader]], contexts: dict[str, Context]
) -> int:
    """Bytes the read's frames decode to, from their headers (a continuation frame's
    geometry from its context; one whose context is missing counts 0 and fails later)."""
    total = 0
    for _, hdr in heads:
        ctx = hdr.context if hdr.context is not None else contexts.get(hdr.base)
        if ctx is None:
            continue
        layers = len(hdr.layer_ids) or len(ctx.layer_ids)
        total += hdr.num_rows * layers * ctx.topk * index_dtype(ctx.num_experts).itemsize
    return total


def read_frames(
    pieces: Sequence[bytes | bytearray | memoryview],
) -> tuple[dict[str, Context], list[tuple[memoryview, FrameHeader]]]:
    """The read's contexts (by digest, tables inflated once) and its routing frames."""
    contexts: dict[str, Context] = {}
    heads: list[tuple[memoryview, FrameHeader]] = []
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
    return contexts, heads


def _gap_only(
    ctx: Context,
    start: int,
    end: int,
    layers: Sequence[int] | None,
    max_bytes: int,
    who: str,
) -> Routing:
    """All ``-1`` rows ``[start, end)``: a read that fell wholly in a gap."""
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


def _stitch(
    decoded: list[Frame],
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    max_bytes: int,
    who: str,
) -> Routing:
    """Decoded segment frames placed by their rows, trimmed to the rows and layers asked."""
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
    # Every returned frame's segments (a frame outside the range included), kept where
    # they touch [start, hi): the provenance of either answer below.
    segs = (f.routing.segments or (Segment(f.header.start, f.header.end),) for f in decoded)
    uniq = tuple(dict.fromkeys(s for ss in segs for s in ss if s.overlaps(start, hi)))
    only = decoded[0]
    if (
        len(decoded) == 1
        and (only.header.start, only.header.end) == (start, hi)
        and only.routing.layer_ids == kept
    ):
        # One frame that is exactly the answer (a whole single-segment read): its
        # decoded array, already read-only, is the result; no copy.
        return Routing(only.routing.indices, e, kept, start, uniq)
    out = np.full((hi - start, len(kept), k), -1, dtype=index_dtype(e))
    for f in decoded:
        a, b = max(start, f.header.start), min(hi, f.header.end)
        if a >= b:
            continue
        have = f.routing.layer_ids
        missing = [lid for lid in kept if lid not in have]
        if missing:
            raise FrameError(
                f"{who}: segment [{f.header.start}, {f.header.end}) lacks layers {missing}"
            )
        cols = layer_positions(have, kept)
        rows = f.routing.indices[a - f.header.start : b - f.header.start]
        # every layer in order: a view (one copy into out), not a fancy-indexed copy
        out[a - start : b - start] = rows if cols == list(range(len(have))) else rows[:, cols]
    out.flags.writeable = False
    return Routing(out, e, kept, start, uniq)
