"""The stored layout's names: which keys and hash fields a rollout, a view and a shared blob
hold, and how each field's name and small value are written and read (docs/store.md).

Pure names and msgpack, no frame bytes: the cache service builds its writes and reads
from these, in its own process (``cache_service/store``, the Lua scripts it passes them
to), and a :class:`~r3_client.DirectReader` reads Redis with them in a training rank's.
The Lua scripts (``cache_service/lua``) spell the same names; ``tests/test_layering.py``
checks that they are these, and that no other product module spells one.

A rollout hash, ``<prefix>{<rollout id>}`` (a view's, ``<rollout key>:v:<serves>``, is
laid out the same):

==========================  =================================================================
``m``                       msgpack ``[E, K, [layer ids]]`` (:func:`meta_value`)
``s:<a>:<b>``               segment ``[a, b)``: its frame, a chunked frame's head, or
                            ``@<blob key>`` (shared)
``k:<a>:<b>:<i>:…``         chunk ``i`` of a chunked segment (:func:`chunk_field`)
``d:<a>:<b>``               the segment's content digest
``h:<a>:<b>``               msgpack ``[segment, codec, nbytes, shared]`` (:func:`segment_info`)
``r:<a>:<b>``, ``t:<a>:<b>``  a shared segment's blob key and its reference token
``c:<digest>``              a context continuation frames name
``v:<serves>``              a view's registration (:func:`view_registration`)
``b``, ``sb``, ``n``        frame bytes, bytes in shared blobs, segment count
==========================  =================================================================

A shared blob, ``<prefix>blob:{<share key>}``: ``f`` the frame (or head, the chunk fields
beside it), ``d`` its digest, ``x:<token>`` one reference each, ``rc`` their count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from r3_client._answers import SegmentInfo, ViewInfo
from r3_client._routing import Segment, check_rollout_id

__all__ = [
    "BLOB_DIGEST",
    "BLOB_FRAME",
    "BLOB_HOLDER",
    "BLOB_KEY",
    "BLOB_REF",
    "BLOB_REFS",
    "BLOB_TOKEN",
    "CHUNK",
    "CONTEXT",
    "DIGEST",
    "FIELD_PREFIXES",
    "INFO",
    "META",
    "NAMED_FIELDS",
    "POINTER",
    "SEGMENT",
    "SEGMENT_COUNT",
    "SHARED_BYTES",
    "SMALL_FIELDS",
    "TOTAL_BYTES",
    "VIEW",
    "VIEW_KEY",
    "ChunkField",
    "blob_key",
    "chunk_field",
    "chunk_wanted",
    "chunks_by_index",
    "chunks_by_segment",
    "context_digest",
    "context_field",
    "contexts_of",
    "is_segment",
    "is_small",
    "meta_layers",
    "meta_value",
    "parse_chunk_field",
    "parse_meta",
    "parse_segment_info",
    "parse_view",
    "pointed",
    "pointer",
    "rollout_key",
    "segment_field",
    "segment_info",
    "segment_rows",
    "view_field",
    "view_key",
    "view_registration",
    "views_of",
]

# ---- the names ------------------------------------------------------------------------------

#: Rollout (and view) hash: the meta, per segment its frame / digest / info / blob key /
#: reference token, its chunks, the contexts, the views, and the three counters.
META = "m"
SEGMENT = "s:"
DIGEST = "d:"
INFO = "h:"
BLOB_REF = "r:"
BLOB_TOKEN = "t:"
CHUNK = "k:"
CONTEXT = "c:"
VIEW = "v:"
TOTAL_BYTES = "b"
SHARED_BYTES = "sb"
SEGMENT_COUNT = "n"
#: Shared blob hash: the frame (or head), its digest, a reference per holder, their count.
BLOB_FRAME = "f"
BLOB_DIGEST = "d"
BLOB_HOLDER = "x:"
BLOB_REFS = "rc"
#: A view's key after its rollout's key, and a blob's after the namespace prefix.
VIEW_KEY = ":v:"
BLOB_KEY = "blob:"
#: What a shared segment's ``s:`` field holds before the blob's key.
POINTER = b"@"

#: Every field-name prefix (``<prefix><rest>``) of the layout.
FIELD_PREFIXES = (SEGMENT, DIGEST, INFO, BLOB_REF, BLOB_TOKEN, CHUNK, CONTEXT, VIEW, BLOB_HOLDER)
#: Every whole field name of the layout (a rollout's, a view's or a blob's).
NAMED_FIELDS = (META, TOTAL_BYTES, SHARED_BYTES, SEGMENT_COUNT, BLOB_FRAME, BLOB_DIGEST, BLOB_REFS)

#: The small fields of a rollout hash a ranged direct read scans for (``HSCAN … MATCH``):
#: its meta, segments (heads, frames or blob pointers) and views, and ``sb``.
SMALL_FIELDS = f"[{META}{SEGMENT[0]}{VIEW[0]}]*"

_SEGMENT, _CHUNK, _CONTEXT, _VIEW = (p.encode() for p in (SEGMENT, CHUNK, CONTEXT, VIEW))


# ---- keys -----------------------------------------------------------------------------------


def rollout_key(prefix: str, rollout_id: str) -> str:
    """A rollout's key: ``prefix`` (``<prefix>:[<namespace>:]``, with its colon) then the id
    as the hash tag, so that everything of the rollout lives in one cluster slot."""
    return f"{prefix}{{{check_rollout_id(rollout_id)}}}"


def view_key(rollout: str, serves: int) -> str:
    """The key of the view of the rollout at key ``rollout`` serving row ``serves``: in the
    rollout's slot (same hash tag) and under its namespace's key pattern."""
    return f"{rollout}{VIEW_KEY}{int(serves)}"


def blob_key(prefix: str, share: str) -> str:
    """A shared blob's key: ``prefix`` as for :func:`rollout_key`, the share key its tag."""
    return f"{prefix}{BLOB_KEY}{{{share}}}"


def pointer(blob: str) -> bytes:
    """What a shared segment's ``s:`` field holds: ``@`` and the blob's key."""
    return POINTER + blob.encode()


def pointed(value: object) -> bytes | None:
    """The blob key a segment field's value points at, or None (a frame or a head)."""
    if isinstance(value, bytes) and value[:1] == POINTER:
        return value[1:]
    return None


# ---- segment, context and view fields -------------------------------------------------------


def segment_field(start: int, end: int) -> str:
    """The field of segment ``[start, end)`` (its frame, head or blob pointer)."""
    return f"{SEGMENT}{start}:{end}"


def segment_rows(name: bytes) -> tuple[int, int] | None:
    """A segment field's rows, or None when ``name`` is no well-formed segment field."""
    if name[:2] != _SEGMENT:
        return None
    parts = name[2:].split(b":")
    if len(parts) != 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def is_segment(name: bytes) -> bool:
    """Whether ``name`` is a segment field (well formed or not)."""
    return name[:2] == _SEGMENT


def is_small(name: bytes) -> bool:
    """Whether ``name`` is a field :data:`SMALL_FIELDS` matches (the meta, a segment's, a
    view's): what a reader without ``HSCAN`` picks from ``HKEYS``."""
    return name == META.encode() or name[:2] in (_SEGMENT, _VIEW)


def context_field(digest: str) -> str:
    """The field of the context with ``digest``."""
    return f"{CONTEXT}{digest}"


def context_digest(name: bytes) -> str | None:
    """The digest a context field names, or None when ``name`` is no context field."""
    return name[2:].decode() if name[:2] == _CONTEXT else None


def contexts_of(fields: dict[bytes, Any]) -> dict[str, bytes]:
    """A hash's contexts as read (``c:<digest>`` fields), by digest."""
    return {d: v for f, v in fields.items() if (d := context_digest(f)) is not None}


def view_field(serves: int) -> str:
    """The rollout field registering its view serving row ``serves``."""
    return f"{VIEW}{int(serves)}"


def view_registration(start: int, end: int, weight_version: str, nbytes: int) -> bytes:
    """A ``v:<serves>`` field's value: msgpack ``[start, end, weight_version, nbytes]``."""
    out: bytes = msgpack.packb([start, end, weight_version, nbytes])
    return out


def parse_view(serves: int | bytes, raw: bytes) -> ViewInfo:
    """A view registration read back (``serves``: the row, or its ``v:<serves>`` field)."""
    row = int(serves[2:]) if isinstance(serves, bytes) and serves[:2] == _VIEW else int(serves)
    a, b, version, nbytes = msgpack.unpackb(raw)
    return ViewInfo(row, int(a), int(b), str(version), int(nbytes))


def views_of(fields: dict[bytes, Any]) -> list[ViewInfo]:
    """A rollout hash's view registrations (raises what msgpack raises for a bad one)."""
    return [parse_view(f, v) for f, v in fields.items() if f[:2] == _VIEW]


# ---- small values ---------------------------------------------------------------------------


def meta_value(num_experts: int, topk: int, layer_ids: Sequence[int]) -> bytes:
    """The rollout meta field ``m``: msgpack ``[E, K, layer ids]``."""
    out: bytes = msgpack.packb([num_experts, topk, list(layer_ids)], use_bin_type=True)
    return out


def parse_meta(raw: bytes) -> tuple[int, int, tuple[int, ...]]:
    """``(E, K, layer ids)`` of a meta field (raises what msgpack raises for a bad one)."""
    e, k, layer_ids = msgpack.unpackb(raw)
    return e, k, tuple(layer_ids)


def meta_layers(raw: object) -> tuple[int, ...]:
    """The layer ids of a meta field; () when it is missing or unreadable (a continuation
    head then names no chunk, and the decode names the fault)."""
    try:
        _, _, ids = msgpack.unpackb(raw)
        return tuple(int(x) for x in ids)
    except Exception:  # msgpack raises several unrelated types; any of them: unreadable
        return ()


def segment_info(segment: Segment, codec: str, nbytes: int, shared: bool) -> bytes:
    """An ``h:<a>:<b>`` field's value (what ``stat`` lists for the segment)."""
    out: bytes = msgpack.packb([segment.to_dict(), codec, nbytes, shared], use_bin_type=True)
    return out


def parse_segment_info(raw: bytes) -> SegmentInfo:
    """An ``h:`` field's value read back."""
    seg, codec, nbytes, shared = msgpack.unpackb(raw)
    return SegmentInfo(Segment.from_dict(seg), codec, nbytes, shared)


# ---- chunk fields ---------------------------------------------------------------------------


class _Span(Protocol):
    """What names a chunk (a :class:`~r3_client.codec.ChunkSpan`)."""

    @property
    def index(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def first_layer(self) -> int: ...
    @property
    def last_layer(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ChunkField:
    """A chunk field's name, parsed: chunk ``index`` of segment ``[seg_start, seg_end)``,
    rows ``[start, end)`` and absolute layer ids ``first_layer`` … ``last_layer``."""

    seg_start: int
    seg_end: int
    index: int
    start: int
    end: int
    first_layer: int
    last_layer: int


def chunk_field(seg_start: int, seg_end: int, span: _Span) -> str:
    """The field name of ``span``, a chunk of the segment ``[seg_start, seg_end)``:
    ``k:<a>:<b>:<index>:<first row>:<end row>:<first layer id>:<last layer id>``."""
    return (
        f"{CHUNK}{seg_start}:{seg_end}:{span.index}:{span.start}:{span.end}:"
        f"{span.first_layer}:{span.last_layer}"
    )


def parse_chunk_field(name: bytes) -> ChunkField | None:
    """``name`` parsed, or None when it is not a well-formed chunk field (seven numbers of
    at most 18 digits: no row or layer id comes near, and each fits an int64)."""
    if name[:2] != _CHUNK:
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
    (a superset of the groups :func:`~r3_client.codec.needed_chunks` keeps; the rule the
    store's ``segment_fields.lua`` applies too)."""
    if layers and (field.last_layer < min(layers) or field.first_layer > max(layers)):
        return False
    return any(a < field.end and (b is None or field.start < b) for a, b in spans)


def chunks_by_index(names: Sequence[bytes], values: Sequence[bytes]) -> dict[int, bytes]:
    """Chunk values by their index, from the chunk fields' names."""
    out: dict[int, bytes] = {}
    for name, value in zip(names, values, strict=True):
        got = parse_chunk_field(name)
        if got is not None:
            out[got.index] = value
    return out


def chunks_by_segment(fields: dict[bytes, Any]) -> dict[tuple[int, int], dict[int, bytes]]:
    """A hash's chunk fields as read, by segment rows and then by index."""
    out: dict[tuple[int, int], dict[int, bytes]] = {}
    for f, v in fields.items():
        got = parse_chunk_field(f) if f[:2] == _CHUNK else None
        if got is not None:
            out.setdefault((got.seg_start, got.seg_end), {})[got.index] = v
    return out
