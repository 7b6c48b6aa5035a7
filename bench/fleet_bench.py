"""Fleet benchmark: generation throughput with routing capture on vs off, per configuration.

For each SGLang 0.5.23 configuration that runs on this CPU (issue 27;
docs/notes/sglang-0.5.23-fleet-configs.md), two engines of the same tiny random
Qwen3-MoE with the same SGLang arguments run side by side:

* **on**: ``python -m sglang_r3.launch_server --return-routed-experts --routing-cache
  <local cache>`` (:func:`sglang_r3.tools.local_stack.start_cache`, embedded Redis), every request
  tagged with its own rollout id (rows encoded and written to the cache; the response
  carries a reference, checked ``stored``);
* **off**: ``python -m sglang.launch_server``, the same arguments, untagged requests,
  no capture.

Each round sends one batch to each engine: ``--requests`` requests of ``--prompt``
random token ids and ``--new`` new tokens (greedy, ``ignore_eos``), ``--concurrency`` in
flight, new prompts every round (no radix hits), the same prompts to both; the order
(off, on) is reversed every other round, so a slow phase of the machine hits both.  The
ratio is the median over rounds of on tokens/s over off tokens/s of the same round
(paired), next to each side's median tokens/s.  Both engines idle with
``--sleep-on-idle``, so only the one measured uses the CPU; each engine gets
``OMP_NUM_THREADS=--omp-threads``.  Configurations run one after another, each pair
stopped (by process group) before the next starts.

Configurations (:data:`CONFIGS`: SGLang arguments, test-only CPU shims from
``tests/engine/cpu_shims``, environment): ``tp1`` (baseline), ``tp2``, ``dp2`` (the
plugin pins each rollout to a rank by hash, ``--routing-dp-affinity rollout``),
``dp2-affinity-off`` (the same, "on" left to SGLang's round robin), ``dp-attention``
(tp 2, dp 2), ``tokenizer-workers-2``, ``eagle-chain`` (NEXTN with the
tiny MTP draft, ``topk 1``), ``hicache`` (host tier, direct I/O; the pool is large
enough that nothing is evicted, so this measures HiCache's write-back path, not loads),
``pd`` (PD disaggregation: each side is a prefill + a decode server, Mooncake over TCP,
shim ``pd_host_indices``; each request is POSTed to both at once with one bootstrap
room, as sglang-router does, "on" storing rows ``[0, P)`` from the prefill server and
``[P, P+N-1)`` from the decode server; tokens/s are the decode server's answers).
A configuration that fails to start is reported with the reason and skipped.

    python bench/fleet_bench.py --all
    python bench/fleet_bench.py --config tp1 --config dp2 [--requests 16] [--prompt 128]
        [--new 64] [--concurrency 8] [--rounds 5] [--omp-threads 1]
        [--json bench/out/fleet_bench.json]

The engines, the cache service, Redis and this client share the machine's cores: the
ratios measured in one run are the result, not the absolute tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sglang_r3.tools.local_stack import (
    CacheServer,
    EngineServer,
    build_tiny_model,
    start_cache,
    start_engine,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)
from engine_bench import prompts, sigterm_as_interrupt  # noqa: E402

from cache_service.redis_proc import free_port  # noqa: E402
from tests.support.engine_requests import shim_env  # noqa: E402

# One OpenMP bind per rank: without it SGLang asserts ranks <= NUMA nodes (1 here).
BIND = (("SGLANG_CPU_OMP_THREADS_BIND", "0|1"),)


@dataclass(frozen=True)
class Config:
    """One fleet configuration: SGLang arguments, CPU shims, environment."""

    args: tuple[str, ...]
    shims: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    draft: bool = False  # needs the tiny MTP draft (--speculative-draft-model-path)
    on_args: tuple[str, ...] = ()  # sglang_r3.launch_server's own options, "on" only
    pd: bool = False  # a prefill + decode pair per side (PD disaggregation)


SPEC_ARGS = (
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
)  # fmt: skip
HICACHE_ARGS = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend", "direct",
    "--hicache-mem-layout", "layer_first",
)  # fmt: skip
CONFIGS: dict[str, Config] = {
    "tp1": Config(()),
    "tp2": Config(("--tp-size", "2"), ("no_pynccl",), BIND),
    "dp2": Config(("--dp-size", "2"), (), BIND),
    # The same without --routing-dp-affinity: isolates the capture's cost from the
    # pinning's (rollouts by hash, not round robin, which may load ranks unevenly).
    "dp2-affinity-off": Config(
        ("--dp-size", "2"), (), BIND, on_args=("--routing-dp-affinity", "off")
    ),
    "dp-attention": Config(
        ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"),
        ("no_pynccl", "torch_native_cpu_fill"),
        BIND,
    ),
    "tokenizer-workers-2": Config(("--tokenizer-worker-num", "2")),
    "eagle-chain": Config(
        SPEC_ARGS,
        ("spec_ops", "torch_native_verify", "draft_torch_native", "cuda_sync_noop"),
        draft=True,
    ),
    "hicache": Config(HICACHE_ARGS, ("hicache_cpu_io",)),
    "pd": Config(
        ("--disaggregation-transfer-backend", "mooncake"),
        ("pd_host_indices",),
        (
            ("MOONCAKE_PROTOCOL", "tcp"),
            # An early send of a radix-cached prefix's KV records a torch.cuda.Event
            # under overlap scheduling, which dies on CPU; the final send carries the KV.
            ("SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", "0"),
        ),
        pd=True,
    ),
}
# PD roles' own arguments; the prefill server's bootstrap port is added per pair.  A
# host pool for decode retraction backups (the default) is sized from the RAM left
# over a 10 GiB reserve, which a busy 24 GiB machine may not have.
PD_ROLE_ARGS = {
    "prefill": ("--disaggregation-mode", "prefill"),
    "decode": (
        "--disaggregation-mode", "decode",
        "--disaggregation-decode-retraction-backup", "cpu_tensor",
    ),
}  # fmt: skip


class BenchError(RuntimeError):
    """A request failed or returned something other than what its side promises."""


@dataclass
class Result:
    """One configuration's batches."""

    name: str
    args: tuple[str, ...]
    error: str | None = None
    start_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: dict[str, list[float]] = field(default_factory=lambda: {"on": [], "off": []})

    def ratios(self) -> list[float]:
        return [
            a / b for a, b in zip(self.tokens_per_s["on"], self.tokens_per_s["off"], strict=False)
        ]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"args": " ".join(self.args), "error": self.error}
        if self.error is None:
            out.update(
                on_tokens_per_s=statistics.median(self.tokens_per_s["on"]),
                off_tokens_per_s=statistics.median(self.tokens_per_s["off"]),
                ratio=statistics.median(self.ratios()),
                ratio_min=min(self.ratios()),
                ratio_max=max(self.ratios()),
                rounds=len(self.ratios()),
                start_s=self.start_s,
                batches=self.tokens_per_s,
            )
        return out


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
def body(side: str, input_ids: list[int], new: int) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    if side == "on":
        sp["custom_params"] = {"r3": {"rollout_id": f"fleet-{uuid.uuid4().hex}"}}
    return {"input_ids": input_ids, "sampling_params": sp}


def check(side: str, out: dict[str, Any], new: int) -> None:
    """``out`` has ``new`` tokens (a PD prefill server's answer: ``new`` is 1) and, "on"
    only, a stored r3 reference."""
    meta = out.get("meta_info", {})
    if len(out.get("output_ids", ())) != new:
        raise BenchError(f"{side}: expected {new} new tokens, got {meta.get('completion_tokens')}")
    ref = meta.get("r3")
    if side == "on" and (not isinstance(ref, dict) or ref.get("stored") is not True):
        raise BenchError(f"on: not stored: {ref!r}")
    if side == "off" and ref is not None:
        raise BenchError(f"off: response carries an r3 reference: {ref!r}")


async def run_batch(
    urls: list[str], bodies: list[dict[str, Any]], concurrency: int
) -> tuple[float, list[list[dict[str, Any]]]]:
    """POST every body to each of ``urls``' /generate at once (a PD pair: prefill,
    decode), ``concurrency`` bodies in flight; (seconds, responses per body, per url)."""
    results: list[list[dict[str, Any]]] = [[] for _ in bodies]
    todo = iter(enumerate(bodies))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def worker() -> None:
            for i, b in todo:
                rs = await asyncio.gather(*(client.post(f"{u}/generate", json=b) for u in urls))
                for r in rs:
                    if r.status_code != 200:
                        raise BenchError(f"/generate answered {r.status_code}: {r.text[:500]}")
                results[i] = [r.json() for r in rs]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, results


def batch(args: argparse.Namespace, engines: Engines, side: str, seed: int, n: int) -> float:
    """One batch of ``n`` requests against ``engines``; output tokens/s (of the last
    server: a PD pair's decode server)."""
    bodies = [body(side, p, args.new) for p in prompts(seed, n, args.prompt)]
    if engines.bootstrap_port is not None:  # one bootstrap room per request, as the router
        for b in bodies:
            b.update(
                bootstrap_host="127.0.0.1",
                bootstrap_port=engines.bootstrap_port,
                bootstrap_room=uuid.uuid4().int >> 66,
            )
    secs, outs = asyncio.run(run_batch(engines.urls(), bodies, args.concurrency))
    for *firsts, out in outs:
        for first in firsts:  # the prefill server answers with the first token
            check(side, first, 1)
        check(side, out, args.new)
    return n * args.new / secs


# ---------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------
@dataclass
class Engines:
    """One side's servers: one engine, or a PD pair (prefill, decode) and its bootstrap port."""

    servers: list[EngineServer]
    bootstrap_port: int | None = None

    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start(
    args: argparse.Namespace,
    model: Path,
    draft: Path | None,
    cfg: Config,
    side: str,
    cache: CacheServer,
    log: Path,
    role_args: tuple[str, ...] = (),
) -> EngineServer:
    extra = cfg.args + (("--speculative-draft-model-path", str(draft)) if cfg.draft else ())
    extra += role_args
    if side == "on":
        extra += cfg.on_args
    env = {**os.environ, **shim_env(*cfg.shims, **dict(cfg.env))}
    if args.omp_threads > 0:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    return start_engine(
        model,
        port=free_port(),
        log=log,
        routing_cache=cache.url if side == "on" else None,
        extra_args=extra,
        env=env,
        launcher="sglang_r3.launch_server" if side == "on" else "sglang.launch_server",
        max_total_tokens=args.kv_tokens,
        timeout_s=600,
    )


def start_side(
    args: argparse.Namespace,
    model: Path,
    draft: Path | None,
    cfg: Config,
    side: str,
    cache: CacheServer,
    log: Path,
) -> Engines:
    """One side's engine, or (``cfg.pd``) its prefill + decode pair, started together."""
    if not cfg.pd:
        return Engines([start(args, model, draft, cfg, side, cache, log)])
    bootstrap = free_port()
    roles = {
        "prefill": (*PD_ROLE_ARGS["prefill"], "--disaggregation-bootstrap-port", str(bootstrap)),
        "decode": PD_ROLE_ARGS["decode"],
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {
            role: pool.submit(
                start, args, model, draft, cfg, side, cache, log.with_suffix(f".{role}.log"), a
            )
            for role, a in roles.items()
        }
    pair = Engines([f.result() for f in futures.values() if f.exception() is None], bootstrap)
    try:
        for f in futures.values():
            f.result()  # raises the first start-up failure
    except BaseException:
        pair.stop()
        raise
    return pair


def run_config(
    args: argparse.Namespace, name: str, model: Path, tmp: Path, cache: CacheServer
) -> Result:
    cfg = CONFIGS[name]
    res = Result(name, cfg.args)
    draft = None
    servers: dict[str, Engines] = {}
    try:
        if cfg.draft:
            from sglang_r3.tools.local_stack import build_tiny_mtp_draft

            draft = build_tiny_mtp_draft(model, tmp / "mtp")
        for side in ("on", "off"):
            t0 = time.perf_counter()
            servers[side] = start_side(
                args, model, draft, cfg, side, cache, tmp / f"{name}-{side}.log"
            )
            res.start_s[side] = round(time.perf_counter() - t0, 1)
            print(f"  {name}: {side} engine up in {res.start_s[side]:.0f} s", flush=True)
        for side in ("off", "on"):
            batch(args, servers[side], side, 10**6, args.concurrency)  # warm-up
        for r in range(args.rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for side in order:
                res.tokens_per_s[side].append(batch(args, servers[side], side, r, args.requests))
            on, off = res.tokens_per_s["on"][-1], res.tokens_per_s["off"][-1]
            print(
                f"  {name} round {r}: on {on:.0f} off {off:.0f} tok/s ({on / off:.3f})", flush=True
            )
    except (RuntimeError, ImportError, httpx.HTTPError) as exc:
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        tail = str(exc).strip().splitlines()[-8:]
        print(f"  {name}: FAILED {res.error}\n    " + "\n    ".join(tail), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return res


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.requests} requests x ({args.prompt} prompt + {args.new} new tokens), "
        f"{args.concurrency} in flight, {args.rounds} paired rounds",
        "",
        "| configuration | SGLang arguments | on tokens/s | off tokens/s | on / off "
        "(median, min-max) |",
        "|---|---|---:|---:|---|",
    ]
    for name, s in results.items():
        if s["error"]:
            lines.append(f"| {name} | `{s['args']}` | - | - | did not run: {s['error']} |")
            continue
        lines.append(
            f"| {name} | `{s['args'] or '(none)'}` | {s['on_tokens_per_s']:.0f} | "
            f"{s['off_tokens_per_s']:.0f} | {s['ratio']:.3f} "
            f"({s['ratio_min']:.3f}-{s['ratio_max']:.3f}) |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--config", action="append", choices=sorted(CONFIGS), default=[], help="repeatable"
    )
    p.add_argument("--all", action="store_true", help="every configuration in CONFIGS")
    p.add_argument("--requests", type=int, default=16, help="requests per measured batch")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="paired on/off batches per configuration")
    p.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS (0: unset)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="--max-total-tokens of each engine")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "fleet_bench.json")
    args = p.parse_args(argv)
    if args.all:
        args.config = list(CONFIGS)
    if not args.config:
        p.error("name a --config (repeatable) or --all")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="fleet-bench-") as d:
        tmp = Path(d)
        model = build_tiny_model("qwen3_moe", tmp / "model")
        cache = start_cache(tmp / "cache", http_port=free_port(), grpc_port=free_port())
        try:
            for name in dict.fromkeys(args.config):
                print(f"{name}: {' '.join(CONFIGS[name].args) or '(no extra arguments)'}")
                results[name] = run_config(args, name, model, tmp, cache).summary()
        finally:
            cache.stop()
    print()
    print(report(results, args))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=2)
    )
    print(f"wrote {args.json}")
    return 0 if all(r["error"] is None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
