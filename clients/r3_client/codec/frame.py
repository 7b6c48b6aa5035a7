"""The routing frame's fixed parts: constants, limits, the prefix, header-field checks, assembly.

The bottom of the codec: every other codec module builds on these, and this module
imports none of them.  The layout is docs/format.md's (see :mod:`r3_client.codec`).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgpack
import numpy as np

from r3_client._exceptions import FrameError, ShapeError

__all__ = [
    "BLOCK_ROWS",
    "CODECS",
    "CODEC_NAMES",
    "CONTEXT_CODEC",
    "CRC",
    "FORMAT_VERSION",
    "LAYER_GROUPS",
    "MAGIC",
    "MAX_DECLARED_ENTRIES",
    "MAX_DECODED_BYTES",
    "MAX_HEADER",
    "MAX_SEGMENTS",
    "MAX_TABLE_ENTRIES",
    "MIN_GROUPED",
    "PREFIX",
    "TRIAL_ROWS",
    "CodecName",
    "assemble_frame",
    "check_decoded_size",
    "expect_params",
    "int_field",
    "raw_dtype",
    "unique_map",
    "unpack_map",
]


MAGIC: Final = b"R3RF"


#: The version :func:`encode_frame` writes; version 1 frames still decode.
FORMAT_VERSION: Final = 2


#: Codec id of a v2 *context frame*: a rollout's shared context, no rows.
CONTEXT_CODEC: Final = 3


#: Largest decoded array a decoder allocates unless told otherwise (``max_bytes``): 2 GiB,
#: the service's default cap on one rollout (a 1M-token Qwen3-235B rollout is 1.5 GiB
#: as int16), so a default reader reads whatever a default service stores.
MAX_DECODED_BYTES: Final = 1 << 31


#: Largest number of entries (rows times entries per row) a v1 body may declare: a
#: decoder refuses more before numpy allocates anything.
MAX_DECLARED_ENTRIES: Final = 1 << 34


#: Largest relabel table (``L·E`` entries) a context may carry.
MAX_TABLE_ENTRIES: Final = 1 << 22


#: v2 encoder defaults: token rows per block, and at most this many layer groups.
BLOCK_ROWS: Final = 2048


LAYER_GROUPS: Final = 8


#: Below this many entries (``R·L·K``) a v2 frame is one layer group (chunks too small to pay).
MIN_GROUPED: Final = 1 << 16


CodecName = Literal["auto", "raw", "set", "set-zstd"]


CODECS: Final[dict[str, int]] = {"raw": 0, "set": 1, "set-zstd": 2}


CODEC_NAMES: Final = {v: k for k, v in CODECS.items()}


#: The fixed prefix: magic, version, codec id, reserved, header length, body length.
PREFIX: Final = struct.Struct("<4sBBHIQ")


#: The trailing CRC-32 of every preceding byte.
CRC: Final = struct.Struct("<I")


#: Headers hold layer ids and short strings; anything larger is not a frame of ours.
MAX_HEADER: Final = 1 << 20


#: Provenance entries a frame may list (the store's per-rollout segment limit).
MAX_SEGMENTS: Final = 4096


#: Rows the ``auto`` trial compresses before choosing (contiguous tokens, all layers).
TRIAL_ROWS: Final = 1 << 16


def raw_dtype(num_experts: int) -> np.dtype[Any]:
    """Dtype of stored ids (raw bodies, relabel tables): the smallest unsigned one holding E
    plus the ``-1`` sentinel (its maximum)."""
    return np.dtype("u1") if num_experts <= 255 else np.dtype("<u2")


def assemble_frame(
    version: int, codec_id: int, header: dict[str, Any], body: Sequence[bytes]
) -> bytes:
    """Prefix, msgpack ``header``, the ``body`` pieces in order, and the CRC-32 of them all.

    Raises :class:`ShapeError` for a header over :data:`MAX_HEADER` (no reader accepts it).
    """
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER:
        raise ShapeError(f"frame header would be {len(packed)} bytes; the limit is {MAX_HEADER}")
    blen = sum(len(b) for b in body)
    prefix = PREFIX.pack(MAGIC, version, codec_id, 0, len(packed), blen)
    crc = zlib.crc32(packed, zlib.crc32(prefix))
    for b in body:
        crc = zlib.crc32(b, crc)
    return b"".join((prefix, packed, *body, CRC.pack(crc)))


def unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack map hook: a repeated key is an error, not "last one wins"."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise FrameError("frame header repeats a map key")
    return out


def int_field(value: object, name: str) -> int:
    """A header field that must be an int (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"header field {name} must be an int")
    return value


def expect_params(params: dict[str, Any], keys: set[str]) -> None:
    """A codec's ``params`` map holds exactly ``keys``."""
    if set(params) != keys:
        raise FrameError(f"codec params {sorted(map(str, params))} differ from {sorted(keys)}")


def check_decoded_size(rows: int, per_row: int, what: str) -> None:
    """Refuse a body declaring more than :data:`MAX_DECLARED_ENTRIES` before numpy allocates."""
    if rows * per_row > MAX_DECLARED_ENTRIES:
        raise FrameError(f"{what}: frame declares {rows} rows, too many to decode")


def unpack_map(raw: bytes, what: str, *, allow_bin: bool = False) -> dict[Any, Any]:
    """A strict msgpack map (string keys, no repeats, bin only when ``allow_bin``)."""
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_HEADER if allow_bin else 0,
            object_pairs_hook=unique_map,
        )
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(doc, dict):
        raise FrameError(f"{what} must be a map")
    return doc
