"""A training step's routing: each rank fetching its own slice vs one process decoding the step.

Stores a GRPO step at the Qwen3-30B-A3B shape (48 MoE layers, 128 experts, top-8) in a
real cache service over a real ``redis-server``: ``--rollouts`` rollouts of
``--tokens`` tokens, each one segment as the engine ships a single-turn call, skewed
(Zipf-like expert popularity) and uniform routing.  Then, in one run, against the same
store:

* **whole step** (today's glue): one driver process fetches every rollout
  (``RoutingClient.get_many``) and lays out verl's ``routed_experts`` for the whole
  batch (``verl_layout``, int16 ``[bs, T, 48, 8]``), which verl then ships to the
  ranks through Ray.  Timed up to the laid-out tensor only: the dispatch is not
  counted, so this is a lower bound on that path.
* **rank-local**: the driver checks the step once (``check_step``: one ``stat`` per
  rollout) and hands each rank rollout ids and lengths; each of the ``dp x pp x cp x
  tp`` ranks, a separate process, fetches its micro-batches' slices
  (``fetch_verl_rank_slice`` through ``get_ranges``, the next micro-batch prefetched)
  and holds its replay targets (int64, as verl's ``RouterReplay`` takes them).  Ranks
  run ``--wave`` at a time (the machine's cores); each rank's own wall time is what a
  rank on its own host would take.

Reported per distribution: the driver's peak RSS growth in both paths (``VmHWM``
reset before the work), per-rank bytes received against the rank's share of the
stored bytes (its rows x its layers), the sum over ranks against the stored bytes,
per-rank peak RSS growth against the slice it holds, and the time until every rank
holds its targets (slowest rank + the driver's check) against the whole-step time.

    python bench/step_fetch_bench.py                       # 256 x 16k, dp2 pp2 cp2 tp2
    python bench/step_fetch_bench.py --rollouts 16 --tokens 4096 --dist skewed   # quick

Writes ``bench/out/step_fetch_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import Routing, RoutingClient, Segment, encode_frame  # noqa: E402
from r3_client.layouts import VerlRank, verl_layout, verl_rank_plan  # noqa: E402
from r3_client.rank_local import check_step, fetch_verl_rank_slice, prefetched  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from tests.support.counting import Counting  # noqa: E402
from tests.support.memory import reset_peak, rss_mib  # noqa: E402
from tests.support.service_process import KEY_A, start_service  # noqa: E402

LAYERS, E, K = 48, 128, 8  # Qwen3-30B-A3B
BASES = 8  # distinct synthetic rollouts per distribution; the others relabel their experts


def peak_growth(before: float) -> float:
    return rss_mib()[1] - before


def make_step(url: str, n: int, tokens: int, skew: float, seed: int) -> list[str]:
    """Store ``n`` rollouts of ``tokens`` tokens (one segment each); their ids."""
    rng = np.random.default_rng(seed)
    bases = [
        synthetic_routing(tokens - 1, LAYERS, E, K, skew=skew, seed=seed + b).astype(np.int16)
        for b in range(min(BASES, n))
    ]
    ids = []
    with RoutingClient(url, api_key=KEY_A) as client:
        for i in range(n):
            # A per-layer relabelling of a base: the same entropy, different bytes (no two
            # rollouts share a blob, as no two real ones do).
            perm = np.argsort(rng.random((LAYERS, E)), axis=1).astype(np.int16)
            arr = perm[np.arange(LAYERS)[None, :, None], bases[i % len(bases)]]
            frame = encode_frame(
                arr,
                num_experts=E,
                layer_ids=range(LAYERS),
                segment=Segment(0, tokens - 1, "qwen3-30b-a3b-shape", "v1"),
            )
            rid = f"step-{seed}-{i:05d}"
            client.put(rid, frame)
            ids.append(rid)
    return ids


def whole_step(url: str, ids: list[str], tokens: int, out: Any) -> None:
    """The driver's whole-step path, in a fresh process: fetch, decode, lay out."""
    with RoutingClient(url, api_key=KEY_A) as client:
        before = reset_peak()
        t0 = time.perf_counter()
        routings = [r for _, r in client.get_many(ids) if isinstance(r, Routing)]
        n = len(ids)
        p = np.full(n, 1024)
        layout = verl_layout(routings, p, np.full(n, tokens - 1024), num_layers=LAYERS)
        dt = time.perf_counter() - t0
        out.put(
            {"s": dt, "rss_growth_mib": peak_growth(before), "tensor_gib": layout.nbytes / 2**30}
        )


def driver_local(url: str, ids: list[str], tokens: int, out: Any) -> None:
    """The rank-local driver, in a fresh process: one check of the step, then only ids."""
    with RoutingClient(url, api_key=KEY_A) as client:
        before = reset_peak()
        t0 = time.perf_counter()
        check_step(client, ids, np.full(len(ids), tokens))
        dt = time.perf_counter() - t0
        out.put({"s": dt, "rss_growth_mib": peak_growth(before)})


def rank_proc(
    url: str, coords: dict[str, int], micro: list[list[str]], tokens: int, out: Any
) -> None:
    """One rank: fetch every micro-batch's slice (next one prefetched), hold them all."""
    pp, stage = coords["pp"], coords["pp_rank"]
    per = LAYERS // pp
    rank = VerlRank(
        tp_size=coords["tp"], tp_rank=coords["tp_rank"], cp_size=coords["cp"],
        cp_rank=coords["cp_rank"], stage_layers=range(stage * per, (stage + 1) * per),
    )  # fmt: skip
    with RoutingClient(url, api_key=KEY_A) as client:
        src = Counting(client)
        before = reset_peak()
        t0 = time.perf_counter()
        held = []
        for _mb, got in prefetched(
            micro,
            lambda mb: fetch_verl_rank_slice(
                src, mb, [1024] * len(mb), [tokens - 1024] * len(mb), rank=rank
            ),
        ):
            held.append(got)
        dt = time.perf_counter() - t0
        growth = peak_growth(before)
        rows = sum(
            verl_rank_plan([1024] * len(mb), [tokens - 1024] * len(mb), rank=rank).num_rows
            for mb in micro
        )
        out.put(
            {
                **coords,
                "s": dt,
                "bytes": src.bytes,
                "rows": rows,
                "layers": per,
                "slice_mib": sum(sum(a.nbytes for a in s.per_layer) for s in held) / 2**20,
                "rss_growth_mib": growth,
            }
        )


def run_proc(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    res = q.get()
    p.join()
    return dict(res)


def local_world(url: str, ids: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank as its own process, ``args.wave`` at a time."""
    dp, pp, cp, tp = args.dp, args.pp, args.cp, args.tp
    per_dp = len(ids) // dp
    jobs = []
    for d, s, c, t in np.ndindex(dp, pp, cp, tp):
        mine = ids[d * per_dp : (d + 1) * per_dp]
        micro = [mine[i : i + args.micro] for i in range(0, len(mine), args.micro)]
        coords = dict(dp=dp, dp_rank=d, pp=pp, pp_rank=s, cp=cp, cp_rank=c, tp=tp, tp_rank=t)
        jobs.append((coords, micro))
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    for w in range(0, len(jobs), args.wave):
        q = ctx.Queue()
        procs = [
            ctx.Process(target=rank_proc, args=(url, coords, micro, args.tokens, q))
            for coords, micro in jobs[w : w + args.wave]
        ]
        for p in procs:
            p.start()
        results += [q.get() for _ in procs]
        for p in procs:
            p.join()
    return results


def redis_out_bytes(redis_url: str) -> int:
    """Bytes Redis has sent to its clients so far (``INFO stats``)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        return int(r.info("stats")["total_net_output_bytes"])
    finally:
        r.close()


def one_distribution(
    url: str, redis_url: str, name: str, skew: float, args: argparse.Namespace
) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = make_step(url, args.rollouts, args.tokens, skew, seed=17 if name == "skewed" else 29)
    print(f"[{name}] stored {len(ids)} rollouts in {time.perf_counter() - t0:.0f} s", flush=True)
    with RoutingClient(url, api_key=KEY_A) as client:
        stored = [client.stat(r).stored_bytes for r in ids]
    stored_total = sum(stored)
    r0 = redis_out_bytes(redis_url)
    whole = run_proc(whole_step, url, ids, args.tokens)
    r1 = redis_out_bytes(redis_url)
    whole["redis_out_over_stored"] = (r1 - r0) / stored_total
    print(f"[{name}] whole step: {whole}", flush=True)
    driver = run_proc(driver_local, url, ids, args.tokens)
    ranks = local_world(url, ids, args)
    redis_local = (redis_out_bytes(redis_url) - r1) / stored_total
    rows_total = args.rollouts * (args.tokens - 1)
    per_row_layer = stored_total / rows_total / LAYERS
    for r in ranks:
        r["share_bytes"] = per_row_layer * r["rows"] * r["layers"]
        r["bytes_over_share"] = r["bytes"] / r["share_bytes"]
        r["rss_over_slice_mib"] = r["rss_growth_mib"] - r["slice_mib"]
    slowest = max(r["s"] for r in ranks)
    local_s = driver["s"] + slowest
    out = {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "stored_bytes": stored_total,
        "stored_bytes_per_token": stored_total / (args.rollouts * args.tokens),
        "whole_step": whole,
        "rank_local": {
            "driver": driver,
            "ranks": ranks,
            "slowest_rank_s": slowest,
            "sum_rank_s": sum(r["s"] for r in ranks),
            "time_to_all_ranks_s": local_s,
            "sum_bytes_over_stored": sum(r["bytes"] for r in ranks) / stored_total,
            "max_bytes_over_share": max(r["bytes_over_share"] for r in ranks),
            "max_rss_over_slice_mib": max(r["rss_over_slice_mib"] for r in ranks),
            "redis_out_over_stored": redis_local,
        },
        "time_ratio_local_over_whole": local_s / whole["s"],
    }
    with RoutingClient(url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    rl = out["rank_local"]
    print(
        f"[{name}] stored {out['stored_bytes_per_token']:.0f} B/token | whole step "
        f"{whole['s']:.2f} s, driver RSS +{whole['rss_growth_mib']:.0f} MiB | rank-local: "
        f"driver {driver['s']:.2f} s RSS +{driver['rss_growth_mib']:.0f} MiB, slowest rank "
        f"{slowest:.2f} s (sum {rl['sum_rank_s']:.1f} s over {len(ranks)} ranks), bytes/share max "
        f"{rl['max_bytes_over_share']:.3f}, sum/stored {rl['sum_bytes_over_stored']:.3f}, "
        f"rank RSS - slice max {rl['max_rss_over_slice_mib']:.0f} MiB, Redis sent "
        f"{redis_local:.1f}x stored (whole step {whole['redis_out_over_stored']:.1f}x) | "
        f"time ratio {out['time_ratio_local_over_whole']:.3f}",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--wave", type=int, default=2, help="ranks running at once")
    ap.add_argument("--dist", choices=["skewed", "uniform", "both"], default="both")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "step_fetch_bench.json")
    args = ap.parse_args(argv)
    if LAYERS % args.pp or args.rollouts % args.dp:
        ap.error("pp must divide 48 layers and dp the rollouts")
    env = {
        "R3_CACHE_MAX_BATCH": str(max(1024, args.rollouts)),
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    dists = {"skewed": 1.0, "uniform": 0.0}
    chosen = list(dists) if args.dist == "both" else [args.dist]
    with tempfile.TemporaryDirectory(prefix="r3-step-fetch-") as tmp_s:
        tmp = Path(tmp_s)
        redis = RedisProcess(free_port(), tmp / "redis", appendonly=False)
        redis.start()
        svc = None
        try:
            svc = start_service(tmp, redis.url, env=env)
            for name in chosen:
                report[name] = one_distribution(svc.http_url, redis.url, name, dists[name], args)
        finally:
            if svc is not None:
                svc.stop()
            redis.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
