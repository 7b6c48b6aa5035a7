"""Lifecycle benchmark (issues 45, 52): a step's rollouts leaving the cache, one by one vs in
batch, on the frames the engine writes.

Starts its own ``redis-server`` (loopback, free port, AOF off) and its own service
(``python -m cache_service serve`` with auth on, as ``tests/support/service_process.py``
starts it, ``R3_CACHE_MAX_BATCH`` at its default 1,024), and stops both by PID at the end,
also on Ctrl-C / SIGTERM.

**The step's frames are the engine's.** They are produced once, before anything is timed,
by the engine's own :class:`sglang_r3.http_server.shipping.Shipper` (no SGLang: its
client is replaced by a recorder that keeps every put — rollout id, frame, ``view``,
``share`` — and answers as the service would), from synthetic Qwen3-30B-A3B rows
(48 MoE layers x 128 experts, top-8, skewed; cut from one run of ``--distinct`` rollout
lengths, so that every rollout's rows share one expert popularity per layer, as a model's
do), weight version ``7``:

* ``--groups`` GRPO groups of ``--group-size`` samples (``share_prompt``): one
  ``--prompt``-token prompt per group (same token ids, same prompt rows), a
  ``--response``-token response per sample; the Shipper cuts the prompt's rows into their
  own segment and (where it says ``share``) asks for it to be shared;
* ``--agents`` two-turn agent rollouts (no ``share_prompt``): turn 1 of
  ``--agent-turn1`` tokens, turn 2 ships only its new rows (``--agent-turn2`` tokens) as a
  continuation frame; on every other agent turn 2 also recomputed the last ``--view-rows``
  rows of turn 1 (a partial radix-cache hit), which the Shipper stores as a view.

Every token carries a digest (the Shipper writes one on every segment). The recorded puts
are then replayed under fresh rollout ids in each phase (untimed, HTTP, 8 rollouts in
flight, each rollout's puts in the Shipper's order) in two **modes**, the same frames in
the same run:

* ``engine``: put as the Shipper put them (``share`` as it asked, where the client can
  say it; else the store's rule);
* ``private`` (the baseline): nothing shared — ``share=False`` when the client has it,
  else through a second service on the same Redis with dedupe off
  (``R3_CACHE_DEDUPE=false``).

Before the timed phases the namespace also holds rollouts that must stay: ``--kept`` with
a newer weight version and ``--unversioned`` with a version that is not an integer, and
another namespace (tenant-b) holds ``--other`` rollouts of the consumed version (small
one-segment frames without token digests: they make no blobs): every drop call walks past
them. Then, for each mode and transport (HTTP, gRPC; ``RoutingClient``, blocking, as a
trainer loop calls it), each phase stores the step (untimed) and removes it:

1. **one by one** (the baseline of the timings): ``client.delete(id)`` for each id;
2. **delete_many**: ``client.delete_many(ids)`` (one request per 1,024 ids);
3. **drop_consumed**: ``client.drop_consumed(version)`` with the service's default bound
   per call (``R3_CACHE_DROP_MAX_ROLLOUTS`` = 4,096 rollout keys examined, 5 s);
4. **drop_consumed, bounded**: the same with ``max_rollouts=--bound``, so the walk takes
   several calls (each resumed from the previous call's cursor).

Per phase: the bytes the step took in Redis (``used_memory`` rise over its puts) and the
blobs it made; wall time, and per call; requests the client made (its transport, wrapped)
and the service counted (``r3_requests``); Redis commands executed (``INFO commandstats``
before and after, ``INFO`` itself excluded: top level, i.e. scripts and ``SCAN`` as the
service sent them, and all, the commands the scripts ran included); for the drops,
rollout keys examined and ``SCAN`` s per call; the bytes the service reported freed
(``Deleted.freed_bytes``, ``DropResult.freed_bytes``, or ``r3_dropped_bytes_total`` for
the one-by-one deletes, whose answer is a bool) against the fall of ``used_memory``, and
that fall against the rise; and the keys left under the namespace's prefix that were not
there before the phase (rollouts, views, blobs: all of them), which must be none. Ratios
of time are each phase's wall time over the one-by-one time of the same mode, transport
and round. Every answer is checked (each id existed, every consumed rollout dropped, the
kept ones and the other namespace untouched); a wrong one exits 1, and so do keys left
unless ``--tolerate-left`` (to measure a store that leaves them: they are then counted
and deleted with raw ``DEL`` before the next phase, untimed).

    python bench/lifecycle_bench.py [--groups 4] [--group-size 16] [--prompt 256]
        [--response 1792] [--agents 16] [--agent-turn1 1024] [--agent-turn2 1024]
        [--view-rows 128] [--rounds 3] [--kept 256] [--unversioned 32] [--other 2048]
        [--bound 64] [--transports http,grpc] [--modes engine,private] [--tolerate-left]
        [--quick] [--json PATH]

Client, service and Redis share the machine's cores: the ratios, not the absolute times,
are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import redis

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    Deleted,
    DropResult,
    PutResult,
    RoutingClient,
    Segment,
    Timeout,
    encode_frame,
    read_header,
)
from r3_client.synthetic import synthetic_routing
from r3_client.wire import GrpcTransport, HTTPTransport
from sglang_r3.config import EngineConfig
from sglang_r3.http_server.shipping import Shipper
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import moe_shape
from sglang_r3.scheduler.row_transport import EngineRows

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "bench", ROOT):  # ROOT: tests.support, before verl's ``tests``
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from service_bench import _raise_interrupt, machine_info, machine_line  # noqa: E402

from tests.support.service_process import (  # noqa: E402
    KEY_A,
    KEY_B,
    METRICS_KEY,
    Service,
    start_service,
)

L, E, K = 48, 128, 8
MODEL = "qwen3-30b-a3b"
SHAPE = moe_shape(
    SimpleNamespace(
        num_hidden_layers=L, num_experts_per_tok=K, num_experts=E, model_type="qwen3_moe"
    )
)
CONSUMED, NEWER, UNVERSIONED = "7", "9", "default"
PREFIX_A = "r3:tenant-a:"
PHASES = ("one_by_one", "delete_many", "drop_consumed", "drop_bounded")
MODES = ("engine", "private")
#: Commands the delete and drop scripts run inside Redis; every other one the service sent
#: itself ("top level": EVALSHA, SCAN, SCRIPT LOAD after a NOSCRIPT, HELLO on a connection).
IN_SCRIPTS = {
    *("del", "unlink", "exists", "type", "persist", "pexpire", "pttl", "memory|usage"),
    *("hdel", "hexists", "hget", "hgetall", "hincrby", "hkeys", "hmget", "hset", "hsetnx"),
}
QUICK = {
    "groups": 1,
    "group_size": 3,
    "prompt": 24,
    "response": 40,
    "agents": 2,
    "agent_turn1": 32,
    "agent_turn2": 32,
    "view_rows": 8,
    "kept": 1,
    "unversioned": 1,
    "other": 2,
    "bound": 2,
    "rounds": 1,
}


class BenchError(Exception):
    """A wrong answer: an id that did not exist, a rollout dropped that should stay, …"""


# ---- the step's frames, as the engine's Shipper writes them ---------------------------------
@dataclass(frozen=True, slots=True)
class Put:
    """One put the Shipper made: the frame, the view it serves, what it said of sharing."""

    frame: bytes
    view: int | None
    share: bool | None  # None: the Shipper did not say (the store's rule decides)


class Recorder:
    """Stands in for the Shipper's ``AsyncRoutingClient``: keeps every put, stores nothing,
    answers as the service would for a new segment."""

    def __init__(self) -> None:
        self.puts: dict[str, list[Put]] = {}

    async def put(
        self,
        rollout_id: str,
        routing: Any,
        *,
        view: int | None = None,
        share: bool | None = None,
        **_: Any,
    ) -> PutResult:
        frame = bytes(routing)
        self.puts.setdefault(rollout_id, []).append(Put(frame, view, share))
        h = read_header(frame, verify=False)
        seg = h.segment or Segment(h.start, h.end, MODEL, CONSUMED)
        return PutResult("stored", rollout_id, seg, len(frame), bool(share), False)


def _pool(n: int, rows: int) -> npt.NDArray[np.uint8]:
    """``n * rows`` skewed rows ``[., L, K]`` of one model (one expert popularity per layer,
    as a real model's prompt and response rows share), to cut every rollout's rows from."""
    return synthetic_routing(n * rows, L, E, K, skew=1.0, rho=0.9, seed=100).astype(np.uint8)


def _cut(pool: npt.NDArray[np.uint8], i: int, n: int) -> npt.NDArray[np.uint8]:
    """``n`` rows of the pool, a different stretch for each ``i``."""
    off = (i * 7919) % max(1, pool.shape[0] - n)
    return pool[off : off + n]


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in rng.integers(0, 150_000, n)]


async def capture(args: argparse.Namespace) -> tuple[dict[str, list[Put]], dict[str, Any]]:
    """Ship the step through the engine's Shipper once: every put it made, by rollout."""
    t0 = time.perf_counter()
    longest = max(args.prompt + args.response, args.agent_turn1 + args.agent_turn2)
    pool = _pool(args.distinct, longest + 1)
    shipper = Shipper(EngineConfig(routing_cache="http://127.0.0.1:9", api_key=KEY_A), SHAPE, MODEL)
    await shipper.client.aclose()
    rec = Recorder()
    shipper.client = rec  # type: ignore[assignment]
    kinds: dict[str, str] = {}
    refs: list[dict[str, Any]] = []

    async def ship(rid: str, share: bool, start: int, routing: EngineRows, p: Any, o: Any) -> None:
        tag = OutputTag(0, 0, rid, CONSUMED, False, share)
        ref = await shipper.ship(tag, start, routing, p, o, {})
        if not ref["stored"]:
            raise BenchError(f"the Shipper did not store {rid}: {ref}")
        refs.append(ref)

    for g in range(args.groups):
        rng = np.random.default_rng(g)
        prompt_ids = _ids(rng, args.prompt)
        prompt_rows = _cut(pool, g, args.prompt)
        for s in range(args.group_size):
            rid = f"g{g:03d}-s{s:02d}"
            kinds[rid] = "grpo"
            resp = _cut(pool, 1000 + g * args.group_size + s, args.response - 1)
            rows = np.concatenate([prompt_rows, resp])  # one row per token but the last
            await ship(rid, True, 0, EngineRows(rows), prompt_ids, _ids(rng, args.response))
    t1, t2 = args.agent_turn1, args.agent_turn2
    for a in range(args.agents):
        rng = np.random.default_rng(10_000 + a)
        rid = f"a{a:03d}"
        rows = _cut(pool, 5000 + a, t1 + t2 - 1)
        turn1 = _ids(rng, t1)
        p1 = t1 // 2
        await ship(rid, False, 0, EngineRows(rows[: t1 - 1]), turn1[:p1], turn1[p1:])
        turn2 = _ids(rng, t2)
        p2 = t2 // 4  # the tool's answer, then the model's next output
        start, end = t1 - 1, t1 + t2 - 1
        if args.view_rows and a % 2 == 1:
            # a partial radix hit: turn 2 recomputed turn 1's last rows, differently
            first = start - args.view_rows
            again = _cut(pool, 9000 + a, args.view_rows)
            routing = EngineRows(np.concatenate([again, rows[start:end]]), first, (first,))
            kinds[rid] = "agent+view"
        else:
            routing = EngineRows(rows[start:end])
            kinds[rid] = "agent"
        await ship(rid, False, start, routing, turn1 + turn2[:p2], turn2[p2:])
    puts = rec.puts
    flags = Counter(
        f"{kinds[rid]}:{'view' if p.view is not None else f'share={p.share}'}"
        for rid, ps in puts.items()
        for p in ps
    )
    nbytes = sum(len(p.frame) for ps in puts.values() for p in ps)
    tokens = args.groups * args.group_size * (args.prompt + args.response) + args.agents * (t1 + t2)
    info = {
        "rollouts": len(puts),
        "by_kind": dict(Counter(kinds.values())),
        "puts": sum(len(ps) for ps in puts.values()),
        "puts_by_kind_and_share": dict(sorted(flags.items())),
        "views": sum(1 for ps in puts.values() for p in ps if p.view is not None),
        "frame_bytes": nbytes,
        "tokens": tokens,
        "frame_bytes_per_token": nbytes / tokens,
        "capture_s": time.perf_counter() - t0,
    }
    return puts, info


def client_says_share() -> bool:
    """Whether ``RoutingClient.put`` takes ``share`` (issue 52's client)."""
    return "share" in inspect.signature(RoutingClient.put).parameters


def put_step(
    client: RoutingClient,
    step: Mapping[str, list[Put]],
    share: Callable[[Put], bool | None],
    concurrency: int = 8,
) -> int:
    """Put every rollout's recorded frames in order (rollouts ``concurrency`` at a time);
    the blobs reused (``dedupe_hit``)."""

    def one(item: tuple[str, list[Put]]) -> int:
        rid, puts = item
        hits = 0
        for p in puts:
            kw: dict[str, Any] = {}
            if p.view is not None:
                kw["view"] = p.view
            elif (s := share(p)) is not None:
                kw["share"] = s
            res = client.put(rid, p.frame, **kw)
            hits += int(res.dedupe_hit)
        return hits

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, step.items()))


def make_frames(n: int, tokens: int, version: str) -> list[bytes]:
    """``n`` distinct one-segment frames of ``tokens`` skewed rows under weight ``version``,
    without a token digest (never shared): the rollouts that must stay."""
    return [
        encode_frame(
            synthetic_routing(tokens, L, E, K, skew=1.0, rho=0.9, seed=i),
            num_experts=E,
            layer_ids=range(L),
            segment=Segment(0, tokens, MODEL, version),
        )
        for i in range(n)
    ]


def put_all(http: httpx.Client, frames: dict[str, bytes], concurrency: int = 8) -> None:
    """PUT every ``rollout id -> frame`` over HTTP (setup, untimed)."""

    def one(item: tuple[str, bytes]) -> None:
        rid, frame = item
        r = http.put(
            f"/v1/rollouts/{rid}/segments",
            content=frame,
            headers={"content-type": "application/x-r3-frame"},
        )
        if r.status_code != 201:
            raise BenchError(f"PUT {rid}: {r.status_code} {r.text[:300]}")

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, frames.items()))


# ---- what each phase is measured with -------------------------------------------------------
@dataclass
class CallLog:
    """Every call the client's transport made: op -> seconds, and each drop step's answer."""

    times: dict[str, list[float]] = field(default_factory=dict)
    drops: list[dict[str, Any]] = field(default_factory=list)

    def clear(self) -> None:
        self.times.clear()
        self.drops.clear()


def _timed(fn: Callable[..., Any], op: str, log: CallLog) -> Callable[..., Any]:
    def timed(*a: Any) -> Any:
        t0 = time.perf_counter()
        res = fn(*a)
        log.times.setdefault(op, []).append(time.perf_counter() - t0)
        if op == "drop_consumed":
            log.drops.append(dict(res))
        return res

    return timed


def instrumented(url: str, log: CallLog) -> RoutingClient:
    """A ``RoutingClient`` whose transport's delete, delete_many and drop_consumed are
    timed one request at a time (the client's retries and loops stay the client's)."""
    cls = GrpcTransport if url.startswith("grpc") else HTTPTransport
    t = cls(url, api_key=KEY_A, timeout=Timeout())
    for op in ("delete", "delete_many", "drop_consumed"):
        setattr(t, op, _timed(getattr(t, op), op, log))
    return RoutingClient(transport=t)


def redis_state(r: redis.Redis) -> tuple[int, dict[str, int], dict[str, int]]:
    """``used_memory``, and calls and microseconds per command (``INFO`` excluded) so far."""
    used = int(r.info("memory")["used_memory"])
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for name, st in r.info("commandstats").items():
        cmd = str(name).removeprefix("cmdstat_").lower()
        if cmd != "info" and isinstance(st, dict):
            calls[cmd] = int(st["calls"])
            usec[cmd] = int(st["usec"])
    return used, calls, usec


def keys_a(r: redis.Redis) -> set[bytes]:
    """Every key under tenant-a's prefix: rollouts, views, blobs."""
    return set(r.scan_iter(match=PREFIX_A + "*", count=1000))


def _keys(c: Mapping[str, int]) -> str:
    """``{'rollouts': 5, 'blobs': 3}`` as ``5 rollouts, 3 blobs`` (a fixed order)."""
    return ", ".join(f"{c[k]} {k}" for k in ("rollouts", "views", "blobs") if c.get(k))


def kind_of(key: bytes) -> str:
    k = key.decode()
    if k.startswith(PREFIX_A + "blob:"):
        return "blobs"
    return "views" if ":v:" in k.rsplit("}", 1)[-1] else "rollouts"


def scrape(http_url: str) -> dict[tuple[str, str], float]:
    """The service's lifecycle counters: (series, label) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(
        f"{http_url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30
    ).text
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "r3_requests_total" and s.labels["op"] not in ("metrics", "put"):
                key = ("requests", f"{s.labels['transport']}:{s.labels['op']}")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in ("r3_dropped_bytes_total", "r3_rollouts_dropped_total"):
                out[(s.name, s.labels["how"])] = s.value
    return out


def _delta(a: Mapping[Any, float], b: Mapping[Any, float]) -> dict[Any, float]:
    return {k: v - a.get(k, 0) for k, v in b.items() if v != a.get(k, 0)}


# ---- one phase ------------------------------------------------------------------------------
@dataclass
class Mode:
    """How a mode puts the step, and the service its calls go to."""

    name: str
    svc: Service
    share: Callable[[Put], bool | None]
    putter: RoutingClient
    clients: dict[str, RoutingClient]
    logs: dict[str, CallLog]


def run_phase(
    phase: str,
    transport: str,
    mode: Mode,
    step: Mapping[str, list[Put]],
    r: redis.Redis,
    base: set[bytes],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Store ``step`` as ``mode`` puts it, remove it by ``phase``; what it took, checked."""
    client, log, svc = mode.clients[transport], mode.logs[transport], mode.svc
    ids = list(step)
    used_before = int(r.info("memory")["used_memory"])
    hits = put_step(mode.putter, step, mode.share)
    stored_keys = keys_a(r) - base
    made = Counter(kind_of(k) for k in stored_keys)
    log.clear()
    m0 = scrape(svc.http_url)
    used0, calls0, usec0 = redis_state(r)
    t0 = time.perf_counter()
    drop: DropResult | None = None
    answers: list[Deleted] = []
    if phase == "one_by_one":
        existed = [client.delete(rid) for rid in ids]
    elif phase == "delete_many":
        answers = client.delete_many(ids)
        existed = [d.existed for d in answers]
    else:
        bound = args.bound if phase == "drop_bounded" else None
        drop = client.drop_consumed(int(CONSUMED), max_rollouts=bound)
        existed = []
    wall = time.perf_counter() - t0
    used1, calls1, usec1 = redis_state(r)
    m1 = scrape(svc.http_url)
    metrics = _delta(m0, m1)
    calls = _delta(calls0, calls1)
    usec = _delta(usec0, usec1)
    op = {"one_by_one": "delete", "delete_many": "delete_many"}.get(phase, "drop_consumed")
    times = log.times.get(op, [])
    how = {"one_by_one": "delete", "delete_many": "batch_delete"}.get(phase, "drop_version")
    tag = f"{mode.name} {transport} {phase}"
    if drop is None:
        if not all(existed) or len(existed) != len(ids):
            raise BenchError(f"{tag}: {existed.count(False)} ids did not exist")
        reported: float | None = (
            sum(d.freed_bytes or 0 for d in answers)
            if answers
            else metrics.get(("r3_dropped_bytes_total", how), 0.0)
        )
    else:
        want = (len(ids), args.kept, args.unversioned)
        got = (drop.dropped, drop.kept_newer, drop.kept_unversioned)
        if got != want or not drop.done:
            raise BenchError(f"{tag}: dropped/kept newer/unversioned {got}, {want}")
        reported = drop.freed_bytes
    left_keys = keys_a(r) - base
    left = Counter(kind_of(k) for k in left_keys)
    if left_keys:
        if left["rollouts"] or left["views"] or not args.tolerate_left:
            raise BenchError(f"{tag}: keys left under {PREFIX_A}*: {dict(left)}")
        r.delete(*left_keys)  # what the store left: gone before the next phase (untimed)
    top = {c: int(n) for c, n in calls.items() if c not in IN_SCRIPTS}
    requests_svc = sum(v for (s, _), v in metrics.items() if s == "requests")
    return {
        "mode": mode.name,
        "phase": phase,
        "transport": transport,
        "rollouts": len(ids),
        "stored_bytes": used0 - used_before,
        "stored_keys": dict(made),
        "dedupe_hits": hits,
        "wall_s": wall,
        "requests_client": len(times),
        "requests_service": int(requests_svc),
        "largest_call_s": max(times) if times else math.nan,
        "median_call_s": statistics.median(times) if times else math.nan,
        "redis_commands_top": sum(top.values()),
        "redis_commands_all": int(sum(calls.values())),
        "redis_commands": {c: int(n) for c, n in sorted(calls.items())},
        # Redis's own time in the commands the service sent (a script's includes its body)
        "redis_busy_s": sum(n for c, n in usec.items() if c not in IN_SCRIPTS) / 1e6,
        "redis_usec_per_script": (
            usec.get("evalsha", 0) / calls["evalsha"] if calls.get("evalsha") else math.nan
        ),
        "drop_steps": [
            {k: s[k] for k in ("examined", "dropped", "kept_newer", "cursor")} for s in log.drops
        ],
        "scans": int(calls.get("scan", 0)),
        "freed_reported": reported,
        "used_memory_fall": used0 - used1,
        "keys_left": dict(left),
        "keys_left_total": len(left_keys),
    }


# ---- the run --------------------------------------------------------------------------------
def run(
    svcs: dict[str, Service],
    rds: RedisProcess,
    step: dict[str, list[Put]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every round, mode, transport and phase; the JSON report."""
    t0 = time.perf_counter()
    frames = {
        v: make_frames(args.distinct, args.ballast_tokens, v)
        for v in (NEWER, UNVERSIONED, CONSUMED)
    }

    def batch(prefix: str, n: int, version: str) -> dict[str, bytes]:
        fs = frames[version]
        return {f"{prefix}-{i:05d}": fs[i % len(fs)] for i in range(n)}

    r = redis.Redis.from_url(rds.url)
    transports = [t for t in args.transports.split(",") if t]
    modes_wanted = [m for m in args.modes.split(",") if m]
    says = client_says_share()
    keep_a = batch("keep-newer", args.kept, NEWER) | batch(
        "keep-unv", args.unversioned, UNVERSIONED
    )
    other = batch("other", args.other, CONSUMED)
    rows: list[dict[str, Any]] = []
    main = svcs["engine"]
    with (
        httpx.Client(base_url=main.http_url, headers={"Authorization": f"Bearer {KEY_A}"}) as ha,
        httpx.Client(base_url=main.http_url, headers={"Authorization": f"Bearer {KEY_B}"}) as hb,
    ):
        put_all(ha, keep_a)
        put_all(hb, other)
    base = keys_a(r)
    base_keys = int(r.dbsize())
    print(
        f"kept in tenant-a: {args.kept} newer (v{NEWER}) + {args.unversioned} unversioned; "
        f"tenant-b: {args.other} (v{CONSUMED}); Redis holds {base_keys:,} keys "
        f"({time.perf_counter() - t0:.1f} s)\n",
        flush=True,
    )

    def engine_share(p: Put) -> bool | None:
        return p.share if says else None

    def private_share(p: Put) -> bool | None:
        return False if says else None

    urls = {"http": "http_url", "grpc": "grpc_url"}
    modes: list[Mode] = []
    for name in modes_wanted:
        svc = svcs["private"] if name == "private" and not says else main
        logs = {t: CallLog() for t in transports}
        modes.append(
            Mode(
                name,
                svc,
                engine_share if name == "engine" else private_share,
                RoutingClient(svc.http_url, api_key=KEY_A, timeout=Timeout(read=60.0)),
                {t: instrumented(getattr(svc, urls[t]), logs[t]) for t in transports},
                logs,
            )
        )
    ids = list(step)
    warm = {rid: step[rid] for rid in ids[: min(16, len(ids))]}
    try:
        for m in modes:  # warm-up (connections, script loads), not reported
            for tr in transports:
                for phase in PHASES:
                    sub = {f"bench-warmup-{m.name}-{phase}-{tr}-{k}": v for k, v in warm.items()}
                    run_phase(phase, tr, m, sub, r, base, args)
        for rnd in range(args.rounds):
            for m in modes if rnd % 2 == 0 else modes[::-1]:
                for tr in transports if rnd % 2 == 0 else transports[::-1]:
                    for phase in PHASES:
                        sub = {f"bench-{m.name}-{phase}-{rnd}-{tr}-{k}": v for k, v in step.items()}
                        row = run_phase(phase, tr, m, sub, r, base, args)
                        row["round"] = rnd
                        rows.append(row)
                        rep, fall = row["freed_reported"], row["used_memory_fall"]
                        print(
                            f"round {rnd} {m.name:7} {tr:4} {phase:13} {row['wall_s']:7.3f} s  "
                            f"{row['requests_client']:5} requests  stored "
                            f"{row['stored_bytes'] / 1e6:7.2f} MB, fell {fall / 1e6:7.2f} MB, "
                            f"reported {(rep or 0) / 1e6:7.2f} MB; "
                            f"{row['keys_left_total']} keys left {_keys(row['keys_left'])}",
                            flush=True,
                        )
    finally:
        for m in modes:
            m.putter.close()
            for c in m.clients.values():
                c.close()
    # what had to stay did
    a_left = sum(1 for _ in r.scan_iter(match=PREFIX_A + "{keep-*}", count=1000))
    b_left = sum(1 for _ in r.scan_iter(match="r3:tenant-b:{other-*}", count=1000))
    if (a_left, b_left) != (len(keep_a), len(other)):
        raise BenchError(
            f"kept rollouts: tenant-a {a_left} of {len(keep_a)}, tenant-b {b_left} of {len(other)}"
        )
    r.close()
    return {
        "client_says_share": says,
        "private_via": "share=False" if says else "a second service with R3_CACHE_DEDUPE=false",
        "redis_keys_besides": base_keys,
        "rows": rows,
        "summary": summarize(rows, [m.name for m in modes], transports),
    }


def summarize(
    rows: Sequence[dict[str, Any]], modes: Sequence[str], transports: Sequence[str]
) -> list[dict[str, Any]]:
    """Per (mode, transport, phase): medians over rounds, ratios to one-by-one of the same
    mode, transport and round."""
    out = []
    for mode in modes:
        for tr in transports:
            mine_tr = [x for x in rows if x["mode"] == mode and x["transport"] == tr]
            base = {x["round"]: x["wall_s"] for x in mine_tr if x["phase"] == PHASES[0]}
            for phase in PHASES:
                mine = [x for x in mine_tr if x["phase"] == phase]
                last = mine[-1]
                steps = last["drop_steps"]
                reported = [x["freed_reported"] for x in mine]
                med = statistics.median
                out.append(
                    {
                        "mode": mode,
                        "transport": tr,
                        "phase": phase,
                        "rollouts": last["rollouts"],
                        "stored_bytes_median": med(x["stored_bytes"] for x in mine),
                        "stored_keys": last["stored_keys"],
                        "wall_s_median": med(x["wall_s"] for x in mine),
                        "x_one_by_one_median": med(x["wall_s"] / base[x["round"]] for x in mine),
                        "median_call_s": med(x["median_call_s"] for x in mine),
                        "requests_client": last["requests_client"],
                        "requests_service": last["requests_service"],
                        "redis_commands_top": last["redis_commands_top"],
                        "redis_commands_all": last["redis_commands_all"],
                        "redis_busy_s_median": med(x["redis_busy_s"] for x in mine),
                        "redis_usec_per_script_median": med(
                            x["redis_usec_per_script"] for x in mine
                        ),
                        "largest_call_s": max(x["largest_call_s"] for x in mine),
                        "examined_per_call_max": max((s["examined"] for s in steps), default=None),
                        "scans_per_call": last["scans"] / len(steps) if steps else None,
                        "freed_reported_median": (med(reported) if None not in reported else None),
                        "used_memory_fall_median": med(x["used_memory_fall"] for x in mine),
                        "fall_over_stored_median": med(
                            x["used_memory_fall"] / x["stored_bytes"] for x in mine
                        ),
                        "keys_left_max": max(x["keys_left_total"] for x in mine),
                        "keys_left": last["keys_left"],
                    }
                )
    return out


def table(res: dict[str, Any], args: argparse.Namespace) -> str:
    """Markdown tables of the summary: time, then memory."""
    names = {
        "one_by_one": "`delete(id)` each (baseline)",
        "delete_many": "`delete_many(ids)`",
        "drop_consumed": "`drop_consumed(v)`",
        "drop_bounded": f"`drop_consumed(v, max_rollouts={args.bound})`",
    }
    st = res["step"]
    lines = [
        f"{st['rollouts']:,} engine-shipped rollouts a step ({st['by_kind']}; {st['puts']:,} "
        f"puts, {st['views']} views; {st['frame_bytes'] / 1e6:.2f} MB of frames, "
        f"{st['frame_bytes_per_token']:.1f} B/token; Shipper puts: "
        f"{st['puts_by_kind_and_share']}); client says share: {res['client_says_share']} "
        f"(private via {res['private_via']}); besides them Redis holds "
        f"{res['redis_keys_besides']:,} keys. Medians of {args.rounds} round(s); ratio = time "
        "/ one-by-one time of the same mode, transport and round.",
        "",
        "| mode | transport | how | wall s | x one-by-one | per call ms (median / largest) "
        "| requests (client / service) | Redis commands top / all "
        "| Redis busy ms (µs per script) | keys examined per call, max | SCANs per call |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["summary"]:
        ex = s["examined_per_call_max"]
        sc = s["scans_per_call"]
        lines.append(
            f"| {s['mode']} | {s['transport']} | {names[s['phase']]} | {s['wall_s_median']:.3f} | "
            f"{s['x_one_by_one_median']:.3f} | {s['median_call_s'] * 1e3:.2f} / "
            f"{s['largest_call_s'] * 1e3:.1f} | {s['requests_client']:,} / "
            f"{s['requests_service']:,} | {s['redis_commands_top']:,} / "
            f"{s['redis_commands_all']:,} | {s['redis_busy_s_median'] * 1e3:.1f} "
            f"({s['redis_usec_per_script_median']:.0f}) | "
            f"{'—' if ex is None else f'{ex:,}'} | {'—' if sc is None else f'{sc:.1f}'} |"
        )
    lines += [
        "",
        "| mode | transport | how | stored MB (keys made) | used_memory fall MB | fall / stored "
        "| freed reported MB | reported / fall | keys left after (max) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["summary"]:
        rep, fall, stored = (
            s["freed_reported_median"],
            s["used_memory_fall_median"],
            s["stored_bytes_median"],
        )
        ratio = f"{rep / fall:.3f}" if rep is not None and fall > 0 else "—"
        left = f"{s['keys_left_max']}" + (f" ({_keys(s['keys_left'])})" if s["keys_left"] else "")
        lines.append(
            f"| {s['mode']} | {s['transport']} | {names[s['phase']]} | {stored / 1e6:.2f} "
            f"({_keys(s['stored_keys'])}) | {fall / 1e6:.2f} | "
            f"{s['fall_over_stored_median']:.3f} | "
            f"{'—' if rep is None else f'{rep / 1e6:.2f}'} | {ratio} | "
            f"{left} |"
        )
    by_mode = {
        m: statistics.median(s["stored_bytes_median"] for s in res["summary"] if s["mode"] == m)
        for m in {s["mode"] for s in res["summary"]}
    }
    if {"engine", "private"} <= set(by_mode):
        lines += [
            "",
            f"stored a step: engine {by_mode['engine'] / 1e6:.2f} MB, private "
            f"{by_mode['private'] / 1e6:.2f} MB: prompt sharing saves "
            f"{1 - by_mode['engine'] / by_mode['private']:.1%}",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, capture the step, start Redis and the service(s), run, stop them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=4, help="GRPO groups a step")
    p.add_argument("--group-size", type=int, default=16, help="samples per GRPO group")
    p.add_argument("--prompt", type=int, default=256, help="GRPO prompt tokens")
    p.add_argument("--response", type=int, default=1792, help="GRPO response tokens")
    p.add_argument("--agents", type=int, default=16, help="two-turn agent rollouts a step")
    p.add_argument("--agent-turn1", type=int, default=1024, help="agent turn 1 tokens")
    p.add_argument("--agent-turn2", type=int, default=1024, help="agent turn 2's new tokens")
    p.add_argument(
        "--view-rows", type=int, default=128, help="rows every other agent's turn 2 recomputed"
    )
    p.add_argument("--distinct", type=int, default=4, help="rollout lengths of rows generated, cut")
    p.add_argument("--kept", type=int, default=256, help="tenant-a rollouts of a newer version")
    p.add_argument(
        "--unversioned", type=int, default=32, help="tenant-a rollouts, version 'default'"
    )
    p.add_argument("--other", type=int, default=2048, help="tenant-b rollouts (consumed version)")
    p.add_argument("--ballast-tokens", type=int, default=64, help="tokens of those rollouts")
    p.add_argument("--bound", type=int, default=64, help="max_rollouts of the bounded drop")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument("--transports", default="http,grpc", help="comma list of http, grpc")
    p.add_argument("--modes", default="engine,private", help="comma list of engine, private")
    p.add_argument(
        "--tolerate-left",
        action="store_true",
        help="count blobs left after a removal (then DEL them) instead of failing",
    )
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (tests)")
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.distinct = 1

    signal.signal(signal.SIGTERM, _raise_interrupt)
    info = machine_info()
    print(machine_line(info), flush=True)
    step, step_info = asyncio.run(capture(args))
    print(
        f"captured {step_info['rollouts']} rollouts through the Shipper in "
        f"{step_info['capture_s']:.1f} s: {step_info['puts']} puts, "
        f"{step_info['frame_bytes'] / 1e6:.2f} MB ({step_info['frame_bytes_per_token']:.1f} "
        f"B/token); {step_info['puts_by_kind_and_share']}",
        flush=True,
    )
    env = {"R3_CACHE_MAX_BATCH": "1024"}  # the default (the test harness sets 64)
    report: dict[str, Any] = {
        "machine": info,
        "args": vars(args) | {"json": str(args.json)},
        "step": step_info,
    }
    with tempfile.TemporaryDirectory(prefix="r3-lifecycle-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rds = RedisProcess(free_port(), tmp / "redis", appendonly=False)
        svcs: dict[str, Service] = {}
        try:
            rds.start()
            for name in ("engine", "private"):
                (tmp / name).mkdir()
            svcs["engine"] = start_service(tmp / "engine", rds.url, env=env)
            if "private" in args.modes and not client_says_share():
                svcs["private"] = start_service(
                    tmp / "private", rds.url, env=env | {"R3_CACHE_DEDUPE": "false"}
                )
            report.update(run(svcs, rds, step, args))
        except KeyboardInterrupt:
            print("interrupted: stopping the service and redis-server", file=sys.stderr)
            return 130
        except BenchError as exc:
            print(f"FAIL: {exc}", file=sys.stderr)
            return 1
        finally:
            for svc in svcs.values():
                svc.stop()
            rds.stop()
    print("\n" + table(report, args) + "\n", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
