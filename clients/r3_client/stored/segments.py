"""A stored segment: how a checked frame is kept (whole, or as head and chunks) and how a
read puts it back together.

The cache service splits a frame as it stores it (:func:`split_frame`, in its process,
on a PUT); whoever reads the hash (the service answering a GET, a
:class:`~r3_client.DirectReader` in a training rank) turns the fields it fetched into
segments (:func:`hash_segments`, :func:`blob_value`), their frames in order
(:func:`whole_frames`) or their cut (:mod:`r3_client.stored.cut`).  A v3 frame of more than
one chunk is kept as its *head* (prefix, header and trailer: the trailer covers exactly
those, so the head is checked on its own) in the segment's field, each chunk in a field of
its own (:func:`~r3_client.stored.fields.chunk_field`); head plus chunks in body order are
the frame, byte for byte.  v2 frames and one-chunk frames stay whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from r3_client._exceptions import FormatError, FrameError, StoreError
from r3_client.codec.frame import is_context_frame, is_frame_head
from r3_client.codec.header import Context, FrameHeader
from r3_client.codec.rollout import chunk_spans, frame_head, join_frame
from r3_client.codec.v2_write import encode_context
from r3_client.stored.fields import (
    BLOB_FRAME,
    chunk_field,
    chunks_by_segment,
    is_segment,
    parse_chunk_field,
    segment_rows,
)
from r3_client.stored.heads import Chunked, Headers, Stored, head_of

__all__ = [
    "blob_value",
    "context_frame_at",
    "hash_segments",
    "joined",
    "split_frame",
    "whole_frames",
]


def joined(stored: Stored) -> bytes:
    """A segment read whole as its frame (a chunked one's chunks joined to its head,
    unchecked: the decode checks every chunk's CRC)."""
    if isinstance(stored, bytes):
        return stored
    return join_frame(stored.head, [stored.pieces[i] for i in sorted(stored.pieces)])


# ---- writing: a frame as stored -------------------------------------------------------------


def split_frame(
    frame: bytes, hdr: FrameHeader, *, chunked: bool
) -> tuple[bytes, list[str | memoryview]]:
    """What a checked segment frame is stored as: the frame itself (``chunked`` off, a
    version 2 frame, or one chunk), or its head and the ``name, bytes`` pairs of its chunk
    fields, flat, as the store's put scripts take them."""
    if not chunked or hdr.version < 3 or len(hdr.chunks) < 2:
        return frame, []
    assert hdr.segment is not None
    a, b = hdr.segment.start, hdr.segment.end
    view = memoryview(frame)
    chunks: list[str | memoryview] = []
    for span in chunk_spans(hdr):
        chunks += [chunk_field(a, b, span), view[span.offset : span.offset + span.length]]
    return frame_head(frame, hdr), chunks


# ---- reading: fields back into segments -----------------------------------------------------


def hash_segments(rollout_id: str, fields: Mapping[bytes, Any]) -> list[tuple[int, int, Any]]:
    """A hash's segments as read, by start: each segment field's value, a head with the
    chunk fields of its segment that were read (:class:`Chunked`); a shared segment's blob
    pointer, or a value the caller put there already (a blob's, resolved), as it is.
    Raises :class:`StoreError` for a segment field that names no rows."""
    pieces = chunks_by_segment(dict(fields))
    out: list[tuple[int, int, Any]] = []
    for f, v in fields.items():
        if not is_segment(f):
            continue
        rows = segment_rows(f)
        if rows is None:
            raise StoreError(
                f"rollout {rollout_id}: a segment field ({f[:40]!r}) names no rows (a "
                "damaged store); the rollout cannot be read"
            )
        if isinstance(v, bytes) and is_frame_head(v):
            v = Chunked(v, pieces.get(rows, {}))
        out.append((*rows, v))
    out.sort(key=lambda s: s[0])
    return out


def blob_value(
    fields: Mapping[bytes, Any], pieces: dict[int, bytes] | None = None
) -> Stored | None:
    """A shared blob's frame from the blob hash's ``fields`` (``f`` the frame, or its head
    with the chunk fields beside it, or with ``pieces`` when the read fetched only some);
    None when the blob has expired."""
    value = fields.get(BLOB_FRAME.encode())
    if not isinstance(value, bytes):
        return None
    if not is_frame_head(value):
        return value
    if pieces is None:
        pieces = {
            got.index: v for f, v in fields.items() if (got := parse_chunk_field(f)) is not None
        }
    return Chunked(value, pieces)


def context_frame_at(segments: Iterable[tuple[int, int, Stored]]) -> tuple[int, int] | None:
    """The rows of the first segment that holds a context frame (docs/format.md 6.3: read
    from the prefix), or None: decoded, it would read as a gap of -1 rows."""
    for a, b, stored in segments:
        if is_context_frame(head_of(stored)[0]):
            return a, b
    return None


def whole_frames(
    segments: Sequence[tuple[int, int, Stored]], contexts: Mapping[str, bytes], headers: Headers
) -> list[Stored]:
    """A whole read's answer as stored: the segments' frames by start, after the stored
    contexts their continuation frames need and none of them carries (what the service's
    whole GET answers, a chunked segment left as head and chunks: :func:`joined` joins it).

    Only stored contexts can be sent, so the headers are read until every one of them is
    known to travel in its own frame (usually the first: agent turns and GRPO responses
    continue it); a header that does not parse sends none (the decode names the fault)."""
    frames: list[Stored] = [v for _, _, v in segments]
    if not contexts:
        return frames
    carried: set[str] = set()
    bases: list[str] = []
    try:
        for v in frames:
            h = headers.of(v)
            if h.base:
                bases.append(h.base)
            elif h.context is not None:
                carried.add(h.context.digest)
                if carried >= contexts.keys():
                    return frames
    except (FormatError, FrameError):
        return frames
    wanted = [d for d in dict.fromkeys(bases) if d in contexts and d not in carried]
    return [*(encode_context(Context.parse(contexts[d], tables=False)) for d in wanted), *frames]
