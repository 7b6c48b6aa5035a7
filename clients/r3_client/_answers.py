"""What the client returns besides routing: put receipts and rollout descriptions.

These dataclasses are the one definition of the service's answers; the HTTP JSON,
the gRPC messages and their ``.proto`` definitions are derived from them
(:mod:`r3_client._answer_forms`).  Add a field here (at the end), then run
``scripts/gen_proto.sh``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from r3_client._answer_forms import from_plain, to_plain
from r3_client._routing import Segment

__all__ = [
    "PROTO_MESSAGES",
    "Deleted",
    "DropResult",
    "PutResult",
    "RolloutInfo",
    "SegmentInfo",
    "ViewInfo",
    "freed_total",
]


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of storing one segment: ``stored`` now, or ``duplicate`` (already stored)."""

    status: Literal["stored", "duplicate"]
    rollout_id: str
    segment: Segment
    nbytes: int
    shared: bool  # the frame is kept once and shared with other rollouts
    dedupe_hit: bool  # ...and another rollout had already stored it

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PutResult:
        """From the service's answer (its plain form); :class:`ProtocolError` otherwise."""
        return from_plain(cls, d)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A stored segment: its range and provenance, codec, size, and whether it is shared."""

    segment: Segment
    codec: str
    nbytes: int
    shared: bool


@dataclass(frozen=True, slots=True)
class ViewInfo:
    """A stored view: rows ``[start, end)`` the engine *recomputed* (they already had rows)
    in the forward whose KV the tokens of the segment starting at row ``serves`` attended
    to, under ``weight_version`` (docs/store.md, "Views")."""

    serves: int
    start: int
    end: int
    weight_version: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class RolloutInfo:
    """What the service stores for a rollout, without its rows."""

    rollout_id: str
    num_experts: int
    topk: int
    layer_ids: tuple[int, ...]
    num_rows: int  # one past the last stored row; gaps read as -1
    stored_bytes: int  # sum of its segments' frame sizes (shared ones included)
    shared_bytes: int  # the part of stored_bytes held in shared (deduplicated) blobs
    memory_bytes: int | None  # Redis MEMORY USAGE of the rollout's and its views' keys, if on
    ttl_s: float | None  # None = no expiry
    segments: tuple[SegmentInfo, ...]
    #: recomputed prefixes, by the row they serve (empty: every row computed once)
    views: tuple[ViewInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain form (the service's answers); inverse of :meth:`from_dict`."""
        out: dict[str, Any] = to_plain(self)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutInfo:
        """From the service's stat answer; :class:`ProtocolError` otherwise."""
        return from_plain(cls, d)


@dataclass(frozen=True, slots=True)
class Deleted:
    """One rollout of a batch delete: whether it existed, and the bytes Redis freed."""

    rollout_id: str
    existed: bool
    #: Redis MEMORY USAGE of the rollout's and its views' keys before the delete (0 when it
    #: did not exist, None where the operator disabled MEMORY); shared blobs are not counted
    #: (other rollouts may reference them: they expire with their last reference's TTL)
    freed_bytes: int | None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Deleted:
        """From the service's answer (its plain form); :class:`ProtocolError` otherwise."""
        return from_plain(cls, d)


@dataclass(frozen=True, slots=True)
class DropResult:
    """What one drop-by-weight-version call did (docs/service.md, "Lifecycle").

    ``dropped``: rollouts deleted whole (every row computed under a weight version at or
    below the one asked); ``kept_newer``: rollouts kept because a segment or view is newer;
    ``kept_unversioned``: rollouts kept because a weight version is not a decimal integer;
    ``examined``: rollout keys looked at.  ``cursor``: where the next call resumes; ``""``
    when the namespace has been walked to its end.
    """

    dropped: int
    kept_newer: int
    kept_unversioned: int
    freed_bytes: int | None  # summed as Deleted.freed_bytes; None where MEMORY is disabled
    examined: int
    cursor: str

    @property
    def done(self) -> bool:
        """True when the walk reached the end of the namespace."""
        return not self.cursor

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DropResult:
        """From the service's answer (its plain form); :class:`ProtocolError` otherwise."""
        return from_plain(cls, d)


def freed_total(parts: Iterable[int | None]) -> int | None:
    """Bytes freed by several deletes (:attr:`Deleted.freed_bytes`,
    :attr:`DropResult.freed_bytes`), summed; None when any part is unknown (``MEMORY``
    disabled)."""
    total = 0
    for part in parts:
        if part is None:
            return None
        total += part
    return total


#: Each record's gRPC message in ``r3_cache.proto`` (generated from the dataclasses).
PROTO_MESSAGES: dict[type, str] = {
    Segment: "Segment",
    SegmentInfo: "SegmentInfo",
    RolloutInfo: "RolloutStat",
    ViewInfo: "ViewInfo",
    PutResult: "PutSegmentResponse",
    Deleted: "Deleted",
    DropResult: "DropResult",
}
