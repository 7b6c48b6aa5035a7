"""The routing frame's fixed parts: constants, limits, the prefix, header-field checks, assembly.

The bottom of the codec: every other codec module builds on these, and this module
imports none of them.  The layout is docs/format.md's (see :mod:`r3_client.codec`).
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Sequence
from typing import Any, Final, Literal

import google_crc32c
import msgpack
import numpy as np
import zstandard

from r3_client._exceptions import FrameError, ShapeError

__all__ = [
    "BLOCK_ROWS",
    "CHUNKED_VERSIONS",
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
    "STORED_BLOCK_ROWS",
    "TRIAL_ROWS",
    "CodecName",
    "assemble_frame",
    "check_decoded_size",
    "chunk_crc",
    "crc32c",
    "expect_params",
    "frame_crc",
    "int_field",
    "is_context_frame",
    "raw_dtype",
    "unique_map",
    "unpack_map",
    "zstd_compressor",
]


MAGIC: Final = b"R3RF"


#: The version :func:`encode_frame` writes; version 1 and 2 frames still decode.
FORMAT_VERSION: Final = 3


#: Versions with chunked bodies and contexts (v3 is v2's layout with CRC-32C checksums,
#: a header-only trailing CRC and a BLAKE3 content digest: docs/format.md section 18).
CHUNKED_VERSIONS: Final = (2, 3)


#: Codec id of a v2 *context frame*: a rollout's shared context, no rows (v3 frames use
#: the same context frames: a context is version-independent).
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


#: v2 encoder defaults: token rows per block, and at most this many layer groups.  512 since
#: issue 44 (2,048 before): a CP rank's zigzag range of a 16k-token sample then reads at most
#: 1.1x its share from the chunked store, for +0.8% bytes on skewed routing
#: (bench/block_size_bench.py, docs/benchmarks.md "Block size").
BLOCK_ROWS: Final = 512

#: The block sizes the reference store takes (every block but the last that many rows): the
#: writer's default and 2,048, what writers before issue 44 wrote.
STORED_BLOCK_ROWS: Final = (512, 2048)


LAYER_GROUPS: Final = 8


#: Below this many entries (``R·L·K``) a v2 frame is one layer group (chunks too small to pay).
MIN_GROUPED: Final = 1 << 16


CodecName = Literal["auto", "raw", "set", "set-zstd"]


CODECS: Final[dict[str, int]] = {"raw": 0, "set": 1, "set-zstd": 2}


CODEC_NAMES: Final = {v: k for k, v in CODECS.items()}


#: The fixed prefix: magic, version, codec id, reserved, header length, body length.
PREFIX: Final = struct.Struct("<4sBBHIQ")


def is_context_frame(data: bytes) -> bool:
    """Whether ``data`` starts like a context frame (magic and codec id read from the
    prefix alone): a rollout's context, no rows.  What a segment field must never hold."""
    return len(data) >= PREFIX.size and data[:4] == MAGIC and data[5] == CONTEXT_CODEC


def is_frame_head(data: bytes) -> bool:
    """Whether ``data`` has the shape of a v3 frame's head (prefix, header and trailer of a
    frame whose body is kept elsewhere: ``codec.rollout.frame_head``), read from the prefix
    alone; nothing is checked."""
    if len(data) < PREFIX.size + 4 or data[:4] != MAGIC or data[4] < 3:
        return False
    _, _, _, _, hlen, blen = PREFIX.unpack_from(data)
    return bool(blen > 0 and len(data) == PREFIX.size + hlen + 4)


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


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing ``value``: google-crc32c's hardware path.

    google-crc32c takes read-only buffers only; a numpy view over any buffer is accepted
    without a copy.  Extending 0 is the plain CRC.
    """
    return int(google_crc32c.extend(value, np.frombuffer(data, dtype=np.uint8)))


def chunk_crc(version: int, data: bytes | bytearray | memoryview) -> int:
    """The checksum a chunk of a ``version`` frame lists: CRC-32 (v2) or CRC-32C (v3)."""
    return crc32c(data) if version >= 3 else zlib.crc32(data)


def frame_crc(version: int, view: memoryview, hlen: int, total: int) -> int:
    """The trailing checksum a frame must carry: v1/v2 CRC-32 over every byte before it, v3
    CRC-32C over the prefix and header only (each chunk has its own; a slice recomputes
    only the header's)."""
    if version >= 3:
        return crc32c(view[: PREFIX.size + hlen])
    return zlib.crc32(view[: total - CRC.size])


def assemble_frame(
    version: int, codec_id: int, header: dict[str, Any], body: Sequence[bytes | bytearray]
) -> bytes:
    """Prefix, msgpack ``header``, the ``body`` pieces in order, and the trailing CRC
    (:func:`frame_crc`).

    Raises :class:`ShapeError` for a header over :data:`MAX_HEADER` (no reader accepts it).
    """
    packed = msgpack.packb(header, use_bin_type=True)
    if len(packed) > MAX_HEADER:
        raise ShapeError(f"frame header would be {len(packed)} bytes; the limit is {MAX_HEADER}")
    blen = sum(len(b) for b in body)
    prefix = PREFIX.pack(MAGIC, version, codec_id, 0, len(packed), blen)
    if version >= 3:
        crc = crc32c(packed, crc32c(prefix))
    else:
        crc = zlib.crc32(packed, zlib.crc32(prefix))
        for b in body:
            crc = zlib.crc32(b, crc)
    return b"".join((prefix, packed, *body, CRC.pack(crc)))


#: v3's zstd stage when no level is given: zstd's fast strategy with few, long matches and
#: a window covering a whole chunk (one block, one Huffman table per chunk).  Measured on
#: skewed routing at 16k x 48 x top-8 of 128: 15% smaller than level 3 and half its CPU
#: (docs/notes/format-v3-probe.md, section 3).  Only the payload is normative.
V3_ZSTD: Final = {
    "strategy": zstandard.STRATEGY_FAST,
    "window_log": 17,
    "hash_log": 6,
    "min_match": 7,
    "search_log": 1,
}


_LOCAL = threading.local()


def zstd_compressor(level: int | None) -> zstandard.ZstdCompressor:
    """The zstd compressor of a ``level``, or of :data:`V3_ZSTD` for ``None``: declares the
    content size, no zstd checksum (the chunk CRC covers the body).

    Kept per thread and level: building one per chunk cost 1-2 ms a frame, and a
    ZstdCompressor must not be shared between threads.
    """
    cache: dict[int | None, zstandard.ZstdCompressor] | None = getattr(_LOCAL, "zstd", None)
    if cache is None:
        cache = _LOCAL.zstd = {}
    comp = cache.get(level)
    if comp is None:
        if level is None:
            params = zstandard.ZstdCompressionParameters(
                **V3_ZSTD, write_content_size=True, write_checksum=False
            )
            comp = cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            comp = cache[level] = zstandard.ZstdCompressor(level=level)
    return comp


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
