"""What a frame says about itself: :class:`FrameHeader`, :class:`Frame`, and the rollout
:class:`Context` a v2 header carries (``ctx``) or names (``base``).

Also the header fields every version shares: the content digest, provenance (the
``segments`` list) and a v2 ``segment`` map.  A context is part of the header, so
the two types live together and neither imports a codec module above this one.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import blake3
import msgpack
import numpy as np
import numpy.typing as npt
import zstandard

from r3_client._exceptions import CodecError, FormatError, FrameError, ShapeError
from r3_client._kernels.sortnet import sort_rows
from r3_client._routing import (
    Routing,
    Segment,
    check_layer_ids,
    check_params,
    index_dtype,
)
from r3_client.codec.frame import (
    FORMAT_VERSION,
    MAX_HEADER,
    MAX_SEGMENTS,
    MAX_TABLE_ENTRIES,
    int_field,
    raw_dtype,
    unpack_map,
)
from r3_client.codec.inflate import inflate_exact

__all__ = [
    "SEGMENT_TEXT",
    "Context",
    "Frame",
    "FrameHeader",
    "check_provenance",
    "content_digest",
    "inverse_order",
    "read_provenance",
    "segment_fields",
    "write_provenance",
]


def inverse_order(order: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Inverse relabel tables: ``order[l, rank] = expert`` -> ``to_rank[l, expert] = rank``."""
    inv = np.empty_like(order)
    np.put_along_axis(inv, order.astype(np.intp), np.arange(order.shape[1])[None, :], axis=1)
    return inv


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
            table = np.ascontiguousarray(table, dtype=raw_dtype(num_experts))
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
        """Check ``ctx`` bytes; inflate the table only when ``tables`` (bounded by its size).

        Parsed contexts are remembered by their bytes (:data:`CONTEXT_CACHE` of them):
        every frame of a rollout carries or names the same one, and a reader parses a
        header per read (hashing, inflating and checking a 48 x 128 table each time held
        the GIL a training loop needs).  A :class:`Context` is immutable, its table
        read-only, so one may be shared."""
        if len(raw) > MAX_HEADER:
            raise FrameError(f"context is {len(raw)} bytes; the limit is {MAX_HEADER}")
        return _parse_context(bytes(raw), tables)

    @classmethod
    def _parse(cls, raw: bytes, tables: bool) -> Context:
        doc = unpack_map(raw, "context", allow_bin=True)
        keys = set(doc)
        if not {"E", "K", "layers"} <= keys <= {"E", "K", "layers", "table"}:
            raise FrameError(f"context keys {sorted(map(str, keys))} are not E, K, layers[, table]")
        try:
            e, k = int_field(doc["E"], "E"), int_field(doc["K"], "K")
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
            want = entries * raw_dtype(e).itemsize
            payload = inflate_exact(blob, want, "context table", check_only=not tables)
            if payload is not None:
                table = np.frombuffer(payload, dtype=raw_dtype(e)).reshape(len(layers), e)
                table.flags.writeable = False  # shared through the cache
                if not (np.sort(table, axis=1) == np.arange(e)).all():
                    raise CodecError("context relabel table is not a permutation")
        return cls._from(raw, doc, table)

    def subset(self, layer_ids: Sequence[int]) -> Context:
        """This context for ``layer_ids`` only (each one of its layers): the same E and K, the
        relabel table's rows of those layers.  What a slice by layer carries instead of the
        whole context (a pipeline stage's 12 of 48 layers: ~1.5 KB of the ~6 KB table at
        the Qwen3 shape); a new context, so a new digest.  Itself when nothing is dropped.
        Remembered per process (:data:`CONTEXT_CACHE` of them)."""
        ids = tuple(int(i) for i in layer_ids)
        if ids == self.layer_ids:
            return self
        missing = sorted(set(ids) - set(self.layer_ids))
        if missing:
            raise ShapeError(f"layer ids {missing[:8]} are not the context's")
        return _subset_context(self.raw, ids)

    def to_rank(self, positions: Sequence[int]) -> npt.NDArray[Any]:
        """``[len(positions), E]`` inverse tables (expert -> rank) for these layer positions."""
        assert self.table is not None
        return inverse_order(self.table[list(positions)])


#: Parsed contexts a process remembers (a context with its table is ~7 KB at 48 x 128).
CONTEXT_CACHE = 512


@functools.lru_cache(maxsize=CONTEXT_CACHE)
def _parse_context(raw: bytes, tables: bool) -> Context:
    """:meth:`Context.parse`, once per distinct ``(raw, tables)`` (errors are not kept)."""
    return Context._parse(raw, tables)


@functools.lru_cache(maxsize=CONTEXT_CACHE)
def _subset_context(raw: bytes, layer_ids: tuple[int, ...]) -> Context:
    """:meth:`Context.subset`, once per distinct ``(raw, layer_ids)``."""
    full = Context.parse(raw)
    if full.has_table and full.table is None:
        full = Context.parse(raw, tables=True)
    pos = [full.layer_ids.index(i) for i in layer_ids]
    table = None if full.table is None else full.table[pos]
    return Context.build(full.num_experts, full.topk, layer_ids, table)


def content_digest(
    num_experts: int,
    layer_ids: Sequence[int],
    segment: Segment,
    rows: npt.NDArray[Any],
    *,
    canonical: bool = False,
    version: int = FORMAT_VERSION,
) -> str:
    """A segment's meta and its rows as *sets*, hashed: codec- and order-independent.

    What a writer puts in the header (``digest``) and the store uses for idempotence and
    dedupe without decoding: two frames of the same rows under the same segment and format
    version have the same digest whatever codec wrote them (docs/format.md section 10).
    ``version`` 2: SHA-256 over the rows as int32.  ``version`` 3: BLAKE3 over the rows as
    stored (uint8 when E <= 255, else uint16 LE; -1 as the dtype's maximum), a quarter or
    half of the bytes through a hash ~5x faster.
    """
    srt = rows if canonical else sort_rows(np.asarray(rows))
    meta = msgpack.packb([int(num_experts), [int(i) for i in layer_ids], segment.to_dict()])
    flat = srt.reshape(-1)
    if version >= 3:
        # -1 wraps to the dtype's maximum, the raw body's sentinel.
        ids = flat.astype(raw_dtype(num_experts), casting="unsafe")  # one contiguous copy
        return str(blake3.blake3(meta).update(ids.data.cast("B")).hexdigest())
    h = hashlib.sha256()
    h.update(meta)
    # The rows as little-endian int32, a piece at a time: hashlib releases the GIL over
    # each piece, and widening one piece holds it well under a millisecond (widening a
    # 16k-row rollout at 48x8 at once held it ~5 ms; .tobytes() ~20 ms).
    for at in range(0, flat.size, _DIGEST_PIECE):
        h.update(np.ascontiguousarray(flat[at : at + _DIGEST_PIECE], dtype="<i4").data.cast("B"))
    return h.hexdigest()


#: Ids widened per hashlib update in a v2 :func:`content_digest`.
_DIGEST_PIECE = 1 << 17


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
    #: v2/v3: writer-supplied content digest of the segment (see :func:`content_digest`;
    #: SHA-256 in v2, BLAKE3 in v3: equal rows give equal digests within one version).
    digest: str = ""
    #: v2/v3: token rows per block, layers per group, and ``(length, crc)`` per chunk
    #: (CRC-32 in v2, CRC-32C in v3).
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


def read_provenance(hdr: dict[Any, Any]) -> tuple[Segment, ...]:
    """A reader's parse of the header's ``segments`` list (provenance); raises for a bad one."""
    prov = hdr.get("segments", [])
    if not isinstance(prov, list) or len(prov) > MAX_SEGMENTS:
        raise FrameError(f"header segments must be a list of at most {MAX_SEGMENTS}")
    return tuple(Segment.from_dict(p) for p in prov)


def check_provenance(seg: Segment | None, segs: tuple[Segment, ...], start: int, end: int) -> None:
    """A frame is one segment or lists provenance, and provenance overlaps its rows."""
    if seg is not None and segs:
        raise FrameError("a frame carries either segment or segments, not both")
    if not all(p.overlaps(start, end) for p in segs):
        raise FrameError("a provenance segment does not overlap the frame's rows")


def write_provenance(provenance: tuple[Segment, ...], start: int, end: int) -> list[Any]:
    """A writer's header ``segments``: each overlapping ``[start, end)``, at most MAX_SEGMENTS."""
    if len(provenance) > MAX_SEGMENTS or not all(p.overlaps(start, end) for p in provenance):
        raise ShapeError(
            f"segments must overlap the rows [{start}, {end}) and number at most {MAX_SEGMENTS}"
        )
    return [p.to_dict() for p in provenance]


#: The text fields a v2 ``segment`` map may hold (its rows are the frame's).
SEGMENT_TEXT: Final = ("model_id", "weight_version", "tokens_digest")


def segment_fields(seg: Segment) -> dict[str, str]:
    """A v2 ``segment`` map: the non-empty text fields (its rows are the frame's)."""
    return {name: getattr(seg, name) for name in SEGMENT_TEXT if getattr(seg, name)}
