"""A training loop's step time with the next micro-batch's routing fetched beside it.

A rank overlaps the fetch of its next micro-batch's routing (``prefetched``) with the
current step.  The step never waits for it when the fetch is shorter than the step, but
the fetch is Python (the network read, ``decode_rollout``'s frame walk, the layout)
and holds the GIL, which the training loop needs to launch its many small GPU ops: each
op the loop launches releases the GIL and must take it back.  This bench measures how
much the overlapped fetch slows the step, on the CPU alone.

**The training loop** (a CPU stand-in for a GPU launch loop): one thread,
``torch.set_num_threads(1)``, ``--ops`` small torch ops per step (``x = x * 1.0001 +
y``, two ops each, on ``--op-size``-element float32 tensors).  Defaults: 5,500 ops (as
many as the HF Qwen3-MoE step of ``bench/replay_bench.py`` dispatches) of 32,768
elements, about 30 ms a step on one core of the dev machine: about twice a fetch, so
the step need not wait for it (the same ops on 64 elements take about half as long,
and the step then waits for the fetch; ``--op-size 64 --ops 11000`` keeps the step's
length with a loop that spends more of its time holding the GIL).

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
rounds, the order of the runs rotated each round:

* **baseline**: the steps alone, no fetch;
* **overlapped, per transport**: the same steps in today's loop, ``for mb, targets in
  prefetched(micro_batches, fetch): step()``: while a step runs, the next micro-batch
  is fetched in ``prefetched``'s thread;
* with ``--process``, a control per transport: the same loop with each fetch in a
  spawned worker process (its own client; the targets pickled back), which shares no
  GIL with the loop but still its cores.

Reported per transport and distribution: the median step time (the step's own ops,
not the wait) of baseline and overlapped runs, the ratio overlapped / baseline (of the
pooled medians, and each round's against the same round's baseline: the median of
those and their min-max spread), the median of the rounds' extra ms per step (the
loop's time lost to one fetch, whatever the step's length), where the loop's thread
spent its step (Linux ``/proc/thread-self/schedstat``: on a CPU; runnable on a run
queue with no core free, i.e. CPU contention; neither, asleep: mostly waiting for the
GIL; medians, so they need not add up to the step's; in a VM the thread's CPU time is
only good to a millisecond or two per step), the time each step waited
for its fetch after its own ops (median, max, steps that waited > 1 ms), the fetch
alone per micro-batch (no training loop beside it: median, min-max) and while
overlapped (each fetch timed in its thread), and the bytes per micro-batch (frame
bytes the client received through the service; Redis's output bytes, which for
``DirectReader`` are what the rank received).  A baseline that itself waited for a
core more than 5 % of its step is flagged ``busy`` (other load on the machine: its
ratios do not measure the fetch).  The target (issue text): step time with the
overlapped fetch / without <= 1.02 on the 2-core dev machine.

    python bench/overlap_bench.py                                  # 16 x 4,096, both
    python bench/overlap_bench.py --dist skewed --rounds 3         # quick
    python bench/overlap_bench.py --switch-interval 0.0005         # GIL hand-over 0.5 ms
    python bench/overlap_bench.py --process                        # + worker-process control

Writes ``bench/out/overlap_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step_fetch_bench import LAYERS, make_step  # noqa: E402
from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import DirectReader, RoutingClient  # noqa: E402
from r3_client.layouts import MegatronReplayBatch  # noqa: E402
from r3_client.rank_local import RangeSource, fetch_megatron_rank_batch, prefetched  # noqa: E402
from tests.support.counting import Counting  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, start_service  # noqa: E402
from tests.support.stored import redis_sent  # noqa: E402

#: The rank: Megatron pp_rank 0 of pp2, cp_rank 0 of cp2, tp_rank 0 of tp2 with SP.
PP, CP, TP = 2, 2, 2
STAGE_LAYERS = range(0, LAYERS // PP)
TRANSPORTS = ("http", "grpc", "direct")
WAITED_S = 1e-3  # a step "waited" when its fetch was not done within 1 ms of its end
BUSY = 0.05  # a baseline waiting for a core this share of its step: the machine was busy

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


class PerRead:
    """``source`` as a caller's own source (its ``get_ranges`` takes no ``decode=``): each
    read decoded on its own and copied into the targets, the path before issue 44's
    one compiled call per micro-batch (the ``-per-read`` modes: that path in the same
    run)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def get_ranges(
        self, reads: Any, *, layers: Any = None, view: Any = "exact", return_errors: bool = False
    ) -> Any:
        return self.source.get_ranges(reads, layers=layers, view=view, return_errors=return_errors)


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
    per_read: bool = False,
) -> dict[str, Any]:
    """Each micro-batch fetched ``repeat`` times with nothing beside it: time, bytes.
    ``source``: a client of its own (a ``RoutingClient`` is wrapped to count bytes);
    ``per_read``: decoded read by read (:class:`PerRead`)."""
    counted: Any = Counting(source) if name != "direct" else source
    fetch = rank_fetch(PerRead(counted) if per_read else counted, tokens)
    for mb in micro[:1]:  # warm the connections
        fetch(mb)
    spans: list[float] = []
    r0 = redis_sent(redis_url)
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
    redis_bytes = (redis_sent(redis_url) - r0) / n
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


def sched() -> tuple[float, float] | None:
    """The calling thread's time on a CPU and waiting on a run queue (runnable, no core
    free), in seconds, from ``/proc/thread-self/schedstat`` (None where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runq, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(runq) / 1e9


class StepClock:
    """Each step's wall time, and where the loop's thread spent it: on a CPU, waiting for
    a core (run queue: CPU contention), or neither (asleep: mostly waiting for the GIL)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.on_cpu: list[float] = []
        self.runq: list[float] = []

    def timed(self, step: Callable[[], None], keep: bool) -> None:
        s0, t0 = sched(), time.perf_counter()
        step()
        t1, s1 = time.perf_counter(), sched()
        if keep:
            self.wall.append(t1 - t0)
            if s0 is not None and s1 is not None:
                self.on_cpu.append(s1[0] - s0[0])
                self.runq.append(s1[1] - s0[1])

    def report(self) -> dict[str, Any]:
        return {"step_s": self.wall, "on_cpu_s": self.on_cpu, "runq_s": self.runq}


def baseline_run(step: Callable[[], None], steps: int, warmup: int) -> dict[str, Any]:
    clock = StepClock()
    for i in range(warmup + steps):
        clock.timed(step, i >= warmup)
    return clock.report()


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
    items = [micro[i % len(micro)] for i in range(total + 1)]  # + 1: the last step's next
    spans: list[float] = []
    waits: list[float] = []
    clock = StepClock()
    it = prefetched(items, timed(fetch, spans))
    next(it)  # the first micro-batch: fetched before the loop, as a rank's first is
    for i in range(total):
        clock.timed(step, i >= warmup)
        t1 = time.perf_counter()
        next(it)  # the next micro-batch's targets: waits here if its fetch is not done
        if i >= warmup:
            waits.append(time.perf_counter() - t1)
    for _ in it:  # every item handed out: this closes the pool
        pass
    return {**clock.report(), "wait_s": waits, "fetch_s": spans[warmup + 1 :]}


_WORKER: dict[str, Any] = {}


def _worker_init(http_url: str, grpc_url: str, name: str, tokens: int) -> None:
    """A fetch worker process: its own client (or reader) for ``name``."""
    svc = argparse.Namespace(http_url=http_url, grpc_url=grpc_url)
    _WORKER["fetch"] = rank_fetch(open_source(svc, name), tokens)


def _worker_fetch(mb: MicroBatch) -> tuple[MegatronReplayBatch, float]:
    t0 = time.perf_counter()
    got = _WORKER["fetch"](mb)
    return got, time.perf_counter() - t0


def process_pool(svc: Any, name: str, tokens: int) -> ProcessPoolExecutor:
    """One spawned worker fetching through ``name`` (its own client, once started)."""
    return ProcessPoolExecutor(
        1,
        mp_context=mp.get_context("spawn"),
        initializer=_worker_init,
        initargs=(svc.http_url, svc.grpc_url, name, tokens),
    )


def process_run(
    step: Callable[[], None],
    pool: ProcessPoolExecutor,
    micro: list[MicroBatch],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """The control: the same loop with each fetch in a worker process (no GIL shared with
    the loop; its targets pickled back), submitted before the step, awaited after it."""
    total = warmup + steps
    items = [micro[i % len(micro)] for i in range(total + 1)]
    spans: list[float] = []
    waits: list[float] = []
    clock = StepClock()
    pool.submit(_worker_fetch, items[0]).result()  # the first micro-batch, before the loop
    for i in range(total):
        fut = pool.submit(_worker_fetch, items[i + 1])
        clock.timed(step, i >= warmup)
        t1 = time.perf_counter()
        _, span = fut.result()
        if i >= warmup:
            waits.append(time.perf_counter() - t1)
            spans.append(span)
    return {**clock.report(), "wait_s": waits, "fetch_s": spans}


def ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def where(run: dict[str, Any]) -> dict[str, float]:
    """Median ms per step on a CPU, on a run queue, and neither (asleep: the GIL)."""
    wall, cpu, runq = run["step_s"], run["on_cpu_s"], run["runq_s"]
    if not cpu:
        return {}
    return {
        "on_cpu_ms": ms(cpu),
        "runq_ms": ms(runq),
        "asleep_ms": ms([w - c - q for w, c, q in zip(wall, cpu, runq, strict=True)]),
    }


def summarize(rounds: list[dict[str, dict[str, Any]]], modes: list[str]) -> dict[str, Any]:
    """Medians and ratios of the rounds' runs, per mode against the baseline."""

    def pooled(mode: str) -> dict[str, Any]:
        return {k: [x for r in rounds for x in r[mode].get(k, [])] for k in rounds[0][mode]}

    base = pooled("baseline")
    out: dict[str, Any] = {
        "baseline": {
            "median_step_ms": ms(base["step_s"]),
            "round_medians_ms": [ms(r["baseline"]["step_s"]) for r in rounds],
            **where(base),
        }
    }
    b = out["baseline"]
    b["busy"] = b.get("runq_ms", 0.0) > BUSY * b["median_step_ms"]
    b["round_spread"] = max(b["round_medians_ms"]) / min(b["round_medians_ms"])
    for mode in modes[1:]:
        runs = pooled(mode)
        waits = runs["wait_s"]
        per_round = [ms(r[mode]["step_s"]) / ms(r["baseline"]["step_s"]) for r in rounds]
        extra = [ms(r[mode]["step_s"]) - ms(r["baseline"]["step_s"]) for r in rounds]
        out[mode] = {
            "median_step_ms": ms(runs["step_s"]),
            "round_medians_ms": [ms(r[mode]["step_s"]) for r in rounds],
            "ratio_of_medians": ms(runs["step_s"]) / out["baseline"]["median_step_ms"],
            "round_ratios": per_round,
            "median_round_ratio": statistics.median(per_round),
            "round_ratio_min": min(per_round),
            "round_ratio_max": max(per_round),
            "median_round_extra_ms": statistics.median(extra),
            **where(runs),
            "wait_median_ms": ms(waits),
            "wait_max_ms": max(waits) * 1e3,
            "steps_waited": sum(w > WAITED_S for w in waits),
            "steps": len(waits),
            "fetch_overlapped_median_ms": ms(runs["fetch_s"]),
            "fetch_overlapped_max_ms": max(runs["fetch_s"]) * 1e3,
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
    sources: dict[str, Any] = {}
    pools: dict[str, ProcessPoolExecutor] = {}
    modes = ["baseline", *TRANSPORTS]
    try:
        for n in TRANSPORTS:
            sources[n] = open_source(svc, n)
        if args.per_read:
            modes += [f"{n}-per-read" for n in TRANSPORTS]
        if args.process:
            for n in TRANSPORTS:
                pools[n] = process_pool(svc, n, args.tokens)
                pools[n].submit(_worker_fetch, micro[0]).result()  # started, connected
            modes += [f"{n}-process" for n in TRANSPORTS]
        with RoutingClient(svc.http_url, api_key=KEY_A) as client:
            stored = sum(client.stat(r).stored_bytes for r in ids)
        fetches = {n: rank_fetch(s, args.tokens) for n, s in sources.items()}
        if args.per_read:
            fetches |= {
                f"{n}-per-read": rank_fetch(PerRead(s), args.tokens) for n, s in sources.items()
            }
        check_equal(fetches, micro[0])
        alone = {}
        for n in TRANSPORTS:  # clients of their own: the counting wraps their transport
            with open_source(svc, n) as own:
                alone[n] = fetch_alone(n, own, micro, args.tokens, redis.url, args.fetch_repeat)
            if args.per_read:
                with open_source(svc, n) as own:
                    alone[f"{n}-per-read"] = fetch_alone(
                        n, own, micro, args.tokens, redis.url, args.fetch_repeat, per_read=True
                    )
        for n, a in alone.items():
            print(
                f"[{name}] fetch alone {n}: {a['median_ms']:.1f} ms per micro-batch "
                f"({a['min_ms']:.1f}-{a['max_ms']:.1f}), "
                f"{a['client_bytes_per_micro_batch'] / 1e6:.2f} MB received",
                flush=True,
            )
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            got: dict[str, dict[str, Any]] = {}
            for mode in order:
                if mode == "baseline":
                    got[mode] = baseline_run(step, args.steps, args.warmup)
                elif mode.endswith("-process"):
                    pool = pools[mode.removesuffix("-process")]
                    got[mode] = process_run(step, pool, micro, args.steps, args.warmup)
                else:
                    got[mode] = overlapped_run(step, fetches[mode], micro, args.steps, args.warmup)
            rounds.append(got)
            print(
                f"[{name}] round {r + 1}/{args.rounds} ({', '.join(order)}): "
                + ", ".join(f"{m} {ms(got[m]['step_s']):.1f} ms" for m in modes),
                flush=True,
            )
        summary = summarize(rounds, modes)
    finally:
        for src in sources.values():
            src.close()
        for pool in pools.values():
            pool.shutdown()
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    for mode in modes[1:]:
        a = alone[mode.removesuffix("-process")]
        summary[mode]["fetch_alone"] = a
        summary[mode]["fetch_alone_over_step"] = (
            a["median_ms"] / summary["baseline"]["median_step_ms"]
        )
    return {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "micro_batches": len(micro),
        "stored_bytes": stored,
        "stored_bytes_per_micro_batch": stored / len(micro),
        "modes": modes,
        "summary": summary,
        "rounds": rounds,
    }


def split(t: dict[str, Any]) -> str:
    if "on_cpu_ms" not in t:
        return ""
    return f"cpu {t['on_cpu_ms']:.1f} / runq {t['runq_ms']:.1f} / asleep {t['asleep_ms']:.1f} ms"


def print_summary(name: str, res: dict[str, Any]) -> None:
    s = res["summary"]
    b = s["baseline"]
    spread = ", ".join(f"{x:.1f}" for x in b["round_medians_ms"])
    print(
        f"[{name}] baseline step {b['median_step_ms']:.2f} ms (rounds: {spread}; max / min "
        f"{b['round_spread']:.2f}) {split(b)}"
    )
    if b.get("runq_ms", 0.0) > BUSY * b["median_step_ms"]:
        print(
            f"[{name}] WARNING: the baseline itself waited {b['runq_ms']:.1f} ms a step for a "
            "core (other load on the machine): its ratios do not measure the fetch",
            flush=True,
        )
    for n in res["modes"][1:]:
        t = s[n]
        a = t["fetch_alone"]
        print(
            f"[{name}] {n:>14}: step {t['median_step_ms']:.2f} ms, ratio "
            f"{t['ratio_of_medians']:.3f} (rounds {t['round_ratio_min']:.3f}-"
            f"{t['round_ratio_max']:.3f}, median {t['median_round_ratio']:.3f}; "
            f"+{t['median_round_extra_ms']:.1f} ms) {split(t)} | fetch alone "
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
    ap.add_argument("--op-size", type=int, default=32768, help="elements per op's tensors")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each run")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--fetch-repeat", type=int, default=2, help="passes over the micro-batches, fetch alone"
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: Python's, 0.005 s)",
    )
    ap.add_argument(
        "--per-read",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also each transport decoding read by read (the path before one compiled call "
        "per micro-batch), in the same rounds",
    )
    ap.add_argument(
        "--process",
        action="store_true",
        help="also each fetch in a spawned worker process (no GIL shared with the loop)",
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
