"""The routing frame's fixed parts: constants, header types, and small header checks.

Shared by every codec module; see :mod:`r3_client._codec` for the layout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import msgpack

from r3_client._exceptions import (
    FrameError,
    ShapeError,
)
from r3_client._routing import (
    Routing,
    Segment,
    index_dtype,
)

if TYPE_CHECKING:
    from r3_client._codec_v2 import Context


MAGIC: Final = b"R3RF"


#: The version :func:`encode_frame` writes; version 1 frames still decode.
FORMAT_VERSION: Final = 2


#: Codec id of a v2 *context frame*: a rollout's shared context, no rows.
CONTEXT_CODEC: Final = 3


#: Largest decoded array a decoder allocates unless told otherwise (``max_bytes``): 2 GiB,
#: the service's default cap on one rollout (a 1M-token Qwen3-235B rollout is 1.5 GiB
#: as int16), so a default reader reads whatever a default service stores.
MAX_DECODED_BYTES: Final = 1 << 31


#: Largest relabel table (``L·E`` entries) a context may carry.
MAX_TABLE_ENTRIES: Final = 1 << 22


#: v2 encoder defaults: token rows per block, and at most this many layer groups.
BLOCK_ROWS: Final = 2048


LAYER_GROUPS: Final = 8


#: Below this many entries (``R·L·K``) a v2 frame is one layer group (chunks too small to pay).
_MIN_GROUPED: Final = 1 << 16


CodecName = Literal["auto", "raw", "set", "set-zstd"]


CODECS: Final[dict[str, int]] = {"raw": 0, "set": 1, "set-zstd": 2}


_CODEC_NAMES: Final = {v: k for k, v in CODECS.items()}


_PREFIX = struct.Struct("<4sBBHIQ")


_CRC = struct.Struct("<I")


#: Headers hold layer ids and short strings; anything larger is not a frame of ours.
MAX_HEADER: Final = 1 << 20


#: Provenance entries a frame may list (the store's per-rollout segment limit).
MAX_SEGMENTS: Final = 4096


#: Rows the ``auto`` trial compresses before choosing (contiguous tokens, all layers).
_TRIAL_ROWS: Final = 1 << 16


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
    #: v2: writer-supplied content digest of the segment (see :func:`content_digest`).
    digest: str = ""
    #: v2: token rows per block, layers per group, and ``(length, crc32)`` per chunk.
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


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack map hook: a repeated key is an error, not "last one wins"."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise FrameError("frame header repeats a map key")
    return out


def _provenance_field(hdr: dict[Any, Any]) -> tuple[Segment, ...]:
    """The header's ``segments`` list (provenance), parsed; raises for a bad one."""
    prov = hdr.get("segments", [])
    if not isinstance(prov, list) or len(prov) > MAX_SEGMENTS:
        raise FrameError(f"header segments must be a list of at most {MAX_SEGMENTS}")
    return tuple(Segment.from_dict(p) for p in prov)


def _check_provenance(seg: Segment | None, segs: tuple[Segment, ...], start: int, end: int) -> None:
    """A frame is one segment or lists provenance, and provenance overlaps its rows."""
    if seg is not None and segs:
        raise FrameError("a frame carries either segment or segments, not both")
    if not all(p.overlaps(start, end) for p in segs):
        raise FrameError("a provenance segment does not overlap the frame's rows")


def provenance_field(provenance: tuple[Segment, ...], start: int, end: int) -> list[Any]:
    """A writer's header ``segments``: each overlapping ``[start, end)``, at most MAX_SEGMENTS."""
    if len(provenance) > MAX_SEGMENTS or not all(p.overlaps(start, end) for p in provenance):
        raise ShapeError(
            f"segments must overlap the rows [{start}, {end}) and number at most {MAX_SEGMENTS}"
        )
    return [p.to_dict() for p in provenance]


def _int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise FrameError(f"header field {name} must be an int")
    return value


def _expect_params(params: dict[str, Any], keys: set[str]) -> None:
    if set(params) != keys:
        raise FrameError(f"codec params {sorted(map(str, params))} differ from {sorted(keys)}")


def _check_decoded_size(rows: int, per_row: int, what: str) -> None:
    # Guard allocations against absurd declared sizes before touching numpy.
    if rows * per_row > (1 << 34):
        raise FrameError(f"{what}: frame declares {rows} rows, too many to decode")


def _unpack_map(raw: bytes, what: str, *, allow_bin: bool = False) -> dict[Any, Any]:
    try:
        doc = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_HEADER if allow_bin else 0,
            object_pairs_hook=_unique_map,
        )
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise FrameError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(doc, dict):
        raise FrameError(f"{what} must be a map")
    return doc
