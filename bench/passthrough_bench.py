"""Multi-segment rollouts through the cache service: what the data path costs (issue 14).

Measures the service's CPU per PUT and per GB served, PUT throughput, and the wall
time of the client reading a batch against raw redis-py reading the same stored
bytes, for the rollout shapes RL actually writes: a GRPO sample (shared prompt
segment + response segment), an agent rollout (one segment per turn) and a
single-segment rollout.  It uses only interfaces that stay put when the data path
changes (the public client library, the HTTP API, raw redis-py), so the same
script measures before and after.

Starts its own ``redis-server`` (loopback, free port, AOF off) and its own service
(``python -m cache_service serve``, auth on, as ``tests/service/_service.py`` starts
it) and stops both by PID at the end, also on Ctrl-C / SIGTERM.

Data: 48 MoE layers x 128 experts x top-8 (Qwen3-30B-A3B), synthetic, fixed seeds,
"skewed" (per-layer Zipf popularity, skew 1.0, consecutive tokens correlated,
rho 0.9) and "uniform" (skew 0, rho 0).  ``--distinct`` arrays of 4096 rows are
drawn per distribution and every rollout takes a rolled copy of one of them
(drawing 1M rows per scenario would take minutes and change nothing measured).
Scenarios (counts multiplied by ``--scale``):

* ``grpo``: 16 groups x 16 samples; a sample is a 1024-token prompt segment
  ``[0, 1024)`` (the same rows and token digest for the 16 samples of a group,
  so the service stores it once) and a 3072-token response segment ``[1024, 4096)``;
* ``agent``: 32 rollouts x 20 turns of 150-250 tokens, one segment per turn,
  contiguous;
* ``single``: 256 rollouts of one 4096-token segment.

Per scenario and distribution, in one run:

* PUT: every segment is PUT as a pre-encoded frame (``RoutingClient.put`` with
  bytes; ``--put-concurrency`` rollouts in flight, each rollout's segments in
  order); service CPU seconds per PUT (``/proc/<pid>/stat`` utime + stime before
  and after), PUTs/s, stored bytes per token (``stat``: frame bytes of the
  rollout's segments, shared ones counted in every rollout);
* GET, best of ``--repeat``, interleaved:
  - raw: redis-py asyncio, ``--raw-concurrency`` rollouts in flight, ``HGETALL`` of
    each rollout hash plus ``HGET <blob> f`` for each shared-segment reference
    (``s:<a>:<b>`` fields holding ``@<blob key>``; the layout of
    ``cache_service/store.py``); bytes only, no decode;
  - ``RoutingClient.get_many`` (one thread, decoded ``Routing`` objects);
  - ``AsyncRoutingClient.get_many`` (its default concurrency);
  the ratio client / raw, and the service's CPU seconds per GB served (GB =
  10^9 bytes of the responses, sized once with ``get_frame``).

Then:

* ``load``: PUT throughput of one service replica, ``--load-clients`` concurrent
  PUTs of fresh ``--load-tokens``-token single-segment skewed rollouts for
  ``--load-seconds`` (PUTs only; ``bench/service_bench.py``'s load mode mixes
  PUTs and GETs);
* multi-turn: bytes shipped over the 20 turns of each agent rollout / the final
  rollout encoded as one frame (``encode_frame`` of the assembled routing), and
  / the rollout as the service returns it (``get_frame``).

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
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
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
    R3Error,
    RoutingClient,
    Segment,
    Timeout,
    encode_frame,
    token_digest,
)
from r3_client.testing import synthetic_routing

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "service"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from _service import KEY_A, Service, start_service  # noqa: E402
from service_bench import _raise_interrupt, machine_info, proc_cpu_s  # noqa: E402

L, E, K = 48, 128, 8
ROWS = 4096  # rows per rollout in grpo and single; the pool arrays' length
PROMPT = 1024
NAMESPACE = "tenant-a"  # KEY_A's namespace in tests/service/_service.py
MODEL = "bench-moe"
DISTS = {"skewed": {"skew": 1.0, "rho": 0.9}, "uniform": {"skew": 0.0, "rho": 0.0}}
TIMEOUT = Timeout(connect=10, read=600)


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


def frame(rows: Rows, start: int, tokens: npt.NDArray[np.int64]) -> bytes:
    """A segment frame for ``rows`` at ``start``, token digest over ``tokens[0:end]``."""
    end = start + rows.shape[0]
    seg = Segment(start, end, MODEL, "v1", token_digest(tokens[:end]))
    return encode_frame(rows, num_experts=E, layer_ids=range(L), segment=seg)


def grpo(dist: str, arrays: list[Rows], groups: int, seed: int) -> Scenario:
    """``groups`` x 16 samples: shared ``[0, 1024)`` prompt + ``[1024, 4096)`` response."""
    rng = np.random.default_rng(seed)
    sc = Scenario("grpo", dist, [])
    for g in range(groups):
        prompt_tokens = rng.integers(0, 150_000, PROMPT)
        prompt_rows = rows_for(arrays, 1000 + g, PROMPT)
        tokens = np.concatenate([prompt_tokens, np.zeros(ROWS - PROMPT, np.int64)])
        prompt_frame = frame(prompt_rows, 0, tokens)  # one digest for the group
        for s in range(16):
            tokens[PROMPT:] = rng.integers(0, 150_000, ROWS - PROMPT)
            resp = rows_for(arrays, g * 16 + s, ROWS - PROMPT)
            rid = f"grpo-{dist}-g{g:02d}-s{s:02d}"
            sc.rollouts.append(Rollout(rid, [prompt_frame, frame(resp, PROMPT, tokens)], ROWS))
            if (g, s) in ((0, 0), (groups - 1, 15)):
                sc.check[rid] = np.concatenate([prompt_rows, resp])
    return sc


def agent(dist: str, arrays: list[Rows], n: int, turns: int, seed: int) -> Scenario:
    """``n`` rollouts of ``turns`` contiguous segments of 150-250 rows each."""
    rng = np.random.default_rng(seed)
    sc = Scenario("agent", dist, [])
    for i in range(n):
        lengths = rng.integers(150, 251, turns)
        total = int(lengths.sum())
        rows = rows_for(arrays, 500 + i, total)
        tokens = rng.integers(0, 150_000, total)
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        frames = [frame(rows[a:b], int(a), tokens) for a, b in itertools.pairwise(bounds)]
        rid = f"agent-{dist}-{i:02d}"
        sc.rollouts.append(Rollout(rid, frames, total, len(frame(rows, 0, tokens))))
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
    """The rollout's Redis hash: ``<prefix>:<namespace>:{<rid>}`` (cache_service/store.py)."""
    return f"{StoreSettings().key_prefix}:{NAMESPACE}:{{{rid}}}"


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


async def raw_read(redis_url: str, ids: Sequence[str], concurrency: int) -> int:
    """Bytes of every rollout hash (``HGETALL``) plus its shared blobs (``HGET <blob> f``)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(r: aioredis.Redis, rid: str) -> int:
        async with sem:
            h = cast("dict[bytes, bytes]", await r.hgetall(rollout_key(rid)))
            if not h:
                raise BenchError(f"raw: {rollout_key(rid)} is missing")
            n = sum(len(v) for v in h.values())
            for f, v in h.items():
                if f.startswith(b"s:") and v[:1] == b"@":
                    blob = await r.hget(v[1:].decode(), "f")
                    if blob is None:
                        raise BenchError(f"raw: blob {v[1:]!r} of {rid} is missing")
                    n += len(blob)
            return n

    async with aioredis.Redis.from_url(redis_url, max_connections=2 * concurrency) as r:
        return sum(await asyncio.gather(*(one(r, rid) for rid in ids)))


def check_result(sc: Scenario, rid: str, idx: npt.NDArray[Any], want_rows: int) -> None:
    if idx.shape != (want_rows, L, K):
        raise BenchError(f"{rid}: shape {idx.shape}, want {(want_rows, L, K)}")
    want = sc.check.get(rid)
    if want is not None and not np.array_equal(np.sort(idx, -1), np.sort(want, -1)):
        raise BenchError(f"{rid}: rows differ from the ones PUT")


def sync_get_many(url: str, sc: Scenario) -> int:
    """``RoutingClient.get_many`` over every rollout; rows read."""
    rows = {ro.rid: ro.rows for ro in sc.rollouts}
    n = 0
    with RoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        for rid, routing in c.get_many(list(rows)):
            if isinstance(routing, R3Error):  # not with return_errors=False; for mypy
                raise routing
            check_result(sc, rid, routing.indices, rows[rid])
            n += routing.indices.shape[0]
    return n


async def async_get_many(url: str, sc: Scenario) -> int:
    """``AsyncRoutingClient.get_many`` (default concurrency) over every rollout; rows read."""
    rows = {ro.rid: ro.rows for ro in sc.rollouts}
    n = 0
    async with AsyncRoutingClient(url, api_key=KEY_A, timeout=TIMEOUT) as c:
        async for rid, routing in c.get_many(list(rows)):
            if isinstance(routing, R3Error):  # not with return_errors=False; for mypy
                raise routing
            check_result(sc, rid, routing.indices, rows[rid])
            n += routing.indices.shape[0]
    return n


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
    variants = [
        Timed("raw", lambda: asyncio.run(raw_read(redis_url, ids, args.raw_concurrency))),
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
    raw, sync_, async_ = variants
    if sync_.result != sc.rows or async_.result != sc.rows:
        raise BenchError(f"{sc.name}/{sc.dist}: read {sync_.result} rows, want {sc.rows}")
    sent = sum(len(f) for ro in sc.rollouts for f in ro.frames)
    return {
        "scenario": sc.name,
        "dist": sc.dist,
        "rollouts": len(ids),
        "rows": sc.rows,
        "puts": sc.puts,
        "put_bytes": sent,
        "put_s": put_s,
        "put_service_cpu_s": put_cpu,
        "shared_segments": shared,
        "dedupe_hits": hits,
        "stored_bytes": stored,
        "served_bytes": served,
        "raw_bytes": raw.result,
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


# ---- report ---------------------------------------------------------------------------------
def put_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | routing | rollouts | PUTs | MB sent | PUT/s | rollouts/s | "
        "service CPU ms/PUT | service CPU ms/rollout | shared (dedupe hits) | stored B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['scenario']} | {r['dist']} | {r['rollouts']} | {r['puts']} "
            f"| {r['put_bytes'] / 1e6:,.1f} | {r['puts'] / r['put_s']:.1f} "
            f"| {r['rollouts'] / r['put_s']:.1f} "
            f"| {r['put_service_cpu_s'] / r['puts'] * 1e3:.1f} "
            f"| {r['put_service_cpu_s'] / r['rollouts'] * 1e3:.1f} "
            f"| {r['shared_segments']} ({r['dedupe_hits']}) "
            f"| {r['stored_bytes'] / r['rows']:.1f} |"
        )
    return "\n".join(out)


def get_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | routing | MB served | MB raw | raw s | client s (sync) | x raw "
        "| client s (async) | x raw | service CPU s/GB (sync / async) | client CPU s (sync) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        rd, gb = r["read"], r["served_bytes"] / 1e9
        raw = rd["raw"]["best_s"]
        out.append(
            f"| {r['scenario']} | {r['dist']} | {r['served_bytes'] / 1e6:,.1f} "
            f"| {r['raw_bytes'] / 1e6:,.1f} | {raw:.3f} "
            f"| {rd['sync']['best_s']:.3f} | {rd['sync']['best_s'] / raw:.2f} "
            f"| {rd['async']['best_s']:.3f} | {rd['async']['best_s'] / raw:.2f} "
            f"| {rd['sync']['service_cpu_s'] / gb:.1f} / {rd['async']['service_cpu_s'] / gb:.1f} "
            f"| {rd['sync']['client_cpu_s']:.2f} |"
        )
    return "\n".join(out)


def turns_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| routing | rollouts | bytes shipped (all turns) | final rollout as one frame | ratio "
        "| as served (`get_frame`) | shipped / served |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["scenario"] != "agent":
            continue
        out.append(
            f"| {r['dist']} | {r['rollouts']} | {r['put_bytes']:,} | {r['one_frame_bytes']:,} "
            f"| {r['put_bytes'] / r['one_frame_bytes']:.3f} | {r['served_bytes']:,} "
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
    flush.close()
    return report


def print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    rows = report["scenarios"]
    print("\n### PUT\n\n" + put_table(rows), flush=True)
    print(
        "\n### GET: the batch read by the client vs raw redis-py (best of "
        f"{args.repeat})\n\n" + get_table(rows),
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
    p.add_argument("--load-tokens", type=int, default=16384, help="tokens per PUT in the load run")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test (< 60 s): --scale 0.0625 --distinct 2 --repeat 1, 1 s load of "
        "2 clients x 2048 tokens",
    )
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.distinct, args.repeat = 0.0625, 2, 1
        args.load_seconds, args.load_clients, args.load_tokens = 1.0, 2, 2048

    signal.signal(signal.SIGTERM, _raise_interrupt)
    info = machine_info()
    print(
        f"machine: Python {info['python']}, {info['cpu_count']} cores (os.cpu_count), "
        f"{info['platform']}, load avg {info['loadavg_at_start'][0]:.2f}, "
        f"redis-server {info['redis_server']} (AOF off), commit {info['git']}",
        flush=True,
    )
    env = {
        "R3_CACHE_MAX_BATCH": "1024",
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    report: dict[str, Any] = {"machine": info, "args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="r3-passthrough-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rp = RedisProcess(free_port(), tmp / "redis", appendonly=False)
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
