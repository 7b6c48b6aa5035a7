"""The planning of a ranged read: which chunk and context fields a read of some rows and
layers needs, named from the fields themselves, so that only those leave Redis.

The service plans in Redis (its ``segment_fields.lua`` applies
:func:`~r3_client.stored.fields.chunk_wanted` to the hash's field names) and then asks
:func:`uncarried_contexts` which contexts to fetch after the frames.  A
:class:`~r3_client.DirectReader` (its Redis user runs no Lua) plans from the hash's small
fields (:func:`plan_ranged`): the meta, every segment's head, frame or blob pointer; a head
lists its blocks and layer groups (:func:`head_chunks`).  Both run where the read runs: the
service's process, a training rank's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3_client._exceptions import FormatError, FrameError, R3Error
from r3_client.codec.frame import is_frame_head
from r3_client.codec.rollout import chunk_spans, needed_chunks
from r3_client.stored.fields import (
    META,
    chunk_field,
    context_digest,
    context_field,
    is_segment,
    meta_layers,
    parse_chunk_field,
    pointed,
    segment_rows,
)
from r3_client.stored.heads import Chunked, Headers, Stored

__all__ = [
    "RangedPlan",
    "chunk_names",
    "context_fields",
    "head_chunks",
    "incomplete",
    "plan_ranged",
    "uncarried_contexts",
]


def head_chunks(
    seg_start: int,
    seg_end: int,
    head: bytes,
    layer_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    layers: Sequence[int] | None,
    *,
    headers: Headers | None = None,
) -> list[bytes]:
    """The chunk fields of the chunked segment ``[seg_start, seg_end)`` whose head is
    ``head`` that reads of rows ``spans`` and ``layers`` need: exactly the chunks
    :func:`~r3_client.codec.needed_chunks` names for each span, named from the head itself,
    so a reader fetches them without listing the hash's field names (``HKEYS`` sends ~36
    bytes per chunk of every segment; the head holds 8 per chunk and is read anyway).

    ``layer_ids`` are the rollout's (its ``m`` field): a continuation head names none of its
    own.  The head is checked first (its trailer): names computed from damaged bytes would
    ask for fields that are not there.  ``headers``: the read's parsed headers (the head is
    parsed once per read).  Raises :class:`FrameError` (or another :class:`FormatError`)
    for a head that does not parse or a read it cannot serve (a layer it does not hold);
    the caller then fetches no chunk and the decode names the fault."""
    hdr = (headers or Headers()).parsed(head, True)
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


def chunk_names(
    field: bytes,
    head: bytes,
    layer_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    layers: Sequence[int] | None,
    headers: Headers,
) -> list[bytes]:
    """:func:`head_chunks` of segment ``field``; none when the head is damaged or a layer is
    not the segment's (the decode then raises the reason)."""
    a, b = segment_rows(field) or (0, 0)
    try:
        return head_chunks(a, b, head, layer_ids, spans, layers, headers=headers)
    except R3Error:
        return []


def uncarried_contexts(stored: Iterable[Stored], headers: Headers | None = None) -> set[str]:
    """Digests of the contexts that the continuation frames among ``stored`` name and that
    none of them carries: the ``c:<digest>`` fields a ranged read must fetch too (a first
    frame's head carries its own context, ~6 KB at the Qwen3 shape: fetching the field as
    well sent it twice).  A header that does not parse names none here and is refused
    where it is cut or decoded."""
    headers = headers or Headers()
    needed: set[str] = set()
    carried: set[str] = set()
    for v in stored:
        try:
            hdr = headers.of(v)
        except (FormatError, FrameError):
            continue
        if hdr.base:
            needed.add(hdr.base)
        elif hdr.context is not None:
            carried.add(hdr.context.digest)
    return needed - carried


def context_fields(fields: Mapping[bytes, Any], headers: Headers) -> list[bytes]:
    """The ``c:<digest>`` fields of the contexts that the segments among a hash's ``fields``
    continue and none of them carries (:func:`uncarried_contexts`)."""
    frames = [v for f, v in fields.items() if is_segment(f) and isinstance(v, bytes | Chunked)]
    if not frames:
        return []
    return [context_field(d).encode() for d in sorted(uncarried_contexts(frames, headers))]


def incomplete(fields: Mapping[bytes, Any], names: Sequence[bytes]) -> bool:
    """Whether a ranged read's fields lack what its plan fetched (a chunk or context field
    answered as missing, or the meta of a hash that has small fields): the hash changed
    between the read's round trips."""
    if names and not isinstance(fields.get(META.encode()), bytes):
        return True
    return any(
        v is None
        for f, v in fields.items()
        if parse_chunk_field(f) is not None or context_digest(f) is not None
    )


@dataclass(frozen=True, slots=True)
class RangedPlan:
    """What a ranged direct read fetches of one rollout hash after its small fields: the
    names of those (meta, segments, views), the rollout's layer ids, its chunk fields the
    reads need, the shared blobs (by segment field) they overlap, and the contexts no
    frame carries (of a hash without shared segments; with them, asked once the blobs'
    heads are read)."""

    names: list[bytes]
    layer_ids: tuple[int, ...]
    chunks: list[bytes]
    blobs: dict[bytes, bytes]
    contexts: list[bytes]


def plan_ranged(
    fields: dict[bytes, Any],
    spans: Sequence[tuple[int, int]],
    layers: Sequence[int] | None,
    headers: Headers,
) -> RangedPlan:
    """The plan of a ranged read of ``spans`` and ``layers`` from a hash's small fields
    (:data:`~r3_client.stored.fields.SMALL_FIELDS`).  A segment no span overlaps is dropped
    from ``fields`` (not decoded, nothing of a shared one read) unless it is a chunked
    segment's head, which is kept: it may carry the context the read's continuation frames
    need, which then need not be fetched again."""
    names = list(fields)
    layer_ids = meta_layers(fields.get(META.encode()))
    chunks: list[bytes] = []
    blobs: dict[bytes, bytes] = {}
    for f in names:
        if not is_segment(f):
            continue
        a, b = segment_rows(f) or (0, 0)  # malformed: overlaps nothing, refused when read
        v = fields[f]
        blob = pointed(v)
        if not any(a < e and s < b for s, e in spans):
            if not is_frame_head(v):  # a frame or a blob pointer: another read's rows
                del fields[f]
        elif blob is not None:
            blobs[f] = blob
        elif is_frame_head(v):
            chunks += chunk_names(f, v, layer_ids, spans, layers, headers)
    contexts = [] if blobs else context_fields(fields, headers)
    return RangedPlan(names, layer_ids, chunks, blobs, contexts)
