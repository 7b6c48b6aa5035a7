"""What every part of the segment store shares: the Redis client, its Lua scripts, the
namespace a view's keys live under, the keys, and the one translation of redis-py errors
(key layout: :mod:`cache_service.store`)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from typing import TYPE_CHECKING, Any, Self

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from cache_service.store.settings import StoreSettings, check_namespace
from r3_client import InvalidRequestError, Segment, StoreError, StoreUnavailableError
from r3_client.stored import blob_key, rollout_key, view_key

__all__ = ["RedisClient", "StoreBase", "check_serves", "redacted"]

RedisClient = aioredis.Redis | RedisCluster


def check_serves(serves: int) -> int:
    """A view's ``serves`` row: a non-negative int (:class:`InvalidRequestError` otherwise)."""
    if isinstance(serves, bool) or not isinstance(serves, int) or not 0 <= serves < 1 << 40:
        raise InvalidRequestError(f"view must be a row number >= 0, got {serves!r}")
    return serves


def redacted(url: str) -> str:
    """``url`` without its credentials, for messages and logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"


#: How Redis refuses a write at ``maxmemory`` under ``noeviction`` (a command's ``OOM …``
#: reply; inside a script, the script's error names ``maxmemory``).
_FULL = re.compile(r"^OOM |used memory > 'maxmemory'")


def _load(name: str) -> str:
    return resources.files("cache_service").joinpath("lua", name).read_text()


class StoreBase:
    """Connection, scripts, namespace and keys: what every part of the store shares."""

    if TYPE_CHECKING:  # DurableWrites (durability.py) implements it

        async def _write(
            self,
            key: str,
            script: Any,
            args: Sequence[Any],
            acked: Callable[[Any], bool],
            *,
            keys: Sequence[str] = (),
        ) -> Any: ...

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
        self._unref_blob = client.register_script(_load("unref_blob.lua"))
        self._delete = client.register_script(_load("delete_rollout.lua"))
        self._drop = client.register_script(_load("drop_consumed.lua"))
        self._view_put = client.register_script(_load("put_view.lua"))
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
        return rollout_key(f"{self._prefix}:", rollout_id)

    def view_key(self, rollout_id: str, serves: int) -> str:
        """The Redis key of a rollout's view serving row ``serves``: a hash like a rollout's,
        in the rollout's slot (same hash tag), matched by the namespace's key pattern."""
        return view_key(self.key(rollout_id), check_serves(serves))

    def _blob_key(self, meta: bytes, segment: Segment) -> str:
        share = hashlib.sha256(meta + msgpack.packb(segment.to_dict())).hexdigest()
        return blob_key(f"{self._prefix}:", share)

    async def _release(self, refs: Sequence[bytes | str]) -> int | None:
        """Release blob references ``[blob key, token, …]`` (what the delete, drop and
        rewind scripts answer, or the one a refused put took); the bytes the blobs this
        deleted held (None when MEMORY is disabled).

        Each blob lives in its own slot, so each release is its own script, run only after
        the rollout's field that pointed at the blob is gone (or was never written).  The
        caller holds a ``_guarded`` slot; sequential for the same reason as ``_keep_blobs``.
        A token of ``""`` is a reference written before tokens were kept: that blob is left
        to its TTL.
        """
        freed: int | None = 0
        for blob, token in zip(refs[::2], refs[1::2], strict=True):
            tok = token.decode() if isinstance(token, bytes) else token
            if not tok:
                continue
            name = blob.decode() if isinstance(blob, bytes) else blob
            released, mem = await self._write(name, self._unref_blob, [tok], lambda r: bool(r[0]))
            if int(released) and freed is not None:
                freed = None if int(mem) < 0 else freed + int(mem)
        return freed

    @asynccontextmanager
    async def _guarded(self) -> AsyncIterator[None]:
        """Bound in-flight commands by ``max_connections`` and map redis-py failures to
        store errors.

        The one place redis-py exceptions are translated.  The bound makes excess
        callers wait instead of failing with "too many connections".
        """
        try:
            async with self._limit:
                yield
        except (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError) as exc:
            raise StoreUnavailableError(f"Redis is unreachable: {exc}") from exc
        except rexc.ResponseError as exc:
            if not _FULL.search(str(exc)):
                raise StoreError(f"Redis error: {exc}") from exc
            # noeviction at maxmemory: refused whole (Redis refuses a script at its first
            # write command and never after one, scriptVerifyOOM), so a retry is safe
            raise StoreUnavailableError(
                "Redis is full (used memory > maxmemory): nothing was stored; rollouts "
                "already trained on can be dropped (POST /v1/drop-consumed, "
                "/v1/batch/delete; docs/service.md, Lifecycle) or maxmemory raised"
            ) from exc
        except rexc.RedisError as exc:
            raise StoreError(f"Redis error: {exc}") from exc
