"""Body coders: ``raw``, ``set`` and the ``set-zstd`` entropy stage (sorted gaps, byte
planes, popularity relabelling), and the v2 chunk coders built from them.

A v1 body is one of these over the whole frame; a v2 body is one per chunk (a block
of token rows by a layer group).  Every decoder checks what it reads: a body that
does not decode to valid routing raises :class:`CodecError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import CodecError, FormatError
from r3_client._kernels import native as _native
from r3_client._kernels.sortnet import sort_rows
from r3_client._routing import canonical_rows, index_dtype
from r3_client.codec.frame import TRIAL_ROWS, check_decoded_size, raw_dtype, zstd_compressor
from r3_client.codec.inflate import inflate_exact
from r3_client.codec.setrank import pack_bits, ranker, unpack_bits

__all__ = [
    "chunk_body_size",
    "encode_chunk",
    "gap_dtype",
    "gap_payload",
    "gaps_to_ids",
    "planes_to_gaps",
    "popularity",
    "raw_decode",
    "raw_encode",
    "set_decode",
    "set_encode",
    "set_no_larger",
    "set_ok",
    "trial_rows",
    "zset_chunk",
    "zset_chunk_decode",
    "zset_chunk_payload",
]


# ---- raw and set -----------------------------------------------------------------------------
def raw_encode(arr: npt.NDArray[Any], e: int) -> tuple[dict[str, Any], bytes]:
    """``raw``: ids in :func:`raw_dtype`, token-major, the writer's within-row order kept."""
    dt = raw_dtype(e)
    native = _native.raw_encode(arr, e, arr.size * dt.itemsize)
    if native is not None:
        return {}, bytes(native)
    # -1 wraps to the dtype's maximum, which is never a valid id (E <= max).
    return {}, np.ascontiguousarray(arr).astype(dt).tobytes()


def set_encode(srt: npt.NDArray[Any], e: int, k: int) -> tuple[dict[str, Any], bytes]:
    """``set``: each canonical row's rank, bit-packed at the ranker's width."""
    rk = ranker(e, k)
    if srt.ndim == 3:
        nbytes = chunk_body_size("set", srt.shape[0], srt.shape[1], e, k)
        assert nbytes is not None
        native = _native.set_encode(srt, e, k, rk.bits, nbytes)
        if native is not None:
            return {}, bytes(native)
    flat = srt.reshape(-1, k)
    lo, hi = rk.rank(flat, flat[:, 0] < 0)
    if hi is None:
        return {}, pack_bits(lo, rk.bits)
    return {}, pack_bits(lo, 64) + pack_bits(hi, rk.bits - 64)


def raw_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, out: npt.NDArray[Any] | None = None
) -> npt.NDArray[Any]:
    """Inverse of :func:`raw_encode`; the rows are checked to be valid routing.

    Writes into ``out`` (``shape``, the index dtype) when given, and returns it."""
    check_decoded_size(shape[0], shape[1] * shape[2], "raw")
    # Any other length is refused by the reference before it allocates: so here too.
    if len(body) == chunk_body_size("raw", shape[0], shape[1], e, shape[2]):
        dest = np.empty(shape, dtype=index_dtype(e)) if out is None else out
        if _native.raw_decode(body, e, dest):
            return dest
    return _place(_raw_reference(body, shape, e), out, "a raw body")


def _place(decoded: npt.NDArray[Any], out: npt.NDArray[Any] | None, what: str) -> npt.NDArray[Any]:
    """The reference's rows, written into ``out`` when given; notes a native refusal."""
    if _native.backend() == "native":
        _native.disagreed(what)
    if out is None:
        return decoded
    out[...] = decoded
    return out


def _raw_reference(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    dt = raw_dtype(e)
    want = shape[0] * shape[1] * shape[2] * dt.itemsize
    if len(body) != want:
        raise CodecError(f"raw body is {len(body)} bytes, expected {want}")
    u = np.frombuffer(body, dtype=dt).reshape(shape)
    out = u.astype(index_dtype(e))
    out[u == np.iinfo(dt).max] = -1
    try:
        canonical_rows(out, e)
    except FormatError as exc:
        raise CodecError(f"raw body holds invalid routing: {exc}") from None
    return out


def set_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, out: npt.NDArray[Any] | None = None
) -> npt.NDArray[Any]:
    """Inverse of :func:`set_encode`: ascending rows (into ``out`` when given)."""
    rows, nl, k = shape
    check_decoded_size(rows, nl, "set")
    rk = ranker(e, k)
    if len(body) == chunk_body_size("set", rows, nl, e, k):  # else refused before allocating
        dest = np.empty(shape, dtype=index_dtype(e)) if out is None else out
        if _native.set_decode(body, e, k, rk.bits, dest):
            return dest
    return _place(_set_reference(body, shape, e), out, "a set body")


def _set_reference(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    rows, nl, k = shape
    rk = ranker(e, k)
    n = rows * nl
    if rk.wide:
        split = n * 8
        if len(body) < split:
            raise CodecError(f"set body is {len(body)} bytes, expected more than {split}")
        lo = unpack_bits(body[:split], n, 64)
        hi = unpack_bits(body[split:], n, rk.bits - 64)
    else:
        lo, hi = unpack_bits(body, n, rk.bits), None
    return rk.unrank(lo, hi).reshape(shape)


def set_ok(e: int, k: int) -> bool:
    """Whether ``set`` can code ``C(E, K)`` (at most 128 bits)."""
    try:
        ranker(e, k)
    except CodecError:
        return False
    return True


def trial_rows(rows: int, nl: int) -> int:
    """Token rows ``auto``'s trial codes: :data:`TRIAL_ROWS` entries' worth (all layers),
    at least one, at most ``rows``."""
    return min(rows, max(1, TRIAL_ROWS // nl))


def set_no_larger(zset_bytes: int, rows: int, nl: int, e: int, k: int) -> bool:
    """``auto``'s choice: True when ``set``'s fixed width over ``rows x nl`` is no larger than
    a set-zstd body of ``zset_bytes`` coding the same rows."""
    return bool(zset_bytes >= rows * nl * ranker(e, k).bits / 8)


# ---- the set-zstd entropy stage ----------------------------------------------------------------
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


def gap_dtype(e: int, k: int) -> np.dtype[Any]:
    """Dtype of one gap: a byte when every gap (at most ``E - K + 1``) fits one."""
    return np.dtype("u1") if e - k + 1 <= 255 else np.dtype("<u2")


def popularity(srt: npt.NDArray[Any], e: int) -> npt.NDArray[Any]:
    """``[L, E]`` order table: each layer's experts by descending count (ties by id)."""
    native = _native.popularity(srt, e, raw_dtype(e))
    if native is not None:
        return native
    nl = srt.shape[1]
    counts = np.empty((nl, e), dtype=np.int64)
    for layer in range(nl):
        # One layer at a time: each bincount holds the GIL briefly (a single one over
        # 6M ids held it ~8 ms, stalling the event loop of an engine encoding in a
        # thread).  -1 rows shift to bin 0, which is dropped.
        ids = srt[:, layer, :].astype(np.intp).reshape(-1) + 1
        counts[layer] = np.bincount(ids, minlength=e + 1)[1 : e + 1]
    return np.argsort(-counts, axis=1, kind="stable").astype(raw_dtype(e))


def gap_payload(
    srt: npt.NDArray[Any], e: int, k: int, to_rank: npt.NDArray[Any] | None
) -> bytes | bytearray:
    """Gap planes of canonical rows ``[rows, layers, K]``, layer-major, relabelled by
    ``to_rank`` (``[layers, E]``) when given; a -1 row is the impossible first gap."""
    native = _native.gap_payload(srt, e, k, to_rank, gap_dtype(e, k).itemsize)
    if native is not None:
        return native
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
    return _gap_planes(gaps, gap_dtype(e, k))


def planes_to_gaps(
    payload: bytes, shape: tuple[int, int, int], gdt: np.dtype[Any], *, offset: int = 0
) -> npt.NDArray[Any]:
    """Inverse of the gap planes: gaps ``shape`` (layer-major) from ``payload[offset:]``."""
    if gdt.itemsize == 1:
        return np.frombuffer(payload, dtype=np.uint8, offset=offset).reshape(shape)
    n = shape[0] * shape[1] * shape[2]
    planes = np.frombuffer(payload, dtype=np.uint8, offset=offset)
    wide = planes[:n].astype(np.uint16)
    wide |= planes[n:].astype(np.uint16) << 8
    return wide.reshape(shape)


def gaps_to_ids(
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


# ---- v2 chunks -------------------------------------------------------------------------------
def zset_chunk(
    sub: npt.NDArray[Any], e: int, k: int, level: int | None, to_rank: npt.NDArray[Any] | None
) -> bytes:
    """One v2/v3 set-zstd chunk: ``sub`` is ``[rows, layers, K]`` canonical (ascending) rows;
    ``level`` None: v3's tuned fast setting (:data:`~r3_client.codec.frame.V3_ZSTD`)."""
    return zstd_compressor(level).compress(gap_payload(sub, e, k, to_rank))


def encode_chunk(
    codec: str,
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    e: int,
    k: int,
    level: int | None,
    to_rank: npt.NDArray[Any] | None,
) -> bytes:
    """One v2/v3 chunk in ``codec`` (``arr`` as written, ``srt`` its canonical rows)."""
    if codec == "raw":
        return raw_encode(arr, e)[1]
    if codec == "set":
        return set_encode(srt, e, k)[1]
    return zset_chunk(srt, e, k, level, to_rank)


def chunk_body_size(codec: str, rows: int, nl: int, e: int, k: int) -> int | None:
    """Exact body bytes of a raw or set chunk; None for set-zstd (compressed)."""
    if codec == "raw":
        return rows * nl * k * raw_dtype(e).itemsize
    if codec == "set":
        n, bits = rows * nl, ranker(e, k).bits
        return n * 8 + -(-n * (bits - 64) // 8) if bits > 64 else -(-n * bits // 8)
    return None


def zset_chunk_payload(rows: int, nl: int, e: int, k: int) -> int:
    """Bytes a set-zstd chunk of ``rows x nl`` inflates to (its zstd frame must declare them)."""
    return rows * nl * k * gap_dtype(e, k).itemsize


def zset_chunk_decode(
    body: memoryview,
    shape: tuple[int, int, int],
    e: int,
    order: npt.NDArray[Any] | None,
    out: npt.NDArray[Any] | None = None,
) -> npt.NDArray[Any]:
    """Inverse of :func:`zset_chunk` (``order``: the chunk's layers' relabel tables); into
    ``out`` when given."""
    rows, nl, k = shape
    gdt = gap_dtype(e, k)
    payload = inflate_exact(body, zset_chunk_payload(rows, nl, e, k), "set-zstd chunk")
    assert payload is not None
    dest = np.empty(shape, dtype=index_dtype(e)) if out is None else out
    if _native.zset_decode(payload, e, order, dest):
        return dest
    decoded = gaps_to_ids(planes_to_gaps(payload, (nl, rows, k), gdt), e, k, order)
    return _place(decoded, out, "a set-zstd chunk")
