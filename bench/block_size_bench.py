"""What a stored block size costs and saves: the measurement issue 44 asks the block size
to be decided from.

Per block size (token rows per chunk; the store takes 2,048 today), at the Qwen3-30B-A3B
shape (48 layers, 128 experts, top-8; 8 layer groups), skewed and uniform routing, one
rollout of ``--tokens`` tokens:

* **stored**: bytes per token and the header (what every reader of a segment receives once);
* **decode**: a whole rollout's decode time, and a CP rank's (its two zigzag ranges of one
  pipeline stage's 12 layers: the chunks it receives, cut and decoded as a rank does);
* **bytes / share**: what a CP rank receives under the chunked layout (the chunks its rows
  and layers overlap, plus the head) over its share (its rows x layers at the rollout's
  bytes per row and layer), worst and mean over the CP ranks, for 16k and 4k samples at
  CP 2 and 4 (zigzag: rank ``c`` reads chunks ``c`` and ``2 cp - 1 - c`` of ``2 cp``).

Decode times are the median of ``--repeat`` runs, the 2,048-row figures the baseline in
the same run.

    python bench/block_size_bench.py --tokens 16384 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from r3_client import decode_rollout, encode_frame, read_header, slice_frame  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from r3_client.wire import chunk_spans, needed_chunks  # noqa: E402

LAYERS, E, K = 48, 128, 8
SIZES = (2048, 1024, 512, 256)


def zigzag(rows: int, cp: int, c: int) -> list[tuple[int, int]]:
    n = 2 * cp
    cut = [rows * i // n for i in range(n + 1)]
    return [(cut[j], cut[j + 1]) for j in (c, n - 1 - c)]


def received_over_share(frame: bytes, rows: int, cp: int, stage: list[int]) -> list[float]:
    """Per CP rank: the bytes of the chunks its zigzag ranges and ``stage`` layers need plus
    the head, over its share of the frame's chunk bytes."""
    hdr = read_header(frame)
    spans = chunk_spans(hdr)
    head = hdr.frame_length - hdr.body_length
    per_row_layer = hdr.body_length / (rows * LAYERS)
    out = []
    for c in range(cp):
        ranges = zigzag(rows, cp, c)
        need: set[int] = set()
        for a, b in ranges:
            need.update(needed_chunks(hdr, start=a, end=b, layers=stage))
        got = head + sum(spans[i].length for i in need)
        share = per_row_layer * sum(b - a for a, b in ranges) * len(stage)
        out.append(got / share)
    return out


def timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "block_size_bench.json")
    args = ap.parse_args()
    stage = list(range(12, 24))  # pipeline stage 1 of 4
    report: dict[str, Any] = {"tokens": args.tokens, "sizes": list(SIZES)}
    for dist, skew, rho in (("skewed", 1.0, 0.9), ("uniform", 0.0, 0.0)):
        rows16 = args.tokens - 1
        idx = synthetic_routing(rows16, LAYERS, E, K, skew=skew, rho=rho, seed=3)
        res: dict[str, Any] = {}
        for br in SIZES:
            frame = encode_frame(idx, num_experts=E, layer_ids=range(LAYERS), block_rows=br)
            hdr = read_header(frame)
            whole_s = timed(lambda f=frame: decode_rollout(f), args.repeat)

            def rank_decode(f: bytes = frame, rows: int = rows16) -> None:
                for a, b in zigzag(rows, 2, 0):
                    part = slice_frame(f, start=a, end=b, layers=stage)
                    decode_rollout(part, start=a, end=b, layers=stage)

            rank_s = timed(rank_decode, args.repeat)
            row: dict[str, Any] = {
                "bytes_per_token": len(frame) / args.tokens,
                "header_bytes": hdr.frame_length - hdr.body_length,
                "whole_decode_ms": whole_s * 1e3,
                "rank_decode_ms": rank_s * 1e3,
            }
            for tokens in (args.tokens, 4096):
                rows = tokens - 1
                f = frame if tokens == args.tokens else encode_frame(
                    idx[:rows], num_experts=E, layer_ids=range(LAYERS), block_rows=br
                )  # fmt: skip
                for cp in (2, 4):
                    ratios = received_over_share(f, rows, cp, stage)
                    row[f"{tokens}_cp{cp}_worst"] = max(ratios)
                    row[f"{tokens}_cp{cp}_mean"] = statistics.mean(ratios)
            res[str(br)] = row
            print(f"[{dist}] block {br}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            ), flush=True)  # fmt: skip
        report[dist] = res
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
