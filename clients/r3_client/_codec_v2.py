"""Format v2 writing: continuation contexts, content digests, chunked blocks x layer groups."""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import zstandard

from r3_client._codec_gaps import (
    _gap_payload,
    _inverse,
    _popularity,
    _raw_dtype,
    _set_ok,
)
from r3_client._codec_v1 import (
    _raw_encode,
    _set_encode,
)
from r3_client._exceptions import (
    CodecError,
    FormatError,
    FrameError,
    ShapeError,
)
from r3_client._frame import (
    _CRC,
    _MIN_GROUPED,
    _PREFIX,
    _TRIAL_ROWS,
    BLOCK_ROWS,
    CODECS,
    CONTEXT_CODEC,
    LAYER_GROUPS,
    MAGIC,
    MAX_HEADER,
    MAX_TABLE_ENTRIES,
    _int,
    _unpack_map,
    provenance_field,
)
from r3_client._inflate import inflate_exact
from r3_client._routing import (
    Segment,
    check_layer_ids,
    check_params,
)
from r3_client._setrank import ranker
from r3_client._sortnet import sort_rows


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
            payload = inflate_exact(blob, want, "context table", check_only=not tables)
            if payload is not None:
                table = np.frombuffer(payload, dtype=_raw_dtype(e)).reshape(len(layers), e)
                if not (np.sort(table, axis=1) == np.arange(e)).all():
                    raise CodecError("context relabel table is not a permutation")
        return cls._from(bytes(raw), doc, table)

    def to_rank(self, positions: Sequence[int]) -> npt.NDArray[Any]:
        """``[len(positions), E]`` inverse tables (expert -> rank) for these layer positions."""
        assert self.table is not None
        return _inverse(self.table[list(positions)])


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
    header.update(_segment_header(segment, provenance, start, start + rows, e, layers, srt))
    return _assemble_frame(2, CODECS[codec], header, chunks)


def _segment_header(
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    start: int,
    end: int,
    e: int,
    layers: tuple[int, ...],
    srt: npt.NDArray[Any],
) -> dict[str, Any]:
    """The header's ``segment`` and content ``digest``, or its provenance ``segments``."""
    seg = segment if segment is not None else (None if provenance else Segment(start, end))
    if seg is not None:
        digest = bytes.fromhex(content_digest(e, layers, seg, srt, canonical=True))
        return {"segment": _segment_fields(seg), "digest": digest}
    return {"segments": provenance_field(provenance, start, end)}


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
