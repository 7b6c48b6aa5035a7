"""Lifecycle benchmark (issue 45): a step's rollouts leaving the cache, one by one vs in batch.

Starts its own ``redis-server`` (loopback, free port, AOF off) and its own service
(``python -m cache_service serve`` with auth on, as ``tests/support/service_process.py``
starts it, ``R3_CACHE_MAX_BATCH`` at its default 1,024), and stops both by PID at the end,
also on Ctrl-C / SIGTERM.

Each rollout is one small realistic segment: ``--tokens`` rows of 48 MoE layers x 128
experts, top-8 (skewed synthetic routing), computed under an integer weight version.
Only ``--distinct`` arrays are generated and reused under different rollout ids (no token
digest: nothing is deduplicated, every rollout holds its own bytes).  Before the timed
phases the namespace also holds rollouts that must stay: ``--kept`` with a newer weight
version and ``--unversioned`` with a version that is not an integer, and another
namespace (tenant-b) holds ``--other`` rollouts of the consumed version: every drop call
walks past them.  Then, for each transport (HTTP, gRPC; ``RoutingClient``, blocking, as a
trainer loop calls it), each phase stores ``--rollouts`` fresh rollouts (untimed, HTTP,
8 in flight) and removes them:

1. **one by one** (the baseline): ``client.delete(id)`` for each id, sequentially;
2. **delete_many**: ``client.delete_many(ids)`` (one request per 1,024 ids);
3. **drop_consumed**: ``client.drop_consumed(version)`` with the service's default bound
   per call (``R3_CACHE_DROP_MAX_ROLLOUTS`` = 4,096 rollout keys examined, 5 s);
4. **drop_consumed, bounded**: the same with ``max_rollouts=--bound``, so the walk takes
   several calls (each resumed from the previous call's cursor).

Per phase: wall time; requests the client made (its transport, wrapped) and the service
counted (``r3_requests``); Redis commands executed (``INFO commandstats`` before and
after, ``INFO`` itself excluded: top level, i.e. scripts and ``SCAN`` as the service sent
them, and all, the commands the scripts ran included); the largest single call; for the
drops, rollout keys examined and ``SCAN`` s per call; and the bytes the service reported
freed (``Deleted.freed_bytes``, ``DropResult.freed_bytes``, or ``r3_dropped_bytes_total``
for the one-by-one deletes, whose answer is a bool) against the fall of Redis's
``used_memory``.  Ratios are each phase's wall time over the one-by-one time of the same
transport and round.  Every answer is checked (each id existed, every consumed rollout
dropped, the kept ones and the other namespace untouched); a wrong one exits 1.

    python bench/lifecycle_bench.py [--rollouts 2048] [--tokens 256] [--rounds 3]
        [--kept 256] [--unversioned 32] [--other 2048] [--bound 512]
        [--transports http,grpc] [--json PATH]

Client, service and Redis share the machine's cores: the ratios, not the absolute times,
are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import Deleted, DropResult, RoutingClient, Segment, Timeout, encode_frame
from r3_client.synthetic import synthetic_routing
from r3_client.wire import GrpcTransport, HTTPTransport

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
CONSUMED, NEWER, UNVERSIONED = "7", "9", "default"
FRAME_TYPE = "application/x-r3-frame"
PHASES = ("one_by_one", "delete_many", "drop_consumed", "drop_bounded")
#: Commands the delete and drop scripts run inside Redis; every other one the service sent
#: itself ("top level": EVALSHA, SCAN, SCRIPT LOAD after a NOSCRIPT, HELLO on a connection).
IN_SCRIPTS = {"del", "unlink", "hkeys", "hget", "hgetall", "hmget", "memory|usage", "exists"}


class BenchError(Exception):
    """A wrong answer: an id that did not exist, a rollout dropped that should stay, …"""


# ---- data -----------------------------------------------------------------------------------
def make_frames(n: int, tokens: int, version: str) -> list[bytes]:
    """``n`` distinct one-segment frames of ``tokens`` skewed rows under weight ``version``."""
    return [
        encode_frame(
            synthetic_routing(tokens, L, E, K, skew=1.0, rho=0.9, seed=i),
            num_experts=E,
            layer_ids=range(L),
            segment=Segment(0, tokens, "qwen3-30b-a3b", version),
        )
        for i in range(n)
    ]


def put_all(http: httpx.Client, frames: dict[str, bytes], concurrency: int = 8) -> None:
    """PUT every ``rollout id -> frame`` over HTTP (setup, untimed)."""

    def one(item: tuple[str, bytes]) -> None:
        rid, frame = item
        r = http.put(
            f"/v1/rollouts/{rid}/segments", content=frame, headers={"content-type": FRAME_TYPE}
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


def scrape(http_url: str) -> dict[tuple[str, str], float]:
    """The service's lifecycle counters: (series, label) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(
        f"{http_url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30
    ).text
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "r3_requests_total" and s.labels["op"] != "metrics":
                key = ("requests", f"{s.labels['transport']}:{s.labels['op']}")
                out[key] = out.get(key, 0.0) + s.value
            elif s.name in ("r3_dropped_bytes_total", "r3_rollouts_dropped_total"):
                out[(s.name, s.labels["how"])] = s.value
    return out


def _delta(a: Mapping[Any, float], b: Mapping[Any, float]) -> dict[Any, float]:
    return {k: v - a.get(k, 0) for k, v in b.items() if v != a.get(k, 0)}


# ---- one phase ------------------------------------------------------------------------------
def run_phase(
    phase: str,
    transport: str,
    client: RoutingClient,
    log: CallLog,
    ids: list[str],
    r: redis.Redis,
    svc: Service,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Remove ``ids`` (stored) by ``phase``; what it took, checked."""
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
    if drop is None:
        if not all(existed) or len(existed) != len(ids):
            raise BenchError(f"{transport} {phase}: {existed.count(False)} ids did not exist")
        reported: float | None = (
            sum(d.freed_bytes or 0 for d in answers)
            if answers
            else metrics.get(("r3_dropped_bytes_total", how), 0.0)
        )
    else:
        want = (len(ids), args.kept, args.unversioned)
        got = (drop.dropped, drop.kept_newer, drop.kept_unversioned)
        if got != want or not drop.done:
            raise BenchError(f"{transport} {phase}: dropped/kept newer/unversioned {got}, {want}")
        reported = drop.freed_bytes
    left = sum(1 for _ in r.scan_iter(match="r3:tenant-a:{bench-*}", count=1000))
    if left:
        raise BenchError(f"{transport} {phase}: {left} rollouts still stored")
    top = {c: int(n) for c, n in calls.items() if c not in IN_SCRIPTS}
    requests_svc = sum(v for (s, _), v in metrics.items() if s == "requests")
    return {
        "phase": phase,
        "transport": transport,
        "rollouts": len(ids),
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
    }


# ---- the run --------------------------------------------------------------------------------
def run(svc: Service, rds: RedisProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Every round, transport and phase; the JSON report."""
    t0 = time.perf_counter()
    frames = {v: make_frames(args.distinct, args.tokens, v) for v in (CONSUMED, NEWER, UNVERSIONED)}
    sizes = [len(f) for f in frames[CONSUMED]]
    print(
        f"generated {args.distinct} arrays x 3 weight versions in "
        f"{time.perf_counter() - t0:.1f} s; frames {min(sizes):,}-{max(sizes):,} B",
        flush=True,
    )

    def batch(prefix: str, n: int, version: str) -> dict[str, bytes]:
        fs = frames[version]
        return {f"{prefix}-{i:05d}": fs[i % len(fs)] for i in range(n)}

    r = redis.Redis.from_url(rds.url)
    transports = [t for t in args.transports.split(",") if t]
    keep_a = batch("keep-newer", args.kept, NEWER) | batch(
        "keep-unv", args.unversioned, UNVERSIONED
    )
    other = batch("other", args.other, CONSUMED)
    rows: list[dict[str, Any]] = []
    with (
        httpx.Client(base_url=svc.http_url, headers={"Authorization": f"Bearer {KEY_A}"}) as ha,
        httpx.Client(base_url=svc.http_url, headers={"Authorization": f"Bearer {KEY_B}"}) as hb,
    ):
        put_all(ha, keep_a)
        put_all(hb, other)
        base_keys = int(r.dbsize())
        print(
            f"kept in tenant-a: {args.kept} newer (v{NEWER}) + {args.unversioned} unversioned; "
            f"tenant-b: {args.other} (v{CONSUMED}); Redis holds {base_keys:,} keys\n",
            flush=True,
        )
        logs = {t: CallLog() for t in transports}
        urls = {"http": svc.http_url, "grpc": svc.grpc_url}
        clients = {t: instrumented(urls[t], logs[t]) for t in transports}
        try:
            for tr in transports:  # warm-up (connections, script loads), not reported
                for phase in PHASES:
                    stored = batch(f"bench-warmup-{phase}-{tr}", min(16, args.rollouts), CONSUMED)
                    put_all(ha, stored)
                    run_phase(phase, tr, clients[tr], logs[tr], list(stored), r, svc, args)
            for rnd in range(args.rounds):
                order = transports if rnd % 2 == 0 else transports[::-1]
                for tr in order:
                    for phase in PHASES:
                        stored = batch(f"bench-{phase}-{rnd}-{tr}", args.rollouts, CONSUMED)
                        put_all(ha, stored)
                        row = run_phase(
                            phase, tr, clients[tr], logs[tr], list(stored), r, svc, args
                        )
                        row["round"] = rnd
                        rows.append(row)
                        print(
                            f"round {rnd} {tr:4} {phase:13} {row['wall_s']:7.3f} s  "
                            f"{row['requests_client']:5} requests  "
                            f"{row['redis_commands_top']:6} Redis commands (top level)",
                            flush=True,
                        )
        finally:
            for c in clients.values():
                c.close()
    # what had to stay did
    a_left = sum(1 for _ in r.scan_iter(match="r3:tenant-a:{keep-*}", count=1000))
    b_left = sum(1 for _ in r.scan_iter(match="r3:tenant-b:{other-*}", count=1000))
    if (a_left, b_left) != (len(keep_a), len(other)):
        raise BenchError(
            f"kept rollouts: tenant-a {a_left} of {len(keep_a)}, tenant-b {b_left} of {len(other)}"
        )
    r.close()
    return {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "frame_bytes": sizes,
        "redis_keys_besides": base_keys,
        "rows": rows,
        "summary": summarize(rows, transports),
    }


def summarize(rows: Sequence[dict[str, Any]], transports: Sequence[str]) -> list[dict[str, Any]]:
    """Per (transport, phase): medians over rounds, ratios to one-by-one of the same round."""
    out = []
    for tr in transports:
        base = {
            x["round"]: x["wall_s"]
            for x in rows
            if x["transport"] == tr and x["phase"] == PHASES[0]
        }
        for phase in PHASES:
            mine = [x for x in rows if x["transport"] == tr and x["phase"] == phase]
            last = mine[-1]
            steps = last["drop_steps"]
            reported = [x["freed_reported"] for x in mine]
            out.append(
                {
                    "transport": tr,
                    "phase": phase,
                    "wall_s_median": statistics.median(x["wall_s"] for x in mine),
                    "x_one_by_one_median": statistics.median(
                        x["wall_s"] / base[x["round"]] for x in mine
                    ),
                    "requests_client": last["requests_client"],
                    "requests_service": last["requests_service"],
                    "redis_commands_top": last["redis_commands_top"],
                    "redis_commands_all": last["redis_commands_all"],
                    "redis_busy_s_median": statistics.median(x["redis_busy_s"] for x in mine),
                    "redis_usec_per_script_median": statistics.median(
                        x["redis_usec_per_script"] for x in mine
                    ),
                    "largest_call_s": max(x["largest_call_s"] for x in mine),
                    "examined_per_call_max": max((s["examined"] for s in steps), default=None),
                    "scans_per_call": last["scans"] / len(steps) if steps else None,
                    "freed_reported_median": (
                        statistics.median(reported) if None not in reported else None
                    ),
                    "used_memory_fall_median": statistics.median(
                        x["used_memory_fall"] for x in mine
                    ),
                }
            )
    return out


def table(res: dict[str, Any], args: argparse.Namespace) -> str:
    """Markdown table of the summary."""
    names = {
        "one_by_one": "`delete(id)` each (baseline)",
        "delete_many": "`delete_many(ids)`",
        "drop_consumed": "`drop_consumed(v)`",
        "drop_bounded": f"`drop_consumed(v, max_rollouts={args.bound})`",
    }
    lines = [
        f"{res['rollouts']:,} rollouts x {res['tokens']} tokens ({L}x{E}x{K} skewed, frames "
        f"{min(res['frame_bytes']):,}-{max(res['frame_bytes']):,} B); besides them Redis "
        f"holds {res['redis_keys_besides']:,} keys (kept and tenant-b rollouts). Medians of "
        f"{args.rounds} round(s); ratio = time / one-by-one time of the same round.",
        "",
        "| transport | how | wall s | x one-by-one | requests (client / service) "
        "| Redis commands top / all | Redis busy ms (µs per script) | largest call ms "
        "| keys examined per call, max | SCANs per call | freed reported / used_memory fall |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["summary"]:
        rep, fall = s["freed_reported_median"], s["used_memory_fall_median"]
        mem = f"{rep / 1e6:.2f} / {fall / 1e6:.2f} MB ({rep / fall:.2f})" if rep and fall else "—"
        ex = s["examined_per_call_max"]
        sc = s["scans_per_call"]
        lines.append(
            f"| {s['transport']} | {names[s['phase']]} | {s['wall_s_median']:.3f} | "
            f"{s['x_one_by_one_median']:.3f} | {s['requests_client']:,} / "
            f"{s['requests_service']:,} | {s['redis_commands_top']:,} / "
            f"{s['redis_commands_all']:,} | {s['redis_busy_s_median'] * 1e3:.1f} "
            f"({s['redis_usec_per_script_median']:.0f}) | {s['largest_call_s'] * 1e3:.1f} | "
            f"{'—' if ex is None else f'{ex:,}'} | {'—' if sc is None else f'{sc:.1f}'} | {mem} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, start Redis and the service, run, stop both."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rollouts", type=int, default=2048, help="rollouts per phase (a step)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rollout")
    p.add_argument("--distinct", type=int, default=8, help="distinct arrays generated, reused")
    p.add_argument("--kept", type=int, default=256, help="tenant-a rollouts of a newer version")
    p.add_argument(
        "--unversioned", type=int, default=32, help="tenant-a rollouts, version 'default'"
    )
    p.add_argument("--other", type=int, default=2048, help="tenant-b rollouts (consumed version)")
    p.add_argument("--bound", type=int, default=512, help="max_rollouts of the bounded drop")
    p.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument("--transports", default="http,grpc", help="comma list of http, grpc")
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)

    signal.signal(signal.SIGTERM, _raise_interrupt)
    info = machine_info()
    print(machine_line(info), flush=True)
    env = {"R3_CACHE_MAX_BATCH": "1024"}  # the default (the test harness sets 64)
    report: dict[str, Any] = {"machine": info, "args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="r3-lifecycle-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rds = RedisProcess(free_port(), tmp / "redis", appendonly=False)
        svc: Service | None = None
        try:
            rds.start()
            svc = start_service(tmp, rds.url, env=env)
            report.update(run(svc, rds, args))
        except KeyboardInterrupt:
            print("interrupted: stopping the service and redis-server", file=sys.stderr)
            return 130
        except BenchError as exc:
            print(f"FAIL: {exc}", file=sys.stderr)
            return 1
        finally:
            if svc is not None:
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
