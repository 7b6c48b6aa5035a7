"""Direct reads: a trainer reads its namespace's rollouts from Redis itself.

The service authenticates the trainer and hands it a *read plan* (``POST
/v1/read-plan``): a Redis URL and a Redis ACL user that can run only ``HGETALL``/
``HGET``/``HMGET`` on the namespace's keys.  The service stays the only writer
and auth still decides who reads what; the bytes do not pass through a
Python relay.  What comes back is exactly what the service's GET returns for a
whole rollout (context frames and stored segment frames), decoded here with
:func:`~r3_client.decode_rollout`.  Range and layer requests read whole
segments and are trimmed here (the relay can cut them on the server instead).

    reader = DirectReader.from_service("http://r3-cache:8080", api_key=key)
    for rid, routing in reader.get_many(ids):
        ...
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from r3_client._config import Timeout
from r3_client._exceptions import (
    AuthError,
    FormatError,
    FrameError,
    ProtocolError,
    R3Error,
    RolloutNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from r3_client._routing import Routing, check_rollout_id
from r3_client.codec import MAX_DECODED_BYTES, Context, decode_rollout, encode_context, read_header

__all__ = ["DirectReader"]

Result = tuple[str, Routing | R3Error]


class DirectReader:
    """Reads rollouts from Redis / Redis Cluster with a read plan's read-only credentials.

    Create with :meth:`from_service` (asks the service for the plan) or from a
    plan dict; close with :meth:`close` or use as a context manager.  Needs
    ``redis`` (redis-py).  Synchronous; one connection pool.
    """

    def __init__(
        self, plan: dict[str, Any], *, timeout: float = 30.0, max_bytes: int = MAX_DECODED_BYTES
    ) -> None:
        import redis  # lazy: only direct readers need redis-py
        from redis.cluster import RedisCluster

        try:
            self.key_prefix = str(plan["key_prefix"])
            kw = {
                "username": str(plan["username"]),
                "password": str(plan["password"]),
                "socket_timeout": timeout,
            }
            url = str(plan["redis_url"])
            cluster = bool(plan["cluster"])
        except (KeyError, TypeError) as exc:
            raise ProtocolError(f"read plan is incomplete: {exc}") from None
        self.max_bytes = max_bytes
        self._cluster = cluster
        self._r: Any = (
            RedisCluster.from_url(url, **kw) if cluster else redis.Redis.from_url(url, **kw)
        )

    @classmethod
    def from_service(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_bytes: int = MAX_DECODED_BYTES,
    ) -> DirectReader:
        """Ask the service at ``url`` (HTTP) for this API key's read plan.

        Errors as from any client call: the service's own (``AuthError``, ``InvalidRequestError``
        when direct reads are off, ...) or a :class:`TransportError` when it is unreachable.
        """
        from r3_client._transports import HTTPTransport  # lazy: httpx only when asked

        http = HTTPTransport(url, api_key=api_key, timeout=Timeout(read=timeout))
        try:
            plan = http.read_plan()
        finally:
            http.close()
        return cls(plan, timeout=timeout, max_bytes=max_bytes)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the Redis connections."""
        self._r.close()

    def key(self, rollout_id: str) -> str:
        """The Redis key of a rollout (the service's layout: ``<prefix>:<ns>:{<id>}``)."""
        return f"{self.key_prefix}{{{check_rollout_id(rollout_id)}}}"

    def fetch_many(
        self, rollout_ids: Sequence[str], *, chunk_size: int = 16, concurrency: int = 2
    ) -> Iterator[tuple[str, list[bytes] | R3Error]]:
        """Each rollout's frames, in order: context frames (only those its continuation
        frames need), then its stored segment frames by start, as Redis returned them
        (no copy; ``b"".join(frames)`` is exactly what the service's whole-rollout GET
        returns, and :func:`~r3_client.decode_rollout` takes the list as it is).

        Per chunk of ``chunk_size`` ids, the ``HGETALL`` of the rollout hashes is
        pipelined, and the ``HGET`` of the shared (deduplicated) segments a hash
        references is sent as soon as that hash's reply is parsed, on the same
        connection (on Redis Cluster, where the blobs live on other nodes, after the
        chunk: a second pipelined round trip).  ``concurrency`` chunks are in flight at
        once, each on its own pooled connection, so Redis sending one chunk overlaps
        redis-py parsing another (parsing holds the GIL, so more threads than that
        mostly wait for it); at most ``concurrency`` chunks wait for the consumer.
        """
        ids = [check_rollout_id(r) for r in rollout_ids]
        chunks = [ids[i : i + chunk_size] for i in range(0, len(ids), max(1, chunk_size))]
        width = max(1, concurrency)
        with ThreadPoolExecutor(width, thread_name_prefix="r3-fetch") as pool:
            pending: deque[Future[list[tuple[str, list[bytes] | R3Error]]]] = deque()
            for chunk in chunks:
                pending.append(pool.submit(self._fetch_chunk, chunk))
                if len(pending) >= width:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()

    def _fetch_chunk(self, chunk: list[str]) -> list[tuple[str, list[bytes] | R3Error]]:
        import redis.exceptions as rexc

        try:
            hashes = self._read_pipelined(chunk) if self._cluster else self._read_streamed(chunk)
        except rexc.AuthenticationError as exc:
            raise AuthError(f"Redis refused the read plan's credentials: {exc}") from None
        except rexc.NoPermissionError as exc:
            raise AuthError(f"Redis refused a direct read: {exc}") from None
        except (rexc.ConnectionError, rexc.TimeoutError) as exc:
            raise StoreUnavailableError(f"Redis is unreachable: {exc}") from None
        return [
            (rid, self._assemble(rid, fields)) for rid, fields in zip(chunk, hashes, strict=True)
        ]

    def _read_streamed(self, chunk: list[str]) -> list[dict[bytes, Any]]:
        """One pooled connection: every ``HGETALL`` sent at once, and each reply's
        shared-segment ``HGET`` commands sent as soon as that reply is parsed, so Redis
        answers them while the rest of the chunk is still being read (no second
        round trip after the chunk).  A dropped connection retries the chunk as
        redis-py retries a pipeline (the reads are idempotent)."""
        pool = self._r.connection_pool
        conn = pool.get_connection()
        try:
            hashes: list[dict[bytes, Any]] = conn.retry.call_with_retry(
                lambda: self._stream(conn, chunk), lambda _err: conn.disconnect()
            )
        except BaseException:
            conn.disconnect()  # replies may still be on the wire: never reuse it
            raise
        finally:
            pool.release(conn)
        return hashes

    def _stream(self, conn: Any, chunk: list[str]) -> list[dict[bytes, Any]]:
        parse = self._r.parse_response  # reads one reply, applies redis-py's callback
        conn.send_packed_command(conn.pack_commands([("HGETALL", self.key(r)) for r in chunk]))
        hashes: list[dict[bytes, Any]] = []
        refs: list[tuple[int, bytes]] = []
        for n in range(len(chunk)):
            fields: dict[bytes, Any] = parse(conn, "HGETALL")
            hashes.append(fields)
            mine = _shared_refs(fields)
            if mine:
                conn.send_packed_command(conn.pack_commands([("HGET", b, "f") for _, b in mine]))
                refs.extend((n, f) for f, _ in mine)
        for n, f in refs:
            hashes[n][f] = parse(conn, "HGET")
        return hashes

    def _read_pipelined(self, chunk: list[str]) -> list[dict[bytes, Any]]:
        """Redis Cluster: the blobs live in other slots, so two pipelined round trips
        (the cluster pipeline routes each command to its node): ``HGETALL`` of the
        chunk, then ``HGET`` of the shared segments it references."""
        pipe = self._r.pipeline(transaction=False)
        for rid in chunk:
            pipe.hgetall(self.key(rid))
        hashes: list[dict[bytes, Any]] = pipe.execute()
        refs = [(n, f, blob) for n, h in enumerate(hashes) for f, blob in _shared_refs(h)]
        if refs:
            pipe = self._r.pipeline(transaction=False)
            for _, _, blob in refs:
                pipe.hget(blob, "f")
            for (n, f, _), frame in zip(refs, pipe.execute(), strict=True):
                hashes[n][f] = frame
        return hashes

    @staticmethod
    def _assemble(rollout_id: str, fields: dict[bytes, Any]) -> list[bytes] | R3Error:
        if not fields:
            return RolloutNotFoundError(f"rollout {rollout_id} not found")
        segments = sorted((int(f.split(b":")[1]), v) for f, v in fields.items() if f[:2] == b"s:")
        if any(not isinstance(v, bytes) for _, v in segments):
            return StoreError(f"rollout {rollout_id}: a shared segment's data has expired")
        frames: list[bytes] = [v for _, v in segments]
        stored = {f[2:].decode(): raw for f, raw in fields.items() if f[:2] == b"c:"}
        if not stored:
            return frames
        # Contexts travel only for continuation frames (a self-contained frame carries
        # its own), as in the service's GET.  Only stored contexts can be sent, so the
        # headers are read until every one of them is known to travel in its own frame
        # (usually the first frame: agent turns and GRPO responses continue it).
        carried: set[str] = set()
        bases: set[str] = set()
        try:
            for v in frames:
                h = read_header(v, verify=False)
                if h.base:
                    bases.add(h.base)
                elif h.context is not None:
                    carried.add(h.context.digest)
                    if carried >= stored.keys():
                        return frames
            parts = [
                encode_context(Context.parse(raw, tables=False))
                for d, raw in stored.items()
                if d in bases - carried
            ]
        except FrameError:  # damaged: the decode of the whole names the segment
            parts = []
        return [*parts, *frames]

    def get_many(
        self,
        rollout_ids: Sequence[str],
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        chunk_size: int = 16,
        return_errors: bool = False,
        workers: int = 2,
        concurrency: int = 2,
    ) -> Iterator[Result]:
        """``(rollout_id, Routing)`` for each id, in order: :meth:`fetch_many`, decoded and
        trimmed to ``[start, end)`` / ``layers``.  A rollout that cannot be read or
        decoded raises, or with ``return_errors`` is yielded as ``(id, R3Error)``.

        Decoding runs in ``workers`` threads (zstd and numpy release the GIL) while
        the next rollouts are fetched; at most ``2 * workers`` decoded rollouts wait.
        """
        width = max(1, workers)

        def decode(rid: str, got: list[bytes] | R3Error) -> Routing | R3Error:
            if isinstance(got, R3Error):
                return got
            try:
                return decode_rollout(
                    got,
                    start=start,
                    end=end,
                    layers=layers,
                    rollout_id=rid,
                    max_bytes=self.max_bytes,
                )
            except (FormatError, FrameError) as exc:
                return exc

        with ThreadPoolExecutor(width, thread_name_prefix="r3-decode") as pool:
            pending: deque[tuple[str, Future[Routing | R3Error]]] = deque()
            fetched = self.fetch_many(rollout_ids, chunk_size=chunk_size, concurrency=concurrency)
            for rid, got in fetched:
                pending.append((rid, pool.submit(decode, rid, got)))
                while len(pending) > 2 * width or (pending and pending[0][1].done()):
                    yield self._ready(pending.popleft(), return_errors)
            while pending:
                yield self._ready(pending.popleft(), return_errors)

    @staticmethod
    def _ready(item: tuple[str, Future[Routing | R3Error]], return_errors: bool) -> Result:
        rid, fut = item
        res = fut.result()
        if isinstance(res, R3Error) and not return_errors:
            raise res
        return rid, res


def _shared_refs(fields: dict[bytes, Any]) -> list[tuple[bytes, bytes]]:
    """``(field, blob key)`` of a rollout hash's segments stored as shared blobs
    (``s:<start>`` fields holding ``@<key>``)."""
    return [(f, v[1:]) for f, v in fields.items() if f[:2] == b"s:" and v[:1] == b"@"]
