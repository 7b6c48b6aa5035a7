"""Engine benchmark: generation throughput with routing capture, and bytes moved per agent turn.

Real SGLang 0.5.23 on CPU (``--device cpu``, torch-native attention, bf16) with a tiny
random Qwen3-MoE checkpoint (``sglang_r3.tools.local_stack.build_tiny_model``), next to the real
cache service (``python -m cache_service serve``, auth on, with its embedded
``redis-server``).  Every process the script starts is stopped by PID (SGLang by process
group) at the end, also on error or Ctrl-C.

Three configurations of the same model:

* **off**: ``python -m sglang.launch_server``, routing capture off;
* **upstream**: ``python -m sglang.launch_server --enable-return-routed-experts``,
  requests with ``"return_routed_experts": true`` (base64 int32 ``[rows, L, K]`` in
  every response);
* **r3**: ``python -m sglang_r3.launch_server --return-routed-experts --routing-cache
  <service>``, every request tagged with its own rollout id (routing encoded and
  written to the cache; the response carries a reference).

The three servers run side by side, each with ``--sleep-on-idle`` (an idle SGLang
scheduler otherwise busy-polls a whole core) and ``OMP_NUM_THREADS=1``
(``--omp-threads``), so only the one being measured uses the CPU: its forward pass gets
one core, and its HTTP/tokenizer process, the client and the cache service the other.
Both matter on 2 cores.  In a first version that started one server at a time with
torch's default threads (one OpenMP thread per core), the OpenMP workers spin-waited
for each other whenever another process was runnable and batches of one configuration
varied 10x (52-730 tokens/s); with one thread but servers restarted per round, slow
phases of the machine lasting minutes still moved whole rounds by 15%, so
configurations are now interleaved batch by batch.

1. **Throughput.**  ``--requests`` requests of ``--prompt`` random token ids (3..1023)
   each, ``--new`` new tokens (greedy, ``ignore_eos``), ``--concurrency`` in flight over
   ``/generate``.  Each server gets a warm-up batch, then ``--rounds`` rounds of one
   batch per configuration (order off, upstream, r3, reversed every other round).  Every
   round uses new prompts (no radix-cache hits), the same ones for every configuration.
   Output tokens/s per batch; a configuration's figure is the median of its batches, and
   also the median over rounds of its batch's tokens/s over that round's "off" batch
   (paired, robust to slow drift of the machine).  Target: r3 / off >= 0.97.  CPU
   seconds of SGLang's scheduler, its HTTP/tokenizer process (where the extension encodes
   and ships), its detokenizer, the cache service (with its Redis) and this process are
   recorded for each batch, and for r3 the extension's own ``r3_engine_ship_seconds``
   (encode + write, per output).

2. **Agent conversation.**  One rollout of ``--turns`` turns: a ``--agent-prompt``-token
   prompt; each turn generates ``--agent-new`` tokens, then ``--agent-tool`` "tool output"
   tokens are appended; every turn sends the whole conversation so far as ``input_ids``.

   * r3: the same rollout id on every turn; the extension asks the engine only for the
     new rows.  Ratio = sum over turns of ``meta_info.r3.nbytes`` (frame bytes shipped to
     the cache) / bytes of the final stored rollout (``RoutingClient.get_frame``).  Also
     rows shipped / final rows, and the same sum against one frame of the final
     trajectory written in a single piece (encoded here with the engine's codec and
     segment metadata), which isolates the per-segment frame overhead.  Target <= 1.05.
   * upstream: the same turns with ``return_routed_experts``; ratio = sum of the base64
     lengths over turns / the base64 length of the last turn's routing (the last turn's
     response covers exactly the final trajectory, ``len(final) - 1`` rows).
   * projection: the r3 ratio again with the same turn boundaries and segment metadata
     but synthetic routing of a real model's shape (48 x 128 x top-8, Qwen3-30B-A3B;
     skewed and uniform), each segment encoded as the extension encodes it and stored
     through the real service.  On the tiny model a turn's rows are ~100 bytes and the
     per-segment frame header is of the same size; this shows what that header costs
     when rows are realistic.

    python bench/engine_bench.py [--layers 4] [--experts 16] [--topk 2] [--requests 64]
        [--prompt 128] [--new 64] [--concurrency 8] [--warmup 16] [--rounds 10]
        [--omp-threads 1] [--turns 20] [--json bench/out/engine_bench.json]

Client, engine, cache service and Redis share the machine's cores: the ratios measured
in the same run are the result, not the absolute tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np

from r3_client import (
    Context,
    RoutingClient,
    Segment,
    decode_rollout,
    encode_frame,
    read_header,
    split_frames,
)
from r3_client.synthetic import synthetic_routing
from sglang_r3.tools.local_stack import EngineServer, build_tiny_model, start_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)
from cache_service.redis_proc import free_port  # noqa: E402
from tests.support.service_process import KEY_A, Service, start_service  # noqa: E402

CONFIGS: tuple[str, ...] = ("off", "upstream", "r3")  # plus "r3grpc" with --r3-grpc
LABELS = {
    "off": "(a) capture off: sglang.launch_server",
    "upstream": "(b) upstream inline: --enable-return-routed-experts",
    "r3": "(c) sglang_r3 + cache service, tagged",
    "r3grpc": "(d) sglang_r3 + cache service over gRPC (grpc://), tagged",
}


def is_r3(config: str) -> bool:
    """(c) and (d): the extension shipping to the cache (over HTTP or gRPC)."""
    return config.startswith("r3")


TOKEN_LO, TOKEN_HI = 3, 1024  # the tiny tokenizer's word ids
CLK = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """A request failed or returned something other than what the configuration promises."""


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and its live descendants by process name."""
    parent: dict[int, int] = {}
    cpu: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()
        parent[int(entry)] = int(rest[1])
        cpu[int(entry)] = (name, (int(rest[11]) + int(rest[12])) / CLK)
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in cpu:
            name, secs = cpu[pid]
            out[name] = out.get(name, 0.0) + secs
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return out


CPU_PARTS = ("scheduler", "http", "detokenizer", "service", "client")


def cpu_now(engine: int, service: int) -> dict[str, float]:
    """CPU seconds so far of: SGLang's scheduler, its HTTP/tokenizer process, its
    detokenizer, the cache service with its Redis, this process."""
    eng = tree_cpu(engine)
    sched = sum(v for k, v in eng.items() if k.startswith("sglang::sched"))
    detok = sum(v for k, v in eng.items() if k.startswith("sglang::detok"))
    return {
        "scheduler": sched,
        "http": sum(eng.values()) - sched - detok,
        "detokenizer": detok,
        "service": sum(tree_cpu(service).values()),
        "client": self_cpu(),
    }


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def engine_env(omp_threads: int) -> dict[str, str]:
    """The engines' environment: this one, with ``OMP_NUM_THREADS`` when asked."""
    env = dict(os.environ)
    if omp_threads > 0:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    # The extension's heartbeat on the HTTP process's event loop (GET /r3/loop); the
    # plugin is installed in this environment, so plain sglang.launch_server has it too.
    env["SGLANG_R3_LOOP_PROBE_MS"] = "1"
    return env


@dataclass
class Ctx:
    """What the benchmark runs against."""

    args: argparse.Namespace
    model: Path
    tmp: Path
    svc: Service
    layers: int
    topk: int
    engines: list[EngineServer] = field(default_factory=list)

    def start(self, config: str, tag: str) -> EngineServer:
        launcher = "sglang_r3.launch_server" if is_r3(config) else "sglang.launch_server"
        cache = f"grpc://{self.svc.grpc_target}" if config == "r3grpc" else self.svc.http_url
        extra: tuple[str, ...] = ("--sleep-on-idle",)
        if is_r3(config):
            extra += ("--routing-lookup", self.args.r3_lookup)
        if config == "upstream":
            extra += ("--enable-return-routed-experts",)
        t0 = time.perf_counter()
        server = start_engine(
            self.model,
            port=free_port(),
            log=self.tmp / f"sglang-{config}-{tag}.log",
            routing_cache=cache if is_r3(config) else None,
            api_key=KEY_A if is_r3(config) else None,
            extra_args=extra,
            env=engine_env(self.args.omp_threads),
            launcher=launcher,
            max_total_tokens=self.args.kv_tokens,
            timeout_s=900,
        )
        self.engines.append(server)
        print(f"  started {config} ({launcher}) in {time.perf_counter() - t0:.0f} s", flush=True)
        return server

    def stop(self, server: EngineServer) -> None:
        server.stop()
        with contextlib.suppress(ValueError):
            self.engines.remove(server)


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
def request_body(config: str, input_ids: list[int], new: int, rollout_id: str) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sp}
    if config == "upstream":
        body["return_routed_experts"] = True
    elif is_r3(config):
        sp["custom_params"] = {"r3": {"rollout_id": rollout_id}}
    return body


def check_response(
    config: str, out: dict[str, Any], prompt_len: int, new: int, row_bytes: int
) -> None:
    """Raise unless the response is what the configuration promises."""
    meta = out.get("meta_info", {})
    if meta.get("completion_tokens") != new or len(out.get("output_ids", ())) != new:
        got = meta.get("completion_tokens")
        raise BenchError(f"{config}: expected {new} new tokens, got {got}")
    rows = prompt_len + new - 1
    if config == "upstream":
        b64 = meta.get("routed_experts")
        if not isinstance(b64, str) or len(base64.b64decode(b64)) != rows * row_bytes:
            raise BenchError(f"upstream: no or wrong-sized routed_experts: {str(b64)[:80]!r}")
    elif is_r3(config):
        ref = meta.get("r3")
        if not isinstance(ref, dict) or ref.get("stored") is not True:
            raise BenchError(f"r3: not stored: {ref!r}")
        if "routed_experts" in meta:
            raise BenchError("r3: response still carries routed_experts")
    elif "routed_experts" in meta and meta["routed_experts"] is not None:
        raise BenchError("off: response carries routed_experts")


async def stream_gaps(
    client: httpx.AsyncClient, body: dict[str, Any], stop: asyncio.Event
) -> tuple[list[float], list[float]]:
    """Run streaming requests one after another until ``stop``; the gaps between chunks,
    and every wait for the next chunk *including the first* (time to first token).

    Inter-chunk gaps alone miss a stream that is stalled before its first token: a
    stream request queued behind a long prefill shows no gap at all.
    """
    gaps: list[float] = []
    waits: list[float] = []
    while not stop.is_set():
        last = None
        sent = time.perf_counter()
        async with client.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                waits.append(now - (sent if last is None else last))
                last = now
    return gaps, waits


async def run_batch(
    url: str, bodies: list[dict[str, Any]], concurrency: int, streams: int = 0, stream_new: int = 32
) -> tuple[float, list[dict[str, Any]], list[float], tuple[list[float], list[float]]]:
    """POST every body to /generate with ``concurrency`` in flight, while ``streams``
    untagged streaming requests run back to back; (seconds, responses, per-request
    latencies, inter-chunk gaps of the streams)."""
    results: list[dict[str, Any]] = [{} for _ in bodies]
    latencies = [0.0 for _ in bodies]
    todo = iter(enumerate(bodies))
    n = concurrency + streams
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        stop = asyncio.Event()
        sbody = {
            "input_ids": list(range(TOKEN_LO, TOKEN_LO + 16)),
            "sampling_params": {"max_new_tokens": stream_new, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        probes = [asyncio.ensure_future(stream_gaps(client, sbody, stop)) for _ in range(streams)]

        async def worker() -> None:
            for i, body in todo:
                t = time.perf_counter()
                r = await client.post("/generate", json=body)
                latencies[i] = time.perf_counter() - t
                if r.status_code != 200:
                    raise BenchError(f"/generate answered {r.status_code}: {r.text[:500]}")
                results[i] = r.json()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        secs = time.perf_counter() - t0
        stop.set()
        done = await asyncio.gather(*probes)
        gaps = [g for p in done for g in p[0]]
        waits = [w for p in done for w in p[1]]
        return secs, results, latencies, (gaps, waits)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(TOKEN_LO, TOKEN_HI, size=(n, length)).tolist()  # type: ignore[no-any-return]


def throughput_batch(
    ctx: Ctx, server: EngineServer, config: str, seed: int, n: int
) -> dict[str, Any]:
    """One batch of ``n`` requests; tokens/s and who spent the CPU."""
    a = ctx.args
    ps = prompts(seed, n, a.prompt)
    bodies = [
        request_body(config, p, a.new, f"tp-{seed}-{i}-{uuid.uuid4().hex[:8]}")
        for i, p in enumerate(ps)
    ]
    ship0 = ship_seconds(server.url) if is_r3(config) else (0.0, 0.0)
    loop_lag(server.url)  # a new window
    cpu0 = cpu_now(server.proc.pid, ctx.svc.proc.pid)
    secs, outs, lat, (gaps, waits) = asyncio.run(
        run_batch(server.url, bodies, a.concurrency, a.streams, a.stream_new)
    )
    cpu1 = cpu_now(server.proc.pid, ctx.svc.proc.pid)
    lag = loop_lag(server.url)
    ship1 = ship_seconds(server.url) if is_r3(config) else (0.0, 0.0)
    shipped = ship1[1] - ship0[1]
    row_bytes = ctx.layers * ctx.topk * 4
    for out in outs:
        check_response(config, out, a.prompt, a.new, row_bytes)
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    return {
        "seed": seed,
        "requests": n,
        "output_tokens": tokens,
        "seconds": secs,
        "tokens_per_s": tokens / secs,
        "cpu_s": {k: cpu1[k] - cpu0[k] for k in CPU_PARTS},
        "mean_latency_s": statistics.fmean(lat),
        "loop_lag": lag,
        "stream_gaps": {
            "n": len(gaps),
            "max_s": max(gaps) if gaps else None,
            "p99_s": float(np.percentile(gaps, 99)) if gaps else None,
            "p50_s": float(np.percentile(gaps, 50)) if gaps else None,
        },
        "stream_waits": {
            "n": len(waits),
            "max_s": max(waits) if waits else None,
            "p99_s": float(np.percentile(waits, 99)) if waits else None,
        },
        "mean_ship_s": (ship1[0] - ship0[0]) / shipped if shipped else None,
    }


# ---------------------------------------------------------------------------------------------
# agent conversation
# ---------------------------------------------------------------------------------------------
def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/r3/metrics", timeout=10).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def loop_lag(url: str) -> dict[str, Any]:
    """The HTTP process's event-loop lags since the last call (``GET /r3/loop``)."""
    return httpx.get(f"{url}/r3/loop", timeout=30).json()  # type: ignore[no-any-return]


def ship_seconds(url: str) -> tuple[float, float]:
    """The extension's ``r3_engine_ship_seconds`` histogram: (sum, count)."""
    return metric(url, "r3_engine_ship_seconds_sum"), metric(url, "r3_engine_ship_seconds_count")


def agent(ctx: Ctx, server: EngineServer, config: str) -> dict[str, Any]:
    """Run the multi-turn conversation against ``server``; per-turn sizes."""
    a = ctx.args
    rng = np.random.default_rng(12345)
    tokens = rng.integers(TOKEN_LO, TOKEN_HI, size=a.agent_prompt).tolist()
    tools = rng.integers(TOKEN_LO, TOKEN_HI, size=(a.turns, a.agent_tool)).tolist()
    rollout = f"agent-{config}-{uuid.uuid4().hex[:10]}"
    row_bytes = ctx.layers * ctx.topk * 4
    turns: list[dict[str, Any]] = []
    engine_bytes0 = metric(server.url, "r3_engine_bytes_engine_total") if is_r3(config) else 0
    final: list[int] = []
    with httpx.Client(base_url=server.url, timeout=600) as client:
        for t in range(a.turns):
            body = request_body(config, tokens, a.agent_new, rollout)
            t0 = time.perf_counter()
            r = client.post("/generate", json=body)
            secs = time.perf_counter() - t0
            if r.status_code != 200:
                raise BenchError(f"{config} agent turn {t}: {r.status_code}: {r.text[:500]}")
            out = r.json()
            check_response(config, out, len(tokens), a.agent_new, row_bytes)
            meta = out["meta_info"]
            turn: dict[str, Any] = {"turn": t, "input_tokens": len(tokens), "seconds": secs}
            if config == "r3":
                ref = meta["r3"]
                rows = ref["end"] - ref["start"]
                turn.update(start=ref["start"], end=ref["end"], nbytes=ref["nbytes"], rows=rows)
                expect_start = turns[-1]["end"] if turns else 0
                if ref["start"] != expect_start:
                    raise BenchError(f"r3 turn {t}: start {ref['start']} != {expect_start}")
            else:
                b64 = meta["routed_experts"]
                turn.update(b64_bytes=len(b64), rows=len(base64.b64decode(b64)) // row_bytes)
            turns.append(turn)
            final = tokens + out["output_ids"]
            tokens = final + tools[t]
    res: dict[str, Any] = {"rollout_id": rollout, "final_tokens": len(final), "turns": turns}
    final_rows = len(final) - 1
    res["final_rows"] = final_rows
    res["rows_moved"] = sum(t["rows"] for t in turns)
    if config == "upstream":
        last = turns[-1]
        if last["rows"] != final_rows:
            raise BenchError(f"upstream: last turn has {last['rows']} rows, expected {final_rows}")
        res["bytes_moved"] = sum(t["b64_bytes"] for t in turns)
        res["final_bytes"] = last["b64_bytes"]
        res["int32_moved"] = res["rows_moved"] * row_bytes
        res["final_int32"] = final_rows * row_bytes
        return res
    res["engine_bytes"] = metric(server.url, "r3_engine_bytes_engine_total") - engine_bytes0
    res["final_int32"] = final_rows * row_bytes
    with RoutingClient(ctx.svc.http_url, api_key=KEY_A) as client:
        frame = client.get_frame(rollout)
        seg_frames = [client.get_frame(rollout, start=t["start"], end=t["end"]) for t in turns]
    # Format v2: a read returns the stored segment frames (context frames first).
    heads = [h for h in map(read_header, split_frames(frame)) if h.codec != "context"]
    routing = decode_rollout(frame)
    if routing.end != final_rows or routing.start != 0:
        raise BenchError(f"r3: stored [{routing.start}, {routing.end}), expected [0, {final_rows})")
    # The same rows written in one piece, as one request over the final trajectory would.
    seg = routing.segments[-1]
    one = encode_frame(
        routing.indices,
        num_experts=routing.num_experts,
        layer_ids=routing.layer_ids,
        start=0,
        segment=Segment(0, final_rows, seg.model_id, seg.weight_version, seg.tokens_digest),
    )
    one_head = read_header(one)
    seg_heads = [
        h for f in seg_frames for h in map(read_header, split_frames(f)) if h.codec != "context"
    ]
    res["shape_projection"] = [
        project(ctx, [h.segment for h in seg_heads if h.segment is not None], skew)
        for skew in (1.0, 0.0)
    ]
    res.update(
        bytes_moved=sum(t["nbytes"] for t in turns),
        final_bytes=len(frame),
        final_header_bytes=len(frame) - sum(h.body_length for h in heads),
        final_body_bytes=sum(h.body_length for h in heads),
        final_codec="+".join(sorted({h.codec for h in heads})),
        single_piece_bytes=len(one),
        single_piece_body_bytes=one_head.body_length,
        single_piece_codec=one_head.codec,
        segments_read_back_bytes=sum(len(f) for f in seg_frames),
        segments_body_bytes=sum(h.body_length for h in seg_heads),
        segments_codecs=sorted({h.codec for h in seg_heads}),
        segments=len(routing.segments),
    )
    return res


def project(ctx: Ctx, segments: list[Segment], skew: float) -> dict[str, Any]:
    """The agent's byte ratio at a real model's shape: same turn boundaries and segment
    metadata, synthetic routing (48 MoE layers x 128 experts x top-8, Qwen3-30B-A3B),
    each segment encoded as the extension does and stored through the real service."""
    layers, experts, topk = 48, 128, 8
    rows = segments[-1].end
    rho = 0.9 if skew else 0.0
    indices = synthetic_routing(rows, layers, experts, topk, skew=skew, rho=rho, seed=7)
    rollout = f"proj-{uuid.uuid4().hex[:10]}"
    moved = 0
    base: Context | None = None
    with RoutingClient(ctx.svc.http_url, api_key=KEY_A) as client:
        for seg in segments:
            # As the extension does: later segments continue from the first one's context
            # when it has a relabel table (or the rows are too few to pay for one).
            cont = base if base is not None and (base.has_table or seg.num_rows < experts) else None
            frame = encode_frame(
                indices[seg.start : seg.end],
                num_experts=experts,
                layer_ids=range(layers),
                start=seg.start,
                segment=seg,
                base=cont,
            )
            if base is None:
                own = read_header(frame).context
                assert own is not None
                base = Context.parse(own.raw)
            moved += client.put(rollout, frame).nbytes
        stored = len(client.get_frame(rollout))
    last = segments[-1]
    one = encode_frame(
        indices,
        num_experts=experts,
        layer_ids=range(layers),
        start=0,
        segment=Segment(0, rows, last.model_id, last.weight_version, last.tokens_digest),
    )
    return {
        "shape": f"{layers}x{experts}x{topk}",
        "data": "skewed (Zipf 1.0, AR(1) 0.9)" if skew else "uniform",
        "rows": rows,
        "bytes_moved": moved,
        "stored_bytes": stored,
        "single_piece_bytes": len(one),
        "upstream_int32_per_token": layers * topk * 4,
        "moved_over_stored": moved / stored,
        "moved_over_single_piece": moved / len(one),
    }


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(res: dict[str, Any]) -> str:
    a = res["args"]
    tp = res["throughput"]
    off = tp["off"]["median_tokens_per_s"]
    lines = [
        f"### Throughput: {a['requests']} requests x ({a['prompt']} prompt + {a['new']} new "
        f"tokens), {a['concurrency']} in flight, {a['rounds']} interleaved rounds, "
        f"engines with OMP_NUM_THREADS={a['omp_threads'] or 'default'}",
        "",
        "| configuration | tokens/s per batch | median tokens/s | x off | x off paired | "
        "mean request latency ms | r3 ship ms per output | "
        "CPU s per batch (median): scheduler / HTTP+tokenizer / detokenizer / "
        "cache service+Redis / client |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in CONFIGS:
        batches = tp[c]["batches"]
        per = ", ".join(f"{b['tokens_per_s']:.0f}" for b in batches)
        cpu = [med([b["cpu_s"][k] for b in batches]) for k in CPU_PARTS]
        m = tp[c]["median_tokens_per_s"]
        latency = med([b["mean_latency_s"] for b in batches]) * 1e3
        ships = [b["mean_ship_s"] for b in batches if b["mean_ship_s"] is not None]
        ship = f"{med(ships) * 1e3:.1f}" if ships else ""
        lines.append(
            f"| {LABELS[c]} | {per} | {m:.1f} | {m / off:.3f} | "
            f"{tp[c]['median_round_ratio_over_off']:.3f} | {latency:.0f} | {ship} | "
            + " / ".join(f"{x:.2f}" for x in cpu)
            + " |"
        )
    lines += [
        "",
        "Event loop of the HTTP/tokenizer process (heartbeat every 1 ms, `GET /r3/loop`) and "
        f"the inter-chunk gaps of {a['streams']} untagged streams running during each batch; "
        "medians over batches of each batch's figure, and the worst batch:",
        "",
        "| configuration | loop lag max ms (worst) | loop lag p99 ms | lags > 5 ms per batch | "
        "stream gap p99 ms | stream gap max ms (worst) | stream gap p99 x off | "
        "longest stream wait incl. first token ms (worst) | stream tokens per batch | "
        "HTTP+tokenizer CPU s per request | all SGLang CPU s per request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gap_off = med([b["stream_gaps"]["p99_s"] or 0.0 for b in tp["off"]["batches"]])
    for c in CONFIGS:
        bs = tp[c]["batches"]
        lag_max = [b["loop_lag"]["max_s"] * 1e3 for b in bs]
        gp99 = [(b["stream_gaps"]["p99_s"] or 0.0) * 1e3 for b in bs]
        gmax = [(b["stream_gaps"]["max_s"] or 0.0) * 1e3 for b in bs]
        wmax = [(b["stream_waits"]["max_s"] or 0.0) * 1e3 for b in bs]
        http = med([b["cpu_s"]["http"] / b["requests"] for b in bs])
        sg = med(
            [
                (b["cpu_s"]["http"] + b["cpu_s"]["scheduler"] + b["cpu_s"]["detokenizer"])
                / b["requests"]
                for b in bs
            ]
        )
        lines.append(
            f"| {LABELS[c]} | {med(lag_max):.1f} ({max(lag_max):.1f}) | "
            f"{med([b['loop_lag']['p99_s'] * 1e3 for b in bs]):.1f} | "
            f"{med([float(b['loop_lag']['over_5ms']) for b in bs]):.0f} | {med(gp99):.1f} | "
            f"{med(gmax):.1f} ({max(gmax):.1f}) | "
            f"{(med(gp99) / 1e3 / gap_off) if gap_off else float('nan'):.3f} | "
            f"{med(wmax):.1f} ({max(wmax):.1f}) | "
            f"{med([float(b['stream_waits']['n']) for b in bs]):.0f} | "
            f"{http:.3f} | {sg:.3f} |"
        )
    if not res["agent"]:
        return "\n".join(lines)
    ag = res["agent"]
    ours, up = ag["r3"], ag["upstream"]
    lines += [
        "",
        f"### Agent conversation: {a['turns']} turns, {a['agent_prompt']}-token prompt, "
        f"{a['agent_new']} new + {a['agent_tool']} tool tokens per turn "
        f"(final trajectory {ours['final_tokens']} tokens, {ours['final_rows']} rows)",
        "",
        "| path | bytes moved over all turns | final trajectory stored once | ratio | "
        "rows moved / final rows |",
        "|---|---:|---:|---:|---:|",
        f"| r3: sum of `r3.nbytes` / `get_frame` of the rollout ({ours['segments']} segments) "
        f"| {ours['bytes_moved']:,} | {ours['final_bytes']:,} | "
        f"{ours['bytes_moved'] / ours['final_bytes']:.3f} | "
        f"{ours['rows_moved'] / ours['final_rows']:.3f} |",
        f"| r3: sum of `r3.nbytes` / one frame of the final trajectory in one piece "
        f"| {ours['bytes_moved']:,} | {ours['single_piece_bytes']:,} | "
        f"{ours['bytes_moved'] / ours['single_piece_bytes']:.3f} | |",
        f"| r3: codec bodies only (segments / one piece) "
        f"| {ours['segments_body_bytes']:,} | {ours['single_piece_body_bytes']:,} | "
        f"{ours['segments_body_bytes'] / ours['single_piece_body_bytes']:.3f} | |",
        f"| r3: int32 rows the engine handed to the extension "
        f"(`r3_engine_bytes_engine_total`) / final int32 "
        f"| {int(ours['engine_bytes']):,} | {ours['final_int32']:,} | "
        f"{ours['engine_bytes'] / ours['final_int32']:.3f} | |",
        f"| upstream: base64 per turn / last turn's base64 "
        f"| {up['bytes_moved']:,} | {up['final_bytes']:,} | "
        f"{up['bytes_moved'] / up['final_bytes']:.3f} | "
        f"{up['rows_moved'] / up['final_rows']:.3f} |",
        "",
        "| bytes per token (final trajectory) | B/token |",
        "|---|---:|",
        f"| r3 stored rollout (`get_frame`, {ours['final_codec']}, with "
        f"{ours['final_header_bytes']:,} B header) | "
        f"{ours['final_bytes'] / ours['final_rows']:.2f} |",
        f"| r3 one piece ({ours['single_piece_codec']}) | "
        f"{ours['single_piece_bytes'] / ours['final_rows']:.2f} |",
        f"| r3 codec body only | {ours['final_body_bytes'] / ours['final_rows']:.2f} |",
        f"| upstream int32 (L x K x 4) | {up['final_int32'] / up['final_rows']:.2f} |",
        f"| upstream base64 in the response | {up['final_bytes'] / up['final_rows']:.2f} |",
        "",
        "Same turn boundaries and segment metadata at a real model's shape (synthetic routing, "
        "frames stored through the service):",
        "",
        "| shape | data | bytes moved | `get_frame` | one piece | moved / stored | "
        "moved / one piece | B/token stored | upstream int32 B/token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in ours["shape_projection"]:
        lines.append(
            f"| {p['shape']} | {p['data']} | {p['bytes_moved']:,} | {p['stored_bytes']:,} | "
            f"{p['single_piece_bytes']:,} | {p['moved_over_stored']:.3f} | "
            f"{p['moved_over_single_piece']:.3f} | {p['stored_bytes'] / p['rows']:.1f} | "
            f"{p['upstream_int32_per_token']} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=16, help="requests in the warm-up batch")
    p.add_argument("--rounds", type=int, default=10, help="measured batches per configuration")
    p.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of every engine (0: torch's default, one per core)",
    )
    p.add_argument(
        "--streams", type=int, default=2, help="untagged streams running during every batch"
    )
    p.add_argument("--stream-new", type=int, default=32, help="new tokens per stream request")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--kv-tokens", type=int, default=4096, help="--max-total-tokens of each engine")
    p.add_argument(
        "--real-shape",
        action="store_true",
        help="Qwen3-30B-A3B's routing shape (48 layers x 128 experts x top-8, hidden 64): "
        "sets --layers/--experts/--topk/--hidden and sizes the KV pool for --prompt",
    )
    p.add_argument("--skip-agent", action="store_true", help="throughput only")
    p.add_argument(
        "--r3-lookup",
        choices=["always", "seen"],
        default="always",
        help="--routing-lookup of the r3 engines (seen: no lookup before generating a "
        "rollout the engine has not seen)",
    )
    p.add_argument(
        "--r3-grpc",
        action="store_true",
        help="also run (d): the extension shipping to the cache over gRPC",
    )
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--agent-prompt", type=int, default=64)
    p.add_argument("--agent-new", type=int, default=16)
    p.add_argument("--agent-tool", type=int, default=8)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "engine_bench.json")
    args = p.parse_args(argv)
    global CONFIGS
    CONFIGS = ("off", "upstream", "r3", "r3grpc") if args.r3_grpc else ("off", "upstream", "r3")
    if args.real_shape:
        args.layers, args.experts, args.topk, args.hidden = 48, 128, 8, 64
        args.kv_tokens = max(args.kv_tokens, (args.prompt + args.new) * args.concurrency + 4096)
    return args


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    model = build_tiny_model(
        "qwen3_moe",
        tmp / "model",
        layers=args.layers,
        experts=args.experts,
        topk=args.topk,
        hidden=args.hidden,
        positions=max(4096, args.prompt + args.new + 64),
    )
    (tmp / "service").mkdir()
    svc = start_service(tmp / "service", None)
    ctx = Ctx(args, model, tmp, svc, args.layers, args.topk)
    batches: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    agents: dict[str, dict[str, Any]] = {}
    try:
        # All three at once: --sleep-on-idle keeps the idle schedulers off the CPU.
        servers = {c: ctx.start(c, "main") for c in CONFIGS}
        for c in CONFIGS:
            throughput_batch(ctx, servers[c], c, seed=10_000, n=args.warmup)
        for rnd in range(args.rounds):
            order = CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))
            for c in order:
                b = throughput_batch(ctx, servers[c], c, seed=rnd, n=args.requests)
                b["round"] = rnd
                batches[c].append(b)
                print(
                    f"round {rnd + 1}/{args.rounds} {c:>8}: {b['output_tokens']} tokens in "
                    f"{b['seconds']:.1f} s = {b['tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
        for c in () if args.skip_agent else ("upstream", "r3"):
            t0 = time.perf_counter()
            agents[c] = agent(ctx, servers[c], c)
            print(f"agent {c}: {args.turns} turns in {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        for server in list(ctx.engines):
            ctx.stop(server)
        svc.stop()
    tps = {c: med([b["tokens_per_s"] for b in batches[c]]) for c in CONFIGS}
    paired = {
        c: med(
            [
                b["tokens_per_s"] / o["tokens_per_s"]
                for b, o in zip(batches[c], batches["off"], strict=True)
            ]
        )
        for c in CONFIGS
    }
    throughput = {
        c: {
            "batches": batches[c],
            "median_tokens_per_s": tps[c],
            "median_round_ratio_over_off": paired[c],
        }
        for c in CONFIGS
    }
    off = tps["off"]
    ratios = {
        "upstream_over_off": tps["upstream"] / off,
        "r3_over_off": tps["r3"] / off,
        "upstream_over_off_paired": paired["upstream"],
        "r3_over_off_paired": paired["r3"],
    }
    if "r3grpc" in tps:
        ratios["r3grpc_over_off"] = tps["r3grpc"] / off
        ratios["r3grpc_over_off_paired"] = paired["r3grpc"]
    targets = {"r3_over_off >= 0.98": tps["r3"] / off >= 0.98}
    if agents:
        ours, up = agents["r3"], agents["upstream"]
        ratios.update(
            r3_bytes_moved_over_stored=ours["bytes_moved"] / ours["final_bytes"],
            r3_bytes_moved_over_single_piece=ours["bytes_moved"] / ours["single_piece_bytes"],
            r3_rows_moved_over_final=ours["rows_moved"] / ours["final_rows"],
            upstream_bytes_moved_over_final=up["bytes_moved"] / up["final_bytes"],
        )
        targets["r3_bytes_moved_over_stored <= 1.05"] = (
            ours["bytes_moved"] / ours["final_bytes"] <= 1.05
        )
        targets["r3 rows moved == final rows"] = ours["rows_moved"] == ours["final_rows"]
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "model": {
            "family": "qwen3_moe",
            "layers": args.layers,
            "experts": args.experts,
            "topk": args.topk,
            "hidden": args.hidden,
        },
        "throughput": throughput,
        "agent": agents,
        "ratios": ratios,
        "targets": targets,
        "wall_s": time.perf_counter() - t_start,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="engine-bench-") as d:
        res = run(args, Path(d))
    print()
    print(report(res))
    print()
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.3f}")
    for k, ok in res["targets"].items():
        print(f"target {k}: {'met' if ok else 'NOT met'}")
    print(f"wall time {res['wall_s']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
