"""A refusal releases what it holds (issue 53, part 4).

A training rank that catches a refused fetch (a straddled rollout read without its
states, a missing one, one deleted under the read, a store that died) and goes on must find
its client as it was: no stream still open, no connection, thread or file descriptor more,
and the next fetch answered correctly.  Before the fix ``fetch_plan_rows`` raised with the
``get_ranges`` generator still suspended inside its batch stream, and an exception/frame
cycle (or a caller keeping the error) kept the HTTP response open until the garbage
collector ran; one such finalizer ran inside httpcore's pool lock and waited on it for good.

Every refusal here runs under ``gc.disable()`` with its error kept (as a trainer logging it
keeps it), so nothing counts as released that only the collector would release.  Each fetch
has a deadline (clients with a 5 s read and pool timeout, and each fetch's time checked),
each test a pytest timeout, and a fetch that runs past ``HANG_S`` has every thread's
stack written out (``faulthandler``: a thread not yet started included) before pytest's
timeout names only where the test was.  Against the real service over a real
``redis-server``; the refusals per test:

- :class:`RoutingClient` through ``fetch_megatron_rank_batch``: 700 over HTTP (350
  straddled, 280 missing, 70 deleted between the fetch's stat and its rows) and 300 over
  gRPC (150, 120, 30), the refused sample at each position of a 7-sample micro-batch
  (before the fix 8 and 12 of 14 refusals left a stream open);
- :class:`AsyncRoutingClient` ``get_many`` (chunks of 2, 2 streams at once): 200 over HTTP
  and 200 over gRPC, missing and deleted between its rows and its views' stat;
- :class:`DirectReader` through ``fetch_megatron_rank_batch``: 300 (150 straddled, 120
  missing, 30 deleted between its scan of the hash and its read of the chunks);
- a service's and its readers' ``redis-server`` killed: 40 through each of the four
  (sync HTTP, sync gRPC, async HTTP, direct), then Redis started again and each answering.
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    AsyncRoutingClient,
    DirectReader,
    InvalidRequestError,
    R3Error,
    Retry,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    Segment,
    StoreUnavailableError,
    Timeout,
)
from r3_client._transports import AsyncHTTPTransport
from r3_client.rank_local import fetch_megatron_rank_batch
from tests.support.service_process import DIRECT_READS, KEY_A, Service, start_service, url_of

E, K, LAYERS = 8, 2, (0, 1)
ROWS = 20  # each rollout's rows; its sample has ROWS + 1 tokens
VICTIM_ROWS = 2100  # two 2,048-row blocks: stored chunked, so a direct read takes two rounds
MICRO = 7  # samples of a refused micro-batch: the refused one and 6 that read
DEADLINE_S = 5.0
TIMEOUT = Timeout(connect=2.0, read=DEADLINE_S)  # httpx: also the pool's wait
ONCE = Retry(attempts=1)
FD_SLACK = 4  # descriptors a client may open for good on its first use
STOP_AT = 40  # streams left open after which a run stops (before the pool runs dry)
MISSING = "rr-never-stored"
HANG_S = 30.0  # a fetch this slow is stuck, not slow (its deadlines are DEADLINE_S)


def _rows(g: np.random.Generator, n: int) -> np.ndarray:
    # each row's experts ascending: the cache's canonical order (a set per token)
    top = np.argsort(g.random((n, len(LAYERS), E)), axis=-1)[..., :K]
    return np.sort(top, axis=-1).astype(np.int16)


def _put(client: RoutingClient, key: str, rows: np.ndarray, start: int = 0, **kw: Any) -> None:
    seg = Segment(start, start + rows.shape[0], "tiny-moe", kw.pop("version", "w1"))
    client.put(key, rows, num_experts=E, layer_ids=LAYERS, segment=seg, **kw)


@dataclass
class Step:
    """Six rollouts that read, one straddling two states (a view serving row 12), and a
    rollout to delete under a read (stored chunked)."""

    good: list[str]
    rows: dict[str, np.ndarray]
    straddled: str
    victim: str
    victim_rows: np.ndarray

    def tokens(self, ids: list[str]) -> list[int]:
        """Each sample's tokens: its rollout's rows + 1 (a missing one's as the others')."""
        return [(VICTIM_ROWS if key == self.victim else ROWS) + 1 for key in ids]

    def batch(self, bad: str, j: int) -> list[str]:
        """A micro-batch with ``bad`` at position ``j % MICRO``."""
        at = j % MICRO
        return [*self.good[:at], bad, *self.good[at:]]

    def put_victim(self, client: RoutingClient) -> str:
        """The rollout to delete, stored (again)."""
        _put(client, self.victim, self.victim_rows)
        return self.victim


def _store(client: RoutingClient, seed: int) -> Step:
    g = np.random.default_rng(seed)
    run = uuid.uuid4().hex[:8]
    good = [f"rr-{run}-{i}" for i in range(MICRO - 1)]
    rows = {key: _rows(g, ROWS) for key in good}
    for key in good:
        _put(client, key, rows[key])
    straddled = f"rr-{run}-straddled"
    first = _rows(g, ROWS)
    _put(client, straddled, first[:12])
    _put(client, straddled, _rows(g, 12), version="w2", view=12)
    _put(client, straddled, first[12:], 12, version="w2")
    return Step(good, rows, straddled, f"rr-{run}-victim", _rows(g, VICTIM_ROWS))


def _answers(step: Step, source: Any) -> None:
    """The step's good rollouts fetched as stored (``-1`` on each sample's last token)."""
    got = fetch_megatron_rank_batch(source, step.good, seqlens=[ROWS + 1] * len(step.good))
    assert got.layer_ids == LAYERS
    last = np.full((1, K), -1, np.int64)
    for n, layer in enumerate(got.per_layer):
        want = np.concatenate([np.concatenate([step.rows[k][:, n], last]) for k in step.good])
        np.testing.assert_array_equal(layer, want)


async def _aanswers(step: Step, client: AsyncRoutingClient) -> None:
    got = {rid: r async for rid, r in client.get_many(step.good, chunk_size=2, concurrency=2)}
    for key in step.good:
        routing = got[key]
        assert isinstance(routing, Routing)
        np.testing.assert_array_equal(routing.indices, step.rows[key])


def _fetch(step: Step, source: Any, ids: list[str], **kw: Any) -> Callable[[], object]:
    return lambda: fetch_megatron_rank_batch(source, ids, seqlens=step.tokens(ids), **kw)


def _kind(j: int) -> str:
    """Refusal ``j``'s kind: one in ten deleted under the read (it costs a put and a delete
    more), the others straddled and missing in turn."""
    return "deleted" if j % 10 == 9 else ("straddled", "missing")[j % 2]


# ------------------------------------------------------------------ what a client holds


@dataclass
class Held:
    """What a client holds now: ``streams`` open (HTTP requests whose response is not
    closed, gRPC calls not done, Redis connections checked out), connections ``in_use``
    (not back in the pool: leaked once no fetch runs) and ``pooled`` (all it keeps)."""

    streams: Callable[[], int]
    in_use: Callable[[], int]
    pooled: Callable[[], int]


def _http_held(client: RoutingClient | AsyncRoutingClient) -> Held:
    pool = client._t._http._transport._pool  # type: ignore[union-attr]
    return Held(
        lambda: len(pool._requests),
        lambda: sum(not c.is_idle() for c in pool.connections),
        lambda: len(pool.connections),
    )


def _grpc_held(client: RoutingClient | AsyncRoutingClient) -> Held:
    """Every BatchGet call the client makes, recorded; a stream is a call not done."""
    stub = client._t._stub  # type: ignore[union-attr]
    make = stub.BatchGet
    calls: list[Any] = []

    def recording(*args: Any, **kw: Any) -> Any:
        call = make(*args, **kw)
        calls.append(call)
        return call

    def open_calls() -> int:
        calls[:] = [c for c in calls if not c.done()]
        return len(calls)

    stub.BatchGet = recording
    return Held(open_calls, lambda: 0, lambda: 1)  # (one channel: its descriptors counted)


def _held(client: RoutingClient | AsyncRoutingClient, transport: str) -> Held:
    return _http_held(client) if transport == "http" else _grpc_held(client)


def _reader_held(reader: DirectReader) -> Held:
    pool = reader._r.connection_pool
    return Held(
        lambda: len(pool._in_use_connections),
        lambda: len(pool._in_use_connections),
        lambda: len(pool._in_use_connections) + len(pool._available_connections),
    )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _our_threads() -> int:
    """The clients' own worker threads (``r3-decode``, ``r3-fetch``; not gRPC's)."""
    return sum(t.name.startswith("r3-") for t in threading.enumerate())


@dataclass
class Tally:
    """What ``n`` refusals left: how many left a stream open, the slowest, and the
    client's streams, connections in use and pooled, descriptors and worker threads
    before and after."""

    what: str
    held: Held
    refused: int = 0
    left_open: int = 0
    slowest: float = 0.0
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    def now(self) -> tuple[int, ...]:
        held = self.held
        counts = (held.streams(), held.in_use(), held.pooled(), _fds())
        return (*counts, _our_threads())

    def counted(self, elapsed: float) -> None:
        self.refused += 1
        self.slowest = max(self.slowest, elapsed)
        self.left_open += self.held.streams() > 0

    def check(self) -> None:
        (s0, u0, p0, f0, t0), (s1, u1, p1, f1, t1) = self.before, self.after
        said = (
            f"{self.what}: {self.left_open} of {self.refused} refused fetches left an open "
            f"stream; streams {s0} -> {s1}, connections in use {u0} -> {u1}, pooled "
            f"{p0} -> {p1}, fds {f0} -> {f1}, threads {t0} -> {t1}, slowest fetch "
            f"{self.slowest:.2f} s"
        )
        print(said)
        assert self.left_open == 0 and s1 == 0, said
        assert u1 == 0, said
        assert f1 <= f0 + FD_SLACK, said
        assert t1 <= t0, said
        assert self.slowest < DEADLINE_S, said


Case = Callable[[int], tuple[Callable[[], object], type[R3Error]]]
ACase = Callable[[int], tuple[Callable[[], Awaitable[object]], type[R3Error]]]


def _refuse(what: str, held: Held, n: int, case: Case) -> Tally:
    """``n`` refusals: ``case(j)`` is fetch ``j`` and the error it must raise."""
    tally = Tally(what, held)
    kept: list[R3Error] = []
    tally.before = tally.now()
    gc.disable()
    try:
        for j in range(n):
            fetch, refused = case(j)
            t = time.monotonic()
            faulthandler.dump_traceback_later(HANG_S)
            try:
                fetch()
            except refused as exc:
                kept.append(exc)
            else:
                pytest.fail(f"{what}: fetch {j} answered, {refused.__name__} expected")
            finally:
                faulthandler.cancel_dump_traceback_later()
            tally.counted(time.monotonic() - t)
            if tally.left_open >= STOP_AT:
                break
        tally.after = tally.now()
    finally:
        gc.enable()
    return tally


async def _arefuse(what: str, held: Held, n: int, case: ACase) -> Tally:
    """:func:`_refuse` of async fetches."""
    tally = Tally(what, held)
    kept: list[R3Error] = []
    tally.before = tally.now()
    gc.disable()
    try:
        for j in range(n):
            fetch, refused = case(j)
            t = time.monotonic()
            faulthandler.dump_traceback_later(HANG_S)
            try:
                await fetch()
            except refused as exc:
                kept.append(exc)
            else:
                pytest.fail(f"{what}: fetch {j} answered, {refused.__name__} expected")
            finally:
                faulthandler.cancel_dump_traceback_later()
            tally.counted(time.monotonic() - t)
            if tally.left_open >= STOP_AT:
                break
        tally.after = tally.now()
    finally:
        gc.enable()
    return tally


# ------------------------------------------------------------------ sources that delete


class _DeletesAfterStat(RoutingClient):
    """A client that deletes ``victim`` right after a fetch's stat names it, before the
    fetch reads its rows (as a driver's ``delete_many`` racing a rank would)."""

    victim: str | None = None

    def stat_many(self, rollout_ids: Any, *, chunk_size: int = 1024) -> Any:
        got = super().stat_many(rollout_ids, chunk_size=chunk_size)
        victim, self.victim = self.victim, None
        if victim is not None and victim in rollout_ids:
            self.delete(victim)
        return got


class _ADeletesBeforeViews(AsyncRoutingClient):
    """Deletes ``victim`` after its rows arrived, before ``view="latest"`` stats it."""

    victim: str | None = None

    async def stat(self, rollout_id: str) -> Any:
        if rollout_id == self.victim:
            await self.delete(rollout_id)
            self.victim = None
        return await super().stat(rollout_id)


class _DeletesAfterScan(DirectReader):
    """A reader whose ``victim`` is deleted between its scan of the hash's small fields
    and its read of the chunks they name."""

    victim: str | None = None
    deleter: RoutingClient | None = None

    def _small_fields(self, keys: list[str]) -> list[dict[bytes, Any]]:
        got = super()._small_fields(keys)
        if self.victim is not None and self.key(self.victim) in keys:
            assert self.deleter is not None
            self.deleter.delete(self.victim)  # its rereads find it gone too
        return got


# ------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def step(service_single: Service) -> Step:
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        return _store(client, seed=53)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("transport", "n"), [("http", 700), ("grpc", 300)])
def test_a_refused_rank_fetch_releases_its_stream(
    service_single: Service, step: Step, transport: str, n: int
) -> None:
    """Straddled (read without its states), missing, and deleted between the fetch's stat
    and its rows, at each position of the micro-batch: each raises its error with no
    stream, connection, thread or descriptor left, and the next fetch answers."""
    url = url_of(service_single, transport)
    client = _DeletesAfterStat(url, api_key=KEY_A, timeout=TIMEOUT, retry=ONCE)
    with client:
        _answers(step, client)  # the client's connection and threads made
        held = _held(client, transport)

        def case(j: int) -> tuple[Callable[[], object], type[R3Error]]:
            kind, at = _kind(j), j // 2
            if kind == "straddled":  # a read past its state's rows: refused, nothing read
                return _fetch(step, client, step.batch(step.straddled, at)), InvalidRequestError
            if kind == "missing":
                return _fetch(step, client, step.batch(MISSING, at)), RolloutNotFoundError
            client.victim = step.put_victim(client)
            return _fetch(step, client, step.batch(step.victim, at)), RolloutNotFoundError

        tally = _refuse(f"RoutingClient over {transport}", held, n, case)
        tally.check()
        _answers(step, client)


@pytest.mark.timeout(60)
async def test_a_refused_async_get_many_releases_its_streams(
    service_single: Service, step: Step, transport: str
) -> None:
    """``get_many`` refusing a missing rollout, or one deleted between its rows and the
    stat of its views, with other chunks' streams in flight: none left open."""
    url = url_of(service_single, transport)
    client = _ADeletesBeforeViews(url, api_key=KEY_A, timeout=TIMEOUT, retry=ONCE)
    async with client:
        await _aanswers(step, client)
        held = _held(client, transport)
        sync = RoutingClient(service_single.http_url, api_key=KEY_A)

        async def drain(ids: list[str], view: Any) -> None:
            async for _ in client.get_many(ids, chunk_size=2, concurrency=2, view=view):
                pass

        def case(j: int) -> tuple[Callable[[], Awaitable[object]], type[R3Error]]:
            if j % 2 == 0:
                ids = step.batch(MISSING, j // 2)
                return (lambda: drain(ids, "generated")), RolloutNotFoundError
            client.victim = step.put_victim(sync)
            ids = step.batch(step.victim, j // 2)
            return (lambda: drain(ids, "latest")), RolloutNotFoundError

        try:
            tally = await _arefuse(f"AsyncRoutingClient over {transport}", held, 200, case)
        finally:
            sync.close()
        tally.check()
        await _aanswers(step, client)


@pytest.mark.timeout(60)
def test_a_refused_direct_fetch_releases_its_connections(
    service_single: Service, step: Step
) -> None:
    """The same refusals read from Redis directly: no connection left checked out, no
    reader or decode thread left running."""
    reader = _DeletesAfterScan.from_service(service_single.http_url, api_key=KEY_A)
    assert isinstance(reader, _DeletesAfterScan)
    with reader, RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        reader.deleter = client
        _answers(step, reader)
        held = _reader_held(reader)

        def case(j: int) -> tuple[Callable[[], object], type[R3Error]]:
            kind, at = _kind(j), j // 2
            reader.victim = None
            if kind == "straddled":
                return _fetch(step, reader, step.batch(step.straddled, at)), InvalidRequestError
            if kind == "missing":
                return _fetch(step, reader, step.batch(MISSING, at)), RolloutNotFoundError
            reader.victim = step.put_victim(client)
            return _fetch(step, reader, step.batch(step.victim, at)), RolloutNotFoundError

        tally = _refuse("DirectReader", held, 300, case)
        reader.victim = None
        tally.check()
        _answers(step, reader)


@dataclass
class Dying:
    """A service over its own redis-server (AOF on: a restart keeps the rollouts)."""

    svc: Service
    redis: RedisProcess
    step: Step


@pytest.fixture(scope="module")
def dying(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dying]:
    tmp = Path(tmp_path_factory.mktemp("dying"))
    redis = RedisProcess(
        free_port(), tmp / "redis", appendonly=True, password=secrets.token_urlsafe(16)
    ).start()
    svc = start_service(tmp, redis.url, env=DIRECT_READS)
    try:
        with RoutingClient(svc.http_url, api_key=KEY_A) as client:
            step = _store(client, seed=54)
        yield Dying(svc, redis, step)
    finally:
        svc.stop()
        redis.stop()


def _until_answered(check: Callable[[], None], what: str) -> None:
    """``check`` passing within 10 s of Redis coming back (the service reconnects)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            check()
            return
        except R3Error as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not answer again once Redis was back") from exc
            time.sleep(0.1)


@pytest.mark.timeout(120)
async def test_refusals_while_redis_is_dead_release_what_they_hold(dying: Dying) -> None:
    """Redis killed under the service and the direct reader: every fetch refused
    (store unavailable) releases what it held, and each answers once Redis is back."""
    step, http, grpc_url = dying.step, dying.svc.http_url, dying.svc.grpc_url
    sync_http = RoutingClient(http, api_key=KEY_A, timeout=TIMEOUT, retry=ONCE)
    sync_grpc = RoutingClient(grpc_url, api_key=KEY_A, timeout=TIMEOUT, retry=ONCE)
    aclient = AsyncRoutingClient(http, api_key=KEY_A, timeout=TIMEOUT, retry=ONCE)
    reader = DirectReader.from_service(http, api_key=KEY_A, timeout=DEADLINE_S)
    try:
        for source in (sync_http, sync_grpc, reader):
            _answers(step, source)
        await _aanswers(step, aclient)
        probes = (
            ("RoutingClient over http", sync_http, _http_held(sync_http)),
            ("RoutingClient over grpc", sync_grpc, _grpc_held(sync_grpc)),
            ("DirectReader", reader, _reader_held(reader)),
        )
        aheld = _http_held(aclient)
        dying.redis.kill()
        tallies = []
        for what, source, held in probes:
            # generated: no stat first, so the batch stream is open when its items fail
            view = "generated" if isinstance(source, RoutingClient) else "exact"

            def case(
                j: int, source: Any = source, view: str = view
            ) -> tuple[Callable[[], object], type[R3Error]]:
                ids = step.batch(step.good[j % len(step.good)], j)
                return _fetch(step, source, ids, view=view), StoreUnavailableError

            tallies.append(_refuse(f"{what}, Redis dead", held, 40, case))

        async def drain() -> None:
            async for _ in aclient.get_many(step.good, chunk_size=2, concurrency=2):
                pass

        tallies.append(
            await _arefuse(
                "AsyncRoutingClient over http, Redis dead",
                aheld,
                40,
                lambda j: (drain, StoreUnavailableError),
            )
        )
        dying.redis.start()
        for tally in tallies:
            tally.check()
        _until_answered(lambda: _answers(step, sync_http), "RoutingClient over http")
        _until_answered(lambda: _answers(step, sync_grpc), "RoutingClient over grpc")

        def regranted() -> None:  # ACLs are no data: the service grants its reader again
            DirectReader.from_service(http, api_key=KEY_A).close()
            _answers(step, reader)

        _until_answered(regranted, "DirectReader")
        await _aanswers(step, aclient)
    finally:
        if dying.redis.proc is None:
            dying.redis.start()
        sync_http.close()
        sync_grpc.close()
        reader.close()
        await aclient.aclose()


@pytest.mark.timeout(120)
async def test_async_fetches_cancelled_at_any_point_leave_the_pool_whole(
    service_single: Service, step: Step
) -> None:
    """Fetches cancelled at each point of their way through the pool (``get_many`` cancels
    its other chunks when one is refused; a trainer's own timeout cancels a fetch) leave
    no connection behind that the pool can neither use nor reap.

    httpcore 1.0.9 keeps a connection it created for a request that is cancelled after the
    connection was assigned and before it was used (encode/httpcore#1093): neither idle,
    closed nor available, it holds a pool slot for good; ``max_connections`` of them and
    every fetch waits out its pool timeout.  8 fetches at once on a pool of 4 connections,
    cancelled after 0 to 11 turns of the event loop, 30 rounds each: then all 4 slots
    still answer."""
    transport = AsyncHTTPTransport(
        service_single.http_url, api_key=KEY_A, timeout=TIMEOUT, max_connections=4
    )
    pool = transport._http._transport._pool  # type: ignore[attr-defined]
    async with AsyncRoutingClient(transport=transport, retry=ONCE) as client:
        await _aanswers(step, client)
        for turns in range(12):
            for _ in range(30):
                fetches = [asyncio.ensure_future(client.get(key)) for key in step.good[:4] * 2]
                for _ in range(turns):
                    await asyncio.sleep(0)
                for fetch in fetches:
                    fetch.cancel()
                await asyncio.gather(*fetches, return_exceptions=True)
                stuck = [c for c in pool.connections if not c.is_idle() and not c.is_closed()]
                assert not pool._requests and not stuck, (
                    f"cancelled after {turns} turns: {len(stuck)} connections held by no "
                    f"request ({pool}, {pool.connections})"
                )
        t = time.monotonic()
        got = await asyncio.gather(*(client.get(key) for key in step.good[:4] * 4))
        assert all(isinstance(r, Routing) for r in got)
        assert time.monotonic() - t < DEADLINE_S
