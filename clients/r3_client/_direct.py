"""Direct reads: a trainer reads its namespace's rollouts from Redis itself.

The service authenticates the trainer and hands it a *read plan* (``POST
/v1/read-plan``): a Redis URL and a Redis ACL user that can run only ``HGETALL``/
``HGET``/``HMGET``/``HKEYS``/``HSCAN`` on the namespace's keys.  The service stays the only writer
and auth still decides who reads what; the bytes do not pass through a
Python relay.  What comes back is exactly what the service's GET returns for a
whole rollout (context frames and stored segment frames), decoded here with
:func:`~r3_client.decode_rollout`.  Ranged reads (:meth:`DirectReader.get_ranges`)
fetch only the chunks their rows and layers need of a segment stored chunked (the
store's layout since issue 44: docs/store.md), whole frames of one stored before.

Reads take the view policies of :class:`~r3_client.RoutingClient` (docs/store.md,
"Views"): a rollout hash lists its views (``v:<serves>`` fields, read by the same
``HGETALL``), and the view hashes (``<rollout key>:v:<serves>``, under the namespace's
key pattern) are read only for the rollouts that have views, when the policy needs them.

    reader = DirectReader.from_service("http://r3-cache:8080", api_key=key)
    for rid, routing in reader.get_many(ids, view="latest"):
        ...
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, overload

import msgpack

from r3_client._answers import ViewInfo
from r3_client._config import Timeout
from r3_client._exceptions import (
    AuthError,
    FormatError,
    FrameError,
    InvalidRequestError,
    ProtocolError,
    R3Error,
    RolloutNotFoundError,
    ShapeError,
    StoreError,
    StoreUnavailableError,
)
from r3_client._fetched import FetchedRange, layers_tuple
from r3_client._routing import Routing, check_rollout_id
from r3_client._stored import Chunked, head_chunks, parse_chunk_field, uncarried_contexts
from r3_client._views import (
    RangeRead,
    ServedRouting,
    ViewPolicy,
    apply_views,
    check_policy,
    check_views_size,
    one_routing_policy,
    overlapping,
    piece_sources,
    ranged_reads,
    read_views,
    run_steps,
    served,
    serving_views,
)
from r3_client.codec import (
    MAX_DECODED_BYTES,
    Context,
    decode_rollout,
    encode_context,
    join_frame,
    read_header,
    slice_frame,
)
from r3_client.codec.frame import is_context_frame, is_frame_head

__all__ = ["DirectReader"]

Result = tuple[str, Routing | R3Error]
_A = TypeVar("_A", Routing | R3Error, Routing | FetchedRange | R3Error)


@dataclass
class _Read:
    """One rollout as read: its frames, its stored end and the views that serve a stored
    segment (when the policy reads views; their hashes are read when applied)."""

    frames: list[bytes | Chunked]
    stored_end: int = 0  # one past the last stored row
    views: tuple[ViewInfo, ...] = ()


#: What a ranged read fetches of one rollout: the rows of its reads and the layers read.
_Want = tuple[list[tuple[int, int]], Sequence[int] | None]


#: Which views a read needs: ``(start, end)`` rows of the base read, or None (no views).
_Span = tuple[int, int | None] | None


class DirectReader:
    """Reads rollouts from Redis / Redis Cluster with a read plan's read-only credentials.

    Create with :meth:`from_service` (asks the service for the plan) or from a
    plan dict; close with :meth:`close` or use as a context manager.  Needs
    ``redis`` (redis-py).  Synchronous; one connection pool.  Reads answer what
    :class:`~r3_client.RoutingClient` answers under the same view policy
    (``get``/``get_many``: ``generated`` or ``latest``; ``get_served``: ``exact``).
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
        self._scan = True  # False once Redis refuses this user HSCAN (an older grant)
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

    def view_key(self, rollout_id: str, serves: int) -> str:
        """The Redis key of the rollout's view serving row ``serves``: ``<rollout key>:v:
        <serves>``, in the rollout's slot and under the namespace's key pattern."""
        return f"{self.key(rollout_id)}:v:{int(serves)}"

    def fetch_many(
        self, rollout_ids: Sequence[str], *, chunk_size: int = 16, concurrency: int = 2
    ) -> Generator[tuple[str, list[bytes] | R3Error], None, None]:
        """Each rollout's frames, in order: context frames (only those its continuation
        frames need), then its stored segment frames by start, as Redis returned them
        (no copy; ``b"".join(frames)`` is exactly what the service's whole-rollout GET
        returns, and :func:`~r3_client.decode_rollout` takes the list as it is).  These
        are the first computations (``generated``); :meth:`get_many` and
        :meth:`get_served` read the views too where the policy needs them.

        Per chunk of ``chunk_size`` ids, the ``HGETALL`` of the rollout hashes is
        pipelined, and the ``HGET`` of the shared (deduplicated) segments a hash
        references is sent as soon as that hash's reply is parsed, on the same
        connection (on Redis Cluster, where the blobs live on other nodes, after the
        chunk: a second pipelined round trip).  ``concurrency`` chunks are in flight at
        once, each on its own pooled connection, so Redis sending one chunk overlaps
        redis-py parsing another (parsing holds the GIL, so more threads than that
        mostly wait for it); at most ``concurrency`` chunks wait for the consumer.
        """
        with closing(self._reads(rollout_ids, None, chunk_size, concurrency)) as reads:
            for rid, got in reads:
                yield rid, got if isinstance(got, R3Error) else [_whole(f) for f in got.frames]

    def _reads(
        self,
        rollout_ids: Sequence[str],
        span: _Span,
        chunk_size: int,
        concurrency: int,
        wants: dict[str, _Want] | None = None,
    ) -> Generator[tuple[str, _Read | R3Error], None, None]:
        """:meth:`fetch_many`'s chunks in flight, each rollout with the views ``span``
        needs (:meth:`_fetch_chunk`); ``wants``: only the fields a ranged read of each
        rollout needs (:meth:`_read_wanted`), instead of whole hashes.  Closed early (its
        consumer refused a read), the chunks not yet started are dropped and those in
        flight finish, so every connection is back in the pool when it returns."""
        ids = [check_rollout_id(r) for r in rollout_ids]
        chunks = [ids[i : i + chunk_size] for i in range(0, len(ids), max(1, chunk_size))]
        width = max(1, concurrency)
        with ThreadPoolExecutor(width, thread_name_prefix="r3-fetch") as pool:
            pending: deque[Future[list[tuple[str, _Read | R3Error]]]] = deque()
            try:
                for chunk in chunks:
                    pending.append(pool.submit(self._fetch_chunk, chunk, span, wants))
                    if len(pending) >= width:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:
                for fut in pending:
                    fut.cancel()

    def _fetch_chunk(
        self, chunk: list[str], span: _Span, wants: dict[str, _Want] | None = None
    ) -> list[tuple[str, _Read | R3Error]]:
        """The chunk's rollout hashes (with, when ``span`` asks for views, the views that
        serve a stored segment; their hashes are read one at a time as they are applied,
        :meth:`_view_rows`); with ``wants``, only the fields each rollout's ranged reads
        need."""
        keys = [self.key(r) for r in chunk]
        names: list[list[bytes] | None] = [None] * len(chunk)
        with _redis_errors():
            if wants is None:
                hashes: list[dict[bytes, Any] | R3Error] = list(self._read(keys))
            else:
                hashes, got_names = self._read_wanted(keys, [wants[r] for r in chunk])
                names = list(got_names)
        reads = [
            fields if isinstance(fields, R3Error) else self._assembled(rid, fields, span, n)
            for rid, fields, n in zip(chunk, hashes, names, strict=True)
        ]
        return list(zip(chunk, reads, strict=True))

    def _read_wanted(
        self, keys: list[str], wants: list[_Want]
    ) -> tuple[list[dict[bytes, Any] | R3Error], list[list[bytes]]]:
        """The fields of the hashes at ``keys`` that ranged reads of ``wants`` need, and the
        names of each hash's meta, segment and view fields.

        First each hash's small fields: its meta, every segment's head (or frame, or
        shared-blob reference) and its view registrations, by one ``HSCAN … MATCH [msv]*``
        per hash (Redis filters the chunk fields out; an ACL user granted before ``HSCAN``
        was: ``HKEYS`` and an ``HMGET`` instead).  Then, in one pipelined round trip, the
        chunks the reads' rows and ``layers`` need, named from the heads of the segments
        they overlap (:func:`~r3_client._stored.head_chunks`), the heads of the shared
        blobs they overlap, and the contexts no frame read carries; the blobs' chunks in a
        third, only when a read overlaps a shared segment.  A field gone in between (the
        rollout deleted or rewound) rereads that hash once; gone again, the rollout is
        answered as not found when it has gone, as damaged (:class:`StoreError`) when a
        field it names is missing.  Pipelined, so a cluster routes each command to its node.
        """
        got = self._wanted_once(keys, wants)
        again = [n for n, (h, _) in enumerate(got) if h is None]
        if again:  # moved between the rounds: read those once more, from the start
            redo = self._wanted_once([keys[n] for n in again], [wants[n] for n in again])
            for n, (h, names) in zip(again, redo, strict=True):
                got[n] = (h, names)
        hashes: list[dict[bytes, Any] | R3Error] = []
        names_out: list[list[bytes]] = []
        for key, (h, names) in zip(keys, got, strict=True):
            names_out.append(names)
            hashes.append(
                StoreError(
                    f"{key}: a field its segments name is missing from Redis (a damaged "
                    "store: a bad restore or an HDEL); the rollout cannot be read"
                )
                if h is None
                else h
            )
        return hashes, names_out

    def _small_fields(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """Each hash's meta (``m``), segment (``s:…``) and view (``v:…``) fields, with their
        values: one ``HSCAN`` per hash (``MATCH [msv]*``: the chunk, context, digest and
        stat fields stay in Redis), pipelined; a cursor left over (a hash larger than one
        scan's ``COUNT``) is followed.  An ACL user without ``HSCAN`` (granted by a service
        from before it was added) lists the names with ``HKEYS`` and reads those fields
        with ``HMGET``: what this reader did before, every field name sent."""
        import redis  # lazy: only direct readers need redis-py

        if self._scan:
            pipe = self._r.pipeline(transaction=False)
            for key in keys:
                pipe.hscan(key, 0, match=_SMALL_FIELDS, count=_SCAN_COUNT)
            try:
                replies = pipe.execute()
            except redis.exceptions.NoPermissionError:
                self._scan = False
            else:
                out: list[dict[bytes, Any]] = []
                for key, (cursor, fields) in zip(keys, replies, strict=True):
                    while cursor:  # (not with COUNT above any hash's field count)
                        cursor, more = self._r.hscan(
                            key, cursor, match=_SMALL_FIELDS, count=_SCAN_COUNT
                        )
                        fields.update(more)
                    out.append(fields)
                return out
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        picked = [
            [f for f in names if f == b"m" or f[:2] in (b"s:", b"v:")] for names in pipe.execute()
        ]
        pipe = self._r.pipeline(transaction=False)
        for key, fields in zip(keys, picked, strict=True):
            if fields:  # (a rollout that is not there has no fields: nothing to ask)
                pipe.hmget(key, fields)
        replies = iter(pipe.execute())
        return [
            {f: v for f, v in zip(fields, next(replies), strict=True) if v is not None}
            if fields
            else {}
            for fields in picked
        ]

    def _wanted_once(
        self, keys: list[str], wants: list[_Want]
    ) -> list[tuple[dict[bytes, Any] | None, list[bytes]]]:
        """:meth:`_read_wanted`'s rounds once: per hash its fields and the names of its
        small fields, or None for the fields when one it names was not there."""
        small = self._small_fields(keys)
        plans = [
            _plan_wanted(fields, spans, layers)
            for fields, (spans, layers) in zip(small, wants, strict=True)
        ]
        pipe = self._r.pipeline(transaction=False)
        for key, plan in zip(keys, plans, strict=True):
            for blob in plan.blobs.values():
                pipe.hget(blob, "f")
            if plan.chunks or plan.contexts:
                pipe.hmget(key, [*plan.chunks, *plan.contexts])
        replies = iter(pipe.execute() if len(pipe) else [])
        blob_asks: list[tuple[int, bytes, bytes, list[bytes]]] = []
        for n, (fields, plan, (spans, layers)) in enumerate(zip(small, plans, wants, strict=True)):
            for f, blob in plan.blobs.items():
                fields[f] = head = next(replies)
                if isinstance(head, bytes) and is_frame_head(head):
                    fields[f] = Chunked(head, {})
                    names = _chunks_of(f, head, plan.layer_ids, spans, layers)
                    if names:
                        blob_asks.append((n, f, blob, names))
            if plan.chunks or plan.contexts:
                asked = [*plan.chunks, *plan.contexts]
                fields.update(zip(asked, next(replies), strict=True))
        # the contexts of hashes with shared segments, once the blobs' heads are here (a
        # shared first segment's head carries the rollout's context)
        late = [
            (n, names)
            for n, (fields, plan) in enumerate(zip(small, plans, strict=True))
            if plan.blobs and (names := _needed_contexts(fields))
        ]
        if blob_asks or late:
            pipe = self._r.pipeline(transaction=False)
            for _, _, blob, names in blob_asks:
                pipe.hmget(blob, names)
            for n, names in late:
                pipe.hmget(keys[n], names)
            replies = iter(pipe.execute())
            for n, f, _, names in blob_asks:
                values = next(replies)
                # a blob's chunk gone: the blob expired, as a blob without its head reads
                small[n][f] = (
                    None
                    if any(v is None for v in values)
                    else Chunked(small[n][f].head, _indexed(names, values))
                )
            for n, names in late:
                small[n].update(zip(names, next(replies), strict=True))
        return [
            (
                None
                if any(v is None for f, v in fields.items() if f[:2] in (b"k:", b"c:"))
                or (plan.names and not isinstance(fields.get(b"m"), bytes))
                else fields,
                plan.names,
            )
            for fields, plan in zip(small, plans, strict=True)
        ]

    def _read(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """The hashes at ``keys`` (rollouts' or views'), shared segments resolved."""
        return self._read_pipelined(keys) if self._cluster else self._read_streamed(keys)

    def _read_streamed(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """One pooled connection: every ``HGETALL`` sent at once, and each reply's
        shared-segment ``HGET`` commands sent as soon as that reply is parsed, so Redis
        answers them while the rest of the chunk is still being read (no second
        round trip after the chunk).  A dropped connection retries the chunk as
        redis-py retries a pipeline (the reads are idempotent)."""
        pool = self._r.connection_pool
        conn = pool.get_connection()
        try:
            hashes: list[dict[bytes, Any]] = conn.retry.call_with_retry(
                lambda: self._stream(conn, keys), lambda _err: conn.disconnect()
            )
        except BaseException:
            conn.disconnect()  # replies may still be on the wire: never reuse it
            raise
        finally:
            pool.release(conn)
        return hashes

    def _stream(self, conn: Any, keys: list[str]) -> list[dict[bytes, Any]]:
        parse = self._r.parse_response  # reads one reply, applies redis-py's callback
        conn.send_packed_command(conn.pack_commands([("HGETALL", k) for k in keys]))
        hashes: list[dict[bytes, Any]] = []
        refs: list[tuple[int, bytes]] = []
        for n in range(len(keys)):
            fields: dict[bytes, Any] = parse(conn, "HGETALL")
            hashes.append(fields)
            mine = _shared_refs(fields)
            if mine:
                conn.send_packed_command(conn.pack_commands([("HGETALL", b) for _, b in mine]))
                refs.extend((n, f) for f, _ in mine)
        for n, f in refs:
            hashes[n][f] = _blob_value(parse(conn, "HGETALL"))
        return hashes

    def _read_pipelined(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """Redis Cluster: the blobs live in other slots, so two pipelined round trips
        (the cluster pipeline routes each command to its node): ``HGETALL`` of the
        chunk, then ``HGETALL`` of the shared segments' blobs it references."""
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        hashes: list[dict[bytes, Any]] = pipe.execute()
        refs = [(n, f, blob) for n, h in enumerate(hashes) for f, blob in _shared_refs(h)]
        if refs:
            pipe = self._r.pipeline(transaction=False)
            for _, _, blob in refs:
                pipe.hgetall(blob)
            for (n, f, _), blob_fields in zip(refs, pipe.execute(), strict=True):
                hashes[n][f] = _blob_value(blob_fields)
        return hashes

    @classmethod
    def _assembled(
        cls,
        rollout_id: str,
        fields: dict[bytes, Any],
        span: _Span,
        names: Sequence[bytes] | None = None,
    ) -> _Read | R3Error:
        """A rollout hash as a :class:`_Read`: its frames and, when ``span`` asks for
        views, its registered views that serve a stored segment.  ``names``: every field
        name of the hash, when ``fields`` holds only some (a ranged read)."""
        frames = cls._assemble(rollout_id, fields)
        if isinstance(frames, R3Error):
            return frames
        names = list(fields) if names is None else names
        ends = [int(f.split(b":")[2]) for f in names if f[:2] == b"s:"]
        read = _Read(frames, max(ends, default=0))
        if span is None:
            return read
        try:
            views = [_view_info(f, v) for f, v in fields.items() if f[:2] == b"v:"]
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            return StoreError(f"rollout {rollout_id}: a view registration is unreadable ({exc})")
        starts = {int(f.split(b":")[1]) for f in names if f[:2] == b"s:"}
        read.views = serving_views(views, starts)
        return read

    def _view_rows(
        self, rollout_id: str, v: ViewInfo, base: Routing, layers: Sequence[int] | None
    ) -> Routing:
        """View ``v``'s rows in ``base``'s range and ``layers``: its hash read and decoded
        when the view is applied (so one view's rows are held at a time)."""
        a, b = max(v.start, base.start), min(v.end, base.end)
        if a >= b:  # outside the range: no rows of it apply
            return Routing(base.indices[:0], base.num_experts, base.layer_ids, a)
        with _redis_errors():
            (fields,) = self._read([self.view_key(rollout_id, v.serves)])
        if not fields:  # rewound, deleted or expired since its rollout hash was read
            raise RolloutNotFoundError(
                f"rollout {rollout_id} has no view serving row {v.serves} (its stat lists views)"
            )
        frames = self._assemble(rollout_id, fields)
        if isinstance(frames, R3Error):
            raise frames
        return self._decode(frames, rollout_id, a, b, layers)

    @staticmethod
    def _assemble(rollout_id: str, fields: dict[bytes, Any]) -> list[bytes | Chunked] | R3Error:
        """A hash's segments as frames, by start (a chunked one whose chunks all came
        joined back into its frame, else its head and the chunks read), with the contexts
        their continuation frames need first."""
        if not fields:
            return RolloutNotFoundError(f"rollout {rollout_id} not found")
        raw = sorted((int(f.split(b":")[1]), f, v) for f, v in fields.items() if f[:2] == b"s:")
        if any(not isinstance(v, bytes | Chunked) for _, _, v in raw):
            # A blob goes only after the last rollout pointing at it is gone (docs/store.md,
            # "GRPO prompt dedupe"), so this rollout was deleted after its hash was read, or
            # outlived its blob's TTL; one read cannot tell which.
            return StoreError(
                f"rollout {rollout_id}: a shared segment's data is gone (the rollout was "
                "deleted while it was read, or its shared blob expired)"
            )
        segments = [(a, _segment_value(f, v, fields)) for a, f, v in raw]
        planted = _context_in_segment(fields)
        if planted is not None:  # decoded, it would read as a gap of -1 rows
            return StoreError(
                f"rollout {rollout_id}: the stored bytes of segment {planted} are damaged "
                "(it holds a context frame, no rows)"
            )
        frames: list[bytes | Chunked] = [v for _, v in segments]
        stored = {f[2:].decode(): ctx for f, ctx in fields.items() if f[:2] == b"c:"}
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
                h = (
                    read_header(v.head, verify=False, head=True)
                    if isinstance(v, Chunked)
                    else read_header(v, verify=False)
                )
                if h.base:
                    bases.add(h.base)
                elif h.context is not None:
                    carried.add(h.context.digest)
                    if carried >= stored.keys():
                        return frames
            parts: list[bytes | Chunked] = [
                encode_context(Context.parse(ctx, tables=False))
                for d, ctx in stored.items()
                if d in bases - carried
            ]
        except FrameError:  # damaged: the decode of the whole names the segment
            parts = []
        return [*parts, *frames]

    def _decode(
        self,
        frames: list[bytes | Chunked],
        rid: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> Routing:
        """``frames`` decoded to rows ``[start, end)`` and ``layers`` (:meth:`_cut` first)."""
        return decode_rollout(
            self._cut(frames, rid, start, end, layers),
            start=start, end=end, layers=layers, rollout_id=rid, max_bytes=self.max_bytes,
        )  # fmt: skip

    @staticmethod
    def _cut(
        frames: list[bytes | Chunked],
        rid: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> list[bytes]:
        """``frames`` as :func:`~r3_client.decode_rollout` takes them: a chunked segment cut
        from the chunks read (its head's trailer and every chunk's CRC checked, as the
        service checks what it cuts; a chunk missing is a :class:`StoreError`)."""
        if not any(isinstance(f, Chunked) for f in frames):
            return frames  # type: ignore[return-value]
        try:
            return _cut_chunked(frames, start, end, layers)
        except (FormatError, FrameError) as exc:
            raise StoreError(
                f"rollout {rid}: the stored bytes of a segment are damaged ({exc})"
            ) from None

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
        view: ViewPolicy = "generated",
    ) -> Generator[Result, None, None]:
        """``(rollout_id, Routing)`` for each id, in order: :meth:`fetch_many`, decoded and
        trimmed to ``[start, end)`` / ``layers``.  A rollout that cannot be read or
        decoded raises, or with ``return_errors`` is yielded as ``(id, R3Error)``.

        ``view``: ``"generated"`` (each position's first computation) or ``"latest"``
        (the rollout's views applied, as :meth:`RoutingClient.get` answers it): the
        ``v:`` fields come with the ``HGETALL`` of each rollout, and the hash of each
        view overlapping ``[start, end)`` is read by the decode worker as it is applied,
        one view at a time (the answer's declared size is checked against ``max_bytes``
        first).  ``"exact"``: :meth:`get_served`.

        Decoding runs in ``workers`` threads (zstd and numpy release the GIL) while
        the next rollouts are fetched; at most ``2 * workers`` decoded rollouts wait.
        """
        one_routing_policy(view)
        span: _Span = None if view == "generated" else (start, end)
        width = max(1, workers)

        def decode(rid: str, got: _Read | R3Error) -> Routing | R3Error:
            if isinstance(got, R3Error):
                return got
            outside = _outside(rid, start, end, got.stored_end)
            if outside is not None:  # as the service answers such a read: never -1 rows
                return outside
            try:
                base = self._decode(got.frames, rid, start, end, layers)
                steps = apply_views(base, got.views, max_bytes=self.max_bytes, rollout_id=rid)
                return run_steps(steps, lambda v: self._view_rows(rid, v, base, layers))
            except R3Error as exc:
                return exc

        reads = self._reads(rollout_ids, span, chunk_size, concurrency)
        with closing(reads), ThreadPoolExecutor(width, thread_name_prefix="r3-decode") as pool:
            pending: deque[tuple[str, Future[Routing | R3Error]]] = deque()
            for rid, got in reads:
                pending.append((rid, pool.submit(decode, rid, got)))
                while len(pending) > 2 * width or (pending and pending[0][1].done()):
                    yield self._ready(pending.popleft(), return_errors)
            while pending:
                yield self._ready(pending.popleft(), return_errors)

    #: The most rollouts one window of :meth:`get_ranges`' reads names: their frames are
    #: held until their last read of the window (a rollout is read once per window).
    _range_window: int = 256

    @overload
    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 16,
        return_errors: bool = False,
        workers: int = 2,
        concurrency: int = 2,
        decode: Literal[True] = True,
    ) -> Generator[Result, None, None]: ...

    @overload
    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 16,
        return_errors: bool = False,
        workers: int = 2,
        concurrency: int = 2,
        decode: bool,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]: ...

    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        chunk_size: int = 16,
        return_errors: bool = False,
        workers: int = 2,
        concurrency: int = 2,
        decode: bool = True,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]:
        """``(rollout_id, Routing)`` for each ``(rollout_id, start, end[, state])`` read, in
        order, as :meth:`RoutingClient.get_ranges` answers it under the same ``view``
        (``exact`` by default: each read in its state, none past it).  ``decode=False``:
        a read no view applies to is answered as read (its chunked segments cut), a
        :class:`~r3_client._fetched.FetchedRange`, as :meth:`RoutingClient.get_ranges`
        answers it.

        Each rollout's hash is read once: its small fields (``HSCAN``: meta, segment heads
        or frames, views), then the chunks its reads need (an ``HMGET``, named from the
        heads: :meth:`_read_wanted`): of a segment stored chunked (docs/store.md, "Layout")
        only the chunks holding the reads' rows and ``layers``, of one stored whole (before
        issue 44) the whole frame; only the reads' rows and layers are decoded.  The hash
        lists the rollout's views, and the
        hash of each view that holds some row of a read's answer (one with rows in its
        range that later views do not all overwrite) is read when that read applies it
        (one view's rows held at a time).  What waits is bounded whatever the number of
        reads or their order: at most ``2 * workers`` decoded (or decoding) reads, and
        the frames of the rollouts of one window of reads (at most ``_range_window``,
        256, rollouts, plus ``concurrency`` chunks fetched ahead), each let go once its
        last read there is decoded.  A call naming more rollouts than that is taken in
        windows, and a rollout named in several windows is read once in each.  A read
        outside the rollout's rows is answered :class:`InvalidRequestError` naming them.
        """
        policy = check_policy(view)
        items = ranged_reads(reads, policy)
        for rid, a, b, _, _ in items:
            check_rollout_id(rid)
            if a < 0 or b <= a:
                raise ShapeError(f"token range [{a}, {b}) is empty or negative")
        order, last = self._range_windows(items, max(1, self._range_window))
        width = max(1, workers)
        span: _Span = None if policy == "generated" else (0, None)

        def answer(
            rid: str, got: _Read | R3Error, a: int, b: int, state: int | None, upto: int
        ) -> Routing | FetchedRange | R3Error:
            if isinstance(got, R3Error):
                return got
            outside = _outside(rid, a, b, got.stored_end)
            if outside is not None:  # as the service answers such a read
                return outside
            try:
                # the state first: a refused read decodes nothing (RoutingClient's plan too)
                applied = read_views(got.views, policy, state, a, b, got.stored_end, rid, upto)
                if not decode and not overlapping(applied, a, b):
                    return FetchedRange(
                        rid, tuple(self._cut(got.frames, rid, a, b, layers)), a, b,
                        layers_tuple(layers), self.max_bytes,
                    )  # fmt: skip
                base = self._decode(got.frames, rid, a, b, layers)
                views = overlapping(applied, a, b)
                check_views_size(base, views, [], self.max_bytes, rid)
                # a view whose rows here later views all overwrite is not read
                steps = apply_views(
                    base, piece_sources(views, a, b), max_bytes=self.max_bytes, rollout_id=rid
                )
                return run_steps(steps, lambda v: self._view_rows(rid, v, base, layers))
            except R3Error as exc:
                return exc

        # each rollout's fields as its reads need them: the chunks of their rows and layers
        wants: dict[str, _Want] = {}
        for rid, a, b, _, _ in items:
            _add_span(wants.setdefault(rid, ([], layers))[0], a, b)
        fetched = self._reads(order, span, chunk_size, concurrency, wants)
        # Closed on every exit (a refusal, a consumer that stops): the reads in flight end
        # and their connections return to the pool before this generator's caller goes on.
        with closing(fetched), ThreadPoolExecutor(width, thread_name_prefix="r3-decode") as pool:
            held: dict[str, _Read | R3Error] = {}  # rollouts with reads still to submit
            pending: deque[tuple[str, Future[Routing | FetchedRange | R3Error]]] = deque()
            for n, (rid, a, b, state, upto) in enumerate(items):
                if rid not in held:  # its first read in this window: the next fetched
                    got_id, held[rid] = next(fetched)
                    assert got_id == rid, (got_id, rid)
                got = held.pop(rid) if n in last else held[rid]
                pending.append((rid, pool.submit(answer, rid, got, a, b, state, upto)))
                del got  # the job holds the frames; the last one drops them
                while len(pending) > 2 * width or (pending and pending[0][1].done()):
                    yield self._ready(pending.popleft(), return_errors)
            while pending:
                yield self._ready(pending.popleft(), return_errors)

    @staticmethod
    def _range_windows(
        items: Sequence[tuple[str, int, int, int | None, int]], window: int
    ) -> tuple[list[str], set[int]]:
        """:meth:`get_ranges`' reads cut into windows of at most ``window`` rollouts: the
        rollouts to fetch, in order (each once per window it is named in, for its first
        read there), and the reads that are their rollout's last in its window (its
        frames are let go then)."""
        order: list[str] = []
        last: set[int] = set()
        latest: dict[str, int] = {}  # this window's rollouts: their latest read so far
        for n, (rid, _, _, _, _) in enumerate(items):
            if rid not in latest:
                if len(latest) >= window:
                    last.update(latest.values())
                    latest.clear()
                order.append(rid)
            latest[rid] = n
        last.update(latest.values())
        return order, last

    def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "generated",
    ) -> Routing:
        """One rollout's routing, as :meth:`get_many` reads it (and as
        :meth:`RoutingClient.get` answers it, under the same ``view``)."""
        with closing(
            self.get_many([rollout_id], start=start, end=end, layers=layers, view=view, workers=1)
        ) as answers:
            ((_, routing),) = answers
        assert isinstance(routing, Routing)  # errors raise: return_errors is off
        return routing

    def get_served(
        self,
        rollout_id: str,
        *,
        view: ViewPolicy = "exact",
        layers: Sequence[int] | None = None,
    ) -> list[ServedRouting]:
        """The routing each span of the rollout's tokens attended to, as
        :meth:`RoutingClient.get_served` answers it: ``"exact"``, one
        :class:`~r3_client.ServedRouting` per state; ``"latest"`` / ``"generated"``, one
        over every row.  One ``HGETALL`` of the rollout, then one of its views (when it
        has some and the policy applies them)."""
        policy = check_policy(view)
        span: _Span = None if policy == "generated" else (0, None)
        with closing(self._reads([rollout_id], span, 1, 1)) as reads:
            ((rid, got),) = reads
        if isinstance(got, R3Error):
            raise got
        outside = _outside(rid, 0, None, got.stored_end)
        if outside is not None:
            raise outside
        base = self._decode(got.frames, rid, 0, None, layers)
        # base: every stored row
        steps = served(base, got.views, base.end, policy, max_bytes=self.max_bytes, rollout_id=rid)
        return run_steps(steps, lambda v: self._view_rows(rid, v, base, layers))

    @staticmethod
    def _ready(item: tuple[str, Future[_A]], return_errors: bool) -> tuple[str, _A]:
        rid, fut = item
        res = fut.result()
        if isinstance(res, R3Error) and not return_errors:
            raise res
        return rid, res


def _cut_chunked(
    frames: list[bytes | Chunked], start: int, end: int | None, layers: Sequence[int] | None
) -> list[bytes]:
    """``frames`` with each chunked segment overlapping ``[start, end)`` cut from its chunks
    (the others left out), and the contexts the cut continuation frames need that no frame
    left in carries, first (what the service's ranged GET answers)."""
    contexts: dict[str, Context] = {}
    # Each header parsed once unchecked here (the contexts first: a continuation may come
    # before the frame carrying its context), then once checked where a head is cut.
    headers = [
        read_header(f.head, verify=False, head=True)
        if isinstance(f, Chunked)
        else read_header(f, verify=False)
        for f in frames
    ]
    for h in headers:
        if h.context is not None and not h.base:
            contexts[h.context.digest] = h.context
    out: list[bytes] = []
    carried: set[str] = set()
    needed: set[str] = set()
    for f, h in zip(frames, headers, strict=True):
        if not isinstance(f, Chunked):
            out.append(f)
            if h.context is not None and not h.base:
                carried.add(h.context.digest)
            continue
        if h.end <= start or (end is not None and h.start >= end):
            continue  # another read's rows
        ctx = contexts.get(h.base) if h.base else None
        if h.base and ctx is None:
            raise FrameError(f"the context {h.base[:12]}… a segment continues is not stored")
        hdr = read_header(f.head, verify=True, head=True, context=ctx)
        out.append(
            slice_frame(
                f.head, start=start, end=end, layers=layers, context=ctx, parsed=hdr,
                pieces=f.pieces, verify=True,
            )
        )  # fmt: skip
        if h.base:
            needed.add(h.base)
        elif hdr.context is not None:
            carried.add(hdr.context.digest)
    extra = [encode_context(contexts[d]) for d in sorted(needed - carried)]
    return [*extra, *out]


#: The most row spans kept per rollout for choosing its chunks: past it, their hull.
_MAX_SPANS = 64


def _add_span(spans: list[tuple[int, int]], a: int, b: int) -> None:
    """Add rows ``[a, b)`` to the spans a ranged read fetches chunks for: merged into one it
    overlaps or touches, else appended; more than :data:`_MAX_SPANS` collapse into their
    hull (a superset: a few more chunks read, never one missing), so what a call holds per
    rollout stays bounded however many reads it names."""
    for i, (x, y) in enumerate(spans):
        if a <= y and x <= b:
            spans[i] = (min(x, a), max(y, b))
            return
    spans.append((a, b))
    if len(spans) > _MAX_SPANS:
        spans[:] = [(min(x for x, _ in spans), max(y for _, y in spans))]


#: The small fields of a rollout hash a ranged read scans for: its meta (``m``), segments
#: (``s:…``: heads, frames or shared-blob references) and views (``v:…``), and ``sb``.
_SMALL_FIELDS = "[msv]*"

#: ``HSCAN``'s COUNT: above twice any hash's field count (Redis 7.0 counts a field and its
#: value before MATCH filters), so one scan answers a whole hash.
_SCAN_COUNT = 1 << 20


@dataclass(frozen=True, slots=True)
class _WantPlan:
    """What a ranged read fetches of one rollout hash after its small fields: the names of
    those (meta, segments, views), the rollout's layer ids, its chunk fields the reads
    need, the shared blobs (by segment field) they overlap, and the contexts no frame
    carries (of a hash without shared segments; with them, asked once the blobs' heads
    are read)."""

    names: list[bytes]
    layer_ids: tuple[int, ...]
    chunks: list[bytes]
    blobs: dict[bytes, bytes]
    contexts: list[bytes]


def _plan_wanted(
    fields: dict[bytes, Any], spans: Sequence[tuple[int, int]], layers: Sequence[int] | None
) -> _WantPlan:
    """The plan of a ranged read of ``spans`` and ``layers`` from a hash's small fields
    (:data:`_SMALL_FIELDS`).  A segment no span overlaps is dropped from ``fields`` (not
    decoded, nothing of a shared one read) unless it is a chunked segment's head, which
    is kept: it may carry the context the read's continuation frames need, which then
    need not be fetched again."""
    names = list(fields)
    layer_ids = _meta_layers(fields.get(b"m"))
    chunks: list[bytes] = []
    blobs: dict[bytes, bytes] = {}
    for f in names:
        if f[:2] != b"s:":
            continue
        a, b = _rows_of(f)
        v = fields[f]
        if not any(a < e and s < b for s, e in spans):
            if not is_frame_head(v):  # a frame or a blob reference: another read's rows
                del fields[f]
        elif v[:1] == b"@":
            blobs[f] = v[1:]
        elif is_frame_head(v):
            chunks += _chunks_of(f, v, layer_ids, spans, layers)
    return _WantPlan(names, layer_ids, chunks, blobs, [] if blobs else _needed_contexts(fields))


def _rows_of(field: bytes) -> tuple[int, int]:
    """A segment field's rows (``s:<a>:<b>``); ``(0, 0)`` for a malformed name (read as
    overlapping nothing, and refused where the hash's segments are assembled)."""
    parts = field.split(b":")
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return 0, 0
    return int(parts[1]), int(parts[2])


def _meta_layers(meta: Any) -> tuple[int, ...]:
    """The layer ids of a rollout's meta (msgpack ``[E, K, [layer ids]]``); () when it is
    missing or unreadable (a continuation head then names no chunk, and the decode
    names the fault)."""
    try:
        _, _, ids = msgpack.unpackb(meta)
        return tuple(int(x) for x in ids)
    except Exception:  # msgpack raises several unrelated types; any of them: unreadable
        return ()


def _chunks_of(
    field: bytes,
    head: bytes,
    layer_ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    layers: Sequence[int] | None,
) -> list[bytes]:
    """The chunk fields of segment ``field`` (its head ``head``) that reads of ``spans``
    and ``layers`` need (:func:`~r3_client._stored.head_chunks`); none when the head is
    damaged or a layer is not the segment's (the decode then raises the reason)."""
    a, b = _rows_of(field)
    try:
        return head_chunks(a, b, head, layer_ids, spans, layers)
    except R3Error:
        return []


def _needed_contexts(fields: dict[bytes, Any]) -> list[bytes]:
    """The ``c:<digest>`` fields of the contexts that the frames among ``fields`` continue
    and none of them carries (:func:`~r3_client._stored.uncarried_contexts`)."""
    frames = [
        (v.head, True) if isinstance(v, Chunked) else (v, is_frame_head(v))
        for f, v in fields.items()
        if f[:2] == b"s:" and isinstance(v, bytes | Chunked)
    ]
    return [f"c:{d}".encode() for d in sorted(uncarried_contexts(frames))] if frames else []


def _indexed(names: Sequence[bytes], values: Sequence[bytes]) -> dict[int, bytes]:
    """Chunk values by their index, from the chunk fields' names."""
    out: dict[int, bytes] = {}
    for name, value in zip(names, values, strict=True):
        got = parse_chunk_field(name)
        if got is not None:
            out[got.index] = value
    return out


def _whole(f: bytes | Chunked) -> bytes:
    """A segment read whole as its frame (a chunked one's chunks joined to its head)."""
    if isinstance(f, bytes):
        return f
    return join_frame(f.head, [f.pieces[i] for i in sorted(f.pieces)])


def _segment_value(
    field: bytes, value: bytes | Chunked, fields: dict[bytes, Any]
) -> bytes | Chunked:
    """Segment ``field``'s frame from a hash's ``fields``: the value itself, a chunked
    segment's head with the chunk fields read (``k:<a>:<b>:…``), or a shared blob's value
    as resolved (:func:`_blob_value`).  A whole read (every chunk there) joins them."""
    if isinstance(value, Chunked) or not is_frame_head(value):
        return value
    a, b = (int(x) for x in field.split(b":")[1:3])
    pieces = {
        got.index: v
        for f, v in fields.items()
        if (got := parse_chunk_field(f)) is not None and (got.seg_start, got.seg_end) == (a, b)
    }
    return Chunked(value, pieces)


def _blob_value(fields: dict[bytes, Any]) -> bytes | None:
    """A shared blob's frame from the blob hash's ``fields`` (``f`` the frame, or its head
    with the chunk fields beside it, joined); None when the blob has expired."""
    value = fields.get(b"f")
    if not isinstance(value, bytes):
        return None
    if not is_frame_head(value):
        return value
    pieces = {got.index: v for f, v in fields.items() if (got := parse_chunk_field(f)) is not None}
    return _whole(Chunked(value, pieces))


def _context_in_segment(fields: dict[bytes, Any]) -> str | None:
    """The rows (``"[a, b)"``) of the first segment field of a rollout hash that holds a
    context frame (docs/format.md 6.3: read from the prefix), or None."""
    for f, v in fields.items():
        if f[:2] == b"s:" and is_context_frame(v.head if isinstance(v, Chunked) else v):
            _, a, b = f.decode().split(":")
            return f"[{a}, {b})"
    return None


def _shared_refs(fields: dict[bytes, Any]) -> list[tuple[bytes, bytes]]:
    """``(field, blob key)`` of a rollout hash's segments stored as shared blobs
    (``s:<start>`` fields holding ``@<key>``)."""
    return [(f, v[1:]) for f, v in fields.items() if f[:2] == b"s:" and v[:1] == b"@"]


def _view_info(field: bytes, raw: bytes) -> ViewInfo:
    """A ``v:<serves>`` registration (msgpack ``[start, end, weight_version, nbytes]``)."""
    a, b, version, nbytes = msgpack.unpackb(raw)
    return ViewInfo(int(field[2:]), int(a), int(b), str(version), int(nbytes))


def _outside(rid: str, start: int, end: int | None, stored_end: int) -> R3Error | None:
    """The service's answer to a read of rows ``[start, end)`` outside a rollout's stored
    rows ``[0, stored_end)`` (:class:`InvalidRequestError`), or None when it is inside."""
    if end is None and start >= stored_end:
        return InvalidRequestError(
            f"start {start} is past the last stored row of rollout {rid} "
            f"(it holds rows [0, {stored_end}))"
        )
    if end is not None and end > stored_end:
        return InvalidRequestError(
            f"token range [{start}, {end}) is outside rollout {rid}'s rows [0, {stored_end})"
        )
    return None


@contextmanager
def _redis_errors() -> Iterator[None]:
    """redis-py's failures of a direct read as this library's errors."""
    import redis.exceptions as rexc

    try:
        yield
    except rexc.AuthenticationError as exc:
        raise AuthError(f"Redis refused the read plan's credentials: {exc}") from None
    except rexc.NoPermissionError as exc:
        raise AuthError(f"Redis refused a direct read: {exc}") from None
    except (rexc.ConnectionError, rexc.TimeoutError) as exc:
        raise StoreUnavailableError(f"Redis is unreachable: {exc}") from None
