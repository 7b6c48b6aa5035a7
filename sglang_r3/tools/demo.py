"""``r3 demo``: the whole R3 path on this machine, from one command.

Starts an embedded ``redis-server`` and the cache service, builds a tiny random
Qwen3-MoE, starts a real SGLang server in CPU mode with this extension, and then:

1. a GRPO group: one prompt, ``--samples`` samples, tagged with one rollout id
   (stored as ``{id}-0 … {id}-{n-1}``, the shared prompt rows stored once);
2. a multi-turn agent episode: ``--turns`` turns, "tool output" tokens injected
   between them, every turn sent with the same rollout id (each ships only its new
   rows);
3. fetches every rollout by id through the client (HTTP, and once over gRPC);
4. recomputes the sampled tokens' log-probs in Hugging Face transformers, with the
   model's own routing and with the engine's routing replayed;
5. prints what it stored and what replay changed.

Every process it starts is stopped at the end, on errors, on Ctrl-C and on SIGTERM.
Exit status: 0 on success, 1 when a check fails (e.g. replay did not reproduce the
engine's routing), 130 when interrupted.

``R3_DEMO_HOLD_AFTER_STAGE=k`` (for tests of the clean-up) makes the demo print
``holding after stage k`` once stage ``k`` is done and wait there until interrupted,
so a signal lands at a known point instead of racing the rest of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from r3_client import Routing, RoutingClient
from r3_client.mismatch import logprob_mismatch, routing_disagreement
from sglang_r3.tools.mismatch_report import output_logprobs

if TYPE_CHECKING:
    from sglang_r3.tools.local_stack import LocalStack

BASE64 = 4 / 3  # upstream ships int32 rows as base64 text
#: Stage after which the demo waits for a signal (module docstring); unset: it does not.
HOLD_ENV = "R3_DEMO_HOLD_AFTER_STAGE"


@dataclass
class Sample:
    """One stored rollout: its tokens, where the engine sampled, and its log-probs there."""

    rollout_id: str
    tokens: list[int]
    sampled_at: list[int]  # positions in ``tokens`` of the engine's sampled tokens
    logp_infer: list[float]
    routing: Routing | None = None


@dataclass
class Stats:
    """What the demo measured, for the summary and ``--json``."""

    rollouts: int = 0
    rows: int = 0
    stored_bytes: int = 0
    dedupe_hits: int = 0
    dedupe_saved_bytes: int = 0
    turn_bytes: list[int] = field(default_factory=list)
    turn_upstream_b64: list[int] = field(default_factory=list)
    results: dict[str, dict[str, float]] = field(default_factory=dict)


class Stages:
    """``[k/n] what`` lines with elapsed time, flushed at once (also when piped).

    A stage still running after ``heartbeat_s`` says so every ``heartbeat_s``, so a
    long wait (SGLang loading) never looks like a hang.
    """

    def __init__(
        self, total: int, heartbeat_s: float = 15.0, hold_after: int | None = None
    ) -> None:
        self.total, self.k, self.heartbeat_s = total, 0, heartbeat_s
        self.hold_after = hold_after

    @contextmanager
    def stage(self, what: str) -> Iterator[None]:
        self.k += 1
        t = time.monotonic()
        print(f"[{self.k}/{self.total}] {what} ...", flush=True)
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat_s):
                print(f"      ... still working ({time.monotonic() - t:.0f} s)", flush=True)

        ticker = threading.Thread(target=beat, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
        print(f"      done in {time.monotonic() - t:.1f} s", flush=True)
        if self.k == self.hold_after:
            print(f"      holding after stage {self.k} until interrupted ({HOLD_ENV})", flush=True)
            while True:  # SIGINT / SIGTERM raise KeyboardInterrupt out of the sleep
                time.sleep(60)

    def note(self, msg: str) -> None:
        print(f"      {msg}", flush=True)


def add_demo_parser(sub: Any) -> None:
    """Register ``r3 demo``."""
    p = sub.add_parser(
        "demo",
        help="end-to-end demo: SGLang (CPU) + cache + GRPO + multi-turn agent + HF replay",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--samples", type=int, default=8, help="GRPO group size (n)")
    p.add_argument("--turns", type=int, default=4, help="agent turns")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=48, help="tokens sampled per turn/sample")
    p.add_argument("--tool-tokens", type=int, default=16, help="tool output tokens per turn")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="a smaller run (4 samples, 3 turns, 16 tokens)"
    )
    p.add_argument("--workdir", type=Path, help="keep model, logs and Redis files here")
    p.add_argument("--json", type=Path, help="also write the summary numbers here")
    p.set_defaults(func=run_demo)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise DemoCheckError(what)


class DemoCheckError(Exception):
    """A property the demo exists to show did not hold."""


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    r = httpx.post(url, json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"SGLang answered {r.status_code}: {r.text[:500]}")
    return r.json()


def grpo_group(
    engine: str, args: argparse.Namespace, rid: str, rng: np.random.Generator, stats: Stats
) -> list[Sample]:
    """One prompt, ``args.samples`` samples, one tag; the prompt rows stored once."""
    prompt = [int(t) for t in rng.integers(3, 1000, args.prompt_len)]
    items = _post(
        f"{engine}/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {
                "n": args.samples,
                "max_new_tokens": args.new_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "custom_params": {"r3": {"rollout_id": rid, "weight_version": "step-0"}},
            },
        },
    )
    out = []
    for item in items:
        ref = item["meta_info"]["r3"]
        _check(ref["stored"], f"{ref['rollout_id']} was not stored: {ref}")
        for seg in ref.get("segments", []):
            if seg["dedupe_hit"]:
                stats.dedupe_hits += 1
                stats.dedupe_saved_bytes += seg["nbytes"]
        tokens = prompt + list(item["output_ids"])
        sampled = list(range(len(prompt), len(tokens)))
        out.append(Sample(ref["rollout_id"], tokens, sampled, output_logprobs(item)))
    return out


def agent_episode(
    engine: str,
    args: argparse.Namespace,
    rid: str,
    rng: np.random.Generator,
    stats: Stats,
    stages: Stages,
) -> Sample:
    """``args.turns`` turns of one conversation with tool output injected in between."""
    tokens = [int(t) for t in rng.integers(3, 1000, args.prompt_len)]
    sampled: list[int] = []
    logps: list[float] = []
    for turn in range(args.turns):
        item = _post(
            f"{engine}/generate",
            {
                "input_ids": tokens,
                "return_logprob": True,
                "sampling_params": {
                    "max_new_tokens": args.new_tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "custom_params": {"r3": {"rollout_id": rid, "weight_version": "step-0"}},
                },
            },
        )
        ref = item["meta_info"]["r3"]
        _check(ref["stored"], f"turn {turn + 1} was not stored: {ref}")
        sampled += range(len(tokens), len(tokens) + len(item["output_ids"]))
        tokens = tokens + list(item["output_ids"])
        logps += output_logprobs(item)
        # Upstream returns the whole trajectory's routing on every turn.
        full = (len(tokens) - 1) * args.layers * args.topk * 4
        stats.turn_bytes.append(int(ref["nbytes"]))
        stats.turn_upstream_b64.append(int(full * BASE64))
        stages.note(
            f"turn {turn + 1}: rows [{ref['start']}, {ref['end']}) shipped, "
            f"{ref['nbytes']:,} B (upstream would return {int(full * BASE64):,} B)"
        )
        if turn + 1 < args.turns:
            # A tool's answer: tokens the model did not sample, appended to the prompt.
            tokens += [int(t) for t in rng.integers(1000, 1024, args.tool_tokens)]
    return Sample(rid, tokens, sampled, logps)


def replay_measure(model: Any, samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Routing disagreement with the engine and log-prob mismatch, native and replayed."""
    from tqdm import tqdm

    from sglang_r3.tools.mismatch_report import hf_forward

    engine_rows: list[np.ndarray] = []
    native_rows: list[np.ndarray] = []
    replay_rows: list[np.ndarray] = []
    infer: list[np.ndarray] = []
    native_lp: list[np.ndarray] = []
    replay_lp: list[np.ndarray] = []
    with tqdm(total=2 * len(samples), desc="      HF forwards", unit="fwd", ncols=80) as bar:
        for s in samples:
            assert s.routing is not None
            n = len(s.tokens) - 1  # rows the engine has: every token but the last
            engine_rows.append(np.asarray(s.routing.indices)[:n])
            at = np.asarray(s.sampled_at) - 1  # logits at p-1 predict the token at p
            infer.append(np.asarray(s.logp_infer))
            for rows, lps, routings in (
                (native_rows, native_lp, None),
                (replay_rows, replay_lp, [s.routing]),
            ):
                logp, used = hf_forward(model, [s.tokens], routings)
                rows.append(used[0, :n])
                lps.append(logp[0, at])
                bar.update()
    results = {}
    engine = np.concatenate(engine_rows)[None]
    for name, rows, lps in (("native", native_rows, native_lp), ("replay", replay_rows, replay_lp)):
        d = routing_disagreement(engine, np.concatenate(rows)[None])
        m = logprob_mismatch(np.concatenate(lps)[None], np.concatenate(infer)[None])
        results[name] = {
            "router_disagreement": float(d["router_disagreement"]),
            "token_disagreement": float(d["token_disagreement"]),
            "k3_kl": float(m["k3_kl"]),
            "logp_abs_diff": float(m["logp_abs_diff"]),
        }
    return results


def summary(args: argparse.Namespace, stats: Stats, layers: int) -> str:
    """The numbers, as aligned text."""
    int32 = layers * args.topk * 4
    per_token = stats.stored_bytes / max(stats.rows, 1)
    shipped, upstream = sum(stats.turn_bytes), sum(stats.turn_upstream_b64)
    nat, rep = stats.results["native"], stats.results["replay"]
    lines = [
        ("model", f"tiny qwen3_moe, {layers} MoE layers x {args.experts} experts, top-{args.topk}"),
        (
            "rollouts stored",
            f"{stats.rollouts} (GRPO group of {args.samples} + an agent of {args.turns} turns), "
            f"{stats.rows:,} routing rows",
        ),
        (
            "bytes per token",
            f"{per_token:.1f} B stored (after dedupe) | upstream int32 {int32} B "
            f"({int32 / per_token:.1f}x) | base64 {int32 * BASE64:.0f} B "
            f"({int32 * BASE64 / per_token:.1f}x)",
        ),
        (
            "saved by dedupe",
            f"{stats.dedupe_saved_bytes:,} B: the GRPO prompt stored once, "
            f"{stats.dedupe_hits} of {args.samples} samples shared it",
        ),
        (
            "saved by multi-turn deltas",
            f"{args.turns} turns shipped {shipped:,} B; upstream returns {upstream:,} B "
            f"(base64 of the whole trajectory every turn): {upstream / max(shipped, 1):.1f}x",
        ),
        (
            "routing disagreement",
            f"native {nat['router_disagreement']:.2%} of routers, "
            f"{nat['token_disagreement']:.2%} of tokens -> with replay "
            f"{rep['router_disagreement']:.2%}, {rep['token_disagreement']:.2%}",
        ),
        ("k3 KL(train || infer)", f"native {nat['k3_kl']:.3e} -> with replay {rep['k3_kl']:.3e}"),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in lines)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; see the module docstring for the exit status."""
    if args.quick:
        args.samples, args.turns, args.new_tokens, args.prompt_len = 4, 3, 16, 32
    from sglang_r3.tools.local_stack import LocalStack

    previous = signal.signal(signal.SIGTERM, _sigterm)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="r3-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(work)
    try:
        stats = _run(args, stack)
    except KeyboardInterrupt:
        # A server interrupted while starting was already stopped by its launcher helper.
        print("\ninterrupted: stopping what the demo started ...", flush=True)
        return 130
    except DemoCheckError as exc:
        print(f"r3 demo: check failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("stopped every process the demo started", flush=True)
        signal.signal(signal.SIGTERM, previous)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dataclasses.asdict(stats), indent=2) + "\n")
    return 0


def _fetch_all(http_url: str, grpc_url: str, samples: list[Any], agent: Any, stats: Stats) -> None:
    """Fetch every rollout by id over HTTP (and the agent's again over gRPC); count bytes."""
    with RoutingClient(http_url) as http:
        fetched = dict(http.get_many([s.rollout_id for s in samples]))
        # Segments with a token digest live in content-addressed blobs: a segment
        # several rollouts share (the GRPO prompt) is stored, and counted, once.
        unique: dict[tuple[Any, ...], int] = {}
        for s in samples:
            got = fetched[s.rollout_id]
            _check(isinstance(got, Routing), f"{s.rollout_id}: {got}")
            s.routing = got if isinstance(got, Routing) else None
            info = http.stat(s.rollout_id)
            stats.rows += info.num_rows
            for seg in info.segments:
                unique[(info.layer_ids, seg.segment)] = seg.nbytes
        stats.stored_bytes = sum(unique.values())
    with RoutingClient(grpc_url) as grpc:
        over_grpc = grpc.get(agent.rollout_id)
    _check(
        agent.routing is not None and np.array_equal(over_grpc.indices, agent.routing.indices),
        "HTTP and gRPC returned different routing",
    )
    stats.rollouts = len(samples)


def _run(args: argparse.Namespace, stack: LocalStack) -> Stats:
    import torch
    import transformers

    from r3_client.replay import apply_routing_replay

    # The demo prints its own stage lines; transformers' per-file bars would bury them.
    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    hold = os.environ.get(HOLD_ENV)
    stages = Stages(7, hold_after=int(hold) if hold else None)
    stats = Stats()
    rng = np.random.default_rng(args.seed)
    run = uuid.uuid4().hex[:6]
    with stages.stage(
        f"building a tiny Qwen3-MoE ({args.layers} layers, {args.experts} experts, "
        f"top-{args.topk}; random weights, seed {args.seed})"
    ):
        model_path = stack.build_model(
            "qwen3_moe",
            layers=args.layers,
            experts=args.experts,
            topk=args.topk,
            hidden=args.hidden,
            init_std=0.2,
            seed=args.seed,
        )
    with stages.stage("starting the cache service with an embedded redis-server"):
        cache = stack.start_cache()
        grpc_url = cache.grpc_url
        stages.note(f"HTTP {cache.url}, gRPC {grpc_url}, pid {cache.proc.pid}")
    with stages.stage("starting SGLang (CPU mode) with the sglang-r3 extension, ~30-90 s"):
        engine = stack.start_engine(model_path, routing_cache=cache.url)
        stages.note(f"{engine.url}, pid {engine.proc.pid} (process group {engine.proc.pid})")
    with stages.stage(f"GRPO group: 1 prompt, {args.samples} samples, {args.new_tokens} tokens"):
        group = grpo_group(engine.url, args, f"demo-{run}-grpo", rng, stats)
        stages.note(
            f"stored {group[0].rollout_id} ... {group[-1].rollout_id}; "
            f"prompt segment deduplicated {stats.dedupe_hits} times"
        )
    with stages.stage(f"agent episode: {args.turns} turns with tool output between them"):
        agent = agent_episode(engine.url, args, f"demo-{run}-agent", rng, stats, stages)
    samples = [*group, agent]
    with stages.stage(f"fetching all {len(samples)} rollouts by id (HTTP batch, gRPC once)"):
        _fetch_all(cache.url, grpc_url, samples, agent, stats)
        stages.note(f"{stats.rows:,} rows, {stats.stored_bytes:,} B stored in Redis")
    with stages.stage("replaying in HF transformers: native routing, then the engine's"):
        model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
        model.eval()
        apply_routing_replay(model)
        stats.results = replay_measure(model, samples)
    print("\nsglang-r3 demo: summary", flush=True)
    print(summary(args, stats, args.layers), flush=True)
    rep = stats.results["replay"]
    _check(
        rep["router_disagreement"] == 0.0,
        f"replay left {rep['router_disagreement']:.4%} of routers different from the engine's",
    )
    return stats
