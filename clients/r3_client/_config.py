"""Small keyword-only value objects that configure a client."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Retry", "Timeout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeout:
    """Seconds to wait: ``connect`` for a connection, ``read`` for an answer.

    HTTP applies ``read`` between bytes received; gRPC as the deadline of a call
    (a batch stream gets ``read`` per item batch, see ``AsyncRoutingClient.get_many``).
    """

    connect: float = 5.0
    read: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """Retries of idempotent calls (every call of this API is idempotent, put included).

    Only failures that say nothing about the request itself are retried: no
    connection, a timeout, and the service reporting its store unavailable.
    The delay before retry ``n`` (0-based) is uniform in
    ``[0, min(max_backoff, backoff * 2**n)]`` ("full jitter").
    """

    attempts: int = 3
    backoff: float = 0.2
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("Retry.attempts must be >= 1 (1 = no retries)")

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry``."""
        return random.uniform(0, min(self.max_backoff, self.backoff * 2**retry))
