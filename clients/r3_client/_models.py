"""What the client returns besides routing: put receipts and rollout descriptions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from r3_client._exceptions import ProtocolError
from r3_client._format import Segment

__all__ = ["PutResult", "RolloutInfo", "SegmentInfo"]

_SEGMENT_KEYS = ("start", "end", "model_id", "weight_version", "tokens_digest")


def _segment(d: dict[str, Any]) -> Segment:
    return Segment(**{k: d[k] for k in _SEGMENT_KEYS if k in d})


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
        """From the service's answer (HTTP JSON, or the gRPC message as a dict)."""
        try:
            return cls(
                d["status"],
                d["rollout_id"],
                _segment(d["segment"]),
                int(d["nbytes"]),
                bool(d["shared"]),
                bool(d["dedupe_hit"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"unexpected put answer: {exc}") from None


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A stored segment: its range and provenance, codec, size, and whether it is shared."""

    segment: Segment
    codec: str
    nbytes: int
    shared: bool


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
    memory_bytes: int | None  # Redis MEMORY USAGE of the rollout's key, when available
    ttl_s: float | None  # None = no expiry
    segments: tuple[SegmentInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        """Plain form (the service's answers); inverse of :meth:`from_dict`."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "segments"}
        out["layer_ids"] = list(self.layer_ids)
        out["segments"] = [
            {**i.segment.to_dict(), "codec": i.codec, "nbytes": i.nbytes, "shared": i.shared}
            for i in self.segments
        ]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutInfo:
        """From the service's stat answer."""
        try:
            return cls(
                rollout_id=d["rollout_id"],
                num_experts=int(d["num_experts"]),
                topk=int(d["topk"]),
                layer_ids=tuple(int(x) for x in d["layer_ids"]),
                num_rows=int(d["num_rows"]),
                stored_bytes=int(d["stored_bytes"]),
                shared_bytes=int(d["shared_bytes"]),
                memory_bytes=d.get("memory_bytes"),
                ttl_s=d.get("ttl_s"),
                segments=tuple(
                    SegmentInfo(_segment(s), s["codec"], int(s["nbytes"]), bool(s["shared"]))
                    for s in d["segments"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"unexpected stat answer: {exc}") from None
