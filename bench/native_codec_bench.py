"""Codec cost at a real shape, for issue 29's targets: encode CPU, decode throughput,
thread scaling and GIL stalls, against upstream's base64 in the same run.

At Qwen3-30B-A3B's shape (16,384 rows x 48 layers x top-8 of 128 experts by
default), skewed (Zipf 1.0, AR(1) 0.9) and uniform synthetic routing:

1. **encode**: CPU (``time.process_time``) and wall of ``encode_frame`` called as
   the engine calls it (``sglang_r3.http_server.shipping.Shipper._encode``: codec ``auto``,
   format v2 with its default block rows and layer groups, its own context, a
   whole-rollout segment with a token digest; rows in the smallest unsigned dtype,
   as ``row_transport.compact_rows`` hands them over), against
   ``base64.b64encode`` of the same ids as int32 (upstream's wire form);
2. **decode**, one thread: ``decode_frame`` and ``decode_rollout`` of that frame,
   in M ids/s (the reference the native decoder is measured against);
3. **threads**: aggregate throughput of ``--threads`` threads, each working on its
   own copies of the frame (decode) or rows (encode), over one thread doing the
   same per-thread work, with the machine's core count;
4. **GIL stalls**: a heartbeat thread sleeping 0.1 ms in a loop records the
   longest gap between its wake-ups during one encode and one decode, and while
   idle (the floor the sleep itself costs).

Every figure is taken once per codec backend (``--backends``: the numpy reference and the
compiled ``r3_client.codec._r3codec``) in the same run, and the native/numpy speed-ups are
printed after the table.  Times are the best of ``--repeat`` runs (encode and base64
interleaved); stalls are the median and worst of ``--repeat`` runs.

    python bench/native_codec_bench.py [--tokens 16384] [--repeat 5] [--threads 4]
        [--backends numpy,native] [--json bench/out/native_codec.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3_client import Segment, decode_frame, decode_rollout, encode_frame, read_header, token_digest
from r3_client.codec import backend, use_backend
from r3_client.synthetic import synthetic_routing

DATA = {"skewed": {"skew": 1.0, "rho": 0.9}, "uniform": {"skew": 0.0, "rho": 0.0}}
MODEL_ID = "Qwen/Qwen3-30B-A3B"


@dataclass(frozen=True, slots=True)
class Timing:
    """Best wall and best process-CPU seconds of a call."""

    wall_s: float
    cpu_s: float


@dataclass(frozen=True, slots=True)
class Scaling:
    """Aggregate throughput of ``threads`` threads over one thread doing the same share."""

    threads: int
    per_thread: int  # calls each thread makes
    one_ids_per_s: float
    many_ids_per_s: float
    many_cpu_over_wall: float  # how many cores the threaded run kept busy

    @property
    def ratio(self) -> float:
        return self.many_ids_per_s / self.one_ids_per_s


@dataclass(frozen=True, slots=True)
class Stall:
    """Longest gap between heartbeat wake-ups per run: median and worst over the runs."""

    median_ms: float
    worst_ms: float


def timed(fn: Callable[[], object]) -> Timing:
    """Wall and process CPU of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return Timing(time.perf_counter() - t0, time.process_time() - c0)


def best_of(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, Timing]:
    """Best wall and best CPU of each call over ``repeat`` rounds, the calls interleaved."""
    runs: dict[str, list[Timing]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            runs[name].append(timed(fn))
    return {
        name: Timing(min(t.wall_s for t in ts), min(t.cpu_s for t in ts))
        for name, ts in runs.items()
    }


def scaling(
    make_work: Callable[[], Callable[[], object]],
    ids_per_call: int,
    threads: int,
    per_thread: int,
    repeat: int,
) -> Scaling:
    """Best aggregate ids/s of 1 and of ``threads`` threads, each calling its own work."""

    def run(n: int) -> tuple[float, float]:
        works = [make_work() for _ in range(n)]
        barrier = threading.Barrier(n + 1)

        def body(work: Callable[[], object]) -> None:
            barrier.wait()
            for _ in range(per_thread):
                work()

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(body, w) for w in works]
            c0, t0 = time.process_time(), time.perf_counter()
            barrier.wait()
            for f in futures:
                f.result()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return n * per_thread * ids_per_call / wall, cpu / wall

    one = max(run(1)[0] for _ in range(repeat))
    many = max((run(threads) for _ in range(repeat)), key=lambda r: r[0])
    return Scaling(threads, per_thread, one, many[0], many[1])


class Heartbeat:
    """A thread that sleeps ``interval`` in a loop and records its longest wake-up gap."""

    def __init__(self, interval: float = 1e-4) -> None:
        self.interval = interval
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self.interval)
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        time.sleep(0.02)  # let it reach its loop before the work starts
        self.max_gap = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def stall(fn: Callable[[], object], repeat: int) -> Stall:
    """The heartbeat's longest gap during each of ``repeat`` calls of ``fn``."""
    gaps = []
    for _ in range(repeat):
        with Heartbeat() as hb:
            fn()
        gaps.append(hb.max_gap * 1e3)  # read after the join: the last gap is recorded
    return Stall(statistics.median(gaps), max(gaps))


def idle(seconds: float) -> Callable[[], object]:
    """A call that only waits (the heartbeat's floor on this machine)."""
    return lambda: time.sleep(seconds)


def engine_rows(idx: npt.NDArray[Any], num_experts: int) -> npt.NDArray[Any]:
    """The rows as the engine hands them to the encoder: the smallest unsigned dtype."""
    return idx.astype(np.uint8 if num_experts <= 256 else np.uint16)


def measure(idx: npt.NDArray[Any], num_experts: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for one routing array."""
    rows, nl, _ = idx.shape
    n_ids = idx.size
    layers = tuple(range(nl))
    seg = Segment(0, rows, MODEL_ID, "v0", token_digest(np.arange(rows, dtype=np.uint32)))
    moe = engine_rows(idx, num_experts)
    i32 = np.ascontiguousarray(idx, dtype="<i4")

    def encode(part: npt.NDArray[Any] = moe) -> bytes:
        return encode_frame(part, num_experts=num_experts, layer_ids=layers, start=0, segment=seg)

    frame = encode()
    got = decode_rollout(frame)
    if not np.array_equal(np.sort(got.indices, -1), np.sort(idx, -1)):
        raise SystemExit("round trip mismatch")
    enc = best_of(
        {"encode_frame": encode, "b64encode(int32)": lambda: base64.b64encode(i32.data)},
        args.repeat,
    )
    dec = best_of(
        {
            "decode_frame": lambda: decode_frame(frame),
            "decode_rollout": lambda: decode_rollout(frame),
        },
        args.repeat,
    )

    def own_decode() -> Callable[[], object]:
        mine = bytes(bytearray(frame))  # a private copy per thread
        return lambda: decode_frame(mine)

    def own_encode() -> Callable[[], object]:
        mine = moe.copy()
        return lambda: encode(mine)

    scale_repeat = max(1, min(args.repeat, 3))
    dec_scale = scaling(own_decode, n_ids, args.threads, args.per_thread, scale_repeat)
    enc_scale = scaling(own_encode, n_ids, args.threads, args.per_thread, scale_repeat)
    stalls = {
        "idle": stall(idle(max(enc["encode_frame"].wall_s, 0.01)), args.repeat),
        "encode_frame": stall(encode, args.repeat),
        "decode_frame": stall(lambda: decode_frame(frame), args.repeat),
        "decode_rollout": stall(lambda: decode_rollout(frame), args.repeat),
    }
    b64 = enc["b64encode(int32)"]
    ef = enc["encode_frame"]
    return {
        "codec": read_header(frame).codec,
        "frame_bytes": len(frame),
        "ids": n_ids,
        "encode": {k: asdict(v) for k, v in enc.items()},
        "encode_cpu_over_b64": ef.cpu_s / b64.cpu_s,
        "encode_wall_over_b64": ef.wall_s / b64.wall_s,
        "decode": {k: asdict(v) for k, v in dec.items()},
        "decode_mids_per_s": {k: n_ids / v.wall_s / 1e6 for k, v in dec.items()},
        "decode_threads": {**asdict(dec_scale), "ratio": dec_scale.ratio},
        "encode_threads": {**asdict(enc_scale), "ratio": enc_scale.ratio},
        "stall_ms": {k: asdict(v) for k, v in stalls.items()},
    }


def cells(r: dict[str, Any], threads: int) -> list[tuple[str, str]]:
    """The table's rows for one data set: (figure, value)."""

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f}"

    enc, b64 = r["encode"]["encode_frame"], r["encode"]["b64encode(int32)"]
    out = [
        ("frame codec, bytes", f"{r['codec']}, {r['frame_bytes']:,}"),
        ("encode_frame CPU / wall ms", f"{ms(enc['cpu_s'])} / {ms(enc['wall_s'])}"),
        ("b64encode(int32) CPU / wall ms", f"{ms(b64['cpu_s'])} / {ms(b64['wall_s'])}"),
        (
            "**encode CPU / base64 CPU** (target <= 0.5x)",
            f"**{r['encode_cpu_over_b64']:.2f}x** (wall {r['encode_wall_over_b64']:.2f}x)",
        ),
    ]
    for name in ("decode_frame", "decode_rollout"):
        out.append(
            (
                f"{name}, 1 thread: ms, **M ids/s**",
                f"{ms(r['decode'][name]['wall_s'])}, **{r['decode_mids_per_s'][name]:.0f}**",
            )
        )
    for what in ("decode", "encode"):
        t = r[f"{what}_threads"]
        target = " (target >= 3x)" if what == "decode" else ""
        out.append(
            (
                f"{what}, {threads} threads / 1 thread, aggregate{target}",
                f"**{t['ratio']:.2f}x** ({t['one_ids_per_s'] / 1e6:.0f} -> "
                f"{t['many_ids_per_s'] / 1e6:.0f} M ids/s, "
                f"{t['many_cpu_over_wall']:.2f} cores busy)",
            )
        )
    for name, st in r["stall_ms"].items():
        target = "" if name == "idle" else " (target <= 1 ms)"
        out.append(
            (
                f"heartbeat longest gap, {name}: median / worst ms{target}",
                f"{st['median_ms']:.2f} / {st['worst_ms']:.2f}",
            )
        )
    return out


def report(results: dict[str, dict[str, Any]], threads: int) -> None:
    """Print the figures as one markdown table, a column per data set."""
    columns = [cells(r, threads) for r in results.values()]
    print("\n| figure | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for i, (label, _) in enumerate(columns[0]):
        print(f"| {label} | " + " | ".join(c[i][1] for c in columns) + " |")


def speedups(results: dict[str, dict[str, Any]]) -> None:
    """Native over numpy for each data set measured on both: CPU and throughput ratios."""
    print("\n### native / numpy, same run")
    for data in DATA:
        ref, nat = results.get(f"{data}, numpy"), results.get(f"{data}, native")
        if ref is None or nat is None:
            continue
        enc = ref["encode"]["encode_frame"]["cpu_s"] / nat["encode"]["encode_frame"]["cpu_s"]
        dec = {k: nat["decode_mids_per_s"][k] / ref["decode_mids_per_s"][k] for k in nat["decode"]}
        print(
            f"- {data}: encode CPU {enc:.2f}x less; decode_frame {dec['decode_frame']:.2f}x, "
            f"decode_rollout {dec['decode_rollout']:.2f}x faster on one thread (target >= 4x)"
        )


def main() -> None:
    """Measure skewed and uniform routing at one shape and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--per-thread", type=int, default=4, help="calls per thread, scaling runs")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--backends", default="numpy,native", help="codec backends, in order")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = cores
    print(
        f"# native codec baseline (issue 29) — python {platform.python_version()}, "
        f"numpy {np.__version__}, zstandard {zstandard.__version__}, {platform.machine()}, "
        f"{usable} usable cores of {cores}, switch interval "
        f"{sys.getswitchinterval() * 1e3:.0f} ms"
    )
    print(f"command: python {' '.join(sys.argv)}")
    shape = f"{args.tokens} rows x {args.layers} layers x top-{args.topk} of {args.experts}"
    print(f"shape: {shape}")
    results: dict[str, dict[str, Any]] = {}
    for data, kw in DATA.items():
        idx = synthetic_routing(args.tokens, args.layers, args.experts, args.topk, seed=1, **kw)
        for name in args.backends.split(","):
            with use_backend(name):
                results[f"{data}, {backend()}"] = measure(idx, args.experts, args)
    report(results, args.threads)
    speedups(results)
    if args.json:
        meta = {
            "command": sys.argv,
            "shape": shape,
            "cores": cores,
            "usable_cores": usable,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "python": platform.python_version(),
            "numpy": np.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
