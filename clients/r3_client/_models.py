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
    shared: bool
    dedupe_hit: bool

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
    num_rows: int
    stored_bytes: int
    shared_bytes: int
    memory_bytes: int | None
    ttl_s: float | None
    segments: tuple[SegmentInfo, ...]

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
