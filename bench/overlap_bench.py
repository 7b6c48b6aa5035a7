"""A training loop's step time with the next micro-batch's routing fetched beside it.

A rank overlaps the fetch of its next micro-batch's routing (``prefetched``) with the
current step.  The step never waits for it when the fetch is shorter than the step, but
the fetch is Python (the network read, ``decode_rollout``'s frame walk, the layout)
and holds the GIL, which the training loop needs to launch its many small GPU ops: each
op the loop launches releases the GIL and must take it back.  This bench measures how
much the overlapped fetch slows the step, on the CPU alone.

**The training loop** (a CPU stand-in for a GPU launch loop): one thread,
``torch.set_num_threads(1)``, ``--ops`` tiny torch ops per step (``x = x * 1.0001 + y``
on 64-element float32 tensors: two ops each; 5,500 by default, some tens of ms a step
on one core of the dev machine).

**The fetch**: a real ``redis-server`` (with a password: direct reads need one) and a
real cache service (HTTP and gRPC, direct reads on), holding ``--rollouts`` rollouts of
``--tokens`` tokens at the Qwen3-30B-A3B shape (48 MoE layers, 128 experts, top-8), one
segment each, stored as ``bench/step_fetch_bench.py`` stores a step (skewed: Zipf-like
expert popularity; uniform).  The rank: Megatron ``pp_rank 0`` of pp2 (MoE layers
0-23), ``cp_rank 0`` of cp2, ``tp_rank 0`` of tp2 with sequence parallelism, so a
quarter of each micro-batch's tokens of half the layers; ``--micro`` rollouts (2) per
micro-batch, packed as Megatron packs them.  Each fetch is what that rank does for a
micro-batch: ``fetch_megatron_rank_batch`` (one ``get_ranges`` call, decoded into its
int64 replay targets), through ``RoutingClient`` over HTTP, ``RoutingClient`` over gRPC
(``grpc://``) and ``DirectReader`` (Redis directly).

**Runs**, each ``--steps`` steps (after ``--warmup`` untimed ones), in ``--rounds``
rounds, the order of the four rotated each round:

* **baseline**: the steps alone, no fetch;
* **overlapped, per transport**: the same steps in today's loop, ``for mb, targets in
  prefetched(micro_batches, fetch): step()``: while a step runs, the next micro-batch
  is fetched in ``prefetched``'s thread.

Reported per transport and distribution: the median step time (the step's own ops,
not the wait) of baseline and overlapped runs, the ratio overlapped / baseline (of the
pooled medians, and each round's against the same round's baseline: the median of
those and their min-max spread), the time each step waited for its fetch after its own
ops (median, max, steps that waited > 1 ms), the fetch alone per micro-batch (no
training loop beside it: median, min-max) and while overlapped (each fetch timed in its
thread), and the bytes per micro-batch (frame bytes the client received through the
service; Redis's output bytes, which for ``DirectReader`` are what the rank received).
The target (issue text): step time with the overlapped fetch / without <= 1.02 on the
2-core dev machine.

    python bench/overlap_bench.py                                  # 16 x 4,096, both
    python bench/overlap_bench.py --dist skewed --rounds 3         # quick
    python bench/overlap_bench.py --switch-interval 0.0005         # GIL hand-over 0.5 ms

Writes ``bench/out/overlap_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step_fetch_bench import LAYERS, make_step, redis_out_bytes  # noqa: E402
from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import DirectReader, RoutingClient  # noqa: E402
from r3_client.layouts import MegatronReplayBatch  # noqa: E402
from r3_client.rank_local import RangeSource, fetch_megatron_rank_batch, prefetched  # noqa: E402
from tests.support.counting import Counting  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, start_service  # noqa: E402

#: The rank: Megatron pp_rank 0 of pp2, cp_rank 0 of cp2, tp_rank 0 of tp2 with SP.
PP, CP, TP = 2, 2, 2
STAGE_LAYERS = range(0, LAYERS // PP)
TRANSPORTS = ("http", "grpc", "direct")
WAITED_S = 1e-3  # a step "waited" when its fetch was not done within 1 ms of its end

MicroBatch = list[str]


# ---------------------------------------------------------------- the training loop


def make_step_fn(ops: int, size: int) -> Callable[[], None]:
    """One training step: ``ops`` small torch ops on ``size``-element float32 tensors,
    launched one after another, one thread."""
    x = torch.ones(size)
    y = torch.full((size,), 1e-4)
    pairs = max(1, ops // 2)

    def step() -> None:
        a = x
        for _ in range(pairs):
            a = a * 1.0001 + y

    return step


# ---------------------------------------------------------------- the fetch


def rank_fetch(source: RangeSource, tokens: int) -> Callable[[MicroBatch], MegatronReplayBatch]:
    """The rank's fetch of one micro-batch through ``source``: its replay targets."""

    def fetch(mb: MicroBatch) -> MegatronReplayBatch:
        return fetch_megatron_rank_batch(
            source,
            mb,
            seqlens=[tokens] * len(mb),
            tp_size=TP,
            tp_rank=0,
            cp_size=CP,
            cp_rank=0,
            sequence_parallel=True,
            stage_layers=STAGE_LAYERS,
        )

    return fetch


def timed(fetch: Callable[[MicroBatch], Any], spans: list[float]) -> Callable[[MicroBatch], Any]:
    """``fetch``, each call's duration appended to ``spans`` (in the thread it runs in)."""

    def run(mb: MicroBatch) -> Any:
        t0 = time.perf_counter()
        out = fetch(mb)
        spans.append(time.perf_counter() - t0)
        return out

    return run


def fetch_alone(
    name: str,
    source: Any,
    micro: list[MicroBatch],
    tokens: int,
    redis_url: str,
    repeat: int,
) -> dict[str, Any]:
    """Each micro-batch fetched ``repeat`` times with nothing beside it: time, bytes.
    ``source``: a client of its own (a ``RoutingClient`` is wrapped to count bytes)."""
    counted: Any = Counting(source) if name != "direct" else source
    fetch = rank_fetch(counted, tokens)
    for mb in micro[:1]:  # warm the connections
        fetch(mb)
    spans: list[float] = []
    r0 = redis_out_bytes(redis_url)
    if name != "direct":
        counted.bytes = counted.view_bytes = 0
    n = 0
    held = 0
    for _ in range(repeat):
        for mb in micro:
            t0 = time.perf_counter()
            got = fetch(mb)
            spans.append(time.perf_counter() - t0)
            held = sum(a.nbytes for a in got.per_layer)
            n += 1
    redis_bytes = (redis_out_bytes(redis_url) - r0) / n
    return {
        "median_ms": statistics.median(spans) * 1e3,
        "min_ms": min(spans) * 1e3,
        "max_ms": max(spans) * 1e3,
        "client_bytes_per_micro_batch": (
            redis_bytes if name == "direct" else (counted.bytes + counted.view_bytes) / n
        ),
        "redis_out_bytes_per_micro_batch": redis_bytes,
        "targets_bytes_per_micro_batch": held,
    }


def open_source(svc: Any, name: str) -> Any:
    """A fresh ``RoutingClient`` over HTTP or gRPC, or a ``DirectReader``."""
    if name == "direct":
        return DirectReader.from_service(svc.http_url, api_key=KEY_A)
    return RoutingClient(svc.http_url if name == "http" else svc.grpc_url, api_key=KEY_A)


def check_equal(
    fetches: dict[str, Callable[[MicroBatch], MegatronReplayBatch]], mb: MicroBatch
) -> None:
    """Every transport answers the micro-batch with the same targets."""
    got = {name: f(mb) for name, f in fetches.items()}
    first = next(iter(got.values()))
    for name, b in got.items():
        if b.layer_ids != first.layer_ids or not all(
            np.array_equal(x, y) for x, y in zip(b.per_layer, first.per_layer, strict=True)
        ):
            raise AssertionError(f"{name} answers other targets than {next(iter(got))}")


# ---------------------------------------------------------------- runs


def baseline_run(step: Callable[[], None], steps: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"step_s": times}


def overlapped_run(
    step: Callable[[], None],
    fetch: Callable[[MicroBatch], Any],
    micro: list[MicroBatch],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """Today's loop: ``for mb, targets in prefetched(...): step()``, the next micro-batch
    fetched while a step runs.  Times each step's ops, and the wait for the next fetch
    after them (``prefetched`` hands the next item once its fetch is done)."""
    total = warmup + steps
    items = [micro[i % len(micro)] for i in range(total)]
    spans: list[float] = []
    times: list[float] = []
    waits: list[float] = []
    it = prefetched(items, timed(fetch, spans))
    next(it)  # the first micro-batch: fetched before the loop, as a rank's first is
    for i in range(total):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if i + 1 < total:
            next(it)  # the next micro-batch's targets: waits here if its fetch is not done
        t2 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
            if i + 1 < total:
                waits.append(t2 - t1)
    for _ in it:  # nothing left: closes the pool
        pass
    return {"step_s": times, "wait_s": waits, "fetch_s": spans[warmup + 1 :]}


def ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Medians and ratios of the rounds' runs, per transport against the baseline."""
    base_all = [t for r in rounds for t in r["baseline"]["step_s"]]
    out: dict[str, Any] = {
        "baseline": {
            "median_step_ms": ms(base_all),
            "round_medians_ms": [ms(r["baseline"]["step_s"]) for r in rounds],
        }
    }
    for name in TRANSPORTS:
        steps_all = [t for r in rounds for t in r[name]["step_s"]]
        waits = [w for r in rounds for w in r[name]["wait_s"]]
        fetches = [f for r in rounds for f in r[name]["fetch_s"]]
        per_round = [ms(r[name]["step_s"]) / ms(r["baseline"]["step_s"]) for r in rounds]
        out[name] = {
            "median_step_ms": ms(steps_all),
            "round_medians_ms": [ms(r[name]["step_s"]) for r in rounds],
            "ratio_of_medians": ms(steps_all) / out["baseline"]["median_step_ms"],
            "round_ratios": per_round,
            "median_round_ratio": statistics.median(per_round),
            "round_ratio_min": min(per_round),
            "round_ratio_max": max(per_round),
            "wait_median_ms": ms(waits),
            "wait_max_ms": max(waits) * 1e3,
            "steps_waited": sum(w > WAITED_S for w in waits),
            "steps": len(waits),
            "fetch_overlapped_median_ms": ms(fetches),
            "fetch_overlapped_max_ms": max(fetches) * 1e3,
        }
    return out


def one_distribution(
    svc: Any, redis: RedisProcess, name: str, skew: float, args: argparse.Namespace
) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = make_step(svc.http_url, args.rollouts, args.tokens, skew, seed=17 if skew else 29)
    print(f"[{name}] stored {len(ids)} rollouts in {time.perf_counter() - t0:.0f} s", flush=True)
    micro = [ids[i : i + args.micro] for i in range(0, len(ids), args.micro)]
    step = make_step_fn(args.ops, args.op_size)
    http = open_source(svc, "http")
    grpc = open_source(svc, "grpc")
    direct = open_source(svc, "direct")
    try:
        with RoutingClient(svc.http_url, api_key=KEY_A) as client:
            stored = sum(client.stat(r).stored_bytes for r in ids)
        sources: dict[str, Any] = {"http": http, "grpc": grpc, "direct": direct}
        fetches = {n: rank_fetch(s, args.tokens) for n, s in sources.items()}
        check_equal(fetches, micro[0])
        alone = {}
        for n in TRANSPORTS:  # clients of their own: the counting wraps their transport
            with open_source(svc, n) as own:
                alone[n] = fetch_alone(n, own, micro, args.tokens, redis.url, args.fetch_repeat)
        for n, a in alone.items():
            print(
                f"[{name}] fetch alone {n}: {a['median_ms']:.1f} ms per micro-batch "
                f"({a['min_ms']:.1f}-{a['max_ms']:.1f}), "
                f"{a['client_bytes_per_micro_batch'] / 1e6:.2f} MB received",
                flush=True,
            )
        modes = ["baseline", *TRANSPORTS]
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            got: dict[str, dict[str, Any]] = {}
            for mode in order:
                if mode == "baseline":
                    got[mode] = baseline_run(step, args.steps, args.warmup)
                else:
                    got[mode] = overlapped_run(step, fetches[mode], micro, args.steps, args.warmup)
            rounds.append(got)
            print(
                f"[{name}] round {r + 1}/{args.rounds} ({', '.join(order)}): "
                + ", ".join(f"{m} {ms(got[m]['step_s']):.1f} ms" for m in modes),
                flush=True,
            )
        summary = summarize(rounds)
    finally:
        http.close()
        grpc.close()
        direct.close()
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    for n in TRANSPORTS:
        summary[n]["fetch_alone"] = alone[n]
        summary[n]["fetch_alone_over_step"] = (
            alone[n]["median_ms"] / summary["baseline"]["median_step_ms"]
        )
    return {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "micro_batches": len(micro),
        "stored_bytes": stored,
        "stored_bytes_per_micro_batch": stored / len(micro),
        "summary": summary,
        "rounds": rounds,
    }


def print_summary(name: str, res: dict[str, Any]) -> None:
    s = res["summary"]
    b = s["baseline"]
    spread = ", ".join(f"{x:.1f}" for x in b["round_medians_ms"])
    print(f"[{name}] baseline step {b['median_step_ms']:.2f} ms (rounds: {spread})")
    for n in TRANSPORTS:
        t = s[n]
        a = t["fetch_alone"]
        print(
            f"[{name}] {n:>6}: step {t['median_step_ms']:.2f} ms, ratio "
            f"{t['ratio_of_medians']:.3f} (rounds {t['round_ratio_min']:.3f}-"
            f"{t['round_ratio_max']:.3f}, median {t['median_round_ratio']:.3f}) | fetch alone "
            f"{a['median_ms']:.1f} ms ({a['median_ms'] / b['median_step_ms']:.2f} of a step), "
            f"overlapped {t['fetch_overlapped_median_ms']:.1f} ms | "
            f"{a['client_bytes_per_micro_batch'] / 1e6:.2f} MB/micro-batch | waited "
            f"{t['steps_waited']}/{t['steps']} steps (max {t['wait_max_ms']:.1f} ms)",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--micro", type=int, default=2, help="rollouts per micro-batch")
    ap.add_argument("--dist", choices=["skewed", "uniform", "both"], default="both")
    ap.add_argument("--ops", type=int, default=5500, help="torch ops per training step")
    ap.add_argument("--op-size", type=int, default=16384, help="elements per op's tensors")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--fetch-repeat", type=int, default=2, help="passes over the micro-batches, fetch alone"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: Python's, 0.005 s)",
    )
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "overlap_bench.json")
    args = ap.parse_args(argv)
    if args.rollouts % args.micro:
        ap.error("--micro must divide --rollouts")
    torch.set_num_threads(1)  # one launch thread
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    env = {
        **DIRECT_READS,
        "R3_CACHE_MAX_BATCH": str(max(1024, args.rollouts)),
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_start": os.getloadavg(),
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "switch_interval_s": sys.getswitchinterval(),
        "rank": {
            "pp": PP,
            "pp_rank": 0,
            "cp": CP,
            "cp_rank": 0,
            "tp": TP,
            "tp_rank": 0,
            "sequence_parallel": True,
            "stage_layers": [STAGE_LAYERS.start, STAGE_LAYERS.stop],
        },
    }
    dists = {"skewed": 1.0, "uniform": 0.0}
    chosen = list(dists) if args.dist == "both" else [args.dist]
    with tempfile.TemporaryDirectory(prefix="r3-overlap-") as tmp_s:
        tmp = Path(tmp_s)
        redis = RedisProcess(
            free_port(), tmp / "redis", appendonly=False, password=secrets.token_urlsafe(24)
        )
        redis.start()
        svc = None
        try:
            svc = start_service(tmp, redis.url, env=env)
            for name in chosen:
                report[name] = one_distribution(svc, redis, name, dists[name], args)
        finally:
            if svc is not None:
                svc.stop()
            redis.stop()
    report["machine"]["loadavg_end"] = os.getloadavg()
    for name in chosen:
        print_summary(name, report[name])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
