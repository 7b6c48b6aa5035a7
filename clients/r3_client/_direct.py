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

Runs in a training rank's process: this module is the reader's answers (its view
policies, the decode threads, the windows of a rank's ranged reads); the Redis calls are
:mod:`r3_client._direct_fetch`'s (the fetch threads), and the stored layout (which fields,
how a segment is cut and put back) is :mod:`r3_client.stored`'s, the service's too.

    reader = DirectReader.from_service("http://r3-cache:8080", api_key=key)
    for rid, routing in reader.get_many(ids, view="latest"):
        ...
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from typing import Any, Literal, TypeVar, overload

from r3_client._answers import ViewInfo
from r3_client._config import Timeout
from r3_client._direct_fetch import HashRead, RedisReads, Span, Want, assemble, redis_errors
from r3_client._exceptions import (
    ProtocolError,
    R3Error,
    RolloutNotFoundError,
    ShapeError,
)
from r3_client._fetched import FetchedRange, layers_tuple
from r3_client._routing import Routing, check_rollout_id
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
)
from r3_client.codec import MAX_DECODED_BYTES, decode_rollout
from r3_client.stored.cut import cut, outside_rows
from r3_client.stored.heads import Chunked, Headers, Stored
from r3_client.stored.segments import joined, whole_frames

__all__ = ["DirectReader"]

Result = tuple[str, Routing | R3Error]
_A = TypeVar("_A", Routing | R3Error, Routing | FetchedRange | R3Error)
#: One read of :meth:`DirectReader.get_ranges`: ``(rollout_id, start, end, state, upto)``.
_Item = tuple[str, int, int, int | None, int]


class DirectReader(RedisReads):
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
                yield rid, got if isinstance(got, R3Error) else _whole_answer(got)

    def _view_rows(
        self, rollout_id: str, v: ViewInfo, base: Routing, layers: Sequence[int] | None
    ) -> Routing:
        """View ``v``'s rows in ``base``'s range and ``layers``: its hash read and decoded
        when the view is applied (so one view's rows are held at a time)."""
        a, b = max(v.start, base.start), min(v.end, base.end)
        if a >= b:  # outside the range: no rows of it apply
            return Routing(base.indices[:0], base.num_experts, base.layer_ids, a)
        with redis_errors():
            (fields,) = self._read([self.view_key(rollout_id, v.serves)])
        if not fields:  # rewound, deleted or expired since its rollout hash was read
            raise RolloutNotFoundError(
                f"rollout {rollout_id} has no view serving row {v.serves} (its stat lists views)"
            )
        read = assemble(rollout_id, fields, Headers())
        if isinstance(read, R3Error):
            raise read
        return self._decode(read, rollout_id, a, b, layers)

    @staticmethod
    def _assemble(rollout_id: str, fields: dict[bytes, Any]) -> list[Stored] | R3Error:
        """A hash's segments as frames, by start (a chunked one as its head and the chunks
        read), with the contexts their continuation frames need first: what the service's
        whole GET answers (:func:`~r3_client.stored.whole_frames`)."""
        read = assemble(rollout_id, fields, Headers())
        return read if isinstance(read, R3Error) else _whole_frames(read)

    def _decode(
        self,
        read: HashRead,
        rid: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> Routing:
        """``read`` decoded to rows ``[start, end)`` and ``layers`` (:meth:`_cut` first)."""
        return decode_rollout(
            self._cut(read, rid, start, end, layers),
            start=start, end=end, layers=layers, rollout_id=rid, max_bytes=self.max_bytes,
        )  # fmt: skip

    @staticmethod
    def _cut(
        read: HashRead, rid: str, start: int, end: int | None, layers: Sequence[int] | None
    ) -> list[bytes]:
        """``read``'s frames as :func:`~r3_client.decode_rollout` takes them: a chunked
        segment cut from the chunks read (its head's trailer, its rows and every chunk's
        CRC checked, as the service checks what it cuts: :func:`~r3_client.stored.cut`; a
        chunk missing is a :class:`StoreError`), a whole one as stored (the decode checks
        it)."""
        if not any(isinstance(v, Chunked) for _, _, v in read.segments):
            return _whole_frames(read)  # type: ignore[return-value]
        return cut(
            rid, read.segments, read.contexts, start, end, layers,
            headers=read.headers, cut_whole=False, trim_contexts=False,
        )  # fmt: skip

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
        span: Span = None if view == "generated" else (start, end)
        width = max(1, workers)

        def decode(rid: str, got: HashRead | R3Error) -> Routing | R3Error:
            if isinstance(got, R3Error):
                return got
            outside = outside_rows(rid, start, end, got.stored_end)
            if outside is not None:  # as the service answers such a read: never -1 rows
                return outside
            try:
                base = self._decode(got, rid, start, end, layers)
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
        answer = functools.partial(self._range_answer, policy=policy, layers=layers, decode=decode)
        yield from self._ranges(
            items, answer, layers, policy, chunk_size, max(1, workers), concurrency, return_errors
        )

    def _range_answer(
        self,
        rid: str,
        got: HashRead | R3Error,
        a: int,
        b: int,
        state: int | None,
        upto: int,
        *,
        policy: ViewPolicy,
        layers: Sequence[int] | None,
        decode: bool,
    ) -> Routing | FetchedRange | R3Error:
        """One read of :meth:`get_ranges` answered from its rollout's read (in a decode
        thread): refused outside the rows or past its state, else decoded with the views
        that hold some row of its answer applied (or, ``decode=False`` and no view
        applying, as read)."""
        if isinstance(got, R3Error):
            return got
        outside = outside_rows(rid, a, b, got.stored_end)
        if outside is not None:  # as the service answers such a read
            return outside
        try:
            # the state first: a refused read decodes nothing (RoutingClient's plan too)
            applied = read_views(got.views, policy, state, a, b, got.stored_end, rid, upto)
            if not decode and not overlapping(applied, a, b):
                return FetchedRange(
                    rid, tuple(self._cut(got, rid, a, b, layers)), a, b,
                    layers_tuple(layers), self.max_bytes,
                )  # fmt: skip
            base = self._decode(got, rid, a, b, layers)
            views = overlapping(applied, a, b)
            check_views_size(base, views, [], self.max_bytes, rid)
            # a view whose rows here later views all overwrite is not read
            steps = apply_views(
                base, piece_sources(views, a, b), max_bytes=self.max_bytes, rollout_id=rid
            )
            return run_steps(steps, lambda v: self._view_rows(rid, v, base, layers))
        except R3Error as exc:
            return exc

    def _ranges(
        self,
        items: Sequence[_Item],
        answer: Callable[..., Routing | FetchedRange | R3Error],
        layers: Sequence[int] | None,
        policy: ViewPolicy,
        chunk_size: int,
        width: int,
        concurrency: int,
        return_errors: bool,
    ) -> Generator[tuple[str, Routing | FetchedRange | R3Error], None, None]:
        """:meth:`get_ranges`' reads answered in order, window by window
        (:meth:`_range_windows`): each rollout fetched once per window with the fields
        its reads there need, and let go after its last read there is answered."""
        order, last = self._range_windows(items, max(1, self._range_window))
        span: Span = None if policy == "generated" else (0, None)
        # each rollout's fields as its reads need them: the chunks of their rows and layers
        wants: dict[str, Want] = {}
        for rid, a, b, _, _ in items:
            _add_span(wants.setdefault(rid, ([], layers))[0], a, b)
        fetched = self._reads(order, span, chunk_size, concurrency, wants)
        # Closed on every exit (a refusal, a consumer that stops): the reads in flight end
        # and their connections return to the pool before this generator's caller goes on.
        with closing(fetched), ThreadPoolExecutor(width, thread_name_prefix="r3-decode") as pool:
            held: dict[str, HashRead | R3Error] = {}  # rollouts with reads still to submit
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
    def _range_windows(items: Sequence[_Item], window: int) -> tuple[list[str], set[int]]:
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
        span: Span = None if policy == "generated" else (0, None)
        with closing(self._reads([rollout_id], span, 1, 1)) as reads:
            ((rid, got),) = reads
        if isinstance(got, R3Error):
            raise got
        outside = outside_rows(rid, 0, None, got.stored_end)
        if outside is not None:
            raise outside
        base = self._decode(got, rid, 0, None, layers)
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


def _whole_frames(read: HashRead) -> list[Stored]:
    """A whole read's frames as stored, contexts first."""
    return whole_frames(read.segments, read.contexts, read.headers)


def _whole_answer(read: HashRead) -> list[bytes]:
    """A whole read's frames, each chunked one joined: what the service's whole GET sends."""
    return [joined(f) for f in _whole_frames(read)]


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
