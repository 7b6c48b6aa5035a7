"""Codec cost at real shapes, for issues 29 and 37: encode CPU, decode speed and size per
format version and backend, against upstream's base64 in the same run; thread scaling and
GIL stalls.

For each shape (``--shapes``: qwen3 48 layers x 128 experts x top-8, dsv3 58 x 256 x 8,
kimi-k2 60 x 384 x 8, e512 40 x 512 x 22; ``--tokens`` rows, 16,384 by default) and each
distribution (skewed: ``synthetic_routing`` skew 1.0, rho 0.9; uniform: skew 0, rho 0):

1. **encode**: process CPU (``time.process_time``) of ``encode_frame`` called as the
   engine calls it (``sglang_r3.http_server.shipping.Shipper._encode``: codec ``auto``,
   default block rows and layer groups, its own context, a whole-rollout segment with a
   token digest; rows in the smallest unsigned dtype, as
   ``sglang_r3.scheduler.row_transport.compact_rows`` hands them over), once per format
   version (``--versions``, default 2,3) and codec backend (``--backends``, default
   numpy,native), interleaved with two baselines:
   ``base64.b64encode`` of the ids as int32 (upstream SGLang 0.5.23's wire) and of the ids
   in the smallest unsigned dtype, uint8 (uint16 for E > 256: upstream main's narrow wire).
   Minor page faults per call (``ru_minflt``) are reported for every call.
2. **base64, fresh and warm**: the calls above run with the allocator as it comes
   ("fresh"): glibc maps base64's 33.5 MB int32 output with a new ``mmap`` on every call
   (above its 32 MiB dynamic threshold) and faults every page in, which costs ~2x.  After
   everything else, the run switches glibc to a warm heap (``mallopt``: no mmap, no trim)
   and measures base64 and the last backend's encodes again ("warm": output pages reused,
   no faults).  Each ratio names the state it uses.
3. **decode**, one thread: process CPU of ``decode_frame`` and ``decode_rollout`` of each
   frame; the baseline is v2's numpy reference (``use_backend("numpy")``) decoding the v2
   frame of the same rows, measured in the same interleaved rounds.
4. **size**: bytes per (token, layer) row of each version's frame, next to the set bound
   log2 C(E, K) / 8 and the per-layer empirical entropy bound (the mean over rows of the
   sum over a row's K ids of -log2 p_layer(id), minus log2 K!, in bytes).
5. **threads** and **GIL stalls**, at the first shape for each backend and the newest
   version in ``--versions``: aggregate throughput of ``--threads`` threads, each on its
   own copies, over one thread; the longest gap of a heartbeat thread (sleeping 0.1 ms)
   during one encode / decode, and while idle (the floor).

Times are the best of ``--repeat`` rounds (all calls of a round interleaved); stalls the
median and worst of ``--repeat`` runs.  Every frame is checked to round-trip, and the
frames of both backends to be byte-identical.

    python bench/native_codec_bench.py [--tokens 16384] [--repeat 5] [--threads 4]
        [--shapes qwen3,dsv3,kimi-k2,e512] [--versions 2,3] [--backends numpy,native]
        [--json bench/out/native_codec.json]
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import ctypes.util
import json
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3_client import Segment, decode_frame, decode_rollout, encode_frame, read_header, token_digest
from r3_client.codec import FORMAT_VERSION, backend, use_backend
from r3_client.synthetic import synthetic_routing

DATA = {"skewed": {"skew": 1.0, "rho": 0.9}, "uniform": {"skew": 0.0, "rho": 0.0}}
SHAPES = {  # name: (model id, layers, experts, topk)
    "qwen3": ("Qwen/Qwen3-30B-A3B", 48, 128, 8),  # issue 37's headline shape
    "dsv3": ("deepseek-ai/DeepSeek-V3", 58, 256, 8),
    "kimi-k2": ("moonshotai/Kimi-K2-Instruct", 60, 384, 8),
    "e512": ("nemotron-h-like", 40, 512, 22),  # E = 512 / K = 22; layer count assumed
}
B64_WIDE = "b64(int32)"
#: issue 37's decode baseline, today's v2 numpy reference (also the v2 numpy row's own key)
BASELINE = "decode_frame v2 numpy"


@dataclass(frozen=True, slots=True)
class Timing:
    """Best wall and best process-CPU seconds of a call, median CPU, median minor faults."""

    wall_s: float
    cpu_s: float
    cpu_median_s: float
    minflt: float  # minor page faults per call, median


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


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn: Callable[[], object]) -> tuple[float, float, int]:
    """Wall, process CPU and minor page faults of one call (its result dropped after)."""
    f0, c0, t0 = minflt(), time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0, minflt() - f0


def best_of(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, Timing]:
    """Best wall and best CPU of each call over ``repeat`` rounds, the calls interleaved."""
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            runs[name].append(timed(fn))
    return {
        name: Timing(
            min(t[0] for t in ts),
            min(t[1] for t in ts),
            statistics.median(t[1] for t in ts),
            statistics.median(t[2] for t in ts),
        )
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


def b64_narrow(num_experts: int) -> str:
    """The narrow wire's label: base64 of the ids in the smallest unsigned dtype."""
    return "b64(uint8)" if num_experts <= 256 else "b64(uint16)"


def bounds(idx: npt.NDArray[Any], num_experts: int) -> dict[str, float]:
    """Bytes per (token, layer) row: the set bound and the per-layer empirical entropy bound."""
    _, nl, k = idx.shape
    flat = (idx.astype(np.int64) + np.arange(nl)[None, :, None] * num_experts).reshape(-1)
    counts = np.bincount(flat, minlength=nl * num_experts).reshape(nl, num_experts)
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)  # bits per id, per layer
    ids_bits = float(h.mean()) * k  # mean over rows of sum over K ids of -log2 p_layer(id)
    return {
        "set_bound": math.log2(math.comb(num_experts, k)) / 8,
        "entropy_ids": ids_bits / 8,
        "entropy_bound": (ids_bits - math.log2(math.factorial(k))) / 8,
        "raw_narrow": float(engine_rows(idx[:1], num_experts).itemsize * k),
    }


def in_backend(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run on codec backend ``name``."""

    def call() -> object:
        with use_backend(name):
            return fn()

    return call


@contextmanager
def warm_allocator() -> Iterator[bool]:
    """glibc's heap kept warm for the rest of the process: no mmap, no trim (True if set).

    Freed large blocks then stay mapped and the next call of the same size reuses them,
    as a long-lived process with a steady allocation pattern would.  It is not undone
    (mallopt freezes glibc's dynamic thresholds), so the run does this last.
    """
    path = ctypes.util.find_library("c")
    ok = False
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc" and path:
        libc = ctypes.CDLL(path)
        m_trim_threshold, m_mmap_max = -1, -4
        ok = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    yield ok


class Case:
    """One shape and distribution: its rows, a frame per (version, backend), the baselines."""

    def __init__(self, shape: str, data: str, args: argparse.Namespace) -> None:
        self.shape, self.data = shape, data
        self.model_id, nl, self.num_experts, k = SHAPES[shape]
        self.idx = synthetic_routing(args.tokens, nl, self.num_experts, k, seed=1, **DATA[data])
        self.rows = args.tokens
        self.layers = tuple(range(nl))
        self.seg = Segment(
            0, self.rows, self.model_id, "v0", token_digest(np.arange(self.rows, dtype=np.uint32))
        )
        self.moe = engine_rows(self.idx, self.num_experts)
        self.versions = [int(v) for v in args.versions.split(",")]
        self.backends = args.backends.split(",")

    def encode(self, version: int, part: npt.NDArray[Any] | None = None) -> bytes:
        rows = self.moe if part is None else part
        return encode_frame(
            rows,
            num_experts=self.num_experts,
            layer_ids=self.layers,
            start=0,
            segment=self.seg,
            version=version,
        )

    def baselines(self) -> dict[str, Callable[[], object]]:
        i32 = np.ascontiguousarray(self.idx, dtype="<i4")
        narrow = self.moe
        return {
            B64_WIDE: lambda: base64.b64encode(i32.data),
            b64_narrow(self.num_experts): lambda: base64.b64encode(narrow.data),
        }

    def frames(self) -> dict[tuple[int, str], bytes]:
        """Every (version, backend) frame, checked: round trip, same bytes on each backend."""
        out: dict[tuple[int, str], bytes] = {}
        want = np.sort(self.idx, -1)
        for version in sorted({2, *self.versions}):
            for name in self.backends:
                with use_backend(name):
                    frame = self.encode(version)
                    got = decode_rollout(frame)
                if not np.array_equal(np.sort(got.indices, -1), want):
                    raise SystemExit(f"round trip mismatch: {self.shape} {self.data} v{version}")
                out[version, name] = frame
        return out


def key(version: int, name: str) -> str:
    return f"v{version} {name}"


def measure(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Encode, decode and size figures for one shape and distribution (allocator fresh)."""
    frames = case.frames()
    n_rows = case.rows * len(case.layers)
    enc_fns = dict(case.baselines())
    dec_fns: dict[str, Callable[[], object]] = {
        BASELINE: in_backend("numpy", partial(decode_frame, frames[2, case.backends[0]]))
    }
    for version in case.versions:
        for name in case.backends:
            frame = frames[version, name]
            enc_fns[f"encode_frame {key(version, name)}"] = in_backend(
                name, partial(case.encode, version)
            )
            dec_fns[f"decode_frame {key(version, name)}"] = in_backend(
                name, partial(decode_frame, frame)
            )
            dec_fns[f"decode_rollout {key(version, name)}"] = in_backend(
                name, partial(decode_rollout, frame)
            )
    enc = best_of(enc_fns, args.repeat)
    dec = best_of(dec_fns, args.repeat)
    wide = enc[B64_WIDE]
    narrow = enc[b64_narrow(case.num_experts)]
    base = dec[BASELINE]
    codecs: dict[str, Any] = {}
    sizes = {v: len(frames[v, case.backends[0]]) for v in {2, *case.versions}}
    for version in case.versions:
        for name in case.backends:
            e = enc[f"encode_frame {key(version, name)}"]
            d = dec[f"decode_frame {key(version, name)}"]
            r = dec[f"decode_rollout {key(version, name)}"]
            frame = frames[version, name]
            codecs[key(version, name)] = {
                "version": version,
                "backend": name,
                "codec": read_header(frame).codec,
                "frame_bytes": len(frame),
                "B_per_row": len(frame) / n_rows,
                "size_over_v2": len(frame) / sizes[2],
                "identical_across_backends": all(
                    frames[version, b] == frame for b in case.backends
                ),
                "encode": asdict(e),
                "encode_cpu_over_b64_int32_fresh": e.cpu_s / wide.cpu_s,
                "encode_cpu_over_b64_narrow_fresh": e.cpu_s / narrow.cpu_s,
                "decode_frame": asdict(d),
                "decode_rollout": asdict(r),
                "decode_frame_speedup_over_v2_numpy": base.cpu_s / d.cpu_s,
                "decode_rollout_speedup_over_v2_numpy": base.cpu_s / r.cpu_s,
                "decode_frame_mids_per_cpu_s": case.idx.size / d.cpu_s / 1e6,
            }
    return {
        "shape": case.shape,
        "data": case.data,
        "model_id": case.model_id,
        "rows": case.rows,
        "layers": len(case.layers),
        "experts": case.num_experts,
        "topk": case.idx.shape[2],
        "ids": case.idx.size,
        "bounds_B_per_row": bounds(case.idx, case.num_experts),
        "b64_fresh": {B64_WIDE: asdict(wide), "narrow": asdict(narrow)},
        "b64_narrow_wire": b64_narrow(case.num_experts),
        "decode_baseline_v2_numpy": asdict(base),
        "codecs": codecs,
    }


def measure_warm(case: Case, r: dict[str, Any], args: argparse.Namespace) -> None:
    """base64 and the last backend's encodes again, allocator warm; into ``r["warm"]``."""
    name = case.backends[-1]
    fns = dict(case.baselines())
    for version in case.versions:
        fns[f"encode_frame {key(version, name)}"] = in_backend(name, partial(case.encode, version))
    for fn in fns.values():  # one call each first: the heap grows to its steady size
        fn()
    got = best_of(fns, args.repeat)
    wide, narrow = got[B64_WIDE], got[b64_narrow(case.num_experts)]
    r["warm"] = {
        "backend": name,
        B64_WIDE: asdict(wide),
        "narrow": asdict(narrow),
        "encode": {k: asdict(v) for k, v in got.items() if k.startswith("encode_frame")},
    }
    for version in case.versions:
        c = r["codecs"][key(version, name)]
        w = got[f"encode_frame {key(version, name)}"]
        c["encode_warm"] = asdict(w)
        c["encode_cpu_warm_over_b64_int32_warm"] = w.cpu_s / wide.cpu_s
        c["encode_cpu_warm_over_b64_narrow_warm"] = w.cpu_s / narrow.cpu_s
    for c in r["codecs"].values():  # every backend's fresh encode over the warm base64
        c["encode_cpu_over_b64_int32_warm"] = c["encode"]["cpu_s"] / wide.cpu_s
        c["encode_cpu_over_b64_narrow_warm"] = c["encode"]["cpu_s"] / narrow.cpu_s


def detail(case: Case, version: int, args: argparse.Namespace) -> dict[str, Any]:
    """Threads and GIL stalls for one case, version and the current backend."""
    frame = case.encode(version)
    n_ids = case.idx.size

    def own_decode() -> Callable[[], object]:
        mine = bytes(bytearray(frame))  # a private copy per thread
        return lambda: decode_frame(mine)

    def own_encode() -> Callable[[], object]:
        mine = case.moe.copy()
        return lambda: case.encode(version, mine)

    scale_repeat = max(1, min(args.repeat, 3))
    dec_scale = scaling(own_decode, n_ids, args.threads, args.per_thread, scale_repeat)
    enc_scale = scaling(own_encode, n_ids, args.threads, args.per_thread, scale_repeat)
    enc_wall = timed(lambda: case.encode(version))[0]
    stalls = {
        "idle": stall(idle(max(enc_wall, 0.01)), args.repeat),
        "encode_frame": stall(lambda: case.encode(version), args.repeat),
        "decode_frame": stall(lambda: decode_frame(frame), args.repeat),
        "decode_rollout": stall(lambda: decode_rollout(frame), args.repeat),
    }
    return {
        "version": version,
        "decode_threads": {**asdict(dec_scale), "ratio": dec_scale.ratio},
        "encode_threads": {**asdict(enc_scale), "ratio": enc_scale.ratio},
        "stall_ms": {k: asdict(v) for k, v in stalls.items()},
    }


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def faults(t: dict[str, Any]) -> str:
    return f"{ms(t['cpu_s'])} ({t['minflt']:,.0f} f)"


def report_baselines(results: dict[str, dict[str, Any]]) -> None:
    print("\n### baselines and bounds (ms CPU best; (N f): minor page faults per call, median)\n")
    print(
        "| shape | data | b64(int32) fresh | b64(int32) warm | narrow wire | narrow fresh "
        "| narrow warm | v2 numpy decode_frame (decode baseline) | set bound B/row "
        "| entropy bound B/row (ids - log2 K!) | id entropy B/row |"
    )
    print("|---|---|" + "---:|" * 9)
    for r in results.values():
        w = r.get("warm")
        b = r["bounds_B_per_row"]
        print(
            f"| {r['shape']} {r['layers']}x{r['experts']}x{r['topk']} | {r['data']} "
            f"| {faults(r['b64_fresh'][B64_WIDE])} "
            f"| {faults(w[B64_WIDE]) if w else '—'} | {r['b64_narrow_wire']} "
            f"| {faults(r['b64_fresh']['narrow'])} | {faults(w['narrow']) if w else '—'} "
            f"| {ms(r['decode_baseline_v2_numpy']['cpu_s'])} | {b['set_bound']:.3f} "
            f"| {b['entropy_bound']:.3f} | {b['entropy_ids']:.3f} |"
        )


def report_codecs(results: dict[str, dict[str, Any]]) -> None:
    print(
        "\n### encode / decode / size per version and backend (ms CPU best, one thread)\n\n"
        "encode CPU / base64 CPU: `fresh` = both with the allocator as it comes; "
        "`/warm` = this encode (fresh) over base64 with a warm heap (no faults: the strict "
        "denominator); `warm/warm` = both warm (last backend only). Decode speed-up is "
        f"over `{BASELINE}` (v2's numpy reference on the v2 frame, same rows, same run).\n"
    )
    print(
        "| shape | data | frame | codec | B/row | size / v2 | encode ms (faults) "
        "| **encode CPU / base64 CPU** int32: fresh, /warm, warm/warm | narrow: fresh, /warm "
        "| decode_frame ms | decode_rollout ms | **decode / v2 numpy** frame, rollout |"
    )
    print("|---|---|---|---|" + "---:|" * 8)
    for r in results.values():
        for name, c in r["codecs"].items():
            ww = c.get("encode_cpu_warm_over_b64_int32_warm")
            same = "" if c["identical_across_backends"] else " (differs!)"
            print(
                f"| {r['shape']} | {r['data']} | {name} | {c['codec']}{same} "
                f"| {c['B_per_row']:.3f} | {c['size_over_v2']:.3f} | {faults(c['encode'])} "
                f"| **{c['encode_cpu_over_b64_int32_fresh']:.2f}x**, "
                f"{c.get('encode_cpu_over_b64_int32_warm', math.nan):.2f}x, "
                f"{'—' if ww is None else f'{ww:.2f}x'} "
                f"| {c['encode_cpu_over_b64_narrow_fresh']:.2f}x, "
                f"{c.get('encode_cpu_over_b64_narrow_warm', math.nan):.2f}x "
                f"| {ms(c['decode_frame']['cpu_s'])} | {ms(c['decode_rollout']['cpu_s'])} "
                f"| **{c['decode_frame_speedup_over_v2_numpy']:.2f}x**, "
                f"{c['decode_rollout_speedup_over_v2_numpy']:.2f}x |"
            )


def detail_cells(r: dict[str, Any], threads: int) -> list[tuple[str, str]]:
    """The detail table's rows for one (data, backend): (figure, value)."""
    out = []
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


def report_detail(details: dict[str, dict[str, Any]], shape: str, threads: int) -> None:
    if not details:
        return
    print(f"\n### threads and GIL stalls, {shape}\n")
    columns = [detail_cells(r, threads) for r in details.values()]
    print("| figure | " + " | ".join(details) + " |")
    print("|---|" + "---:|" * len(details))
    for i, (label, _) in enumerate(columns[0]):
        print(f"| {label} | " + " | ".join(c[i][1] for c in columns) + " |")


def report_targets(results: dict[str, dict[str, Any]], versions: list[int]) -> None:
    """Issue 37's figures for the newest version on the native backend (else the last)."""
    newest = max(versions)
    print(f"\n### issue 37 targets, v{newest} (same run)\n")
    for r in results.values():
        name = next((k for k in r["codecs"] if k == key(newest, "native")), None)
        name = name or [k for k in r["codecs"] if k.startswith(f"v{newest} ")][-1]
        c = r["codecs"][name]
        ww = c.get("encode_cpu_warm_over_b64_int32_warm")
        warm = "" if ww is None else f", both warm {ww:.2f}x"
        print(
            f"- {r['shape']} {r['data']}, {name}: encode CPU / base64 CPU (int32) fresh "
            f"{c['encode_cpu_over_b64_int32_fresh']:.2f}x, over warm base64 "
            f"{c.get('encode_cpu_over_b64_int32_warm', math.nan):.2f}x{warm} (target <= 0.5x); "
            f"over {r['b64_narrow_wire']} fresh {c['encode_cpu_over_b64_narrow_fresh']:.2f}x; "
            f"decode_frame / v2 numpy {c['decode_frame_speedup_over_v2_numpy']:.2f}x "
            f"(target >= 4x); size / v2 {c['size_over_v2']:.3f} (target <= 1)"
        )


def main() -> None:
    """Measure every shape, distribution, version and backend, and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--versions", default="2,3", help="format versions to write, 2 and/or 3")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--per-thread", type=int, default=4, help="calls per thread, scaling runs")
    ap.add_argument("--no-detail", action="store_true", help="skip the threads and stalls")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-allocator pass")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--backends", default="numpy,native", help="codec backends, in order")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    versions = [int(v) for v in args.versions.split(",")]
    if unknown_v := [v for v in versions if v not in (2, 3)]:
        ap.error(f"unknown versions {unknown_v}; choose from 2, 3")
    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = cores
    print(
        f"# native codec (issues 29, 37) — python {platform.python_version()}, "
        f"numpy {np.__version__}, zstandard {zstandard.__version__}, {platform.machine()}, "
        f"{usable} usable cores of {cores}, switch interval "
        f"{sys.getswitchinterval() * 1e3:.0f} ms, default format v{FORMAT_VERSION}"
    )
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{args.tokens} rows per rollout; shapes {', '.join(shapes)}; versions {versions}")
    results: dict[str, dict[str, Any]] = {}
    cases: dict[str, Case] = {}
    details: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        for data in DATA:
            case = cases[f"{shape}/{data}"] = Case(shape, data, args)
            results[f"{shape}/{data}"] = measure(case, args)
            if shape == shapes[0] and not args.no_detail:
                for name in case.backends:
                    with use_backend(name):
                        details[f"{data}, {backend()} v{max(versions)}"] = detail(
                            case, max(versions), args
                        )
    warm = False
    if not args.no_warm:
        with warm_allocator() as warm:
            if warm:
                for k, case in cases.items():
                    measure_warm(case, results[k], args)
    if not warm:
        print("warm allocator: not measured (needs glibc; or --no-warm)")
    report_baselines(results)
    report_codecs(results)
    report_detail(details, shapes[0], args.threads)
    report_targets(results, versions)
    if args.json:
        meta = {
            "command": sys.argv,
            "tokens": args.tokens,
            "shapes": {s: SHAPES[s] for s in shapes},
            "versions": versions,
            "default_version": FORMAT_VERSION,
            "warm_allocator": warm,
            "cores": cores,
            "usable_cores": usable,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "zstandard": zstandard.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "detail": details}, f, indent=1)


if __name__ == "__main__":
    main()
