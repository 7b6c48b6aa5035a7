"""After a training step: the step's rollouts leave the cache (framework-free).

A trainer done with a step calls :func:`release_step` (or :func:`arelease_step` from async
code) with the step's rollout ids, and, where its rollouts carry integer weight versions
(AReaL's, or a tag's ``weight_version=str(step)``), the newest version no later step will
read: everything computed up to it leaves too, including rollouts that were aborted or
filtered out and never trained on.  docs/service.md ("Lifecycle") sizes Redis for what
stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3_client._answers import Deleted, DropResult, freed_total

if TYPE_CHECKING:
    from r3_client._async_client import AsyncRoutingClient
    from r3_client._sync_client import RoutingClient

__all__ = ["StepRelease", "arelease_step", "release_step"]


@dataclass(frozen=True, slots=True)
class StepRelease:
    """What left the cache after a step: ``deleted`` of the step's own rollouts (those that
    still existed), ``dropped`` by weight version, and the bytes Redis freed (None where
    the operator disabled ``MEMORY``)."""

    deleted: int
    dropped: int
    freed_bytes: int | None


def _summed(gone: Sequence[Deleted], dropped: DropResult | None) -> StepRelease:
    parts = [d.freed_bytes for d in gone] + ([dropped.freed_bytes] if dropped else [])
    freed = freed_total(parts)
    return StepRelease(
        sum(d.existed for d in gone), dropped.dropped if dropped is not None else 0, freed
    )


def release_step(
    client: RoutingClient,
    rollout_ids: Sequence[str],
    *,
    consumed_version: int | None = None,
) -> StepRelease:
    """Delete the step's rollouts (one request per 1,024 ids), then, with
    ``consumed_version``, drop every rollout of the namespace computed entirely under
    weight versions ``<= consumed_version`` (:meth:`~r3_client.RoutingClient.drop_consumed`).

    Call it once the step's last read of the routing is done (after the actor update).
    ``consumed_version``: on-policy, the version the step's rollouts were generated
    under; asynchronous with at most ``s`` versions of staleness, the trainer's new
    version minus ``s + 1``.
    """
    gone = client.delete_many(rollout_ids) if rollout_ids else []
    dropped = client.drop_consumed(consumed_version) if consumed_version is not None else None
    return _summed(gone, dropped)


async def arelease_step(
    client: AsyncRoutingClient,
    rollout_ids: Sequence[str],
    *,
    consumed_version: int | None = None,
) -> StepRelease:
    """:func:`release_step` with an :class:`~r3_client.AsyncRoutingClient`."""
    gone = await client.delete_many(rollout_ids) if rollout_ids else []
    dropped = await client.drop_consumed(consumed_version) if consumed_version is not None else None
    return _summed(gone, dropped)
