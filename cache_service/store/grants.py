"""Direct reads' Redis users: the read-only ACL user a namespace's read plan names, and the
check that Redis asks every connection for credentials before one is issued.

Runs in the service's process: at start-up (direct reads on) and for each ``POST
/v1/read-plan`` (:meth:`~cache_service.routing_service.RoutingService.read_plan`); the
reader it creates is a :class:`~r3_client.DirectReader` in a training rank.
"""

from __future__ import annotations

import hmac
from typing import Any

import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from cache_service.store.base import StoreBase, redacted
from r3_client import InvalidRequestError, StoreError

__all__ = ["ReaderGrants"]

#: What a direct reader may run: reads of rollout hashes and blobs, and connection set-up.
_READER_COMMANDS = (
    "hgetall",
    "hget",
    "hmget",
    "hkeys",
    "hscan",
    "ping",
    "hello",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "readonly",
    "command",
)

_OPEN_REDIS = (
    "direct reads are on, but Redis {nodes} lets clients in without a password (its "
    "`default` user is `on` and `nopass`, Redis's out-of-the-box setting): anyone who "
    "reaches the Redis port would read every tenant's rollouts, whatever user a read "
    "plan creates, so no read plan is issued. Give the default user a password "
    "(`requirepass <password>` in redis.conf, or `ACL SETUSER default on >password`) or "
    "switch it off (`user default off`, with a user of its own for the service), and put "
    "the service's credentials in R3_CACHE_REDIS_URL; or set R3_CACHE_DIRECT_READS=false. "
    "(Without R3_CACHE_REDIS_URL the service starts its own Redis with a password.)"
)


def _admits_anyone(acl_user: Any) -> bool:
    """Whether an ``ACL GETUSER default`` reply lets connections in with no credentials."""
    flags = {f.decode() if isinstance(f, bytes) else str(f) for f in acl_user[b"flags"]}
    return "on" in flags and "nopass" in flags


class ReaderGrants(StoreBase):
    """The read-only Redis user of a namespace's read plans (docs/service.md, "Direct
    reads")."""

    async def refuse_open_redis(self) -> None:
        """Raise :class:`StoreError` unless every Redis node refuses clients without
        credentials (direct reads: at start-up, and before each read plan).

        A reader user confines its holder to one namespace only while Redis asks every
        connection for credentials: with the ``default`` user ``on`` and ``nopass``
        anyone who reaches the port reads every tenant.  Checked with ``ACL GETUSER
        default`` on every node (ACLs are per node); a Redis restarted without a
        password set at run time is caught at the next plan.
        """
        nodes = self._r.get_nodes() if isinstance(self._r, RedisCluster) else [None]
        open_nodes = []
        async with self._guarded():
            for node in nodes:
                try:
                    if node is None:
                        reply = await self._r.execute_command("ACL", "GETUSER", "default")
                        name = redacted(self.settings.redis_url)
                    else:
                        assert isinstance(self._r, RedisCluster)
                        reply = await self._r.execute_command(
                            "ACL", "GETUSER", "default", target_nodes=node
                        )
                        if isinstance(reply, dict) and node.name in reply:
                            reply = reply[node.name]  # some redis-py versions key it by node
                        name = node.name
                except rexc.NoPermissionError as exc:
                    raise StoreError(
                        "direct reads need the service's Redis user to run ACL GETUSER and "
                        f"ACL SETUSER on every node; Redis refused: {exc}"
                    ) from exc
                if _admits_anyone(reply):
                    open_nodes.append(name)
        if open_nodes:
            raise StoreError(_OPEN_REDIS.format(nodes=", ".join(open_nodes)))

    async def grant_reader(self, secret: str) -> tuple[str, str, str]:
        """Create (idempotently) this namespace's read-only Redis user; its credentials.

        ``ACL SETUSER r3-read-<ns>`` on every node (ACLs are per node, also on a
        cluster): key pattern ``<prefix>:<ns>:*`` only, commands ``HGETALL``/``HGET``/``HKEYS``/
        ``HSCAN``/``HMGET`` and what a client needs to connect (``PING``, ``HELLO``,
        ``CLUSTER SLOTS``/``SHARDS``/``NODES``, ``READONLY``, ``COMMAND``; redis-py
        ignores a refused ``CLIENT SETINFO``, which Redis 7.0 does not know).
        The password is HMAC-SHA256(``secret``, namespace), so every replica of the
        service issues the same one.  Returns ``(username, password, key prefix)``.
        Refused (:meth:`refuse_open_redis`) where Redis admits clients without credentials.
        """
        if not self._namespace:
            raise InvalidRequestError("direct reads are per namespace")
        await self.refuse_open_redis()
        user = f"r3-read-{self._namespace}"
        password = hmac.new(secret.encode(), self._namespace.encode(), "sha256").hexdigest()
        prefix = f"{self._prefix}:"
        rules = [
            "reset",
            "on",
            f">{password}",
            f"~{prefix}*",
            "resetchannels",
            "-@all",
            *(f"+{c}" for c in _READER_COMMANDS),
        ]
        async with self._guarded():
            if isinstance(self._r, RedisCluster):
                await self._r.execute_command(
                    "ACL", "SETUSER", user, *rules, target_nodes=self._r.get_nodes()
                )
            else:
                await self._r.execute_command("ACL", "SETUSER", user, *rules)  # type: ignore[no-untyped-call]
        return user, password, prefix
