"""The stored layout, one owner: what a rollout's, a view's and a shared blob's Redis
hashes hold, and how a stored segment is cut and put back together (docs/store.md).

Two processes read what one writes, and both take the layout from here:

* the cache service (``cache_service/store``, its own process) writes every hash (a PUT:
  :func:`split_frame`, the names and values of :mod:`~r3_client.stored.fields`, passed to
  its Lua scripts) and answers every GET (its fields into :func:`hash_segments`, the
  contexts to fetch from :func:`uncarried_contexts`, the answer from :func:`cut`);
* a :class:`~r3_client.DirectReader` in a training rank reads its namespace's hashes from
  Redis itself with the same names (a ranged read planned from the hash's small fields:
  :func:`plan_ranged`), and cuts and puts back with the same functions.

Modules, from the bottom up: :mod:`~r3_client.stored.fields` (names and small values: no
frame bytes), :mod:`~r3_client.stored.heads` (a segment as read, :class:`Headers`: each
stored header parsed once per read), then :mod:`~r3_client.stored.segments` (a frame split
for storing, fields put back into segments), :mod:`~r3_client.stored.plan` (which fields a
ranged read needs) and :mod:`~r3_client.stored.cut` (the answer's frames).
Code outside ``r3_client`` imports these from here.
"""

from __future__ import annotations

from r3_client.stored.cut import cut, damaged, outside_rows
from r3_client.stored.fields import (
    BLOB_FRAME,
    FIELD_PREFIXES,
    META,
    NAMED_FIELDS,
    SMALL_FIELDS,
    VIEW_KEY,
    ChunkField,
    blob_key,
    chunk_field,
    chunk_wanted,
    chunks_by_segment,
    context_digest,
    context_field,
    contexts_of,
    meta_layers,
    meta_value,
    parse_chunk_field,
    parse_meta,
    parse_segment_info,
    parse_view,
    pointed,
    pointer,
    rollout_key,
    segment_field,
    segment_info,
    segment_rows,
    view_field,
    view_key,
    view_registration,
)
from r3_client.stored.heads import (
    Chunked,
    Headers,
    ParseHeader,
    Stored,
    head_of,
    read_stored_header,
)
from r3_client.stored.plan import RangedPlan, head_chunks, plan_ranged, uncarried_contexts
from r3_client.stored.segments import (
    blob_value,
    context_frame_at,
    hash_segments,
    joined,
    split_frame,
    whole_frames,
)

__all__ = [
    "BLOB_FRAME",
    "FIELD_PREFIXES",
    "META",
    "NAMED_FIELDS",
    "SMALL_FIELDS",
    "VIEW_KEY",
    "ChunkField",
    "Chunked",
    "Headers",
    "ParseHeader",
    "RangedPlan",
    "Stored",
    "blob_key",
    "blob_value",
    "chunk_field",
    "chunk_wanted",
    "chunks_by_segment",
    "context_digest",
    "context_field",
    "context_frame_at",
    "contexts_of",
    "cut",
    "damaged",
    "hash_segments",
    "head_chunks",
    "head_of",
    "joined",
    "meta_layers",
    "meta_value",
    "outside_rows",
    "parse_chunk_field",
    "parse_meta",
    "parse_segment_info",
    "parse_view",
    "plan_ranged",
    "pointed",
    "pointer",
    "read_stored_header",
    "rollout_key",
    "segment_field",
    "segment_info",
    "segment_rows",
    "split_frame",
    "uncarried_contexts",
    "view_field",
    "view_key",
    "view_registration",
    "whole_frames",
]
