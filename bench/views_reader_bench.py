"""A reader's memory for ``latest`` / ``exact`` over a rollout with many views (issue 42, item 4).

Starts a ``redis-server`` and the cache service (as ``tests/support/service_process.py``
does), writes one rollout of ``--segments`` segments where every later call recomputed every
earlier row (``--segments - 1`` views, each ``[0, serves)``), then, for each reader
(``RoutingClient`` over HTTP and gRPC, ``DirectReader``) and policy, runs the read in a fresh
child process and prints its peak RSS growth over the RSS it had just before the read
(``/proc/self/status`` VmHWM after ``clear_refs``), the time and the outcome.  ``generated``
(no view read) is the baseline of the same run.  Run it on the tree to measure; run it with
``PYTHONPATH`` pointing at an older checkout to measure that one.

    python bench/views_reader_bench.py [--segments 256] [--answer-mib 2] [--max-mib 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, start_service  # noqa: E402

LAYERS = tuple(range(48))
E, K = 128, 8

CHILD = r"""
import json, sys, time
from r3_client import DirectReader, RoutingClient, R3Error

def mib(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024

how, url, plan, rid, policy, max_bytes = json.loads(sys.argv[1])
reader = DirectReader(plan, max_bytes=max_bytes) if how == "direct" else RoutingClient(
    url, api_key=__KEY__, max_bytes=max_bytes)
with reader:
    reader.get(rid, start=0, end=8)  # warm: connections, the codec
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = mib("VmRSS")
    t0 = time.perf_counter()
    try:
        got = reader.get_served(rid) if policy == "exact" else reader.get(rid, view=policy)
        out = f"ok: {len(got) if isinstance(got, list) else 1} routing(s)"
    except R3Error as exc:
        out = type(exc).__name__
    dt = time.perf_counter() - t0
    print(json.dumps([mib("VmHWM") - start, dt, out]))
""".replace("__KEY__", repr(KEY_A))


def _rollout(url: str, segments: int, rows: int) -> str:
    from r3_client import RoutingClient, Segment, encode_frame, token_digest
    from r3_client.synthetic import synthetic_routing

    rid = f"views-bench-{time.time_ns()}"
    traj = synthetic_routing(segments * rows, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=1)
    with RoutingClient(url, api_key=KEY_A) as c:
        for i in range(segments):
            s = i * rows
            wv = f"v{i}"
            if i:
                again = synthetic_routing(s, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=100 + i)
                seg = Segment(0, s, "bench", wv, token_digest(range(s)))
                frame = encode_frame(again, num_experts=E, layer_ids=LAYERS, segment=seg)
                c.put(rid, frame, view=s)
            seg = Segment(s, s + rows, "bench", wv, token_digest(range(s + rows)))
            frame = encode_frame(traj[s : s + rows], num_experts=E, layer_ids=LAYERS, segment=seg)
            c.put(rid, frame)
    return rid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=256)
    ap.add_argument("--answer-mib", type=float, default=2.0, help="decoded size of the rollout")
    ap.add_argument("--max-mib", type=int, default=32, help="the readers' max_bytes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    row = len(LAYERS) * K * 2  # int16 ids (E = 128 with -1 for "no route")
    rows = max(1, int(args.answer_mib * (1 << 20) / row / args.segments))
    tmp = Path(tempfile.mkdtemp(prefix="views-bench-"))
    redis_proc = RedisProcess(free_port(), tmp / "redis", password="bench-password").start()
    env = {
        **DIRECT_READS,
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
        "R3_CACHE_MAX_BODY_BYTES": str(64 << 20),
        "R3_CACHE_MAX_VIEWS": str(max(256, args.segments)),
    }
    svc = start_service(tmp, redis_proc.url, env=env)
    results = []
    try:
        t0 = time.perf_counter()
        rid = _rollout(svc.http_url, args.segments, rows)
        print(
            f"rollout: {args.segments} segments x {rows} rows, {args.segments - 1} views "
            f"(each [0, serves)), {args.segments * rows * row / (1 << 20):.1f} MiB decoded; "
            f"written in {time.perf_counter() - t0:.1f} s; readers' max_bytes {args.max_mib} MiB",
            flush=True,
        )
        with svc.http() as c:
            plan = c.post("/v1/read-plan").json()
        print(f"{'reader':8} {'policy':10} {'max_bytes':>10} {'RSS +MiB':>9} {'s':>7}  outcome")
        for how in ("http", "grpc", "direct"):
            url = svc.http_url if how != "grpc" else svc.grpc_url
            for policy, max_mib in (
                ("generated", args.max_mib),
                ("latest", args.max_mib),
                ("exact", args.max_mib),
                ("exact", 2048),
            ):
                spec = json.dumps([how, url, plan, rid, policy, max_mib << 20])
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, spec], capture_output=True, text=True, check=True
                )
                grew, dt, outcome = json.loads(out.stdout.strip().splitlines()[-1])
                results.append([how, policy, max_mib, grew, dt, outcome])
                print(f"{how:8} {policy:10} {max_mib:>7} MiB {grew:9.1f} {dt:7.2f}  {outcome}")
    finally:
        svc.stop()
        redis_proc.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
