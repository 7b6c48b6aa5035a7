"""Which implementation runs the codec's hot loops: the compiled ``_r3codec`` or numpy.

The numpy code in :mod:`r3_client.codec` is the reference and the fallback; the compiled
module (``clients/r3_client/_kernels/_r3codec.c``, built by ``pip install`` / ``make
bootstrap`` with the system compiler) computes the same bytes and arrays with the GIL
released. Each wrapper here returns ``None`` (or False) when the compiled module cannot take
the call (not built, switched off, an input it does not handle, or input it refuses): the
caller then runs the numpy reference, which also raises the exact exception for bad input,
so both backends fail with the same error.

Chosen once at import:

* ``R3_CODEC_BACKEND=numpy`` switches the compiled module off (``native``, the default, uses
  it when it loads);
* ``R3_NATIVE_LIBRARY=/path/to/_r3codec.so`` loads that build instead of the installed one
  (the AddressSanitizer build the fuzz tests run).

When the compiled module should load and does not, one line is logged at WARNING and the
numpy code runs.  :func:`use` switches backends at run time (the differential tests).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BACKEND_ENV",
    "LIBRARY_ENV",
    "backend",
    "canonical",
    "decode_chunks",
    "decode_into",
    "decodes_chunks",
    "decodes_into",
    "disagreed",
    "gap_payload",
    "popularity",
    "raw_decode",
    "raw_encode",
    "set_decode",
    "set_encode",
    "unavailable_reason",
    "use",
    "zset_decode",
]

BACKEND_ENV = "R3_CODEC_BACKEND"
LIBRARY_ENV = "R3_NATIVE_LIBRARY"

_log = logging.getLogger("r3_client")

#: dtypes the compiled kernels read as routing input (native byte order only).
_INPUT_KINDS = {"i1", "i2", "i4", "i8", "u1", "u2", "u4"}


def _load() -> tuple[ModuleType | None, str]:
    """The compiled module and "" or None and why not."""
    wanted = os.environ.get(BACKEND_ENV, "native")
    if wanted == "numpy":
        return None, f"{BACKEND_ENV}=numpy"
    if wanted != "native":
        _log.warning("r3_client: %s=%r is not native or numpy; using native", BACKEND_ENV, wanted)
    path = os.environ.get(LIBRARY_ENV)
    try:
        if path:
            name = "r3_client._kernels._r3codec"
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            assert spec is not None
            mod = importlib.util.module_from_spec(spec)
            loader.exec_module(mod)
        else:
            mod = importlib.import_module("r3_client._kernels._r3codec")
    except (ImportError, OSError) as exc:
        reason = f"the compiled codec did not load ({exc})"
        _log.warning("r3_client: %s; using the numpy codec (slower)", reason)
        return None, reason
    return mod, ""


_lib, _reason = _load()
_active: ModuleType | None = _lib


def backend() -> str:
    """``"native"`` or ``"numpy"``: what the codec's hot loops run on now."""
    return "native" if _active is not None else "numpy"


def unavailable_reason() -> str:
    """Why the compiled module is not in use ("" when it is)."""
    return "" if _active is not None else (_reason or "switched off by use('numpy')")


@contextmanager
def use(name: str) -> Iterator[None]:
    """Run the block on ``"native"`` or ``"numpy"`` (tests; not thread-safe).

    Raises :class:`RuntimeError` for ``"native"`` where the compiled module is not loaded.
    """
    global _active
    if name not in ("native", "numpy"):
        raise ValueError(f"backend must be native or numpy, not {name!r}")
    if name == "native" and _lib is None:
        raise RuntimeError(f"the native codec is not available: {_reason}")
    before = _active
    _active = _lib if name == "native" else None
    try:
        yield
    finally:
        _active = before


def disagreed(what: str) -> None:
    """Record that the compiled module refused input the reference accepted (a backend bug:
    the reference's answer is used; tests assert this never happens)."""
    global disagreements
    disagreements += 1
    _log.warning("r3_client: the native codec refused %s that the numpy reference accepts", what)


#: How many times :func:`disagreed` was called in this process.
disagreements = 0


def _fits(arr: npt.NDArray[Any]) -> bool:
    """An array the kernels read as it is: 3-D, K axis contiguous."""
    return arr.ndim == 3 and (arr.shape[2] == 1 or arr.strides[2] == arr.itemsize)


def _taking(arr: npt.NDArray[Any], k: int) -> ModuleType | None:
    """The compiled module when it is active and takes ``arr`` (3-D, K contiguous) with
    top-k ``k``; None: the caller runs the reference."""
    lib = _active
    if lib is None or not _fits(arr) or not 1 <= k <= int(lib.KMAX):
        return None
    return lib


def _input_dtype(arr: npt.NDArray[Any]) -> bool:
    """Routing the kernels read as given: a native-order integer dtype of theirs."""
    return arr.dtype.str[1:] in _INPUT_KINDS and arr.dtype.isnative


@lru_cache(maxsize=8)
def _tables(e: int, k: int) -> bytes:
    assert _lib is not None
    tables: bytes = _lib.set_tables(e, k)
    return tables


# ---- encode ------------------------------------------------------------------------------
def canonical(arr: npt.NDArray[Any], e: int, out_dtype: np.dtype[Any]) -> npt.NDArray[Any] | None:
    """Validated rows sorted ascending (``[..., K]``, ``out_dtype``), or None: the caller runs
    the reference (also for invalid rows, to raise its exact error)."""
    if arr.ndim < 1 or arr.size == 0 or not _input_dtype(arr):
        return None
    src = arr if _fits(arr) else np.ascontiguousarray(arr).reshape(-1, 1, arr.shape[-1])
    lib = _taking(src, arr.shape[-1])
    if lib is None:
        return None
    out = np.empty(src.shape, dtype=out_dtype)
    code, _ = lib.canonical(src, out, e)
    return None if code else out.reshape(arr.shape)


def popularity(
    srt: npt.NDArray[Any], e: int, table_dtype: np.dtype[Any]
) -> npt.NDArray[Any] | None:
    """The ``[L, E]`` popularity order table of canonical rows, or None (use the reference)."""
    lib = _taking(srt, srt.shape[-1])
    if lib is None:
        return None
    table = np.empty((srt.shape[1], e), dtype=table_dtype)
    lib.popularity(srt, e, table)
    return table


def gap_payload(
    srt: npt.NDArray[Any], e: int, k: int, to_rank: npt.NDArray[Any] | None, gap_bytes: int
) -> bytearray | None:
    """Layer-major gap planes of canonical rows (relabelled by ``to_rank``), or None."""
    lib = _taking(srt, k)
    if lib is None:
        return None
    out = bytearray(srt.size * gap_bytes)
    rank = None if to_rank is None else np.ascontiguousarray(to_rank, dtype=np.int32)
    lib.gap_payload(srt, e, rank, out)
    return out


def set_encode(srt: npt.NDArray[Any], e: int, k: int, bits: int, nbytes: int) -> bytearray | None:
    """Canonical rows' set ranks packed at ``bits`` bits (``nbytes`` in all), or None."""
    lib = _taking(srt, k)
    if lib is None:
        return None
    out = bytearray(nbytes)
    lib.set_encode(srt, e, _tables(e, k), bits, out)
    return out


def raw_encode(arr: npt.NDArray[Any], e: int, nbytes: int) -> bytearray | None:
    """Ids as written, as ``u1``/``<u2`` with -1 as the dtype's maximum, or None."""
    lib = _taking(arr, arr.shape[-1])
    if lib is None or not _input_dtype(arr):
        return None
    out = bytearray(nbytes)
    lib.raw_encode(arr, e, out)
    return out


# ---- decode (into ``out``: a view of the frame's array) ----------------------------------
def set_decode(body: Any, e: int, k: int, bits: int, out: npt.NDArray[Any]) -> bool:
    """Unrank a ``set`` body into ``out``; False when the caller must run the reference."""
    lib = _taking(out, k)
    if lib is None:
        return False
    return lib.set_decode(body, e, _tables(e, k), bits, out) == 0  # type: ignore[no-any-return]


def zset_decode(
    payload: Any, e: int, order: npt.NDArray[Any] | None, out: npt.NDArray[Any]
) -> bool:
    """Inflated set-zstd gap planes into ``out``; False when the caller must run the reference."""
    lib = _taking(out, out.shape[-1])
    if lib is None:
        return False
    dtype = "u1" if e <= 255 else "<u2"
    table = None if order is None else np.ascontiguousarray(order, dtype=dtype)
    return lib.zset_decode(payload, e, table, out) == 0  # type: ignore[no-any-return]


def raw_decode(body: Any, e: int, out: npt.NDArray[Any]) -> bool:
    """A raw body into ``out``, every row checked; False when the caller must run the reference."""
    lib = _taking(out, out.shape[-1])
    if lib is None:
        return False
    return lib.raw_decode(body, e, out) == 0  # type: ignore[no-any-return]


def decodes_chunks(set_zstd: bool, out: npt.NDArray[Any]) -> bool:
    """Whether :func:`decode_chunks` takes a frame into ``out`` (``set_zstd``: its codec is
    set-zstd): the compiled module is active, has the call, takes ``out``, and was built
    with libzstd when the chunks are zstd frames."""
    lib = _taking(out, out.shape[-1])
    if lib is None or not hasattr(lib, "decode_chunks"):  # (an older R3_NATIVE_LIBRARY build)
        return False
    return not set_zstd or bool(getattr(lib, "HAVE_ZSTD", 0))


def decodes_into(set_zstd: bool) -> bool:
    """Whether :func:`decode_into` runs: the compiled module is active, has the call, and
    was built with libzstd when some frame's chunks are zstd frames (``set_zstd``)."""
    lib = _active
    if lib is None or not hasattr(lib, "decode_into"):  # (an older R3_NATIVE_LIBRARY build)
        return False
    return not set_zstd or bool(getattr(lib, "HAVE_ZSTD", 0))


#: One frame for :func:`decode_into`: its body, its chunk table (``decode_chunks``' desc, in
#: the frame's own rows and layers), the int64 ``[R, L, K]`` window of targets it fills, E,
#: its codec id, set-zstd's relabel rows (``[frame layers, E]``) or None, a set frame's rank
#: width (0 for the others), the frame row that is the window's row 0, and the target layer
#: of each frame layer (int32, -1: not wanted).
IntoJob = tuple[Any, Any, Any, int, int, Any, int, int, Any]


def decode_into(jobs: list[IntoJob]) -> tuple[int, int]:
    """The chunks of ``jobs``' frames holding a wanted row and layer, checked (CRC-32C) and
    decoded straight into their int64 windows of a rank's targets by one compiled call,
    the GIL released from the first frame to the last; only where :func:`decodes_into`
    says so.  ``(0, 0)`` when every one decoded, else a non-zero code and the failing
    job's index (the jobs after it not run: the caller decodes by the reference, which
    raises the exact error)."""
    lib = _active
    assert lib is not None
    args = []
    for body, desc, out, e, codec, order, bits, row_lo, lmap in jobs:
        k = out.shape[-1]
        table = None
        if order is not None:
            table = np.ascontiguousarray(order, dtype="u1" if e <= 255 else "<u2")
        tables = _tables(e, k) if bits else None
        args.append((body, desc, out, e, codec, table, tables, bits, row_lo, lmap))
    code, job, _ = lib.decode_into(args)
    return int(code), int(job)


def decode_chunks(
    body: Any,
    desc: npt.NDArray[np.int64],
    out: npt.NDArray[Any],
    e: int,
    codec_id: int,
    order: npt.NDArray[Any] | None,
    bits: int,
) -> int:
    """Every chunk of a v2/v3 frame's body checked and decoded into ``out`` in one compiled
    call, the GIL released throughout; only where :func:`decodes_chunks` says so.

    ``desc``: int64 ``[n, 7]``, per chunk its offset and length in ``body``, the rows x
    layers of ``out`` it fills and its CRC-32C (-1: none to check); ``codec_id``: the
    frame's (docs/format.md); ``order``: set-zstd's ``[L, E]`` relabel rows for ``out``'s
    layers, or None; ``bits``: a set frame's rank width (0 for the others).  0 when every
    chunk decoded; a non-zero code when one did not (a checksum, a zstd frame, routing:
    the caller decodes the frame chunk by chunk, which raises the exact error)."""
    lib = _active
    assert lib is not None
    k = out.shape[-1]
    tables = _tables(e, k) if bits else None
    table = None
    if order is not None:
        table = np.ascontiguousarray(order, dtype="u1" if e <= 255 else "<u2")
    code, _ = lib.decode_chunks(body, desc, out, e, codec_id, table, tables, bits)
    return int(code)
