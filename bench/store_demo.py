"""Foundation demo: a multi-turn rollout through the codec and a real, embedded Redis.

Starts ``redis-server`` on a free loopback port (AOF on, files in a temp dir),
writes a 3-turn synthetic Qwen3-30B-A3B-shaped rollout (48 MoE layers, 128
experts, top-8) one segment per turn, reads it back whole and sliced, and
prints bytes per token against upstream's int32 and base64.  Every process it
starts is stopped on exit, including on Ctrl-C.

    python bench/store_demo.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from cache_service.redis_proc import RedisProcess, free_port
from cache_service.store import SegmentStore, StoreSettings
from r3_client import Segment, encode_frame, token_digest
from r3_client.testing import synthetic_routing

L, E, K = 48, 128, 8


async def run(url: str, tokens: int) -> None:
    """Write three turns, read back, print the summary."""
    print(f"[1/3] synthesising a {tokens}-token rollout: {L} MoE layers x {E} experts, top-{K}")
    traj = synthetic_routing(tokens - 1, L, E, K, skew=1.0, rho=0.9, seed=0)
    token_ids = np.random.default_rng(0).integers(0, 150_000, size=tokens)
    cuts = [0, (tokens - 1) // 3, 2 * (tokens - 1) // 3, tokens - 1]
    store = await SegmentStore.connect(StoreSettings(redis_url=url))
    try:
        print("[2/3] storing one segment per turn (only the new rows each time)")
        total = 0
        for turn, (a, b) in enumerate(itertools.pairwise(cuts), 1):
            seg = Segment(a, b, "qwen3-30b-a3b-synthetic", f"w{turn}", token_digest(token_ids[:b]))
            frame = encode_frame(traj[a:b], num_experts=E, layer_ids=range(L), segment=seg)
            res = await store.put_segment("demo-rollout", frame)
            total += res.nbytes
            print(f"      turn {turn}: rows [{a}, {b}) -> {res.nbytes:,} bytes ({res.status})")
        again = await store.put_segment("demo-rollout", frame)
        print(f"      re-sending turn 3: {again.status} (stored once)")
        print("[3/3] reading back")
        t0 = time.perf_counter()
        got = await store.get("demo-rollout")
        dt = time.perf_counter() - t0
        ok = np.array_equal(np.sort(got.indices, -1), np.sort(traj, -1))
        part = await store.get("demo-rollout", start=100, end=200, layers=[0, 47])
        st = await store.stat("demo-rollout")
    finally:
        await store.close()
    rows = tokens - 1
    int32 = rows * L * K * 4
    bound = rows * L * math.log2(math.comb(E, K)) / 8
    print()
    print(f"  round trip exact (as sets): {ok}; whole rollout read in {dt * 1000:.0f} ms")
    print(f"  slice [100, 200) x layers (0, 47): shape {part.indices.shape}")
    print(f"  upstream int32:  {int32 / tokens:8.0f} B/token")
    print(f"  upstream base64: {math.ceil(int32 / 3) * 4 / tokens:8.0f} B/token")
    print(f"  set bound:       {bound / tokens:8.0f} B/token")
    print(f"  stored:          {total / tokens:8.0f} B/token ({int32 / total:.1f}x < int32)")
    print(f"  Redis MEMORY USAGE of the rollout: {st.memory_bytes:,} bytes")
    if not ok:
        raise SystemExit("round trip mismatch")


def main() -> None:
    """Entry point: start Redis, run the demo, always stop Redis."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="r3-demo-") as tmp:
        redis = RedisProcess(free_port(), Path(tmp), appendonly=True).start()
        print(f"embedded redis-server pid {redis.pid} on {redis.url} (AOF in {tmp})")
        try:
            asyncio.run(run(redis.url, args.tokens))
        except KeyboardInterrupt:
            print("interrupted")
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
