"""Format v1 bodies: ``raw``, ``set`` and ``set-zstd`` (encode and decode)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3_client._codec_gaps import (
    _gap_dtype,
    _gap_payload,
    _gaps_to_ids,
    _inverse,
    _planes_to_gaps,
    _popularity,
    _raw_dtype,
)
from r3_client._exceptions import (
    CodecError,
    FormatError,
)
from r3_client._frame import (
    _TRIAL_ROWS,
    _check_decoded_size,
)
from r3_client._inflate import inflate_exact
from r3_client._routing import (
    canonical_rows,
    index_dtype,
)
from r3_client._setrank import pack_bits, ranker, unpack_bits


def _encode_body(
    codec: str, arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[dict[str, Any], bytes]:
    if codec == "raw":
        return _raw_encode(arr, e)
    if codec == "set":
        return _set_encode(srt, e, k)
    return _zset_encode(srt, e, k, level)


def _auto_encode(
    arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[str, dict[str, Any], bytes]:
    """``set`` or ``set-zstd``, whichever a trial says is smaller; ``raw`` if set cannot.

    The trial compresses the first ``_TRIAL_ROWS`` rows (contiguous tokens,
    all layers) with ``set-zstd`` and compares with ``set``'s exact fixed width.
    When the trial is the whole input its body is reused.
    """
    try:
        bits = ranker(e, k).bits
    except CodecError:
        return ("raw", *_raw_encode(arr, e))
    rows, nl, _ = srt.shape
    trial_rows = max(1, _TRIAL_ROWS // nl)
    params, zbody = _zset_encode(srt[:trial_rows], e, k, level)
    if len(zbody) >= min(trial_rows, rows) * nl * bits / 8:
        return ("set", *_set_encode(srt, e, k))
    if trial_rows >= rows:
        return "set-zstd", params, zbody
    return ("set-zstd", *_zset_encode(srt, e, k, level))


def _raw_encode(arr: npt.NDArray[Any], e: int) -> tuple[dict[str, Any], bytes]:
    dt = _raw_dtype(e)
    # -1 wraps to the dtype's maximum, which is never a valid id (E <= max).
    return {}, np.ascontiguousarray(arr).astype(dt).tobytes()


def _set_encode(srt: npt.NDArray[Any], e: int, k: int) -> tuple[dict[str, Any], bytes]:
    rk = ranker(e, k)
    flat = srt.reshape(-1, k)
    lo, hi = rk.rank(flat, flat[:, 0] < 0)
    if hi is None:
        return {}, pack_bits(lo, rk.bits)
    return {}, pack_bits(lo, 64) + pack_bits(hi, rk.bits - 64)


def _zset_encode(srt: npt.NDArray[Any], e: int, k: int, level: int) -> tuple[dict[str, Any], bytes]:
    """v1 ``set-zstd``: one zstd frame of [relabel table] + gap planes over all rows."""
    relabel = srt.shape[0] >= e  # a popularity table pays for itself only with enough tokens
    order = _popularity(srt, e) if relabel else None
    table_bytes = b"" if order is None else order.tobytes()
    payload = table_bytes + _gap_payload(srt, e, k, None if order is None else _inverse(order))
    return {"relabel": relabel}, zstandard.ZstdCompressor(level=level).compress(payload)


def _raw_decode(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    dt = _raw_dtype(e)
    _check_decoded_size(shape[0], shape[1] * shape[2], "raw")
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


def _set_decode(body: memoryview, shape: tuple[int, int, int], e: int) -> npt.NDArray[Any]:
    rows, nl, k = shape
    _check_decoded_size(rows, nl, "set")
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


def _zset_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, relabel: bool
) -> npt.NDArray[Any]:
    rows, nl, k = shape
    _check_decoded_size(rows, nl * k, "set-zstd")
    gdt = _gap_dtype(e, k)
    tdt = _raw_dtype(e)
    table_len = nl * e * tdt.itemsize if relabel else 0
    want = table_len + rows * nl * k * gdt.itemsize
    payload = inflate_exact(body, want, "set-zstd body")
    assert payload is not None
    gaps = _planes_to_gaps(payload, (nl, rows, k), gdt, offset=table_len)
    order = np.frombuffer(payload, dtype=tdt, count=nl * e).reshape(nl, e) if relabel else None
    return _gaps_to_ids(gaps, e, k, order, check_order=True)
