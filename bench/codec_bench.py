"""Codec benchmark: bytes per (token x MoE layer) and encode/decode time, with baselines.

Every codec is measured in the same run as upstream's formats and generic
compressors on the same array, so the ratios hold on any machine:

* baselines: int32 (upstream), base64 of int32 (upstream's wire form), the
  smallest unsigned dtype (uint8/uint16), zstd-3 of int32 and of that dtype,
  and the set bound log2 C(E, K) / 8 bytes per row;
* ours: ``raw``, ``set``, ``set-zstd`` and ``auto`` frames (the default).

Data: (a) uniform random top-k sets; (b) skewed synthetic routing — per-layer
Zipf expert popularity (skew 1.0) and AR(1) token correlation (rho 0.9).
Shapes: Qwen3-30B-A3B 48x128x8, DeepSeek-V3 58x256x8, Kimi-K2 60x384x8.

    python bench/codec_bench.py [--tokens 32768] [--repeat 5] [--json out.json]

Times are the best of ``--repeat`` runs; the targets are checked as ratios.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from r3_client import decode_frame, encode_frame, read_header
from r3_client.synthetic import synthetic_routing

SHAPES = [("Qwen3-30B-A3B", 48, 128, 8), ("DeepSeek-V3", 58, 256, 8), ("Kimi-K2", 60, 384, 8)]
DATA = {"uniform": {"skew": 0.0, "rho": 0.0}, "skewed": {"skew": 1.0, "rho": 0.9}}


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of ``repeat`` calls, and the last result."""
    out, t_best = None, math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        t_best = min(t_best, time.perf_counter() - t0)
    return t_best, out


def measure(idx: np.ndarray, e: int, repeat: int) -> list[dict[str, Any]]:
    """All baselines and codecs on one array; one dict per method."""
    rows, nl, k = idx.shape
    n = rows * nl
    rows_out: list[dict[str, Any]] = []

    def add(name: str, size: float, enc: float | None, dec: float | None) -> None:
        rows_out.append(
            {"method": name, "bytes_per_row": size / n, "encode_s": enc, "decode_s": dec}
        )

    i32 = np.ascontiguousarray(idx, dtype="<i4")
    raw32 = i32.tobytes()
    add("int32 (upstream)", len(raw32), None, None)
    t_enc, b64 = best(lambda: base64.b64encode(raw32), repeat)
    t_dec, _ = best(lambda: np.frombuffer(base64.b64decode(b64), dtype="<i4"), repeat)
    add("base64(int32) (upstream wire)", len(b64), t_enc, t_dec)
    small = np.dtype("u1") if e <= 255 else np.dtype("<u2")
    t_enc, ub = best(lambda: i32.astype(small).tobytes(), repeat)
    add(f"{small.name}", len(ub), t_enc, None)
    zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    t_enc, z32 = best(lambda: zc.compress(raw32), repeat)
    t_dec, _ = best(lambda: np.frombuffer(zd.decompress(z32), dtype="<i4"), repeat)
    add("zstd-3(int32)", len(z32), t_enc, t_dec)
    t_enc, zsm = best(lambda: zc.compress(ub), repeat)
    t_dec, _ = best(lambda: np.frombuffer(zd.decompress(zsm), dtype=small), repeat)
    add(f"zstd-3({small.name})", len(zsm), t_enc, t_dec)
    add("set bound log2 C(E,K)", n * math.log2(math.comb(e, k)) / 8, None, None)
    layers = list(range(nl))
    for codec in ("raw", "set", "set-zstd", "auto"):
        t_enc, frame = best(
            lambda c=codec: encode_frame(idx, num_experts=e, layer_ids=layers, codec=c), repeat
        )
        t_dec, dec = best(lambda f=frame: decode_frame(f), repeat)
        if not np.array_equal(np.sort(dec.routing.indices, -1), np.sort(idx, -1)):
            raise SystemExit(f"{codec}: round trip mismatch")
        name = f"frame {codec}" + (
            f" (chose {read_header(frame).codec})" if codec == "auto" else ""
        )
        add(name, len(frame), t_enc, t_dec)
    return rows_out


def report(shape: str, data: str, tokens: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Print one markdown table and return the target checks for it."""
    by = {r["method"]: r for r in rows}
    bound = by["set bound log2 C(E,K)"]["bytes_per_row"]
    z32 = by["zstd-3(int32)"]
    print(f"\n### {shape}, {data}, {tokens} tokens\n")
    print(
        "| method | B / (token x layer) | x set bound | encode ms | decode ms "
        "| encode / zstd-3(int32) | decode / zstd(int32) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")

    def ms(x: float | None) -> str:
        return "" if x is None else f"{x * 1e3:.1f}"

    def ratio(x: float | None, base: float) -> str:
        return "" if x is None else f"{x / base:.2f}"

    for r in rows:
        enc, dec = r["encode_s"], r["decode_s"]
        print(
            f"| {r['method']} | {r['bytes_per_row']:.3f} | {r['bytes_per_row'] / bound:.3f} "
            f"| {ms(enc)} | {ms(dec)} | {ratio(enc, z32['encode_s'])} "
            f"| {ratio(dec, z32['decode_s'])} |"
        )
    auto = next(r for r in rows if r["method"].startswith("frame auto"))
    return {
        "shape": shape,
        "data": data,
        "auto_vs_bound": auto["bytes_per_row"] / bound,
        "auto_encode_vs_zstd3": auto["encode_s"] / z32["encode_s"],
        "auto_decode_vs_zstd": auto["decode_s"] / z32["decode_s"],
        "auto_codec": auto["method"],
    }


def main() -> None:
    """Run every shape x data combination and print the tables and target checks."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shapes", default="all", help="comma list of model names, or all")
    ap.add_argument("--json", help="also write raw results here")
    args = ap.parse_args()
    shapes = (
        SHAPES if args.shapes == "all" else [s for s in SHAPES if s[0] in args.shapes.split(",")]
    )
    print(
        f"# codec benchmark — python {platform.python_version()}, numpy {np.__version__}, "
        f"zstandard {zstandard.__version__}, {platform.machine()}"
    )
    print(f"command: python {' '.join(sys.argv)}")
    results, checks = [], []
    for name, nl, e, k in shapes:
        for data, kw in DATA.items():
            idx = synthetic_routing(args.tokens, nl, e, k, seed=1, **kw)
            rows = measure(idx, e, args.repeat)
            results.append({"shape": name, "data": data, "rows": rows})
            checks.append(report(name, data, args.tokens, rows))
    print("\n### targets (compact codec = `auto`, the default)\n")
    print("| shape | data | codec | size / bound | encode / zstd-3(int32) | decode / zstd(int32) |")
    print("|---|---|---|---:|---:|---:|")
    for c in checks:
        print(
            f"| {c['shape']} | {c['data']} | {c['auto_codec'][len('frame auto ') :]} "
            f"| {c['auto_vs_bound']:.3f} | {c['auto_encode_vs_zstd3']:.2f} "
            f"| {c['auto_decode_vs_zstd']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "checks": checks}, f, indent=1)


if __name__ == "__main__":
    main()
