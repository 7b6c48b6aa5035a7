"""The transport interface: one method per service operation, bytes and dicts only.

A transport sends one request and translates every failure into the
``r3_client`` exception tree; retries, validation and decoding live in the
client core.  Implement these to plug in another transport (or a test double).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any, Protocol

from r3_client._exceptions import R3Error
from r3_client.codec.stream import StreamItem

__all__ = ["AsyncTransport", "Transport"]


class Transport(Protocol):
    """Blocking transport."""

    def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """Store one segment frame (``view``: as the view serving that row; ``share``: kept
        in a blob other rollouts share, or private, or None: the store's rule); the receipt.

        The clients pass ``view`` and ``share`` only when set, so a transport without them
        still serves plain puts."""
        ...

    def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """One frame of the rollout (or the asked slice; ``view``: of the view serving that
        row)."""
        ...

    def stat(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's description as a dict."""
        ...

    def stat_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """Each rollout's description or its error, in request order (one request)."""
        ...

    def delete(self, rollout_id: str) -> bool:
        """Delete; True if it existed."""
        ...

    def delete_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """Delete each rollout; each id's ``Deleted`` (plain form) or its error, in order."""
        ...

    def drop_consumed(self, upto: str, cursor: str, max_rollouts: int | None) -> dict[str, Any]:
        """One bounded step of dropping rollouts up to a weight version (``DropResult``'s
        plain form)."""
        ...

    def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """Reset the TTL."""
        ...

    def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """Drop the segments starting at or after ``rows``; the description after it."""
        ...

    def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Generator[StreamItem, None, None]:
        """Items in request order, as they arrive (closing the generator ends the call).

        ``ranges``: one ``(start, end)`` per id instead of ``start``/``end``."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class AsyncTransport(Protocol):
    """Asyncio transport: the same operations."""

    async def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """See :meth:`Transport.put`."""
        ...

    async def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """See :meth:`Transport.get`."""
        ...

    async def stat(self, rollout_id: str) -> dict[str, Any]:
        """See :meth:`Transport.stat`."""
        ...

    async def stat_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :meth:`Transport.stat_many`."""
        ...

    async def delete(self, rollout_id: str) -> bool:
        """See :meth:`Transport.delete`."""
        ...

    async def delete_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :meth:`Transport.delete_many`."""
        ...

    async def drop_consumed(
        self, upto: str, cursor: str, max_rollouts: int | None
    ) -> dict[str, Any]:
        """See :meth:`Transport.drop_consumed`."""
        ...

    async def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """See :meth:`Transport.touch`."""
        ...

    async def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """See :meth:`Transport.rewind`."""
        ...

    def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """See :meth:`Transport.batch_get`."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
