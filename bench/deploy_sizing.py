"""Redis memory per rollout, measured: the numbers docs/deploy.md sizes Redis with.

Starts its own ``redis-server`` (loopback, AOF off: memory, not disk, is measured),
stores Qwen3-30B-A3B-shaped rollouts (48 MoE layers x 128 experts, top-8) through the
service's own ``SegmentStore`` exactly as the engine ships them, and reads Redis's
``used_memory`` before and after:

* single-turn rollouts of ``--tokens`` tokens, uniform and skewed routing;
* a GRPO group: ``--group`` samples sharing a ``--prompt``-token prompt, the prompt
  shipped as its own segment (``share=True``: deduplicated by the store), the response as
  another (``share=False``, as the engine puts a sample's own rows).

Baselines are what upstream SGLang hands back per token: int32 (L*K*4 bytes) and the
base64 of it. Every process it starts is stopped on exit, also on Ctrl-C.

    python bench/deploy_sizing.py [--tokens 16384] [--rollouts 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from cache_service.redis_proc import RedisProcess, free_port
from cache_service.store import SegmentStore, StoreSettings
from r3_client import Segment, encode_frame, token_digest
from r3_client.synthetic import synthetic_routing

L, E, K = 48, 128, 8
DATA = {"uniform": {"skew": 0.0, "rho": 0.0}, "skewed": {"skew": 1.0, "rho": 0.9}}


async def _used(r: aioredis.Redis) -> int:
    info = await r.info("memory")
    return int(info["used_memory"])


def _frame(rows: np.ndarray, a: int, b: int, ids: np.ndarray, version: str) -> bytes:
    seg = Segment(a, b, "qwen3-30b-a3b", version, token_digest(ids[:b]))
    return encode_frame(rows, num_experts=E, layer_ids=range(L), segment=seg)


async def single(
    store: SegmentStore, r: aioredis.Redis, data: str, n: int, t: int
) -> dict[str, Any]:
    """``n`` one-segment rollouts of ``t`` tokens: memory per rollout and per token."""
    before = await _used(r)
    wire = 0
    for i in range(n):
        rows = synthetic_routing(t, L, E, K, seed=100 + i, **DATA[data])
        ids = np.random.default_rng(i).integers(0, 150_000, size=t + 1)
        frame = _frame(rows, 0, t, ids, "w1")
        wire += len(frame)
        # what the engine puts for a sample nobody shares: its own, freed with it
        await store.put_segment(f"{data}-{i}", frame, share=False)
    used = await _used(r) - before
    return {
        "case": f"single-turn, {data}",
        "rollouts": n,
        "tokens": t,
        "frame_bytes_per_token": wire / (n * t),
        "redis_bytes_per_token": used / (n * t),
        "redis_bytes_per_rollout": used / n,
    }


async def group(
    store: SegmentStore, r: aioredis.Redis, data: str, g: int, p: int, t: int
) -> dict[str, Any]:
    """One GRPO group: ``g`` samples of ``t`` tokens sharing a ``p``-token prompt."""
    prompt = synthetic_routing(p, L, E, K, seed=7, **DATA[data])
    # Different tokens per data kind: same tokens with other routing would not be shared.
    prompt_ids = np.random.default_rng(len(data)).integers(0, 150_000, size=p)
    before = await _used(r)
    hits = 0
    for s in range(g):
        resp = synthetic_routing(t - p, L, E, K, seed=1000 + s, **DATA[data])
        ids = np.concatenate([prompt_ids, np.random.default_rng(s).integers(0, 150_000, t - p + 1)])
        rid = f"group-{data}-{s}"
        # as the engine puts a GRPO group's sample (sglang_r3 Shipper): the prompt shared,
        # the response the sample's own
        res = await store.put_segment(rid, _frame(prompt, 0, p, ids, "w1"), share=True)
        hits += int(res.dedupe_hit)
        await store.put_segment(rid, _frame(resp, p, t, ids, "w1"), share=False)
    used = await _used(r) - before
    return {
        "case": f"GRPO group of {g}, {p}-token shared prompt, {data}",
        "rollouts": g,
        "tokens": t,
        "dedupe_hits": hits,
        "redis_bytes_per_token": used / (g * t),
        "redis_bytes_per_rollout": used / g,
    }


async def run(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    store = await SegmentStore.connect(StoreSettings(redis_url=url, default_ttl_s=0))
    r = aioredis.from_url(url)
    out = []
    try:
        for data in DATA:
            out.append(await single(store, r, data, args.rollouts, args.tokens))
            print(_row(out[-1]), flush=True)
            out.append(await group(store, r, data, args.group, args.prompt, args.tokens))
            print(_row(out[-1]), flush=True)
    finally:
        await r.aclose()
        await store.close()
    return out


def _row(x: dict[str, Any]) -> str:
    int32 = L * K * 4
    b = x["redis_bytes_per_token"]
    return (
        f"| {x['case']} | {x['rollouts']} x {x['tokens']:,} | {b:,.1f} | "
        f"{x['redis_bytes_per_rollout'] / 2**20:,.2f} | {int32 / b:.1f}x | "
        f"{int32 * 4 / 3 / b:.1f}x |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    print(
        f"Qwen3-30B-A3B shape: {L} MoE layers x {E} experts, top-{K}; upstream int32 "
        f"{L * K * 4} B/token, base64 {L * K * 4 * 4 // 3} B/token"
    )
    print("| case | rollouts x tokens | Redis B/token | Redis MiB/rollout | vs int32 | vs base64 |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(free_port(), Path(tmp), appendonly=False).start()
        try:
            results = asyncio.run(run(args, redis.url))
        finally:
            redis.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
