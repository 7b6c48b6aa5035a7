"""The segment store's settings, key layout and shared state (see :mod:`cache_service.store`)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any, Self

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from r3_client import (
    InvalidRequestError,
    Segment,
    StoreError,
    StoreUnavailableError,
    check_rollout_id,
)

_NAMESPACE = re.compile(r"[a-z0-9_-]{1,64}")
RedisClient = aioredis.Redis | RedisCluster
DURABILITY_MODES = ("ack", "replicas", "fsync")
_log = logging.getLogger("r3.cache.store")
_PUT_ACKED = (b"stored", b"duplicate")
#: What a direct reader may run: reads of rollout hashes and blobs, and connection set-up.
_READER_COMMANDS = (
    "hgetall",
    "hget",
    "hmget",
    "ping",
    "hello",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "readonly",
    "command",
)
_BLOB_ACKED = (b"new", b"same")


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """How the store talks to Redis and what it accepts.

    ``redis_url`` is a ``redis://`` DSN; ``cluster=True`` treats it as one seed
    node of a Redis Cluster.  ``default_ttl_s`` (0 = keep forever) applies to
    every write.  ``max_segments`` bounds one rollout's segment count (the put
    script scans them).  A rollout's rows (its highest segment end) stay within
    ``max_rollout_rows`` and, decoded, within ``max_rollout_bytes``; the rows no
    segment covers within ``max_rollout_gap_rows`` in all (``max_gap_rows`` bounds
    one hop past the stored end).

    ``durability`` says when a write counts as done: ``ack`` when Redis applied
    it; ``replicas`` when ``durability_replicas`` replicas of the key's master have
    it too (``WAIT``); ``fsync`` when the master's AOF is fsynced (``WAITAOF``,
    Redis >= 7.2) and ``durability_replicas`` replicas have it (``WAIT``).  A wait that
    does not complete within ``durability_timeout_ms`` fails the write with
    :class:`StoreUnavailableError`.
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

    def __post_init__(self) -> None:
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


def _load(name: str) -> str:
    return resources.files("cache_service").joinpath("lua", name).read_text()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def check_namespace(namespace: object) -> str:
    """Return ``namespace`` or raise :class:`InvalidRequestError` (the tenant namespace rule)."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise InvalidRequestError(f"invalid namespace {namespace!r}: use [a-z0-9_-]{{1,64}}")
    return namespace


def _meta_bytes(num_experts: int, topk: int, layer_ids: Sequence[int]) -> bytes:
    out: bytes = msgpack.packb([num_experts, topk, list(layer_ids)], use_bin_type=True)
    return out


@asynccontextmanager
async def _translate(limit: asyncio.Semaphore) -> AsyncIterator[None]:
    """Bound in-flight commands by ``limit`` and map redis-py failures to store errors.

    The one place redis-py exceptions are translated.  The bound makes excess
    callers wait instead of failing with "too many connections".
    """
    try:
        async with limit:
            yield
    except (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError) as exc:
        raise StoreUnavailableError(f"Redis is unreachable: {exc}") from exc
    except rexc.RedisError as exc:
        raise StoreError(f"Redis error: {exc}") from exc


class StoreBase:
    """Connection, scripts, namespace and keys: what every part of the store shares."""

    def __init__(self, client: RedisClient, settings: StoreSettings) -> None:
        self._r = client
        self.settings = settings
        self._put = client.register_script(_load("put_segment.lua"))
        self._fields = client.register_script(_load("segment_fields.lua"))
        self._stat = client.register_script(_load("stat_rollout.lua"))
        self._touch = client.register_script(_load("touch_rollout.lua"))
        self._rewind = client.register_script(_load("rewind_rollout.lua"))
        self._put_blob = client.register_script(_load("put_blob.lua"))
        self._keep_blob = client.register_script(_load("keep_blob.lua"))
        self._delete = client.register_script("return redis.call('DEL', KEYS[1])")
        self._namespace = ""
        self._limit = asyncio.Semaphore(settings.max_connections)

    def for_namespace(self, namespace: str) -> Self:
        """A view of this store whose keys live under ``namespace`` (a tenant).

        Shares the connection pool, scripts and concurrency bound.  Rollouts
        and shared blobs of different namespaces never see each other.
        """
        check_namespace(namespace)
        view = copy.copy(self)
        view._namespace = namespace
        return view

    @property
    def _prefix(self) -> str:
        base = self.settings.key_prefix
        return f"{base}:{self._namespace}" if self._namespace else base

    def key(self, rollout_id: str) -> str:
        """The Redis key of a rollout (hash-tagged for Cluster)."""
        return f"{self._prefix}:{{{check_rollout_id(rollout_id)}}}"

    def _blob_key(self, meta: bytes, segment: Segment) -> str:
        share = hashlib.sha256(meta + msgpack.packb(segment.to_dict())).hexdigest()
        return f"{self._prefix}:blob:{{{share}}}"
