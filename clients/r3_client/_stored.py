"""The chunked store layout's field names, which the service and a direct reader share.

A stored format-v3 segment frame is kept as its *head* (prefix, header, trailer:
:func:`~r3_client.codec.frame_head`) in the segment's field and each chunk in a field of
its own, named by what it holds, so that a reader asks Redis for exactly the chunks a
token range and a set of layers need (docs/store.md, "Layout").  A chunk's field is

    k:<a>:<b>:<index>:<first row>:<end row>:<first layer id>:<last layer id>

(``[a, b)`` the segment's rows, ``index`` the chunk's place in the body, rows
``[first, end)`` and absolute layer ids ``first`` … ``last`` inclusive), in the hash that
holds the segment's head: the rollout's, a view's, or a shared blob's.  The store's Lua
script ``segment_fields.lua`` applies the same rule as :func:`chunk_wanted`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from r3_client._exceptions import FormatError, FrameError
from r3_client.codec import ChunkSpan, chunk_spans, needed_chunks, read_header

__all__ = [
    "ChunkField",
    "Chunked",
    "chunk_field",
    "chunk_wanted",
    "head_chunks",
    "parse_chunk_field",
    "uncarried_contexts",
]

#: The first two bytes of every chunk field.
CHUNK_PREFIX = b"k:"


@dataclass(frozen=True, slots=True)
class Chunked:
    """A segment stored chunked, as a read fetched it: its frame's head and the chunks read,
    by index (all of them for a whole read); cut or joined into a frame where it is
    answered (``slice_frame(pieces=…)``)."""

    head: bytes
    pieces: dict[int, bytes]


@dataclass(frozen=True, slots=True)
class ChunkField:
    """A chunk field's name, parsed."""

    seg_start: int
    seg_end: int
    index: int
    start: int
    end: int
    first_layer: int
    last_layer: int


def chunk_field(seg_start: int, seg_end: int, span: ChunkSpan) -> str:
    """The field name of ``span``, a chunk of the segment ``[seg_start, seg_end)``."""
    return (
        f"k:{seg_start}:{seg_end}:{span.index}:{span.start}:{span.end}:"
        f"{span.first_layer}:{span.last_layer}"
    )


def parse_chunk_field(name: bytes) -> ChunkField | None:
    """``name`` parsed, or None when it is not a well-formed chunk field (seven numbers of
    at most 18 digits: no row or layer id comes near, and each fits an int64)."""
    if name[:2] != CHUNK_PREFIX:
        return None
    parts = name[2:].split(b":")
    if len(parts) != 7 or not all(p.isdigit() and len(p) <= 18 for p in parts):
        return None
    return ChunkField(*(int(p) for p in parts))


def chunk_wanted(
    field: ChunkField, spans: Iterable[tuple[int, int | None]], layers: Sequence[int] | None
) -> bool:
    """Whether a read of rows ``spans`` and ``layers`` (absolute ids; None: all) needs the
    chunk: its rows overlap a span and its layer ids overlap ``[min(layers), max(layers)]``
    (a superset of the groups :func:`~r3_client.codec.needed_chunks` keeps)."""
    if layers and (field.last_layer < min(layers) or field.first_layer > max(layers)):
        return False
    return any(a < field.end and (b is None or field.start < b) for a, b in spans)


def head_chunks(
    seg_start: int,
    seg_end: int,
    head: bytes,
    layer_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    layers: Sequence[int] | None,
) -> list[bytes]:
    """The chunk fields of the chunked segment ``[seg_start, seg_end)`` whose head is
    ``head`` that reads of rows ``spans`` and ``layers`` need: exactly the chunks
    :func:`~r3_client.codec.needed_chunks` names for each span, named from the head itself,
    so a reader fetches them without listing the hash's field names (``HKEYS`` sends ~36
    bytes per chunk of every segment; the head holds 8 per chunk and is read anyway).

    ``layer_ids`` are the rollout's (its ``m`` field): a continuation head names none of its
    own.  The head is checked first (its trailer): names computed from damaged bytes would
    ask for fields that are not there.  Raises :class:`FrameError` (or another
    :class:`FormatError`) for a head that does not parse or a read it cannot serve (a layer
    it does not hold); the caller then fetches no chunk and the decode names the fault."""
    hdr = read_header(head, verify=True, head=True)
    if not hdr.layer_ids:
        if len(layer_ids) != sum(hdr.groups):
            raise FrameError("the rollout's layer ids do not match the segment's layer groups")
        hdr = dataclasses.replace(hdr, layer_ids=tuple(layer_ids))
    picked: set[int] = set()
    for a, b in spans:
        lo, hi = max(a, hdr.start), min(b, hdr.end)
        if lo < hi:
            picked.update(needed_chunks(hdr, start=lo, end=hi, layers=layers))
    return [
        chunk_field(seg_start, seg_end, span).encode()
        for span in chunk_spans(hdr)
        if span.index in picked
    ]


def uncarried_contexts(frames: Iterable[tuple[bytes, bool]]) -> set[str]:
    """Digests of the contexts that the continuation frames among ``frames`` (each a frame,
    or a head when its flag is set) name and that none of them carries: the ``c:<digest>``
    fields a ranged read must fetch too (a first frame's head carries its own context, ~6
    KB at the Qwen3 shape: fetching the field as well sent it twice).  Read from the headers
    unchecked (the reader checks what it decodes); a header that does not parse names none
    here and is refused where it is decoded."""
    needed: set[str] = set()
    carried: set[str] = set()
    for raw, head in frames:
        try:
            hdr = read_header(raw, verify=False, head=head)
        except (FormatError, FrameError):
            continue
        if hdr.base:
            needed.add(hdr.base)
        elif hdr.context is not None:
            carried.add(hdr.context.digest)
    return needed - carried
