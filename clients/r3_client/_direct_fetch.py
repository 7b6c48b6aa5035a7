"""A direct reader's Redis calls: each chunk of rollout ids read from Redis in as few round
trips as the stored layout allows, and what a hash read comes back as (:class:`HashRead`).

Runs in a training rank's process, in the reader's fetch threads (``r3-fetch``: one
pooled connection each), while its decode threads decode what came back.  Which fields
to ask for and how to put them back together is :mod:`r3_client.stored`'s (the layout the
service writes); this module is the commands: ``HGETALL`` of whole hashes (streamed on one
connection, or pipelined on a cluster, whose blobs live on other nodes), and for ranged
reads ``HSCAN`` of the small fields then ``HMGET`` of the chunks and contexts they name.
redis-py's failures become this library's errors here (:func:`redis_errors`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack

from r3_client._answers import ViewInfo
from r3_client._exceptions import (
    AuthError,
    R3Error,
    RolloutNotFoundError,
    StoreError,
    StoreUnavailableError,
)
from r3_client._routing import check_rollout_id
from r3_client._views import serving_views
from r3_client.codec.frame import is_frame_head
from r3_client.stored.cut import damaged
from r3_client.stored.fields import (
    BLOB_FRAME,
    SMALL_FIELDS,
    chunks_by_index,
    contexts_of,
    is_segment,
    is_small,
    pointed,
    rollout_key,
    segment_rows,
    view_key,
    views_of,
)
from r3_client.stored.heads import Chunked, Headers, Stored
from r3_client.stored.plan import RangedPlan, chunk_names, context_fields, incomplete, plan_ranged
from r3_client.stored.segments import blob_value, context_frame_at, hash_segments

__all__ = ["HashRead", "RedisReads", "Span", "Want", "assembled", "redis_errors"]

#: What a ranged read fetches of one rollout: the rows of its reads and the layers read.
Want = tuple[list[tuple[int, int]], Sequence[int] | None]

#: Which views a read needs: ``(start, end)`` rows of the base read, or None (no views).
Span = tuple[int, int | None] | None

#: ``HSCAN``'s COUNT: above twice any hash's field count (Redis 7.0 counts a field and its
#: value before MATCH filters), so one scan answers a whole hash.
_SCAN_COUNT = 1 << 20


@dataclass
class HashRead:
    """One rollout (or view) hash as read: its segments by start, its stored contexts,
    their headers (parsed once for the read), its stored end and the views that serve a
    stored segment (when the policy reads views; their hashes are read when applied)."""

    segments: list[tuple[int, int, Stored]]
    contexts: dict[str, bytes]
    headers: Headers = field(default_factory=Headers)
    stored_end: int = 0  # one past the last stored row
    views: tuple[ViewInfo, ...] = ()


class RedisReads:
    """The Redis side of :class:`~r3_client.DirectReader`: one connection pool and the
    reads of whole hashes and of the fields ranged reads need."""

    key_prefix: str
    _r: Any
    _cluster: bool
    _scan: bool  # False once Redis refuses this user HSCAN (an older grant)

    def key(self, rollout_id: str) -> str:
        """The Redis key of a rollout (the service's layout: ``<prefix>:<ns>:{<id>}``)."""
        return rollout_key(self.key_prefix, rollout_id)

    def view_key(self, rollout_id: str, serves: int) -> str:
        """The Redis key of the rollout's view serving row ``serves``: ``<rollout key>:v:
        <serves>``, in the rollout's slot and under the namespace's key pattern."""
        return view_key(self.key(rollout_id), serves)

    def _reads(
        self,
        rollout_ids: Sequence[str],
        span: Span,
        chunk_size: int,
        concurrency: int,
        wants: dict[str, Want] | None = None,
    ) -> Generator[tuple[str, HashRead | R3Error], None, None]:
        """:meth:`~r3_client.DirectReader.fetch_many`'s chunks in flight, each rollout with
        the views ``span`` needs (:meth:`_fetch_chunk`); ``wants``: only the fields a
        ranged read of each rollout needs (:meth:`_read_wanted`), instead of whole hashes.
        Closed early (its consumer refused a read), the chunks not yet started are dropped
        and those in flight finish, so every connection is back in the pool when it
        returns."""
        ids = [check_rollout_id(r) for r in rollout_ids]
        chunks = [ids[i : i + chunk_size] for i in range(0, len(ids), max(1, chunk_size))]
        width = max(1, concurrency)
        with ThreadPoolExecutor(width, thread_name_prefix="r3-fetch") as pool:
            pending: deque[Future[list[tuple[str, HashRead | R3Error]]]] = deque()
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
        self, chunk: list[str], span: Span, wants: dict[str, Want] | None = None
    ) -> list[tuple[str, HashRead | R3Error]]:
        """The chunk's rollout hashes (with, when ``span`` asks for views, the views that
        serve a stored segment; their hashes are read one at a time as they are applied);
        with ``wants``, only the fields each rollout's ranged reads need."""
        keys = [self.key(r) for r in chunk]
        names: list[list[bytes] | None] = [None] * len(chunk)
        heads = [Headers() for _ in chunk]
        with redis_errors():
            if wants is None:
                hashes: list[dict[bytes, Any] | R3Error] = list(self._read(keys))
            else:
                hashes, got_names, heads = self._read_wanted(keys, [wants[r] for r in chunk])
                names = list(got_names)
        reads = [
            fields if isinstance(fields, R3Error) else assembled(rid, fields, span, n, h)
            for rid, fields, n, h in zip(chunk, hashes, names, heads, strict=True)
        ]
        return list(zip(chunk, reads, strict=True))

    # ---- ranged reads: the small fields, then what they name ----------------------------

    def _read_wanted(
        self, keys: list[str], wants: list[Want]
    ) -> tuple[list[dict[bytes, Any] | R3Error], list[list[bytes]], list[Headers]]:
        """The fields of the hashes at ``keys`` that ranged reads of ``wants`` need, the
        names of each hash's meta, segment and view fields, and each hash's parsed headers.

        First each hash's small fields (:meth:`_small_fields`); then, in one pipelined
        round trip, the chunks the reads' rows and layers need, named from the heads of
        the segments they overlap (:func:`~r3_client.stored.plan_ranged`), the heads of the
        shared blobs they overlap, and the contexts no frame read carries; the blobs'
        chunks in a third, only when a read overlaps a shared segment.  A field gone in
        between (the rollout deleted or rewound) rereads that hash once; gone again, the
        rollout is answered as not found when it has gone, as damaged
        (:class:`StoreError`) when a field it names is missing.  Pipelined, so a cluster
        routes each command to its node.
        """
        got = self._wanted_once(keys, wants)
        again = [n for n, (h, _, _) in enumerate(got) if h is None]
        if again:  # moved between the rounds: read those once more, from the start
            redo = self._wanted_once([keys[n] for n in again], [wants[n] for n in again])
            for n, one in zip(again, redo, strict=True):
                got[n] = one
        hashes: list[dict[bytes, Any] | R3Error] = [
            StoreError(
                f"{key}: a field its segments name is missing from Redis (a damaged "
                "store: a bad restore or an HDEL); the rollout cannot be read"
            )
            if h is None
            else h
            for key, (h, _, _) in zip(keys, got, strict=True)
        ]
        return hashes, [names for _, names, _ in got], [heads for _, _, heads in got]

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
                pipe.hscan(key, 0, match=SMALL_FIELDS, count=_SCAN_COUNT)
            try:
                replies = pipe.execute()
            except redis.exceptions.NoPermissionError:
                self._scan = False
            else:
                out: list[dict[bytes, Any]] = []
                for key, (cursor, fields) in zip(keys, replies, strict=True):
                    while cursor:  # (not with COUNT above any hash's field count)
                        cursor, more = self._r.hscan(
                            key, cursor, match=SMALL_FIELDS, count=_SCAN_COUNT
                        )
                        fields.update(more)
                    out.append(fields)
                return out
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        picked = [[f for f in names if is_small(f)] for names in pipe.execute()]
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
        self, keys: list[str], wants: list[Want]
    ) -> list[tuple[dict[bytes, Any] | None, list[bytes], Headers]]:
        """:meth:`_read_wanted`'s rounds once: per hash its fields (None when one it names
        was not there), the names of its small fields and its parsed headers."""
        small = self._small_fields(keys)
        heads = [Headers() for _ in keys]
        plans = [
            plan_ranged(fields, spans, layers, h)
            for fields, (spans, layers), h in zip(small, wants, heads, strict=True)
        ]
        pipe = self._r.pipeline(transaction=False)
        for key, plan in zip(keys, plans, strict=True):
            for blob in plan.blobs.values():
                pipe.hget(blob, BLOB_FRAME)
            if plan.chunks or plan.contexts:
                pipe.hmget(key, [*plan.chunks, *plan.contexts])
        replies = iter(pipe.execute() if len(pipe) else [])
        blob_asks: list[tuple[int, bytes, bytes, list[bytes]]] = []
        for n, (fields, plan, (spans, layers)) in enumerate(zip(small, plans, wants, strict=True)):
            for f, blob in plan.blobs.items():
                fields[f] = head = next(replies)
                if isinstance(head, bytes) and is_frame_head(head):
                    fields[f] = Chunked(head, {})
                    names = chunk_names(f, head, plan.layer_ids, spans, layers, heads[n])
                    if names:
                        blob_asks.append((n, f, blob, names))
            if plan.chunks or plan.contexts:
                asked = [*plan.chunks, *plan.contexts]
                fields.update(zip(asked, next(replies), strict=True))
        self._blob_chunks(keys, small, plans, heads, blob_asks)
        return [
            (None if incomplete(fields, plan.names) else fields, plan.names, h)
            for fields, plan, h in zip(small, plans, heads, strict=True)
        ]

    def _blob_chunks(
        self,
        keys: list[str],
        small: list[dict[bytes, Any]],
        plans: list[RangedPlan],
        heads: list[Headers],
        blob_asks: list[tuple[int, bytes, bytes, list[bytes]]],
    ) -> None:
        """The third round trip of ranged reads that overlap shared segments: the chunks
        of the blobs they need, and the contexts of those hashes, now that the blobs' heads
        are here (a shared first segment's head carries the rollout's context)."""
        late = [
            (n, names)
            for n, (fields, plan) in enumerate(zip(small, plans, strict=True))
            if plan.blobs and (names := context_fields(fields, heads[n]))
        ]
        if not (blob_asks or late):
            return
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
                else Chunked(small[n][f].head, chunks_by_index(names, values))
            )
        for n, names in late:
            small[n].update(zip(names, next(replies), strict=True))

    # ---- whole hashes ---------------------------------------------------------------------

    def _read(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """The hashes at ``keys`` (rollouts' or views'), shared segments resolved."""
        return self._read_pipelined(keys) if self._cluster else self._read_streamed(keys)

    def _read_streamed(self, keys: list[str]) -> list[dict[bytes, Any]]:
        """One pooled connection: every ``HGETALL`` sent at once, and each reply's
        shared-segment ``HGETALL`` commands sent as soon as that reply is parsed, so Redis
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
            hashes[n][f] = blob_value(parse(conn, "HGETALL"))
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
                hashes[n][f] = blob_value(blob_fields)
        return hashes


def _shared_refs(fields: dict[bytes, Any]) -> list[tuple[bytes, bytes]]:
    """``(field, blob key)`` of a rollout hash's segments stored as shared blobs."""
    return [(f, b) for f, v in fields.items() if is_segment(f) and (b := pointed(v)) is not None]


def assemble(rollout_id: str, fields: dict[bytes, Any], headers: Headers) -> HashRead | R3Error:
    """A hash's fields as read (shared segments resolved) as its segments and contexts,
    or the error they are: not found, a shared segment's data gone, a context frame
    planted in a segment field."""
    if not fields:
        return RolloutNotFoundError(f"rollout {rollout_id} not found")
    try:
        segments = hash_segments(rollout_id, fields)
    except StoreError as exc:
        return exc
    if any(not isinstance(v, bytes | Chunked) for _, _, v in segments):
        # A blob goes only after the last rollout pointing at it is gone (docs/store.md,
        # "GRPO prompt dedupe"), so this rollout was deleted after its hash was read, or
        # outlived its blob's TTL; one read cannot tell which.
        return StoreError(
            f"rollout {rollout_id}: a shared segment's data is gone (the rollout was "
            "deleted while it was read, or its shared blob expired)"
        )
    planted = context_frame_at(segments)
    if planted is not None:  # decoded, it would read as a gap of -1 rows
        return StoreError(damaged(rollout_id, *planted, "it holds a context frame, no rows"))
    return HashRead(segments, contexts_of(fields), headers)


def assembled(
    rollout_id: str,
    fields: dict[bytes, Any],
    span: Span,
    names: Sequence[bytes] | None = None,
    headers: Headers | None = None,
) -> HashRead | R3Error:
    """A rollout hash as a :class:`HashRead`: its segments and, when ``span`` asks for
    views, its registered views that serve a stored segment.  ``names``: every field name
    of the hash, when ``fields`` holds only some (a ranged read)."""
    read = assemble(rollout_id, fields, headers or Headers())
    if isinstance(read, R3Error):
        return read
    rows = [r for f in (list(fields) if names is None else names) if (r := segment_rows(f))]
    read.stored_end = max((b for _, b in rows), default=0)
    if span is None:
        return read
    try:
        views = views_of(fields)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        return StoreError(f"rollout {rollout_id}: a view registration is unreadable ({exc})")
    starts = {a for a, _ in rows}
    read.views = serving_views(views, starts)
    return read


@contextmanager
def redis_errors() -> Iterator[None]:
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
