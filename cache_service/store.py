"""The Redis segment store: rollouts as atomically-written, stitched segments.

One Redis hash per rollout, ``<prefix>:{<rollout_id>}``; the ``{…}`` hash tag
keeps every key of a rollout in one Redis Cluster slot, so the same Lua
scripts run unchanged on a single Redis and on a cluster.  Fields:

* ``m`` — rollout meta (E, K, MoE layer ids); every segment must agree;
* ``s:<a>:<b>`` — the segment's frame, exactly as validated on put;
* ``d:<a>:<b>`` — digest of the segment's *content* (canonical rows + meta), so a
  re-put of the same data in another codec is still recognised as a duplicate;
* ``h:<a>:<b>`` — segment info (range, model, weight version, codec, bytes);
* ``r:<a>:<b>`` — for a *shared* segment, the blob key holding its frame
  (``s:<a>:<b>`` then holds ``@<blob key>``);
* ``b`` / ``sb`` / ``n`` — total frame bytes / bytes of shared segments / segment count.

GRPO prompt dedupe: a segment with a token digest is stored once per
(namespace, E, K, layers, range, model id, weight version, token digest) in a
blob hash ``<prefix>:blob:{<sha>}`` and referenced from every rollout that puts
it, so the n samples of one prompt keep one copy of the prompt's rows.  If two
writers send different rows under the same share key (non-deterministic
numerics), the second keeps its own copy: sharing never changes what a rollout
reads.  A blob's TTL is kept at least as long as that of every rollout
referencing it (refreshed on each put and touch); deleting a rollout leaves
shared blobs to expire.

Durability (``StoreSettings.durability``): ``ack`` answers once Redis has applied a
write (what survives a crash is then up to that Redis's AOF policy); ``replicas``
follows every write with ``WAIT n timeout``, ``fsync`` with ``WAITAOF 1 0 timeout``
(plus ``WAIT n`` with replicas).  They are sent in one pipeline on the *same
connection* as the write (both count only what that connection wrote) and, on a
cluster, on the master that owns the key's slot.  A write that is not confirmed in
time raises :class:`StoreUnavailableError`: applied, maybe not durable, safe to
retry.  Paths that find their data already stored (a duplicate segment, a shared
blob already there) still write one unchanged field, so the retry's wait covers the
data an earlier, unconfirmed request stored.

Rules (all enforced inside one Lua script, so concurrent writers cannot race):
putting an identical segment again is a no-op; a segment overlapping a stored
one and not identical to it is a :class:`SegmentConflictError`; rows between
segments that were never written read back as ``-1``.  Every write refreshes
the rollout's TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgpack
import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from r3_client import (
    FormatError,
    FrameError,
    InvalidRequestError,
    RolloutNotFoundError,
    Routing,
    Segment,
    SegmentConflictError,
    ShapeError,
    StoreError,
    StoreUnavailableError,
    UnsupportedFrameError,
    check_rollout_id,
    read_header,
)
from r3_client._codec import Context, encode_context
from r3_client._codec_rollout import decode_rollout, slice_frame
from r3_client._codec_v2_read import check_chunks
from r3_client._format import layer_positions
from r3_client._models import PutResult, RolloutInfo, SegmentInfo

__all__ = ["DURABILITY_MODES", "SegmentStore", "StoreSettings", "check_namespace"]

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
    script scans them).

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


class SegmentStore:
    """Async segment store over redis-py asyncio (single Redis or Redis Cluster).

    Create with :meth:`connect` (pings with bounded retries) and close with
    :meth:`close`, or use ``async with SegmentStore.connect(...)``.
    """

    def __init__(self, client: RedisClient, settings: StoreSettings) -> None:
        self._r = client
        self.settings = settings
        self._put = client.register_script(_load("put_segment.lua"))
        self._fields = client.register_script(_load("segment_fields.lua"))
        self._stat = client.register_script(_load("stat_rollout.lua"))
        self._touch = client.register_script(_load("touch_rollout.lua"))
        self._put_blob = client.register_script(_load("put_blob.lua"))
        self._keep_blob = client.register_script(_load("keep_blob.lua"))
        self._delete = client.register_script("return redis.call('DEL', KEYS[1])")
        self._namespace = ""
        self._limit = asyncio.Semaphore(settings.max_connections)

    @classmethod
    async def connect(cls, settings: StoreSettings) -> SegmentStore:
        """Build the client from ``settings.redis_url`` and ping it, retrying with backoff."""
        client: RedisClient
        if settings.cluster:
            client = RedisCluster.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                max_connections=settings.max_connections,
            )
        else:
            client = aioredis.Redis.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                max_connections=settings.max_connections,
            )
        delay = 0.1
        for attempt in range(settings.connect_retries + 1):
            try:
                await client.ping()
                break
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterError) as exc:
                if attempt == settings.connect_retries:
                    await client.aclose()
                    raise StoreUnavailableError(
                        f"cannot reach Redis at {settings.redis_url}: {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        store = cls(client, settings)
        try:
            await store.check_durability()
        except BaseException:
            await client.aclose()
            raise
        return store

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
        self, key: str, script: Any, args: Sequence[Any], acked: Callable[[Any], bool]
    ) -> Any:
        """Run ``script`` on ``key``; in a durable mode, then wait on the same connection.

        The caller holds a ``_limit`` slot inside :func:`_translate`.  ``acked(result)``
        tells whether the result acknowledges stored data (only then does an
        unconfirmed wait fail the write).
        """
        waits = self._wait_commands()
        if not waits:
            return await script(keys=[key], args=list(args))
        command = ("EVALSHA", script.sha, 1, key, *args)
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

    async def close(self) -> None:
        """Close the connection pool."""
        await self._r.aclose()

    async def __aenter__(self) -> SegmentStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def for_namespace(self, namespace: str) -> SegmentStore:
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

    async def _keep_blobs(self, refs: Sequence[bytes], ttl_ms: int) -> None:
        """Extend the TTL of shared blobs a rollout references (one slot each).

        Sequential on purpose: the caller holds one of ``max_connections`` slots,
        and a rollout references few blobs (its prompt segments).
        """
        for ref in refs:
            await self._write(ref.decode(), self._keep_blob, [ttl_ms], bool)

    async def grant_reader(self, secret: str) -> tuple[str, str, str]:
        """Create (idempotently) this namespace's read-only Redis user; its credentials.

        ``ACL SETUSER r3-read-<ns>`` on every node (ACLs are per node, also on a
        cluster): key pattern ``<prefix>:<ns>:*`` only, commands ``HGETALL``/``HGET``/
        ``HMGET`` and what a client needs to connect (``PING``, ``HELLO``,
        ``CLUSTER SLOTS``/``SHARDS``/``NODES``, ``READONLY``, ``COMMAND``; redis-py
        ignores a refused ``CLIENT SETINFO``, which Redis 7.0 does not know).
        The password is HMAC-SHA256(``secret``, namespace), so every replica of the
        service issues the same one.  Returns ``(username, password, key prefix)``.
        """
        if not self._namespace:
            raise InvalidRequestError("direct reads are per namespace")
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
        async with _translate(self._limit):
            if isinstance(self._r, RedisCluster):
                await self._r.execute_command(
                    "ACL", "SETUSER", user, *rules, target_nodes=self._r.get_nodes()
                )
            else:
                await self._r.execute_command("ACL", "SETUSER", user, *rules)  # type: ignore[no-untyped-call]
        return user, password, prefix

    async def ping(self) -> bool:
        """True when Redis answers."""
        async with _translate(self._limit):
            return bool(await self._r.ping())

    # ---- writes ------------------------------------------------------------------------
    async def put_segment(
        self, rollout_id: str, frame: bytes, *, ttl_s: int | None = None
    ) -> PutResult:
        """Check ``frame``'s header and store it unchanged as one segment of ``rollout_id``.

        No routing is decoded: the header (geometry, limits, contiguity), the CRC,
        each chunk's declared inflated size and the writer's content digest are
        checked, and the bytes are stored as they are.  Raises :class:`FrameError`
        for bad bytes (a v1 frame, which lacks declared sizes and digest, is
        :class:`UnsupportedFrameError`), :class:`SegmentConflictError` for an
        overlapping different segment, different E/K/layers or a continuation
        frame whose context the rollout does not hold, and
        :class:`InvalidRequestError` when the rollout has too many segments or the
        segment starts too far past the stored rows.
        """
        key = self.key(rollout_id)
        hdr = read_header(frame)
        if hdr.version < 2:
            raise UnsupportedFrameError(
                "format v1 frames cannot be stored: the service keeps frames without decoding "
                "them and needs format v2's declared sizes and content digest "
                "(upgrade the writer's r3-client)"
            )
        if hdr.codec == "context" or hdr.segment is None or not hdr.digest:
            raise FrameError(
                "a stored frame must be one whole segment carrying its content digest "
                "(what encode_frame writes with a segment)"
            )
        segment = hdr.segment
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidRequestError(f"ttl must be >= 0 seconds, got {ttl}")
        if hdr.base:
            async with _translate(self._limit):
                raw_ctx = await self._r.hget(key, f"c:{hdr.base}")
            if not isinstance(raw_ctx, bytes):
                raise SegmentConflictError(self._no_base(rollout_id, hdr.base))
            hdr = read_header(frame, verify=False, context=Context.parse(raw_ctx, tables=False))
            ctx_field, ctx_raw, base_field = "", b"", f"c:{hdr.base}"
        else:
            assert hdr.context is not None
            ctx_field, ctx_raw, base_field = f"c:{hdr.context.digest}", hdr.context.raw, ""
        assert hdr.context is not None
        if hdr.layer_ids != hdr.context.layer_ids:
            raise FrameError("a stored segment frame holds every layer of its context")
        if hdr.decoded_bytes > self.settings.max_decoded_bytes:
            raise InvalidRequestError(
                f"segment [{segment.start}, {segment.end}) declares {hdr.decoded_bytes} bytes of "
                f"routing; the limit is {self.settings.max_decoded_bytes}"
            )
        check_chunks(frame, hdr)  # every zstd chunk declares exactly what its shape allows
        digest = hdr.digest
        meta = _meta_bytes(hdr.num_experts, hdr.topk, hdr.layer_ids)
        value, ref, dedupe_hit = frame, "", False
        async with _translate(self._limit):
            if segment.tokens_digest and self.settings.dedupe:
                blob = self._blob_key(meta, segment)
                shared = await self._write(
                    blob, self._put_blob, [frame, digest, ttl * 1000], _BLOB_ACKED.__contains__
                )
                if shared in (b"new", b"same"):
                    value, ref, dedupe_hit = b"@" + blob.encode(), blob, shared == b"same"
            info = msgpack.packb(
                [segment.to_dict(), hdr.codec, len(frame), bool(ref)], use_bin_type=True
            )
            res = await self._write(
                key,
                self._put,
                [
                    meta,
                    segment.start,
                    segment.end,
                    value,
                    digest,
                    info,
                    ttl * 1000,
                    self.settings.max_segments,
                    len(frame),
                    ref,
                    ctx_field,
                    ctx_raw,
                    base_field,
                    self.settings.max_gap_rows,
                ],
                lambda r: r[0] in _PUT_ACKED,
            )
            if res[0] in (b"stored", b"duplicate"):
                await self._keep_blobs(res[1:], ttl * 1000)
        status = res[0].decode()
        if status == "stored" or status == "duplicate":
            hit = dedupe_hit and status == "stored"
            return PutResult(status, rollout_id, segment, len(frame), bool(ref), hit)
        if status == "meta":
            e, k, layers = msgpack.unpackb(res[1])
            raise SegmentConflictError(
                f"rollout {rollout_id} holds routing with E={e}, K={k}, layers={layers}; "
                f"this segment has E={hdr.num_experts}, K={hdr.topk}, "
                f"layers={list(hdr.layer_ids)}"
            )
        if status == "conflict":
            other, how = res[1].decode(), res[2].decode()
            a, b = other.split(":")
            detail = (
                "covers the same range with different routing or metadata"
                if how == "differs"
                else "overlaps it; send only rows not yet stored (start at the stored end)"
            )
            raise SegmentConflictError(
                f"segment [{segment.start}, {segment.end}) of rollout {rollout_id} conflicts "
                f"with stored segment [{a}, {b}): it {detail}"
            )
        if status == "nobase":
            raise SegmentConflictError(self._no_base(rollout_id, hdr.base))
        if status == "gap":
            raise InvalidRequestError(
                f"segment [{segment.start}, {segment.end}) of rollout {rollout_id} starts "
                f"{segment.start - int(res[1])} rows past its stored rows [0, {int(res[1])}); "
                f"the limit is {self.settings.max_gap_rows} (R3_CACHE_MAX_GAP_ROWS)"
            )
        if status == "full":
            raise InvalidRequestError(
                f"rollout {rollout_id} already has {int(res[1])} segments "
                f"(limit {self.settings.max_segments})"
            )
        raise StoreError(f"unexpected put result {res!r}")

    @staticmethod
    def _no_base(rollout_id: str, base: str) -> str:
        return (
            f"rollout {rollout_id} holds no context {base[:12]}…: a continuation frame "
            "follows a segment that carries that context; put that segment first"
        )

    async def delete(self, rollout_id: str) -> bool:
        """Delete a rollout; True if it existed."""
        key = self.key(rollout_id)
        async with _translate(self._limit):
            if not self._wait_commands():
                return bool(await self._r.delete(key))
            return bool(await self._write(key, self._delete, [], bool))

    async def touch(self, rollout_id: str, ttl_s: int | None = None) -> None:
        """Reset the rollout's TTL (default: ``settings.default_ttl_s``; 0 = never expire).

        Raises :class:`RolloutNotFoundError` if it does not exist.
        """
        key = self.key(rollout_id)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidRequestError(f"ttl must be >= 0 seconds, got {ttl}")
        async with _translate(self._limit):
            res = await self._write(key, self._touch, [ttl * 1000], bool)
            if not res:
                raise RolloutNotFoundError(f"rollout {rollout_id} not found")
            await self._keep_blobs(res[1:], ttl * 1000)

    # ---- reads -------------------------------------------------------------------------
    async def _fetch(
        self, rollout_id: str, start: int, end: int | None
    ) -> tuple[
        tuple[int, int, tuple[int, ...]], int, list[tuple[int, int, bytes]], dict[str, bytes]
    ]:
        """Meta, stored end, ``(start, end, frame)`` of segments overlapping ``[start, end)``,
        and the rollout's contexts.

        Sorted by start; shared segments resolved to their frames; contexts by digest.
        A whole-rollout read is one ``HGETALL``; a range asks a script for the
        overlapping field names (and the context names) and then ``HMGET``s them
        (segments are never rewritten in place, so the two steps cannot mix
        versions; a rollout deleted in between reads as not found).
        """
        key = self.key(rollout_id)
        if start < 0 or (end is not None and end <= start):
            raise InvalidRequestError(f"token range [{start}, {end}) is empty or negative")
        missing = RolloutNotFoundError(f"rollout {rollout_id} not found")
        async with _translate(self._limit):
            if start == 0 and end is None:
                fields: dict[Any, Any] = await self._r.hgetall(key)
                meta = fields.get(b"m")
                named = [(f, v) for f, v in fields.items() if f[:2] in (b"s:", b"c:")]
                stored_end = max(
                    (int(f.split(b":")[2]) for f, _ in named if f[:2] == b"s:"), default=0
                )
            else:
                res = await self._fields(keys=[key], args=[start, -1 if end is None else end])
                meta = res[0] if res else None
                stored_end = int(res[1]) if res else 0
                names = res[2:]
                values: list[Any] = await self._r.hmget(key, names) if names else []
                if any(v is None for v in values):
                    raise missing
                named = list(zip(names, values, strict=True))
            if meta is None:
                raise missing
            contexts = {f[2:].decode(): v for f, v in named if f[:2] == b"c:"}
            segments = sorted(
                (int(a), int(b), v)
                for f, v in named
                if f[:2] == b"s:"
                for _, a, b in (f.split(b":"),)
            )
            for i, (seg_start, seg_end, value) in enumerate(segments):
                if value[:1] == b"@":  # shared segment: one HGET in the blob's own slot
                    blob = await self._r.hget(value[1:].decode(), "f")
                    if not isinstance(blob, bytes):
                        raise StoreError(
                            f"rollout {rollout_id}: a shared segment's data has expired"
                        )
                    segments[i] = (seg_start, seg_end, blob)
        e, k, layer_ids = msgpack.unpackb(meta)
        return (e, k, tuple(layer_ids)), stored_end, segments, contexts

    async def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> bytes:
        """The rollout's stored frames overlapping the request, concatenated: nothing decoded.

        Whole segments come back byte for byte; a segment the range or ``layers``
        cuts comes back as a :func:`~r3_client.slice_frame` of it (the blocks and
        layer groups that cover the request; the reader trims).  Context frames for
        the continuation frames returned come first.  Decode with
        :func:`r3_client.decode_rollout` using the same ``start``/``end``/``layers``.
        Raises :class:`RolloutNotFoundError`, or :class:`InvalidRequestError` for a
        range outside ``[0, num_rows)`` or an unknown layer id.
        """
        (_, _, layer_ids), stored_end, segments, contexts = await self._fetch(
            rollout_id, start, end
        )
        if end is None and start >= stored_end:
            raise InvalidRequestError(
                f"start {start} is past the last stored row of rollout {rollout_id} "
                f"(it holds rows [0, {stored_end}))"
            )
        hi = stored_end if end is None else end
        if not start < hi <= stored_end:
            raise InvalidRequestError(
                f"token range [{start}, {end}) is outside rollout {rollout_id}'s rows "
                f"[0, {stored_end})"
            )
        if layers is not None:
            try:
                layer_positions(layer_ids, layers)
            except ShapeError as exc:
                raise InvalidRequestError(str(exc)) from None
        if start == 0 and end is None and layers is None and len(segments) == 1:
            return segments[0][2]  # a single self-contained segment: the stored bytes
        return await asyncio.to_thread(
            self._cut, rollout_id, segments, contexts, start, end, layers
        )

    @staticmethod
    def _cut(
        rollout_id: str,
        segments: list[tuple[int, int, bytes]],
        contexts: dict[str, bytes],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> bytes:
        """Frames (or slices) for the request plus the contexts they continue from."""
        parts: list[bytes] = []
        bases: dict[str, Context] = {}
        carried: set[str] = set()  # contexts a returned frame carries itself
        for a, b, frame in segments:
            try:
                hdr = read_header(frame, verify=False)
                ctx = None
                if hdr.context is not None and not hdr.base:
                    carried.add(hdr.context.digest)
                if hdr.version == 1:  # stored before format v2: whole, the reader trims
                    parts.append(frame)
                    continue
                if hdr.base:
                    raw = contexts.get(hdr.base)
                    if raw is None:
                        raise StoreError(
                            f"rollout {rollout_id}: the context of segment [{a}, {b}) is missing"
                        )
                    ctx = bases.get(hdr.base) or Context.parse(raw, tables=False)
                    bases[hdr.base] = ctx
                cut = (start > a or (end is not None and end < b)) or layers is not None
                parts.append(
                    slice_frame(frame, start=start, end=end, layers=layers, context=ctx)
                    if cut
                    else frame
                )
            except (FormatError, FrameError):
                # A stored frame damaged in Redis: hand it over whole; the reader's decode
                # names the rollout and segment (the service never decodes to judge it).
                parts.append(frame)
        if not parts and contexts:  # the range lies in a gap: the context says E, K, layers
            bases = {d: Context.parse(raw, tables=False) for d, raw in list(contexts.items())[:1]}
        extra = [encode_context(c) for d, c in bases.items() if d not in carried]
        return b"".join([*extra, *parts])

    async def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> Routing:
        """:meth:`get_frame` decoded (a convenience for tests and tools: it decodes in
        this process; the service's request paths never call it)."""
        data = await self.get_frame(rollout_id, start=start, end=end, layers=layers)
        return await asyncio.to_thread(
            decode_rollout, data, start=start, end=end, layers=layers, rollout_id=rollout_id
        )

    async def stat(self, rollout_id: str) -> RolloutInfo:
        """Meta, segments, sizes and TTL of a rollout; :class:`RolloutNotFoundError` if absent."""
        key = self.key(rollout_id)
        async with _translate(self._limit):
            res = await self._stat(keys=[key], args=[])
            if not res:
                raise RolloutNotFoundError(f"rollout {rollout_id} not found")
            try:
                mem = await self._r.memory_usage(key, samples=0)  # 0 = count every field
            except rexc.ResponseError:  # MEMORY disabled by the operator
                mem = None
        e, k, layer_ids = msgpack.unpackb(res[0])
        infos = []
        for raw in res[4:]:
            seg, codec, nbytes, shared = msgpack.unpackb(raw)
            infos.append(SegmentInfo(Segment.from_dict(seg), codec, nbytes, shared))
        infos.sort(key=lambda i: i.segment.start)
        pttl = int(res[3])
        return RolloutInfo(
            rollout_id=rollout_id,
            num_experts=e,
            topk=k,
            layer_ids=tuple(layer_ids),
            num_rows=max((i.segment.end for i in infos), default=0),
            stored_bytes=int(res[1]),
            shared_bytes=int(res[2]),
            memory_bytes=None if mem is None else int(mem),
            ttl_s=None if pttl < 0 else pttl / 1000,
            segments=tuple(infos),
        )

    async def memory(self) -> dict[str, int]:
        """Store-wide accounting: Redis ``used_memory`` and key count, summed over primaries."""
        async with _translate(self._limit):
            if isinstance(self._r, RedisCluster):
                nodes = RedisCluster.PRIMARIES
                per_node: Any = await self._r.info("memory", target_nodes=nodes)
                used = sum(int(v["used_memory"]) for v in per_node.values())
                nkeys = int(await self._r.dbsize(target_nodes=nodes))  # summed by redis-py
            else:
                info: Any = await self._r.info("memory")
                used, nkeys = int(info["used_memory"]), int(await self._r.dbsize())
        return {"used_memory": used, "keys": nkeys}
