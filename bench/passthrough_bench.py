"""Multi-segment rollouts through the cache service: what the data path costs (issue 14).

Measures the service's CPU per PUT and per GB served, PUT throughput, and the wall
time of reading a batch of rollouts -- bytes only and decoded, through the relay
(HTTP / gRPC batch GET) and the direct path (``DirectReader``: a read plan from the
service, then redis-py with read-only credentials) -- against raw redis-py reading
the same stored bytes, for the rollout shapes RL actually writes: a GRPO sample
(shared prompt segment + response segment), an agent rollout (one segment per turn)
and a single-segment rollout; and what a layer slice (one pipeline stage) moves.

Starts its own ``redis-server`` (loopback, free port, AOF off, a password: the service
issues read plans only where Redis asks for credentials) and its own service
(``python -m cache_service serve``, auth on, direct reads on, as
``tests/support/service_process.py`` starts it) and stops both by PID at the end, also on
Ctrl-C / SIGTERM.

Data: 48 MoE layers x 128 experts x top-8 (Qwen3-30B-A3B), synthetic, fixed seeds,
"skewed" (per-layer Zipf popularity, skew 1.0, consecutive tokens correlated,
rho 0.9) and "uniform" (skew 0, rho 0).  ``--distinct`` arrays of 4096 rows are
drawn per distribution and every rollout takes a rolled copy of one of them
(drawing 1M rows per scenario would take minutes and change nothing measured).
Frames are written the way the engine writes them (``sglang_r3/http_server/shipping.py``): a
rollout's first segment is self-contained, a later one is a continuation frame of
the first segment's context when that context has a relabel table or the new rows
are fewer than E.  Scenarios (counts multiplied by ``--scale``):

* ``grpo``: 16 groups x 16 samples; a sample is a 1024-token prompt segment
  ``[0, 1024)`` (the same rows and token digest for the 16 samples of a group,
  so the service stores it once) and a 3072-token response segment ``[1024, 4096)``
  (a continuation of the prompt's context);
* ``agent``: 32 rollouts x 20 turns of 150-250 tokens, one segment per turn,
  contiguous (turns 2..20 continuations of turn 1's context);
* ``single``: 256 rollouts of one 4096-token segment.

Per scenario and distribution, in one run:

* PUT: every segment is PUT as a pre-encoded frame (``RoutingClient.put`` with
  bytes; ``--put-concurrency`` rollouts in flight, each rollout's segments in
  order); service CPU seconds per PUT (``/proc/<pid>/stat`` utime + stime before
  and after), PUTs/s, stored bytes per token (``stat``: frame bytes of the
  rollout's segments, shared ones counted in every rollout);
* reads, best of ``--repeat``, interleaved; bytes only:
  - raw: redis-py, ``HGETALL`` of each rollout hash plus ``HGET <blob> f`` for each
    shared-segment reference (``s:<a>:<b>`` fields holding ``@<blob key>``; the
    layout of ``cache_service/store/``), two ways: asyncio with
    ``--raw-concurrency`` rollouts in flight, and one connection pipelining 64
    rollouts at a time (DirectReader's pattern); the faster is "raw";
  - direct: ``DirectReader.fetch_many`` (the bytes a whole-rollout GET returns);
  - relay: the batch stream (``POST /v1/batch/get``, and gRPC ``BatchGet``) read
    through the client's transport, 64 ids per request, items not decoded;
  and decoded:
  - ``decode_rollout`` of each rollout's bytes (fetched beforehand), one thread;
  - ``DirectReader.get_many``, ``RoutingClient.get_many`` (HTTP, one thread) and
    ``AsyncRoutingClient.get_many`` (its default concurrency): fetch + decode;
  the ratio to raw, and the service's CPU seconds per GB served (GB = 10^9 bytes
  of the responses, sized once with ``get_frame``).

Then:

* ``load``: PUT throughput of one service replica, ``--load-clients`` concurrent
  PUTs of fresh ``--load-tokens``-token single-segment skewed rollouts for
  ``--load-seconds`` (PUTs only; ``bench/service_bench.py``'s load mode mixes
  PUTs and GETs);
* slicing: a ``--load-tokens``-token skewed rollout stored as one segment and as 4
  segments (3 continuations); ``get_frame(layers=...)`` of each pipeline stage's
  quarter of the layers: bytes moved / the whole rollout's bytes, the service's
  CPU per sliced GET (vs the client's decode of the same bytes), rows checked;
* multi-turn: bytes shipped over the 20 turns of each agent rollout / the final
  rollout encoded as one frame (``encode_frame`` of the assembled routing), and
  / the rollout as the service returns it (``get_frame``);
* targets: issue 14's targets against the "Before" figures of docs/benchmarks-history.md
  (commit 6ed7d25, measured with this script's earlier version).

    python bench/passthrough_bench.py [--scale 1] [--repeat 3] [--quick] [--json PATH]

MB/GB are 10^6/10^9 bytes.  Client, service and Redis share the machine's cores:
the ratios and the service's CPU seconds are the result, not the wall times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import redis
import redis.asyncio as aioredis

from cache_service.redis_proc import RedisProcess, free_port
from cache_service.store import StoreSettings
from r3_client import (
    AsyncRoutingClient,
    Context,
    DirectReader,
    R3Error,
    RoutingClient,
    Segment,
    Timeout,
    decode_rollout,
    encode_frame,
    read_header,
    stored,
    token_digest,
)
from r3_client.synthetic import synthetic_routing
from r3_client.wire import GrpcTransport, HTTPTransport

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "bench", ROOT):  # ROOT: tests.support, before verl's ``tests``
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from service_bench import (  # noqa: E402
    _raise_interrupt,
    machine_info,
    machine_line,
    proc_cpu_s,
)

from tests.support.service_process import DIRECT_READS, KEY_A, Service, start_service  # noqa: E402

L, E, K = 48, 128, 8
ROWS = 4096  # rows per rollout in grpo and single; the pool arrays' length
PROMPT = 1024
STAGES = 4  # pipeline stages of the slicing test: each reads L / STAGES layers
CHUNK = 64  # ids per batch request / pipeline (RoutingClient's and DirectReader's default)
NAMESPACE = "tenant-a"  # KEY_A's namespace in tests/support/service_process.py
MODEL = "bench-moe"
DISTS = {"skewed": {"skew": 1.0, "rho": 0.9}, "uniform": {"skew": 0.0, "rho": 0.0}}
TIMEOUT = Timeout(connect=10, read=600)

# docs/benchmarks-history.md "Pass-through data path (issue 14)" / "Before" (commit 6ed7d25, this
# script's earlier version, --repeat 2): the baselines the targets are relative to.
BEFORE: dict[str, Any] = {
    "put_ms": {  # service CPU ms per PUT
        ("grpo", "skewed"): 15.3,
        ("agent", "skewed"): 4.5,
        ("single", "skewed"): 25.6,
        ("grpo", "uniform"): 24.8,
        ("agent", "uniform"): 6.3,
        ("single", "uniform"): 40.2,
    },
    "s_per_gb": {  # service CPU s/GB served, RoutingClient.get_many (sync)
        ("grpo", "skewed"): 110.4,
        ("agent", "skewed"): 127.3,
        ("single", "skewed"): 2.1,
        ("grpo", "uniform"): 51.0,
        ("agent", "uniform"): 82.5,
        ("single", "uniform"): 1.7,
    },
    "x_raw": {  # RoutingClient.get_many (sync) wall time / raw redis-py
        ("grpo", "skewed"): 84.79,
        ("agent", "skewed"): 16.15,
        ("single", "skewed"): 15.61,
        ("grpo", "uniform"): 59.08,
        ("agent", "uniform"): 16.28,
        ("single", "uniform"): 28.32,
    },
    "b_per_token": {"skewed": 162.1, "uniform": 246.1},  # single, stored B/token
    "turns_ratio": {"skewed": 1.120, "uniform": 1.005},
    "load_puts_per_s": 11.8,
    "load_ms_per_put": 119.3,
}


class BenchError(Exception):
    """A wrong answer: a missing rollout, a wrong row count or wrong rows."""


# ---- data -----------------------------------------------------------------------------------
Rows = npt.NDArray[np.int32]


@dataclass
class Rollout:
    """One rollout: its id, the frames to PUT in order, and its total rows."""

    rid: str
    frames: list[bytes]
    rows: int
    one_frame: int = 0  # bytes of the assembled rollout encoded as one frame (agent only)
    continuations: int = 0  # how many of ``frames`` are continuation frames


@dataclass
class Scenario:
    """The rollouts of one scenario at one distribution, and a spot check."""

    name: str
    dist: str
    rollouts: list[Rollout]
    check: dict[str, Rows] = field(default_factory=dict)  # rid -> its full rows

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.rollouts)

    @property
    def puts(self) -> int:
        return sum(len(r.frames) for r in self.rollouts)


def pool(dist: str, n: int, seed0: int) -> list[Rows]:
    """``n`` arrays of ``ROWS`` rows of one distribution."""
    return [synthetic_routing(ROWS, L, E, K, **DISTS[dist], seed=seed0 + i) for i in range(n)]


def rows_for(arrays: list[Rows], i: int, n: int) -> Rows:
    """``n`` rows for rollout ``i``: one pool array, rotated (so no two share bytes) and
    wrapped around when ``n`` exceeds its length."""
    src = arrays[i % len(arrays)]
    shift = 97 * (i // len(arrays)) + 13 * i
    return np.ascontiguousarray(src[(np.arange(n) + shift) % src.shape[0]])


def frame(
    rows: Rows, start: int, tokens: npt.NDArray[np.int64] | None, base: Context | None = None
) -> bytes:
    """A segment frame for ``rows`` at ``start``, token digest over ``tokens[0:end]`` (none
    when ``tokens`` is None); a continuation frame of ``base`` when given."""
    end = start + rows.shape[0]
    digest = "" if tokens is None else token_digest(tokens[:end])
    seg = Segment(start, end, MODEL, "v1", digest)
    return encode_frame(rows, num_experts=E, layer_ids=range(L), segment=seg, base=base)


def context_of(first: bytes) -> Context:
    """The context a self-contained frame carries, parsed with its table (a base)."""
    ctx = read_header(first).context
    assert ctx is not None
    return Context.parse(ctx.raw)


def engine_base(ctx: Context, rows: int) -> Context | None:
    """``http_server/shipping.py`` ``_base``: continue from the first segment's context when
    it has a relabel table, or when the new rows are too few to pay for one."""
    return ctx if ctx.has_table or rows < E else None


def grpo(dist: str, arrays: list[Rows], groups: int, seed: int) -> Scenario:
    """``groups`` x 16 samples: shared ``[0, 1024)`` prompt + ``[1024, 4096)`` response."""
    rng = np.random.default_rng(seed)
    sc = Scenario("grpo", dist, [])
    for g in range(groups):
        prompt_tokens = rng.integers(0, 150_000, PROMPT)
        prompt_rows = rows_for(arrays, 1000 + g, PROMPT)
        tokens = np.concatenate([prompt_tokens, np.zeros(ROWS - PROMPT, np.int64)])
        prompt_frame = frame(prompt_rows, 0, tokens)  # one digest for the group
        base = engine_base(context_of(prompt_frame), ROWS - PROMPT)
        for s in range(16):
            tokens[PROMPT:] = rng.integers(0, 150_000, ROWS - PROMPT)
            resp = rows_for(arrays, g * 16 + s, ROWS - PROMPT)
            rid = f"grpo-{dist}-g{g:02d}-s{s:02d}"
            frames = [prompt_frame, frame(resp, PROMPT, tokens, base)]
            sc.rollouts.append(Rollout(rid, frames, ROWS, continuations=int(base is not None)))
            if (g, s) in ((0, 0), (groups - 1, 15)):
                sc.check[rid] = np.concatenate([prompt_rows, resp])
    return sc


def turn_frames(
    rows: Rows, bounds: Sequence[int], tokens: npt.NDArray[np.int64] | None
) -> tuple[list[bytes], int]:
    """One frame per ``[bounds[i], bounds[i+1])`` as the engine ships them: the first
    self-contained, later ones continuations of its context when ``engine_base`` says so.
    Returns (frames, continuation frames)."""
    frames: list[bytes] = []
    ctx: Context | None = None
    cont = 0
    for a, b in itertools.pairwise(bounds):
        base = None if ctx is None else engine_base(ctx, b - a)
        frames.append(frame(rows[a:b], a, tokens, base))
        cont += base is not None
        if ctx is None:
            ctx = context_of(frames[0])
    return frames, cont


def agent(dist: str, arrays: list[Rows], n: int, turns: int, seed: int) -> Scenario:
    """``n`` rollouts of ``turns`` contiguous segments of 150-250 rows each."""
    rng = np.random.default_rng(seed)
    sc = Scenario("agent", dist, [])
    for i in range(n):
        lengths = rng.integers(150, 251, turns)
        total = int(lengths.sum())
        rows = rows_for(arrays, 500 + i, total)
        tokens = rng.integers(0, 150_000, total)
        bounds = [0, *(int(x) for x in np.cumsum(lengths))]
        frames, cont = turn_frames(rows, bounds, tokens)
        rid = f"agent-{dist}-{i:02d}"
        one = len(frame(rows, 0, tokens))
        sc.rollouts.append(Rollout(rid, frames, total, one, cont))
        if i in (0, n - 1):
            sc.check[rid] = rows
    return sc


def single(dist: str, arrays: list[Rows], n: int, seed: int) -> Scenario:
    """``n`` rollouts of one ``[0, 4096)`` segment."""
    rng = np.random.default_rng(seed)
    sc = Scenario("single", dist, [])
    for i in range(n):
        rows = rows_for(arrays, 2000 + i, ROWS)
        rid = f"single-{dist}-{i:03d}"
        sc.rollouts.append(Rollout(rid, [frame(rows, 0, rng.integers(0, 150_000, ROWS))], ROWS))
        if i in (0, n - 1):
            sc.check[rid] = rows
    return sc


# ---- measuring ------------------------------------------------------------------------------
def rollout_key(rid: str) -> str:
    """The rollout's Redis hash: ``<prefix>:<namespace>:{<rid>}`` (cache_service/store/)."""
    return stored.rollout_key(f"{StoreSettings().key_prefix}:{NAMESPACE}:", rid)


def blob_refs(h: dict[bytes, bytes]) -> list[str]:
    """The shared-segment blobs a rollout hash references (``s:<a>:<b>`` = ``@<key>``)."""
    return [b.decode() for f, v in h.items() if stored.segment_rows(f) and (b := stored.pointed(v))]


async def put_all(
    url: str, rollouts: Sequence[Rollout], concurrency: int
) -> tuple[float, int, int]:
    """PUT every rollout's frames in order, ``concurrency`` rollouts at once.

    Returns (seconds, shared segments, dedupe hits)."""
    sem = asyncio.Semaphore(concurrency)
    shared = hits = 0

    async def one(c: AsyncRoutingClient, ro: Rollout) -> None:
        nonlocal shared, hits
        async with sem:
            for f in ro.frames:
                res = await c.put(ro.rid, f)
                shared += bool(res.shared)
                hits += bool(res.dedupe_hit)

    async with AsyncRoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, ro) for ro in rollouts))
        return time.perf_counter() - t0, shared, hits


async def raw_async(redis_url: str, ids: Sequence[str], concurrency: int) -> int:
    """Bytes of every rollout hash (``HGETALL``) plus its shared blobs (``HGET <blob> f``),
    asyncio, ``concurrency`` rollouts in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(r: aioredis.Redis, rid: str) -> int:
        async with sem:
            h = cast("dict[bytes, bytes]", await r.hgetall(rollout_key(rid)))
            if not h:
                raise BenchError(f"raw: {rollout_key(rid)} is missing")
            n = sum(len(v) for v in h.values())
            for blob_key in blob_refs(h):
                blob = await r.hget(blob_key, stored.BLOB_FRAME)
                if blob is None:
                    raise BenchError(f"raw: blob {blob_key} of {rid} is missing")
                n += len(blob)
            return n

    async with aioredis.Redis.from_url(redis_url, max_connections=2 * concurrency) as r:
        return sum(await asyncio.gather(*(one(r, rid) for rid in ids)))


def raw_pipelined(r: redis.Redis, ids: Sequence[str]) -> int:
    """The same bytes, one connection, ``CHUNK`` rollouts per pipeline: ``HGETALL`` of the
    chunk, then ``HGET`` of the blobs it references (DirectReader's access pattern)."""
    n = 0
    for i in range(0, len(ids), CHUNK):
        pipe = r.pipeline(transaction=False)
        for rid in ids[i : i + CHUNK]:
            pipe.hgetall(rollout_key(rid))
        hashes = cast("list[dict[bytes, bytes]]", pipe.execute())
        refs = [b for h in hashes for b in blob_refs(h)]
        if not all(hashes):
            raise BenchError("raw: a rollout hash is missing")
        n += sum(len(v) for h in hashes for v in h.values())
        if refs:
            pipe = r.pipeline(transaction=False)
            for b in refs:
                pipe.hget(b, stored.BLOB_FRAME)
            n += sum(len(cast(bytes, v)) for v in pipe.execute())
    return n


def direct_fetch(
    reader: DirectReader, ids: Sequence[str], keep: dict[str, list[bytes]] | None
) -> int:
    """``DirectReader.fetch_many`` (bytes only); bytes read.  Keeps them in ``keep``."""
    n = 0
    for rid, got in reader.fetch_many(ids):
        if isinstance(got, R3Error):
            raise got
        n += sum(len(p) for p in got)
        if keep is not None:
            keep[rid] = got
    return n


def relay_fetch(transport: HTTPTransport | GrpcTransport, ids: Sequence[str]) -> int:
    """The batch stream through a client transport, ``CHUNK`` ids per request, items not
    decoded; bytes read."""
    n = 0
    for i in range(0, len(ids), CHUNK):
        with contextlib.closing(transport.batch_get(ids[i : i + CHUNK], 0, None, None)) as items:
            for item in items:
                if item.frame is None:
                    raise BenchError(f"relay: {item.rollout_id}: {item.error_message}")
                n += len(item.frame)
    return n


def check_result(sc: Scenario, rid: str, idx: npt.NDArray[Any], want_rows: int) -> None:
    if idx.shape != (want_rows, L, K):
        raise BenchError(f"{rid}: shape {idx.shape}, want {(want_rows, L, K)}")
    want = sc.check.get(rid)
    if want is not None and not np.array_equal(np.sort(idx, -1), np.sort(want, -1)):
        raise BenchError(f"{rid}: rows differ from the ones PUT")


def decode_all(sc: Scenario, fetched: dict[str, list[bytes]]) -> int:
    """``decode_rollout`` of each rollout's bytes, one thread; rows decoded."""
    rows = {ro.rid: ro.rows for ro in sc.rollouts}
    n = 0
    for rid, data in fetched.items():
        idx = decode_rollout(data, rollout_id=rid).indices
        check_result(sc, rid, idx, rows[rid])
        n += idx.shape[0]
    return n


def checked_rows(sc: Scenario, results: Iterable[tuple[str, Any]]) -> int:
    rows = {ro.rid: ro.rows for ro in sc.rollouts}
    n = 0
    for rid, routing in results:
        if isinstance(routing, R3Error):  # not with return_errors=False; for mypy
            raise routing
        check_result(sc, rid, routing.indices, rows[rid])
        n += routing.indices.shape[0]
    return n


def sync_get_many(url: str, sc: Scenario) -> int:
    """``RoutingClient.get_many`` over every rollout; rows read."""
    with RoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        return checked_rows(sc, c.get_many([ro.rid for ro in sc.rollouts]))


async def async_get_many(url: str, sc: Scenario) -> int:
    """``AsyncRoutingClient.get_many`` (default concurrency) over every rollout; rows read."""
    async with AsyncRoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        return checked_rows(sc, [x async for x in c.get_many([ro.rid for ro in sc.rollouts])])


@dataclass
class Timed:
    """One read variant's repetitions: wall seconds, and CPU seconds of client and service."""

    name: str
    run: Callable[[], int]
    wall: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)
    service_cpu: list[float] = field(default_factory=list)
    result: int = 0

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def service_cpu_s(self) -> float:
        """Median service CPU seconds per repetition (CPU is steadier than wall time)."""
        return float(np.median(self.service_cpu))

    @property
    def client_cpu_s(self) -> float:
        return float(np.median(self.client_cpu))


def measure(svc: Service, sc: Scenario, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """PUT the scenario, then time the reads; the figures for its table rows."""
    url, pid = svc.http_url, svc.proc.pid
    cpu0 = proc_cpu_s(pid)
    put_s, shared, hits = asyncio.run(put_all(url, sc.rollouts, args.put_concurrency))
    put_cpu = proc_cpu_s(pid) - cpu0
    ids = [ro.rid for ro in sc.rollouts]
    with RoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        stored = sum(c.stat(rid).stored_bytes for rid in ids)
        served = sum(len(c.get_frame(rid)) for rid in ids)
    fetched: dict[str, list[bytes]] = {}
    with (
        redis.Redis.from_url(redis_url) as r,
        DirectReader.from_service(url, api_key=KEY_A, timeout=600) as reader,
        contextlib.closing(HTTPTransport(url, api_key=KEY_A, timeout=TIMEOUT)) as http,
        contextlib.closing(
            GrpcTransport(f"grpc://{svc.grpc_target}", api_key=KEY_A, timeout=TIMEOUT)
        ) as grpc_t,
    ):
        direct_fetch(reader, ids, fetched)  # the bytes decode_all decodes
        variants = [
            Timed(
                "raw_async", lambda: asyncio.run(raw_async(redis_url, ids, args.raw_concurrency))
            ),
            Timed("raw_pipe", lambda: raw_pipelined(r, ids)),
            Timed("direct", lambda: direct_fetch(reader, ids, None)),
            Timed("relay_http", lambda: relay_fetch(http, ids)),
            Timed("relay_grpc", lambda: relay_fetch(grpc_t, ids)),
            Timed("decode", lambda: decode_all(sc, fetched)),
            Timed("direct_get_many", lambda: checked_rows(sc, reader.get_many(ids))),
            Timed("sync", lambda: sync_get_many(url, sc)),
            Timed("async", lambda: asyncio.run(async_get_many(url, sc))),
        ]
        for v in variants:  # warm-up, and the answers every repetition must repeat
            v.result = v.run()
        for _ in range(args.repeat):
            for v in variants:
                s0, c0, t0 = proc_cpu_s(pid), time.process_time(), time.perf_counter()
                got = v.run()
                v.wall.append(time.perf_counter() - t0)
                v.client_cpu.append(time.process_time() - c0)
                v.service_cpu.append(proc_cpu_s(pid) - s0)
                if got != v.result:
                    raise BenchError(f"{sc.name}/{sc.dist} {v.name}: {got}, first run {v.result}")
    vs = {v.name: v for v in variants}
    for name in ("decode", "direct_get_many", "sync", "async"):
        if vs[name].result != sc.rows:
            raise BenchError(f"{sc.name}/{sc.dist} {name}: {vs[name].result} rows, want {sc.rows}")
    sent = sum(len(f) for ro in sc.rollouts for f in ro.frames)
    return {
        "scenario": sc.name,
        "dist": sc.dist,
        "rollouts": len(ids),
        "rows": sc.rows,
        "puts": sc.puts,
        "continuations": sum(ro.continuations for ro in sc.rollouts),
        "put_bytes": sent,
        "put_s": put_s,
        "put_service_cpu_s": put_cpu,
        "shared_segments": shared,
        "dedupe_hits": hits,
        "stored_bytes": stored,
        "served_bytes": served,
        "bytes": {n: vs[n].result for n in ("raw_async", "raw_pipe", "direct", "relay_http")},
        "read": {
            v.name: {
                "best_s": v.best,
                "wall_s": v.wall,
                "client_cpu_s": v.client_cpu_s,
                "service_cpu_s": v.service_cpu_s,
            }
            for v in variants
        },
        "one_frame_bytes": sum(ro.one_frame for ro in sc.rollouts),
    }


async def load(url: str, frame_: bytes, clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` workers PUT ``frame_`` under fresh rollout ids until ``seconds`` are up."""
    lat: list[float] = []
    errors: list[str] = []

    async def worker(c: AsyncRoutingClient, w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                await c.put(f"load-{w:02d}-{i:05d}", frame_)
                lat.append(time.perf_counter() - t)
            except R3Error as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
            i += 1

    async with AsyncRoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        t0 = time.perf_counter()
        deadline = t0 + seconds
        await asyncio.gather(*(worker(c, w) for w in range(clients)))
        wall = time.perf_counter() - t0
    arr = np.array(lat) if lat else np.array([math.nan])
    return {
        "seconds": wall,
        "puts": len(lat),
        "errors": len(errors),
        "first_errors": errors[:3],
        "puts_per_s": len(lat) / wall,
        "mb_per_s": len(lat) * len(frame_) / wall / 1e6,
        "p50_ms": float(np.percentile(arr, 50) * 1e3),
        "p99_ms": float(np.percentile(arr, 99) * 1e3),
    }


def slicing(svc: Service, tokens: int, repeat: int) -> list[dict[str, Any]]:
    """One pipeline stage's quarter of the layers of a ``tokens``-row skewed rollout stored
    as one segment, and as 4 segments (the first self-contained, 3 continuations)."""
    rows = synthetic_routing(tokens, L, E, K, **DISTS["skewed"], seed=998)
    q = tokens // 4
    layouts = {
        "1 segment": [frame(rows, 0, None)],
        "4 segments": turn_frames(rows, [0, q, 2 * q, 3 * q, tokens], None)[0],
    }
    out: list[dict[str, Any]] = []
    pid, per = svc.proc.pid, L // STAGES
    with RoutingClient(svc.http_url, api_key=KEY_A, timeout=TIMEOUT) as c:
        for name, frames in layouts.items():
            rid = f"slice-{name.split()[0]}"
            for f in frames:
                c.put(rid, f)
            whole = c.get_frame(rid)
            t0 = time.perf_counter()
            decode_rollout(whole, rollout_id=rid)
            whole_decode = time.perf_counter() - t0
            s0 = proc_cpu_s(pid)
            for _ in range(repeat):
                c.get_frame(rid)
            whole_cpu = (proc_cpu_s(pid) - s0) / repeat
            for stage in range(STAGES):
                layers = list(range(stage * per, (stage + 1) * per))
                s0 = proc_cpu_s(pid)
                for _ in range(repeat):
                    part = c.get_frame(rid, layers=layers)
                cpu = (proc_cpu_s(pid) - s0) / repeat
                t0 = time.perf_counter()
                got = decode_rollout(part, layers=layers, rollout_id=rid)
                dec = time.perf_counter() - t0
                want = rows[:, stage * per : (stage + 1) * per]
                if got.indices.shape != want.shape or not np.array_equal(
                    np.sort(got.indices, -1), np.sort(want, -1)
                ):
                    raise BenchError(f"slice {name} stage {stage}: rows differ")
                out.append(
                    {
                        "stored_as": name,
                        "continuations": len(frames) - 1,
                        "tokens": tokens,
                        "stage": stage,
                        "layers": f"{layers[0]}-{layers[-1]}",
                        "whole_bytes": len(whole),
                        "slice_bytes": len(part),
                        "service_cpu_ms": cpu * 1e3,
                        "whole_service_cpu_ms": whole_cpu * 1e3,
                        "decode_ms": dec * 1e3,
                        "whole_decode_ms": whole_decode * 1e3,
                    }
                )
            c.delete(rid)
    return out


# ---- report ---------------------------------------------------------------------------------
def put_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | routing | rollouts | PUTs (continuation) | MB sent | PUT/s | rollouts/s | "
        "service CPU ms/PUT | before | service CPU ms/rollout | shared (dedupe hits) "
        "| stored B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        before = BEFORE["put_ms"].get((r["scenario"], r["dist"]), math.nan)
        out.append(
            f"| {r['scenario']} | {r['dist']} | {r['rollouts']} "
            f"| {r['puts']} ({r['continuations']}) "
            f"| {r['put_bytes'] / 1e6:,.1f} | {r['puts'] / r['put_s']:.1f} "
            f"| {r['rollouts'] / r['put_s']:.1f} "
            f"| {r['put_service_cpu_s'] / r['puts'] * 1e3:.2f} | {before:.1f} "
            f"| {r['put_service_cpu_s'] / r['rollouts'] * 1e3:.2f} "
            f"| {r['shared_segments']} ({r['dedupe_hits']}) "
            f"| {r['stored_bytes'] / r['rows']:.1f} |"
        )
    return "\n".join(out)


def raw_s(r: dict[str, Any]) -> float:
    """The faster raw redis-py read (asyncio or pipelined)."""
    return float(min(r["read"]["raw_async"]["best_s"], r["read"]["raw_pipe"]["best_s"]))


def s_per_gb(r: dict[str, Any], variant: str) -> float:
    return float(r["read"][variant]["service_cpu_s"] / (r["served_bytes"] / 1e9))


def fetch_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | routing | MB raw | MB served | raw s (async / pipelined) | direct s | x raw "
        "| relay HTTP s | x raw | relay gRPC s | x raw "
        "| service CPU s/GB (HTTP / gRPC) | client CPU s (raw pipelined / direct / HTTP) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rd, raw = r["read"], raw_s(r)
        out.append(
            f"| {r['scenario']} | {r['dist']} | {r['bytes']['raw_pipe'] / 1e6:,.1f} "
            f"| {r['served_bytes'] / 1e6:,.1f} "
            f"| {rd['raw_async']['best_s']:.3f} / {rd['raw_pipe']['best_s']:.3f} "
            f"| {rd['direct']['best_s']:.3f} | {rd['direct']['best_s'] / raw:.2f} "
            f"| {rd['relay_http']['best_s']:.3f} | {rd['relay_http']['best_s'] / raw:.2f} "
            f"| {rd['relay_grpc']['best_s']:.3f} | {rd['relay_grpc']['best_s'] / raw:.2f} "
            f"| {s_per_gb(r, 'relay_http'):.2f} / {s_per_gb(r, 'relay_grpc'):.2f} "
            f"| {rd['raw_pipe']['client_cpu_s']:.2f} / {rd['direct']['client_cpu_s']:.2f} "
            f"/ {rd['relay_http']['client_cpu_s']:.2f} |"
        )
    return "\n".join(out)


def decode_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | routing | decode s (1 thread) | ms/rollout | direct get_many s | x raw "
        "| relay get_many s (sync) | x raw | (async) | x raw "
        "| service CPU s/GB (sync / async) | before s/GB | before x raw (sync) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        rd, raw, key = r["read"], raw_s(r), (r["scenario"], r["dist"])
        out.append(
            f"| {r['scenario']} | {r['dist']} | {rd['decode']['best_s']:.3f} "
            f"| {rd['decode']['best_s'] / r['rollouts'] * 1e3:.1f} "
            f"| {rd['direct_get_many']['best_s']:.3f} "
            f"| {rd['direct_get_many']['best_s'] / raw:.1f} "
            f"| {rd['sync']['best_s']:.3f} | {rd['sync']['best_s'] / raw:.1f} "
            f"| {rd['async']['best_s']:.3f} | {rd['async']['best_s'] / raw:.1f} "
            f"| {s_per_gb(r, 'sync'):.2f} / {s_per_gb(r, 'async'):.2f} "
            f"| {BEFORE['s_per_gb'].get(key, math.nan):.1f} "
            f"| {BEFORE['x_raw'].get(key, math.nan):.1f} |"
        )
    return "\n".join(out)


def turns_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| routing | rollouts | continuation frames | bytes shipped (all turns) "
        "| final rollout as one frame | ratio | before | as served (`get_frame`) "
        "| shipped / served |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["scenario"] != "agent":
            continue
        out.append(
            f"| {r['dist']} | {r['rollouts']} | {r['continuations']} | {r['put_bytes']:,} "
            f"| {r['one_frame_bytes']:,} | {r['put_bytes'] / r['one_frame_bytes']:.3f} "
            f"| {BEFORE['turns_ratio'][r['dist']]:.3f} | {r['served_bytes']:,} "
            f"| {r['put_bytes'] / r['served_bytes']:.3f} |"
        )
    return "\n".join(out)


def load_table(res: dict[str, Any], args: argparse.Namespace) -> str:
    return "\n".join(
        [
            "| clients | tokens | frame MB | s | PUTs | errors | PUT/s | MB/s | p50 ms | p99 ms "
            "| service CPU ms/PUT | service CPU share |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {args.load_clients} | {args.load_tokens} | {res['frame_bytes'] / 1e6:.2f} "
            f"| {res['seconds']:.1f} | {res['puts']} | {res['errors']} | {res['puts_per_s']:.1f} "
            f"| {res['mb_per_s']:.1f} | {res['p50_ms']:.0f} | {res['p99_ms']:.0f} "
            f"| {res['service_cpu_s'] / max(res['puts'], 1) * 1e3:.1f} "
            f"| {res['service_cpu_s'] / res['seconds']:.0%} |",
        ]
    )


def slice_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| stored as | tokens | stage (layers) | whole rollout bytes | slice bytes | ratio "
        "| service CPU ms/GET (slice / whole) | client decode ms (slice / whole) |",
        "|---|---:|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['stored_as']} | {r['tokens']} | {r['stage']} ({r['layers']}) "
            f"| {r['whole_bytes']:,} | {r['slice_bytes']:,} "
            f"| {r['slice_bytes'] / r['whole_bytes']:.3f} "
            f"| {r['service_cpu_ms']:.2f} / {r['whole_service_cpu_ms']:.2f} "
            f"| {r['decode_ms']:.1f} / {r['whole_decode_ms']:.1f} |"
        )
    return "\n".join(out)


def targets(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(target, measured, baseline, met) for issue 14's measurable targets."""
    rows = {(r["scenario"], r["dist"]): r for r in report["scenarios"]}
    out: list[tuple[str, str, str, bool]] = []
    if "load" in report:
        got, base = report["load"]["puts_per_s"], BEFORE["load_puts_per_s"]
        out.append(
            (
                f"PUT throughput, 1 replica, {report['args']['load_tokens']}-token rollouts, "
                f"{report['args']['load_clients']} clients >= 5x before",
                f"{got:.1f}/s = {got / base:.1f}x",
                f"{base}/s",
                got >= 5 * base,
            )
        )
    for (name, dist), r in rows.items():
        if name in ("grpo", "agent"):
            for variant, label in (("sync", "get_many sync"), ("relay_http", "bytes only")):
                got, base = s_per_gb(r, variant), BEFORE["s_per_gb"][(name, dist)]
                out.append(
                    (
                        f"service CPU s/GB, relay ({label}), {name} {dist} <= 1/3 before",
                        f"{got:.2f} = {got / base:.3f}x",
                        f"{base}",
                        got <= base / 3,
                    )
                )
    for (name, dist), r in rows.items():
        got = r["read"]["direct"]["best_s"] / raw_s(r)
        out.append(
            (
                f"direct read (bytes) / raw redis-py, {name} {dist} <= 1.3",
                f"{got:.2f}",
                "",
                got <= 1.3,
            )
        )
    for (name, dist), r in rows.items():
        if name == "agent":
            got = r["put_bytes"] / r["one_frame_bytes"]
            base = BEFORE["turns_ratio"][dist]
            out.append(
                (
                    f"multi-turn bytes shipped / final as one frame, {dist}"
                    + (" <= 1.05" if dist == "skewed" else " (no target)"),
                    f"{got:.3f}",
                    f"{base:.3f}",
                    got <= 1.05 or dist != "skewed",
                )
            )
    layouts: dict[str, list[dict[str, Any]]] = {}
    for s in report.get("slicing", []):
        layouts.setdefault(s["stored_as"], []).append(s)
    for name, stages in layouts.items():
        worst = max(stages, key=lambda s: s["slice_bytes"] / s["whole_bytes"])
        got = worst["slice_bytes"] / worst["whole_bytes"]
        out.append(
            (
                f"slice: one stage's {L // STAGES} of {L} layers of a {worst['tokens']}-token "
                f"rollout stored as {name}, bytes / whole <= 0.3 (worst of {len(stages)} stages)",
                f"{got:.3f}",
                "",
                got <= 0.3,
            )
        )
    for (name, dist), r in rows.items():
        if name == "single":
            got, base = r["stored_bytes"] / r["rows"], BEFORE["b_per_token"][dist]
            out.append(
                (
                    f"stored B/token, single {dist} <= before",
                    f"{got:.1f}",
                    f"{base}",
                    round(got, 1) <= base,  # the before figure is rounded to 0.1
                )
            )
    return out


def targets_table(report: dict[str, Any]) -> str:
    out = ["| target | measured | before | met |", "|---|---|---|---|"]
    for name, got, base, ok in targets(report):
        out.append(f"| {name} | {got} | {base} | {'met' if ok else 'NOT met'} |")
    return "\n".join(out)


# ---- main -----------------------------------------------------------------------------------
def run(svc: Service, redis_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario at both distributions, then the load run; the JSON report."""

    def count(n: int) -> int:
        return max(1, round(n * float(args.scale)))

    flush: redis.Redis = redis.Redis.from_url(redis_url)
    rows: list[dict[str, Any]] = []
    for di, dist in enumerate(args.dists.split(",")):
        t0 = time.perf_counter()
        arrays = pool(dist, args.distinct, seed0=100 * di)
        print(f"[{dist}] {args.distinct} arrays in {time.perf_counter() - t0:.1f} s", flush=True)
        for name in args.scenarios.split(","):
            t0 = time.perf_counter()
            if name == "grpo":
                sc = grpo(dist, arrays, count(16), seed=1)
            elif name == "agent":
                sc = agent(dist, arrays, count(32), args.turns, seed=2)
            elif name == "single":
                sc = single(dist, arrays, count(256), seed=3)
            else:
                raise SystemExit(f"unknown scenario {name!r}")
            enc = time.perf_counter() - t0
            print(
                f"[{dist}] {name}: {len(sc.rollouts)} rollouts, {sc.puts} segments, "
                f"{sc.rows:,} rows, encoded in {enc:.1f} s",
                flush=True,
            )
            t0 = time.perf_counter()
            rows.append(measure(svc, sc, redis_url, args))
            print(f"[{dist}] {name}: measured in {time.perf_counter() - t0:.1f} s", flush=True)
            flush.flushall()
        del arrays
    report: dict[str, Any] = {"scenarios": rows}
    if args.load_seconds > 0:
        # no token digest: every PUT is a fresh rollout's own segment, never deduplicated
        fr = encode_frame(
            synthetic_routing(args.load_tokens, L, E, K, **DISTS["skewed"], seed=999),
            num_experts=E,
            layer_ids=range(L),
            segment=Segment(0, args.load_tokens, MODEL, "v1"),
        )
        print(f"[load] {args.load_clients} clients x {args.load_seconds:g} s", flush=True)
        c0 = proc_cpu_s(svc.proc.pid)
        res = asyncio.run(load(svc.http_url, fr, args.load_clients, args.load_seconds))
        res["service_cpu_s"] = proc_cpu_s(svc.proc.pid) - c0
        res["frame_bytes"] = len(fr)
        report["load"] = res
        flush.flushall()
    if args.slice_repeat > 0:
        print(f"[slicing] {args.load_tokens} tokens, {STAGES} stages", flush=True)
        report["slicing"] = slicing(svc, args.load_tokens, args.slice_repeat)
        flush.flushall()
    flush.close()
    return report


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    rows = report["scenarios"]
    print("\n### PUT\n\n" + put_table(rows), flush=True)
    print(
        f"\n### GET, bytes only: direct and relay vs raw redis-py (best of {args.repeat})\n\n"
        + fetch_table(rows),
        flush=True,
    )
    print(
        f"\n### GET, decoded: decode alone, and fetch + decode (best of {args.repeat})\n\n"
        + decode_table(rows),
        flush=True,
    )
    if any(r["scenario"] == "agent" for r in rows):
        print(
            f"\n### Multi-turn: bytes shipped over {args.turns} turns\n\n" + turns_table(rows),
            flush=True,
        )
    if "load" in report:
        print(
            "\n### PUT throughput of one replica (fresh single-segment rollouts, skewed)\n\n"
            + load_table(report["load"], args),
            flush=True,
        )
        for msg in report["load"]["first_errors"]:
            print(f"load error: {msg}")
    if report.get("slicing"):
        print(
            "\n### Slicing: one pipeline stage's layers (`get_frame(layers=...)`, skewed)\n\n"
            + slice_table(report["slicing"]),
            flush=True,
        )
    print("\n### Targets (issue 14)\n\n" + targets_table(report), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, start Redis and the service, run, print the tables, stop both."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every rollout count")
    p.add_argument("--scenarios", default="grpo,agent,single", help="comma list")
    p.add_argument("--dists", default="skewed,uniform", help="comma list of skewed, uniform")
    p.add_argument("--turns", type=int, default=20, help="turns per agent rollout")
    p.add_argument("--distinct", type=int, default=8, help="pool arrays drawn per distribution")
    p.add_argument("--repeat", type=int, default=3, help="timed reads (best wall time reported)")
    p.add_argument("--put-concurrency", type=int, default=8, help="rollouts PUT at once")
    p.add_argument("--raw-concurrency", type=int, default=8, help="raw rollouts read at once")
    p.add_argument("--load-seconds", type=float, default=10.0, help="load run length (0: skip)")
    p.add_argument("--load-clients", type=int, default=16)
    p.add_argument(
        "--load-tokens",
        type=int,
        default=16384,
        help="tokens per PUT in the load run, and of the sliced rollout",
    )
    p.add_argument(
        "--slice-repeat", type=int, default=50, help="GETs per slice (service CPU); 0: skip"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test (< 60 s): --scale 0.0625 --distinct 2 --repeat 1, 1 s load of "
        "2 clients x 2048 tokens, slices GET twice",
    )
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.distinct, args.repeat = 0.0625, 2, 1
        args.load_seconds, args.load_clients, args.load_tokens = 1.0, 2, 2048
        args.slice_repeat = 2

    signal.signal(signal.SIGTERM, _raise_interrupt)
    info = machine_info()
    print(machine_line(info), flush=True)
    env = {
        "R3_CACHE_MAX_BATCH": "1024",
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
        **DIRECT_READS,
    }
    report: dict[str, Any] = {"machine": info, "args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="r3-passthrough-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rp = RedisProcess(
            free_port(), tmp / "redis", appendonly=False, password=secrets.token_urlsafe(24)
        )
        svc: Service | None = None
        try:
            rp.start()
            svc = start_service(tmp, rp.url, env=env)
            report.update(run(svc, rp.url, args))
        except KeyboardInterrupt:
            print("interrupted: stopping the service and redis-server", file=sys.stderr)
            return 130
        finally:
            if svc is not None:
                svc.stop()
            rp.stop()
    print_report(report, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    errors = report.get("load", {}).get("errors", 0)
    print(f"load run: {errors} errors" if "load" in report else "load run: skipped")
    return 1 if errors else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
