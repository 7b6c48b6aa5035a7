"""Rollouts leaving the store: one, many in one call, or every rollout a trainer has
consumed up to a weight version (docs/service.md, "Lifecycle")."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from cache_service.store import cursor as drop_cursor
from cache_service.store.base import StoreBase
from r3_client import Deleted, DropResult, R3Error, check_weight_version
from r3_client.wire import freed_total

__all__ = ["StoreLifecycle"]

#: Redis glob's special characters, escaped in a namespace's key pattern.
_GLOB = re.compile(r"([*?\[\]\\])")


def _freed(mem: int) -> int | None:
    return None if mem < 0 else mem


class StoreLifecycle(StoreBase):
    """Deletes: one rollout, many, and a namespace's rollouts up to a weight version.

    Mixed into :class:`~cache_service.store.SegmentStore` before ``DurableWrites``, whose
    ``_write`` (a script run, then the durability wait) every delete goes through.
    """

    async def remove(self, rollout_id: str) -> Deleted:
        """Delete a rollout and its views, then release the shared blobs it referenced
        (a blob no other rollout references goes with it); whether it existed and the bytes
        Redis freed, blobs included."""
        key = self.key(rollout_id)
        async with self._guarded():
            res = await self._write(key, self._delete, [], lambda r: bool(r[0]))
            if not int(res[0]):
                return Deleted(rollout_id, False, 0)
            blobs = await self._release(res[2:])
        return Deleted(rollout_id, True, freed_total((_freed(int(res[1])), blobs)))

    async def delete(self, rollout_id: str) -> bool:
        """Delete a rollout; True if it existed."""
        return (await self.remove(rollout_id)).existed

    async def delete_many(
        self, rollout_ids: Sequence[str], *, concurrency: int = 8
    ) -> list[Deleted | R3Error]:
        """Delete each rollout once (an id named twice gets the same answer twice); an
        answer per id in request order: its :class:`Deleted` or the error it met (an
        invalid id, Redis unreachable).  At most ``concurrency`` deletes in flight.

        The caller bounds ``len(rollout_ids)`` (the service's ``max_batch``).
        """
        unique = list(dict.fromkeys(rollout_ids))
        gate = asyncio.Semaphore(concurrency)

        async def one(rid: str) -> Deleted | R3Error:
            async with gate:
                try:
                    return await self.remove(rid)
                except R3Error as exc:
                    return exc

        answers = dict(zip(unique, await asyncio.gather(*(one(r) for r in unique)), strict=True))
        return [answers[r] for r in rollout_ids]

    def _pattern(self) -> str:
        """The SCAN pattern of this namespace's rollout keys (not views, not blobs)."""
        return _GLOB.sub(r"\\\1", self._prefix) + ":{*}"

    async def _scan(self, node: int, cursor: int, count: int) -> tuple[int, list[bytes], bool]:
        """One SCAN on primary ``node`` (0 on a single Redis): ``(next cursor, keys,
        whether node exists)``."""
        async with self._guarded():
            if isinstance(self._r, RedisCluster):
                nodes = sorted(self._r.get_primaries(), key=lambda n: n.name)
                if node >= len(nodes):
                    return 0, [], False
                reply: Any = await self._r.execute_command(
                    "SCAN",
                    cursor,
                    "MATCH",
                    self._pattern(),
                    "COUNT",
                    count,
                    target_nodes=nodes[node],
                )
                if isinstance(reply, dict):  # some redis-py versions key it by node
                    reply = next(iter(reply.values()))
                if isinstance(reply[0], dict):  # redis-py's cluster SCAN: {node: cursor}
                    reply = (next(iter(reply[0].values())), reply[1])
            else:
                if node > 0:
                    return 0, [], False
                reply = await self._r.execute_command(  # type: ignore[no-untyped-call]
                    "SCAN", cursor, "MATCH", self._pattern(), "COUNT", count
                )
        nxt, keys = reply
        return int(nxt), list(keys), True

    async def drop_consumed(
        self,
        upto: int | str,
        cursor: str = "",
        *,
        max_rollouts: int = 4096,
        scan_count: int = 512,
        deadline_s: float = 5.0,
        concurrency: int = 16,
    ) -> DropResult:
        """Delete this namespace's rollouts whose every segment and view was computed under
        a weight version ``<= upto``; one bounded step of the walk, resumed from ``cursor``.

        Bounded per call: SCANs of ``scan_count`` keys until ``max_rollouts`` rollout keys
        were examined, ``deadline_s`` passed or the walk ended (the answer's ``cursor`` is
        then ``""``).  Each rollout is checked and deleted by one script
        (``drop_consumed.lua``): dropped whole or kept whole, whatever a writer does
        meanwhile.  SCAN's guarantee holds across calls: a rollout stored for the whole
        walk is examined; one stored during it may be missed (a later drop takes it).
        """
        upto = check_weight_version(upto)
        node, scan_cursor = 0, 0
        secret = self.settings.cursor_secret.encode()  # a cursor is this store's answer
        if cursor:
            node, scan_cursor = drop_cursor.parse(secret, self._prefix, upto, cursor)
        gate = asyncio.Semaphore(concurrency)

        async def one(key: str) -> tuple[int, int]:
            async with gate, self._guarded():
                res = await self._write(key, self._drop, [str(upto)], lambda r: int(r[0]) == 1)
                if int(res[0]) != 1:
                    return int(res[0]), 0
                blobs = await self._release(res[2:])
            freed = freed_total((_freed(int(res[1])), blobs))
            return 1, -1 if freed is None else freed

        dropped = newer = unversioned = examined = 0
        freed: int | None = 0
        stop = time.monotonic() + deadline_s
        while True:
            # COUNT is a hint: a page may hold a few more keys than asked
            count = max(1, min(scan_count, max_rollouts - examined))
            scan_cursor, keys, exists = await self._scan(node, scan_cursor, count)
            if not exists:
                return DropResult(dropped, newer, unversioned, freed, examined, "")
            examined += len(keys)
            for status, mem in await asyncio.gather(*(one(k.decode()) for k in keys)):
                if status == 1:
                    dropped += 1
                    freed = freed_total((freed, _freed(mem)))
                elif status == -1:
                    newer += 1
                elif status == -2:
                    unversioned += 1
            if scan_cursor == 0:
                node += 1
            if examined >= max_rollouts or time.monotonic() >= stop:
                # the next node may not exist: the next call then answers done at once
                nxt = drop_cursor.issue(secret, self._prefix, upto, node, scan_cursor)
                return DropResult(dropped, newer, unversioned, freed, examined, nxt)
