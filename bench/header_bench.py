"""What the service spends per ranged GET on a stored frame's header: parsed every
request (before issue 25) vs kept by :class:`cache_service.store.header_cache.HeaderCache`.

Measures the service's own slicing step (``r3_client.stored.cut``, the CPU a ranged GET
spends beyond Redis and HTTP) in one process, for a canonical frame (2,048-row
blocks) and for a frame of one-row blocks as a writer could store before the
block-table rule (the issue stored 250,000; 120,000 one-row blocks fit the 1 MiB header limit with
this encoder; ``--rows``), each with the cache cold
(every request parses: the old behaviour) and warm.

    python bench/header_bench.py [--rows 120000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import time

from cache_service.store.header_cache import HeaderCache
from r3_client import Segment, encode_frame
from r3_client.stored import Chunked, Headers, cut
from r3_client.synthetic import synthetic_routing

LAYERS, E, K = (1, 3, 5), 64, 4


def _per_get(frame: bytes, rows: int, cache_size: int, repeat: int) -> float:
    """Seconds per ranged cut of ``frame`` (rows [rows//2, rows//2 + 10))."""
    cache = HeaderCache(max_bytes=cache_size)
    segs: list[tuple[int, int, bytes | Chunked]] = [(0, rows, frame)]
    mid = rows // 2
    # each GET is a read of its own: a fresh Headers, the service's cache behind it
    cut("r", segs, {}, mid, mid + 10, None, headers=Headers(cache.header))  # warm (or not)
    t0 = time.perf_counter()
    for _ in range(repeat):
        cut("r", segs, {}, mid, mid + 10, None, headers=Headers(cache.header))
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=120_000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    idx = synthetic_routing(args.rows, len(LAYERS), E, K, seed=0)
    seg = Segment(0, args.rows)
    frames = {
        "2048-row blocks": encode_frame(idx, num_experts=E, layer_ids=LAYERS, segment=seg),
        "1-row blocks": encode_frame(
            idx, num_experts=E, layer_ids=LAYERS, segment=seg, block_rows=1, layer_groups=1
        ),
    }
    print(f"ranged GET slicing, {args.rows} rows x {len(LAYERS)} layers x top-{K}")
    print(f"{'frame':<16} {'bytes':>10} {'parsed each GET':>16} {'cached':>10} {'ratio':>7}")
    for name, frame in frames.items():
        cold = _per_get(frame, args.rows, 0, args.repeat)  # max_bytes 0: nothing kept
        warm = _per_get(frame, args.rows, 64 << 20, args.repeat)
        print(
            f"{name:<16} {len(frame):>10} {cold * 1e3:>13.3f} ms {warm * 1e3:>7.3f} ms "
            f"{cold / warm:>6.1f}x"
        )


if __name__ == "__main__":
    main()
