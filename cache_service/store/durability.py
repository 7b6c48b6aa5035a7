"""Durable writes of the segment store: ``WAIT`` / ``WAITAOF`` on the writing connection.

See "Durability" in :mod:`cache_service.store`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from cache_service.store.base import StoreBase
from r3_client import (
    StoreError,
    StoreUnavailableError,
)

_log = logging.getLogger("r3.cache.store")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class DurableWrites(StoreBase):
    """Writes answered only once ``StoreSettings.durability`` is met, and the start-up check."""

    # ---- durability --------------------------------------------------------------------
    def _wait_commands(self) -> list[tuple[Any, ...]]:
        """What follows each write on its connection: nothing (ack), WAIT, WAITAOF (+ WAIT).

        ``fsync`` with replicas asks the master's AOF fsync (``WAITAOF 1 0``) and the
        replicas' receipt (``WAIT n``), not the replicas' own fsync (``WAITAOF 1 n``):
        a failover promotes a replica's memory, and replicas report their fsync only in
        their once-a-second acknowledgement (measured: ~1 s per write).
        """
        s = self.settings
        t = s.durability_timeout_ms
        if s.durability == "replicas":
            return [("WAIT", s.durability_replicas, t)]
        if s.durability == "fsync":
            waits: list[tuple[Any, ...]] = [("WAITAOF", 1, 0, t)]
            if s.durability_replicas:
                waits.append(("WAIT", s.durability_replicas, t))
            return waits
        return []

    async def _on_primaries(self, *command: Any) -> dict[str, Any]:
        """``command``'s reply from every master (one entry on a single Redis)."""
        if isinstance(self._r, RedisCluster):
            out = {}
            for node in self._r.get_primaries():
                reply = await self._r.execute_command(*command, target_nodes=node)
                by_node = isinstance(reply, dict) and node.name in reply
                out[node.name] = reply[node.name] if by_node else reply
            return out
        reply = await self._r.execute_command(*command)  # type: ignore[no-untyped-call]
        return {self.settings.redis_url.rsplit("@", 1)[-1]: reply}

    async def check_durability(self) -> list[str]:
        """Refuse a durability mode these Redis masters cannot give; return warnings.

        ``fsync`` needs ``WAITAOF`` and ``appendonly yes`` on every master: a probe
        ``WAITAOF 1 0 <timeout>`` must answer, or :class:`StoreError` says why (the
        mode would fail every write).  Fewer connected replicas than
        ``durability_replicas`` is only a warning (logged and returned): replicas
        come and go, writes fail with 503 until enough are back, reads keep working.
        """
        s = self.settings
        if s.durability == "ack":
            return []
        warnings: list[str] = []
        try:
            if s.durability == "fsync":
                try:
                    replies = await self._on_primaries("WAITAOF", 1, 0, s.durability_timeout_ms)
                except rexc.ResponseError as exc:
                    raise StoreError(await self._fsync_refusal(exc)) from exc
                for node, reply in replies.items():
                    if int(reply[0]) < 1:
                        raise StoreError(
                            f"durability=fsync: Redis {node} did not confirm an AOF fsync "
                            f"within {s.durability_timeout_ms} ms"
                        )
            else:
                await self._on_primaries("WAIT", 0, s.durability_timeout_ms)
            if s.durability_replicas > 0:
                infos = await self._on_primaries("INFO", "replication")
                for node, info in infos.items():
                    # A replica still in its full sync is connected but acknowledges
                    # nothing: only ``state=online`` ones answer a WAIT.
                    have = sum(
                        1
                        for k, v in info.items()
                        if k.startswith("slave")
                        and isinstance(v, dict)
                        and v.get("state") == "online"
                    )
                    if have < s.durability_replicas:
                        warnings.append(
                            f"durability={s.durability} waits for {s.durability_replicas} "
                            f"replica(s) per write but Redis {node} has {have} online: "
                            "its writes fail (503) until enough replicas are back"
                        )
        except (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterError) as exc:
            raise StoreUnavailableError(f"Redis is unreachable: {exc}") from exc
        except rexc.RedisError as exc:
            raise StoreError(f"durability={s.durability}: Redis refused the check: {exc}") from exc
        for w in warnings:
            _log.warning(w, extra={"r3": {"durability": s.durability}})
        return warnings

    async def _fsync_refusal(self, exc: Exception) -> str:
        """Why ``durability=fsync`` cannot work here, in words (Redis version, AOF policy)."""
        msg = f"durability=fsync needs WAITAOF (Redis >= 7.2) and appendonly yes; Redis said: {exc}"
        with contextlib.suppress(rexc.RedisError):
            info = next(iter((await self._on_primaries("INFO", "server")).values()))
            msg += f" (redis_version {info.get('redis_version')})"
        with contextlib.suppress(rexc.RedisError):
            conf = next(iter((await self._on_primaries("CONFIG", "GET", "appendfsync")).values()))
            if isinstance(conf, list):  # raw reply: [name, value, ...]
                conf = dict(zip(conf[::2], conf[1::2], strict=True))
            policy = {_text(k): _text(v) for k, v in conf.items()}.get("appendfsync")
            if policy == "always":
                msg += (
                    ". This Redis already fsyncs every write (appendfsync always): "
                    "durability=ack gives the same guarantee"
                )
        return msg

    async def _write(
        self,
        key: str,
        script: Any,
        args: Sequence[Any],
        acked: Callable[[Any], bool],
        *,
        keys: Sequence[str] = (),
    ) -> Any:
        """Run ``script`` on ``key`` (and ``keys``, in its slot); in a durable mode, then wait
        on the same connection.

        The caller is inside :meth:`_guarded` (holds a ``max_connections`` slot).  ``acked(result)``
        tells whether the result acknowledges stored data (only then does an
        unconfirmed wait fail the write).
        """
        waits = self._wait_commands()
        if not waits:
            return await script(keys=[key, *keys], args=list(args))
        command = ("EVALSHA", script.sha, 1 + len(keys), key, *keys, *args)
        asking: Any = None
        for _ in range(4):
            try:
                if isinstance(self._r, RedisCluster):
                    # Both commands pinned to the key's master: ClusterPipeline sends
                    # one node's commands on one connection.  No automatic redirection:
                    # a MOVED/ASK write would be re-sent on another connection, where
                    # the wait no longer covers it.
                    node = asking or self._r.get_node_from_key(key)
                    cpipe = self._r.pipeline()
                    if asking is not None:
                        cpipe.execute_command("ASKING", target_nodes=node)
                    cpipe.execute_command(*command, target_nodes=node)
                    for wait in waits:
                        cpipe.execute_command(*wait, target_nodes=node)
                    replies = await cpipe.execute(allow_redirections=False)
                else:
                    pipe = self._r.pipeline(transaction=False)
                    pipe.execute_command(*command)
                    for wait in waits:
                        pipe.execute_command(*wait)
                    replies = await pipe.execute()
            except rexc.NoScriptError:  # first use on this node, or Redis restarted
                await self._r.script_load(script.script)
                continue
            except rexc.MovedError as exc:  # the slot moved: nothing ran; learn and retry
                assert isinstance(self._r, RedisCluster)
                await self._r.nodes_manager.move_slot(exc)
                asking = None
                continue
            except rexc.AskError as exc:  # slot being migrated: the key is on the target
                assert isinstance(self._r, RedisCluster)
                asking = self._r.get_node(host=exc.host, port=exc.port)
                if asking is None:
                    raise
                continue
            result, wait_replies = replies[-1 - len(waits)], replies[-len(waits) :]
            if acked(result):
                self._check_waits(wait_replies)
            return result
        raise StoreUnavailableError(
            "Redis kept redirecting this write (slot migration in progress); retry it"
        )

    def _check_waits(self, replies: Sequence[Any]) -> None:
        s = self.settings
        ok, what, lost_on = True, [], []
        for reply in replies:
            if isinstance(reply, list):  # WAITAOF: [local fsyncs, replica fsyncs]
                ok &= int(reply[0]) >= 1
                what.append(f"was fsynced to the master's AOF {int(reply[0])}/1")
                lost_on.append("a host crash or power loss")
            else:  # WAIT: replicas that have it
                ok &= int(reply) >= s.durability_replicas
                what.append(f"reached {int(reply)} of {s.durability_replicas} replica(s)")
                lost_on.append("a failover")
        if not ok:
            raise StoreUnavailableError(
                f"durability={s.durability}: Redis applied the write but it {' and '.join(what)} "
                f"within {s.durability_timeout_ms} ms, so it may or may not be stored after "
                f"{' or '.join(lost_on)}. "
                "Retrying is safe: the same write again is a no-op that waits again"
            )
