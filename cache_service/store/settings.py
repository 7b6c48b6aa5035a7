"""The segment store's settings (how it reaches Redis, what it accepts, when a write is
done) and the rule for tenant namespace names."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from r3_client import InvalidRequestError

__all__ = ["DURABILITY_MODES", "StoreSettings", "check_namespace"]

DURABILITY_MODES = ("ack", "replicas", "fsync")
STORE_LAYOUTS = ("chunked", "whole")
_NAMESPACE = re.compile(r"[a-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """How the store talks to Redis and what it accepts.

    ``redis_url`` is a ``redis://`` DSN; ``cluster=True`` treats it as one seed
    node of a Redis Cluster.  ``default_ttl_s`` (0 = keep forever) applies to
    every write.  ``max_segments`` bounds one rollout's segment count (the put
    script scans them).  A rollout's rows (its highest segment end) stay within
    ``max_rollout_rows`` and, decoded, within ``max_rollout_bytes``; the rows no
    segment covers within ``max_rollout_gap_rows`` in all (``max_gap_rows`` bounds
    one hop past the stored end).  ``max_views`` bounds the views one rollout holds (each
    is its own hash, listed by ``stat`` and read by the ``latest``/``exact`` policies).

    ``durability`` says when a write counts as done: ``ack`` when Redis applied
    it; ``replicas`` when ``durability_replicas`` replicas of the key's master have
    it too (``WAIT``); ``fsync`` when the master's AOF is fsynced (``WAITAOF``,
    Redis >= 7.2) and ``durability_replicas`` replicas have it (``WAIT``).  A wait that
    does not complete within ``durability_timeout_ms`` fails the write with
    :class:`StoreUnavailableError`.

    ``layout`` says how a format-v3 segment frame is written: ``chunked`` keeps its head
    in the segment's field and each chunk in a field of its own (a ranged read fetches
    only the chunks it needs), ``whole`` keeps the frame in one field (what services
    before issue 44 read).  Reads take both (docs/store.md, "Layout").

    ``cursor_secret`` keys the tag a drop's cursor carries (:mod:`cache_service.store.cursor`):
    a cursor the store did not answer is refused.  Every replica of the service must have
    the same one.  Empty (the default) derives it from what the replicas of one deployment
    share, the key prefix and the Redis URL (its password included): no configuration, but
    whoever knows both can forge a cursor.  An operator sets it to a secret
    (``R3_CACHE_DROP_CURSOR_SECRET``) so that clients cannot.
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "r3"
    default_ttl_s: int = 24 * 3600
    max_segments: int = 4096
    connect_retries: int = 5
    max_connections: int = 64
    dedupe: bool = True
    socket_timeout_s: float = 10.0
    durability: str = "ack"
    durability_replicas: int = 0
    durability_timeout_ms: int = 1000
    max_gap_rows: int = 1 << 17
    max_decoded_bytes: int = 1 << 30
    max_rollout_rows: int = 1 << 20
    max_rollout_gap_rows: int = 1 << 17
    max_rollout_bytes: int = 1 << 31
    max_views: int = 256
    layout: str = "chunked"
    cursor_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.cursor_secret:
            derived = f"r3-drop-cursor\0{self.key_prefix}\0{self.redis_url}".encode()
            object.__setattr__(self, "cursor_secret", hashlib.sha256(derived).hexdigest())
        if self.layout not in STORE_LAYOUTS:
            raise ValueError(f"layout must be one of {STORE_LAYOUTS}, not {self.layout!r}")
        if self.durability not in DURABILITY_MODES:
            raise ValueError(
                f"durability must be one of {DURABILITY_MODES}, not {self.durability!r}"
            )
        if self.durability == "replicas" and self.durability_replicas < 1:
            raise ValueError("durability=replicas needs durability_replicas >= 1")
        if self.durability_replicas < 0:
            raise ValueError("durability_replicas must be >= 0")
        if not 1 <= self.durability_timeout_ms < self.socket_timeout_s * 1000:
            raise ValueError(
                "durability_timeout_ms must be >= 1 and below the socket timeout "
                f"({self.socket_timeout_s * 1000:.0f} ms): WAIT blocks the connection"
            )


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` or raise :class:`InvalidRequestError` (the tenant namespace rule)."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise InvalidRequestError(f"invalid namespace {namespace!r}: use [a-z0-9_-]{{1,64}}")
    return namespace
