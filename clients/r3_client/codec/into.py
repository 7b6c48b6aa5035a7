"""A read's frames decoded straight into a rank's int64 targets (issue 44).

:func:`decode_rollout` decodes a read's frames into a new array of the routing's own dtype,
which a rank-local layout then copies into its int64 targets.  :func:`plan_into` reads the
same frames' headers and plans, per frame, the compiled call that writes the wanted rows
and layers straight into a window of those targets (``_kernels.native.decode_into``: the
chunks decoded there, the GIL released once for a whole micro-batch).  It takes only reads
whose answer is their frames alone and that every frame of which the compiled call decodes
exactly as the reference would: version 3 routing frames (a v2 chunk's CRC-32 is checked in
Python), no overlapping frames, every row of the range held by a frame, every wanted layer
in each frame that holds rows of it.  For any other read it answers None, and the caller
decodes by the reference, which raises the exact error where there is one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import FormatError, FrameError, ShapeError
from r3_client._kernels import native as _native
from r3_client._routing import layer_positions
from r3_client.codec.entry import read_header
from r3_client.codec.frame import CODECS, CRC
from r3_client.codec.header import Context, FrameHeader
from r3_client.codec.rollout import read_frames
from r3_client.codec.setrank import ranker
from r3_client.codec.v2_read import chunk_table

__all__ = ["IntoPlan", "plan_into"]

#: The codecs whose chunks the compiled call decodes.
_CHUNK_CODECS = ("raw", "set", "set-zstd")


@dataclass(frozen=True, slots=True)
class _FramePart:
    """One frame's share of a read: its body, chunk table and codec, the rows ``[a, b)`` of
    the read it fills, and the target layer of each of its layers."""

    body: memoryview
    desc: npt.NDArray[np.int64]
    codec_id: int
    order: npt.NDArray[Any] | None
    bits: int
    frame_start: int
    a: int
    b: int
    lmap: npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class IntoPlan:
    """How a read's frames decode into an int64 ``[end - start, len(layer_ids), topk]``
    window: the rows, the layers (absolute ids, as :func:`decode_rollout` orders them for
    the same ``layers``), E and K, and each frame's part (:meth:`jobs`)."""

    start: int
    end: int
    layer_ids: tuple[int, ...]
    num_experts: int
    topk: int
    parts: tuple[_FramePart, ...]
    set_zstd: bool

    def jobs(self, out: npt.NDArray[np.int64]) -> list[_native.IntoJob]:
        """The compiled call's jobs writing this read into ``out`` (int64, the shape above,
        any strides with K contiguous)."""
        if out.shape != (self.end - self.start, len(self.layer_ids), self.topk):
            raise ShapeError(f"target window {out.shape} does not hold the read's rows")
        return [
            (
                p.body,
                p.desc,
                out[p.a - self.start : p.b - self.start],
                self.num_experts,
                p.codec_id,
                p.order,
                p.bits,
                p.a - p.frame_start,
                p.lmap,
            )
            for p in self.parts
        ]


def plan_into(
    data: bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview],
    *,
    start: int,
    end: int,
    layers: Sequence[int] | None,
) -> IntoPlan | None:
    """The plan writing rows ``[start, end)`` of ``layers`` of a read's frames (``data``,
    as :func:`decode_rollout` takes it) into a rank's targets, or None when the compiled
    call does not take the read as it is (see the module's docstring): then decode it
    with :func:`decode_rollout`.  Headers are checked (their CRCs) as the reference checks
    them; chunk CRCs are checked by the compiled call."""
    if not 0 <= start < end or not _native.decodes_into(False):
        return None
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    try:
        contexts, heads = read_frames(pieces)
        frames = [_resolved(view, hdr, contexts) for view, hdr in heads]
    except (FormatError, FrameError):
        return None
    if not frames or any(f is None for f in frames):
        return None
    ok = sorted((f for f in frames if f is not None), key=lambda f: f[1].start)
    first = ok[0][1]
    e, k = first.num_experts, first.topk
    if any((h.num_experts, h.topk) != (e, k) for _, h, _ in ok):
        return None
    if any(g.start < f.end for (_, f, _), (_, g, _) in itertools.pairwise(ok)):
        return None
    all_layers = sorted({lid for _, h, _ in ok for lid in h.layer_ids})
    try:
        kept = tuple(
            all_layers[p]
            for p in layer_positions(all_layers, all_layers if layers is None else layers)
        )
    except ShapeError:
        return None
    where = {lid: i for i, lid in enumerate(kept)}
    parts: list[_FramePart] = []
    covered = start
    for view, hdr, ctx in ok:
        a, b = max(start, hdr.start), min(end, hdr.end)
        if a >= b:
            continue
        if a != covered or any(lid not in hdr.layer_ids for lid in kept):
            return None  # a gap (rows read as -1) or a layer the frame lacks: the reference
        covered = b
        parts.append(_part(view, hdr, ctx, a, b, where))
    if covered != end:
        return None
    set_zstd = any(p.codec_id == CODECS["set-zstd"] for p in parts)
    if set_zstd and not _native.decodes_into(True):
        return None
    return IntoPlan(start, end, kept, e, k, tuple(parts), set_zstd)


def _resolved(
    view: memoryview, hdr: FrameHeader, contexts: dict[str, Context]
) -> tuple[memoryview, FrameHeader, Context] | None:
    """A routing frame with its context (tables inflated), resolved; None when the compiled
    call does not take it (not version 3, or a codec without chunks) or its context is not
    in the read (the reference names that)."""
    if hdr.version != 3 or hdr.codec not in _CHUNK_CODECS:
        return None
    own = hdr.context.digest if hdr.context is not None and not hdr.base else ""
    ctx = contexts.get(hdr.base or own)
    if ctx is None:
        return None
    if hdr.base:  # its geometry from its context (read_header checked the trailer already)
        hdr = read_header(view, verify=False, context=ctx)
    return view, hdr, ctx


def _part(
    view: memoryview, hdr: FrameHeader, ctx: Context, a: int, b: int, where: dict[int, int]
) -> _FramePart:
    """One frame's part of a read of rows ``[a, b)``: its chunk table (decode_chunks'
    desc, with each chunk's CRC-32C), codec, relabel rows and layer map."""
    desc = chunk_table(hdr, hdr.frame_length - CRC.size - hdr.body_length, crcs=True)
    order = None
    if hdr.codec == "set-zstd" and bool(hdr.params["relabel"]):
        assert ctx.table is not None  # (read_frames parses contexts with their tables)
        order = ctx.table[[ctx.layer_ids.index(lid) for lid in hdr.layer_ids]]
    bits = ranker(hdr.num_experts, hdr.topk).bits if hdr.codec == "set" else 0
    lmap = np.array([where.get(lid, -1) for lid in hdr.layer_ids], np.int32)
    return _FramePart(view, desc, CODECS[hdr.codec], order, bits, hdr.start, a, b, lmap)
