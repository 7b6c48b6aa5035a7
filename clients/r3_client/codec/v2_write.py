"""Format v2 and v3 writing: chunked frames (token blocks x layer groups), context frames.

v3 is v2's layout with other checksums and digest (docs/format.md section 18): CRC-32C per
chunk, a trailing CRC-32C over the prefix and header only, a BLAKE3 content digest, and by
default v3's tuned zstd setting for ``set-zstd``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import Segment
from r3_client.codec.bodies import (
    encode_chunk,
    popularity,
    set_no_larger,
    set_ok,
    trial_rows,
    zset_chunk,
)
from r3_client.codec.frame import (
    BLOCK_ROWS,
    CODECS,
    CONTEXT_CODEC,
    LAYER_GROUPS,
    MAX_TABLE_ENTRIES,
    MIN_GROUPED,
    assemble_frame,
    chunk_crc,
)
from r3_client.codec.header import (
    Context,
    content_digest,
    inverse_order,
    segment_fields,
    write_provenance,
)

__all__ = ["encode_context", "encode_v2"]


def _plan(
    rows: int, nl: int, k: int, block_rows: int | None, groups: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rows per block and layers per group for an encoder (balanced layer groups)."""
    br = BLOCK_ROWS if block_rows is None else block_rows
    if br < 1:
        raise ShapeError("block_rows must be >= 1")
    ng = (
        (min(nl, LAYER_GROUPS) if rows * nl * k >= MIN_GROUPED else 1) if groups is None else groups
    )
    if not 1 <= ng <= nl:
        raise ShapeError(f"layer_groups must be in [1, {nl}]")
    blocks = tuple(min(br, rows - a) for a in range(0, rows, br))
    per, extra = divmod(nl, ng)
    return blocks, tuple(per + (1 if g < extra else 0) for g in range(ng))


def encode_v2(
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    *,
    num_experts: int,
    layers: tuple[int, ...],
    start: int,
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    codec: str,
    level: int | None,
    base: Context | None,
    block_rows: int | None,
    layer_groups: int | None,
    version: int = 2,
) -> bytes:
    """A format v2 or v3 frame of validated routing (``srt``: its canonical rows); see
    :func:`r3_client.codec.encode_frame` for the arguments.  ``level`` None: zstd level 3
    in v2; in v3 the tuned fast setting for relabelled gaps and level 3 for plain ones
    (:func:`_zstd_level`)."""
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
        codec = "set-zstd" if set_ok(e, k) else "raw"  # set-zstd vs set: a trial, below
    own: Context | None = None
    ctx = base
    decided = False
    if base is None:
        relabel_own = codec == "set-zstd" and rows >= e and nl * e <= MAX_TABLE_ENTRIES
        trial = trial_rows(rows, nl)
        if auto and relabel_own and version >= 3 and trial < rows:
            # v3 policy (docs/format.md 18.3): the trial relabels by its own rows' table, so
            # a frame that ends up `set` (uniform routing) never counts the whole frame.
            decided = True
            trial_rank = inverse_order(popularity(srt[:trial], e))
            if _trial_says_set(srt, e, k, _zstd_level(level, version, True), trial_rank):
                codec, relabel_own = "set", False
        table = popularity(srt, e) if relabel_own else None
        own = ctx = Context.build(e, k, layers, table)
    assert ctx is not None
    relabel = codec == "set-zstd" and ctx.table is not None
    ctx_pos = [ctx.layer_ids.index(lid) for lid in layers]
    to_rank = ctx.to_rank(ctx_pos) if relabel else None
    gbounds = list(itertools.accumulate(groups, initial=0))
    run_trial = auto and codec == "set-zstd" and not decided
    level = _zstd_level(level, version, relabel)
    if run_trial and _trial_says_set(srt, e, k, level, to_rank):
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
                encode_chunk(
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
    header["chunks"] = [[len(c), chunk_crc(version, c)] for c in chunks]
    header.update(
        _segment_header(segment, provenance, start, start + rows, e, layers, srt, version)
    )
    return assemble_frame(version, CODECS[codec], header, chunks)


def _zstd_level(level: int | None, version: int, relabel: bool) -> int | None:
    """The zstd setting of a frame's set-zstd chunks: the caller's ``level`` when given; else
    level 3 in v2, and in v3 the tuned fast setting (None) for relabelled gaps and level 3
    for plain ones.  Measured per chunk at Qwen3, Kimi-K2 and E=512 shapes, 16 to 2,048
    rows: the fast setting is 5-17% smaller than level 3 on relabelled gaps at every size,
    and 7-16% larger on plain gaps (docs/format.md 18.3)."""
    if level is not None:
        return level
    return None if version >= 3 and relabel else 3


def _segment_header(
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    start: int,
    end: int,
    e: int,
    layers: tuple[int, ...],
    srt: npt.NDArray[Any],
    version: int,
) -> dict[str, Any]:
    """The header's ``segment`` and content ``digest``, or its provenance ``segments``."""
    seg = segment if segment is not None else (None if provenance else Segment(start, end))
    if seg is not None:
        digest = content_digest(e, layers, seg, srt, canonical=True, version=version)
        return {"segment": segment_fields(seg), "digest": bytes.fromhex(digest)}
    return {"segments": write_provenance(provenance, start, end)}


def _trial_says_set(
    srt: npt.NDArray[Any], e: int, k: int, level: int | None, to_rank: npt.NDArray[Any] | None
) -> bool:
    """``auto``'s choice: True when a set-zstd trial is no smaller than ``set``'s fixed width."""
    rows, nl, _ = srt.shape
    trial = trial_rows(rows, nl)
    return set_no_larger(len(zset_chunk(srt[:trial], e, k, level, to_rank)), trial, nl, e, k)


def encode_context(context: Context) -> bytes:
    """A context frame: the rollout context continuation frames name, with no rows.

    Always format v2 (codec id 3): a context does not depend on the version of the frames
    that name it, so v2 and v3 continuation frames of one rollout share it."""
    return assemble_frame(2, CONTEXT_CODEC, {"ctx": context.raw}, ())
