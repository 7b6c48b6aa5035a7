"""A ranged read's frames as received, decoded where they are consumed (issue 44).

``get_ranges(..., decode=False)`` (:class:`~r3_client.RoutingClient`,
:class:`~r3_client.DirectReader`) answers a read that its stored segments alone answer (no
view applies to its rows) with a :class:`FetchedRange` instead of a decoded
:class:`~r3_client.Routing`: a rank-local layout then decodes every read of a micro-batch
straight into its int64 targets by one compiled call (:mod:`r3_client.codec.into`), and
any read that call does not take by the reference (:meth:`FetchedRange.routing`), which
is what ``decode=True`` answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from r3_client._exceptions import R3Error
from r3_client._routing import Routing
from r3_client.codec import MAX_DECODED_BYTES, decode_rollout
from r3_client.codec.into import IntoPlan, plan_into

__all__ = ["FetchedRange"]


@dataclass(frozen=True, slots=True)
class FetchedRange:
    """Rows ``[start, end)`` of ``layers`` (absolute ids; None: every layer) of a rollout
    as a read received them: ``frames``, what :func:`~r3_client.decode_rollout` takes
    (the service's answer, or a direct reader's frames with chunked segments cut)."""

    rollout_id: str
    frames: bytes | tuple[bytes, ...]
    start: int
    end: int
    layers: tuple[int, ...] | None
    max_bytes: int = MAX_DECODED_BYTES

    def routing(self) -> Routing | R3Error:
        """The read decoded as ``get_ranges`` answers it with ``decode=True`` (the error
        that read answers when the frames do not decode)."""
        try:
            return decode_rollout(
                self.frames if isinstance(self.frames, bytes) else list(self.frames),
                start=self.start,
                end=self.end,
                layers=self.layers,
                rollout_id=self.rollout_id,
                max_bytes=self.max_bytes,
            )
        except R3Error as exc:
            return exc

    def plan(self) -> IntoPlan | None:
        """How the compiled call writes this read into a rank's targets, or None when it
        does not take it (:func:`~r3_client.codec.into.plan_into`): then :meth:`routing`."""
        frames = self.frames if isinstance(self.frames, bytes) else list(self.frames)
        return plan_into(frames, start=self.start, end=self.end, layers=self.layers)


def layers_tuple(layers: Sequence[int] | None) -> tuple[int, ...] | None:
    """``layers`` as a read keeps them."""
    return None if layers is None else tuple(int(x) for x in layers)
