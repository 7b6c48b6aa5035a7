"""The entropy stage's pieces: sorted gaps, byte planes, popularity relabelling."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import (
    CodecError,
)
from r3_client._routing import (
    index_dtype,
)
from r3_client._setrank import ranker
from r3_client._sortnet import sort_rows


def _raw_dtype(num_experts: int) -> np.dtype[Any]:
    return np.dtype("u1") if num_experts <= 255 else np.dtype("<u2")


def _gap_planes(gaps: npt.NDArray[Any], dtype: np.dtype[Any]) -> bytes:
    """Gaps as bytes; 16-bit gaps as a low-byte plane then a high-byte plane.

    The high bytes are almost all zero, so splitting them out lets zstd code
    each plane with its own statistics: ~17% smaller and ~5x faster to compress
    than interleaved uint16 on E=384 routing (measured in bench/codec_bench.py).
    """
    if dtype.itemsize == 1:
        return gaps.astype(dtype).tobytes()
    wide = gaps.astype(np.uint16)
    return (wide & 0xFF).astype(np.uint8).tobytes() + (wide >> 8).astype(np.uint8).tobytes()


def _gap_dtype(e: int, k: int) -> np.dtype[Any]:
    return np.dtype("u1") if e - k + 1 <= 255 else np.dtype("<u2")


def _popularity(srt: npt.NDArray[Any], e: int) -> npt.NDArray[Any]:
    """``[L, E]`` order table: each layer's experts by descending count (ties by id)."""
    nl = srt.shape[1]
    counts = np.empty((nl, e), dtype=np.int64)
    for layer in range(nl):
        # One layer at a time: each bincount holds the GIL briefly (a single one over
        # 6M ids held it ~8 ms, stalling the event loop of an engine encoding in a
        # thread).  -1 rows shift to bin 0, which is dropped.
        ids = srt[:, layer, :].astype(np.intp).reshape(-1) + 1
        counts[layer] = np.bincount(ids, minlength=e + 1)[1 : e + 1]
    return np.argsort(-counts, axis=1, kind="stable").astype(_raw_dtype(e))


def _inverse(order: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Inverse relabel tables: ``order[l, rank] = expert`` -> ``to_rank[l, expert] = rank``."""
    inv = np.empty_like(order)
    np.put_along_axis(inv, order.astype(np.intp), np.arange(order.shape[1])[None, :], axis=1)
    return inv


def _gap_payload(srt: npt.NDArray[Any], e: int, k: int, to_rank: npt.NDArray[Any] | None) -> bytes:
    """Gap planes of canonical rows ``[rows, layers, K]``, layer-major, relabelled by
    ``to_rank`` (``[layers, E]``) when given; a -1 row is the impossible first gap."""
    # Work layer-major ([L, R, K], contiguous) in the narrow index dtype: every pass
    # below is memory-bound, so fewer bytes is faster.
    ids = np.ascontiguousarray(srt.transpose(1, 0, 2), dtype=index_dtype(e))
    empty = ids[..., 0] < 0
    if to_rank is not None:
        # Flat (layer, expert) indices; -1 rows go to one extra slot that maps to -1.
        nl = ids.shape[0]
        offset = (np.arange(nl, dtype=np.int64) * e)[:, None, None]
        flat = np.where(ids < 0, nl * e, ids + offset)
        lookup = np.append(to_rank.astype(ids.dtype).reshape(-1), ids.dtype.type(-1))
        ids = sort_rows(lookup.take(flat))
    gaps = np.empty_like(ids)
    gaps[..., 0] = ids[..., 0]
    np.subtract(ids[..., 1:], ids[..., :-1], out=gaps[..., 1:])
    gaps[..., 1:] -= 1
    gaps[empty] = 0
    gaps[..., 0][empty] = e - k + 1
    return _gap_planes(gaps, _gap_dtype(e, k))


def _set_ok(e: int, k: int) -> bool:
    try:
        ranker(e, k)
    except CodecError:
        return False
    return True


def _planes_to_gaps(
    payload: bytes, shape: tuple[int, int, int], gdt: np.dtype[Any], *, offset: int = 0
) -> npt.NDArray[Any]:
    """Inverse of :func:`_gap_planes`: gaps ``shape`` (layer-major) from ``payload[offset:]``."""
    if gdt.itemsize == 1:
        return np.frombuffer(payload, dtype=np.uint8, offset=offset).reshape(shape)
    n = shape[0] * shape[1] * shape[2]
    planes = np.frombuffer(payload, dtype=np.uint8, offset=offset)
    wide = planes[:n].astype(np.uint16)
    wide |= planes[n:].astype(np.uint16) << 8
    return wide.reshape(shape)


def _gaps_to_ids(
    gaps: npt.NDArray[Any],
    e: int,
    k: int,
    order: npt.NDArray[Any] | None,
    *,
    check_order: bool = False,
) -> npt.NDArray[Any]:
    """Layer-major gaps ``[L, R, K]`` to token-major ids ``[R, L, K]`` (checks every rule).

    ``order`` is the ``[L, E]`` relabel table (rank -> expert), or None; with
    ``check_order`` it is checked to be a permutation first (a v1 body carries its
    own; a v2 context's was checked when it was parsed).
    """
    nl = gaps.shape[0]
    empty = gaps[..., 0] == e - k + 1
    if empty.any() and gaps[empty][:, 1:].any():
        raise CodecError("set-zstd body has a malformed empty-row marker")
    if gaps.max(initial=0) > e - k + 1:
        raise CodecError("set-zstd gap larger than the expert count allows: body is corrupt")
    # ids = cumsum(gap + 1) - 1 along K, column by column, in the narrow index dtype
    # unless K gaps of up to E-K+1 could overflow it.
    dt = index_dtype(e) if k * (e - k + 2) < np.iinfo(np.int16).max else np.dtype(np.int32)
    ids = np.empty(gaps.shape, dtype=dt)
    ids[..., 0] = gaps[..., 0]
    for j in range(1, k):
        np.add(ids[..., j - 1], gaps[..., j], out=ids[..., j], dtype=dt)
        ids[..., j] += 1
    ids[empty] = 0
    if ids[..., -1].max(initial=0) >= e:
        raise CodecError("set-zstd gaps run past the expert count: body is corrupt")
    if order is not None:
        if check_order and not (np.sort(order, axis=1) == np.arange(e)).all():
            raise CodecError("set-zstd relabel table is not a permutation")
        offset = (np.arange(nl, dtype=np.int32) * e)[:, None, None]
        ids = order.astype(dt).reshape(-1).take(ids + offset)
    ids[empty] = -1
    return np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=index_dtype(e))
