"""``r3 rl-demo``: R3 inside a real RL loop, replay on against replay off, on this CPU.

A tiny random MoE (built with ``transformers``), real SGLang with this extension, the
cache service on an embedded Redis, and a small GRPO loop on a verifiable toy task:
the reward of a sample is the fraction of its sampled tokens whose id is even (the
policy can move on it: its output layer is all it has to learn).  Each step:

1. generates ``--prompts`` groups of ``--samples`` samples, and the turns of
   ``--episodes`` multi-turn episodes with tool tokens between turns; an episode's
   first turn is generated in one step and its second in the next, after the weight
   push, so its stored segments carry two weight versions.  Every rollout is tagged
   with the step's ``weight_version``;
2. fetches the routing by rollout id, checks each segment's weight version against the
   step that generated it, and that an episode's first turn still reads as it did
   when it was generated;
3. computes the trainer's log-probs with HF transformers, replaying the engine's
   routing (``replay`` run) or with the model's own routing (``native`` run), the
   train/infer mismatch (k3 KL, mean |Δlogp|, F(2), F(5)) and the routing
   disagreement with the engine, and takes one GRPO step (group-normalised reward);
4. saves the weights and pushes them to SGLang (``/update_weights_from_disk`` with
   the next step's weight version), then checks that a prompt the engine had cached
   returns rows computed with the new weights (equal to the rows after an explicit
   cache flush);
5. deletes the step's finished rollouts and records Redis memory.

The two runs start from the same weights.  Exit status 1 when a check fails: the
replayed routing differs from the engine's, a segment carries the wrong version, a
cached prefix returns old rows, or Redis memory after the last step exceeds 1.2 times its
figure after the first.  See docs/rl-demo.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_r3.tools.grpo_loop import (
    MODES,
    RLCheckError,
    Run,
    StepRecord,
    run_mode,
)

# ---------------------------------------------------------------- output


def table(records: Sequence[StepRecord]) -> str:
    """Markdown table, one row per (mode, step)."""
    head = (
        "| run | step | reward | k3 KL | mean abs dlogp | F(2) | F(5) | router disagr. | "
        "token disagr. | episode last turn k3 KL | samples (episodes across a push) | "
        "bytes moved | bytes stored | Redis memory | s |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in records:
        lines.append(
            f"| {r.mode} | {r.step} | {r.reward:.3f} | {r.k3_kl:.2e} | {r.logp_abs_diff:.2e} | "
            f"{r.f2:.4f} | {r.f5:.4f} | {r.router_disagreement:.4f} | "
            f"{r.token_disagreement:.4f} | {r.straddle_k3_kl:.2e} | "
            f"{r.samples} ({r.straddling_episodes}) | "
            f"{r.bytes_moved:,} | {r.bytes_stored:,} | {r.redis_memory:,} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def plots(records: Sequence[StepRecord], out: Path) -> list[Path]:
    """KL and routing disagreement against step, replay on and off (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label in (
        ("k3_kl", "train/infer k3 KL"),
        ("router_disagreement", "router disagreement with the engine"),
        ("reward", "reward (fraction of even tokens)"),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for mode in MODES:
            rs = [r for r in records if r.mode == mode]
            ax.plot([r.step for r in rs], [getattr(r, key) for r in rs], marker="o", label=mode)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if key == "k3_kl":
            ax.set_yscale("log")  # replay and native differ by orders of magnitude
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- command


def add_rl_demo_parser(sub: Any) -> None:
    """Register ``r3 rl-demo``."""
    p = sub.add_parser(
        "rl-demo",
        help="a GRPO loop with weight pushes to SGLang, replay on vs off (CPU, tiny MoE)",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=2, help="GRPO groups per step")
    p.add_argument("--samples", type=int, default=4, help="samples per group (n)")
    p.add_argument("--episodes", type=int, default=1, help="multi-turn episodes begun per step")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=16, help="tokens sampled per sample or turn")
    p.add_argument("--tool", type=int, default=4, help="tool tokens between an episode's turns")
    p.add_argument("--family", default="qwen3_moe", help="sglang_r3.tools.local_stack.FAMILIES")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids below this")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument(
        "--engine-dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="SGLang's --dtype (the trainer runs float32; with float32 here both sides "
        "compute the same routing and there is no mismatch to remove)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("rl-demo-out"), help="table, JSON, PNGs")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--workdir", type=Path, help="keep model, logs and Redis files here")
    p.set_defaults(func=run_rl_demo)


def run_rl_demo(args: argparse.Namespace) -> int:
    """Run both modes; 0 when every check held, 1 otherwise."""
    import transformers

    from sglang_r3.tools.local_stack import LocalStack

    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="r3-rl-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Run] = {}
    stack = LocalStack(work)
    try:
        print(f"building a tiny {args.family} ({args.layers} layers, {args.experts} experts, "
              f"top-{args.topk}), seed {args.seed}", flush=True)  # fmt: skip
        init = stack.build_model(
            args.family,
            "init",
            layers=args.layers,
            experts=args.experts,
            topk=args.topk,
            hidden=args.hidden,
            seed=args.seed,
        )
        print("starting the cache service (embedded Redis) and SGLang (CPU) ...", flush=True)
        cache = stack.start_cache()
        engine = stack.start_engine(
            init,
            routing_cache=cache.grpc_url,
            # bf16, as rollout engines run; the trainer keeps float32 (master weights).
            # The precision gap is what makes their routers disagree.
            extra_args=("--dtype", args.engine_dtype),
        )
        run_id = uuid.uuid4().hex[:6]
        for mode in MODES:
            runs[mode] = run_mode(mode, args, engine.url, cache.url, init, work, run_id)
    except RLCheckError as exc:
        print(f"r3 rl-demo: check failed: {exc}", flush=True)
        return 1
    finally:
        stack.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    records = [r for mode in MODES for r in runs[mode].records]
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(records)
    kl = {m: float(np.mean([r.k3_kl for r in runs[m].records])) for m in MODES}
    summary = {
        "mean_k3_kl": kl,
        "checks": {m: runs[m].checks for m in MODES},
        "records": [r.__dict__ for r in records],
    }
    (args.out / "rl-demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "rl-demo.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    print(f"\nmean k3 KL: replay {kl['replay']:.3e}, native {kl['native']:.3e}", flush=True)
    for mode in MODES:
        for c in runs[mode].checks:
            print(f"check ({mode}): {c}: ok", flush=True)
    if not args.no_plots:
        for path in plots(records, args.out):
            print(f"wrote {path}", flush=True)
    return 0
