"""``r3 rl-demo``: R3 inside a real RL loop, replay policies against native routing, on this CPU.

A tiny random MoE (built with ``transformers``), real SGLang with this extension, the
cache service on an embedded Redis, and a small GRPO loop on a verifiable toy task:
the reward of a sample is the fraction of its sampled tokens whose id is even (the
policy can move on it: its output layer is all it has to learn).  Each step:

1. generates ``--prompts`` groups of ``--samples`` samples, and the turns of
   ``--episodes`` multi-turn episodes with tool tokens between turns; an episode's
   first turn is generated in one step and its second in the next, after the weight
   push (which flushed the engine's radix cache: the second turn recomputed the
   prefix, stored as a view).  Every rollout is tagged with the step's
   ``weight_version``;
2. fetches the routing by rollout id under each read policy (``generated``,
   ``latest``, ``exact``), checks each segment's weight version against the step that
   generated it, that an episode's first turn still reads as it did when it was
   generated, and that its exact states start at its turns;
3. scores the *same* samples with the *same* weights four ways (paired): the
   trainer's own routing (``native``) and the engine's routing replayed under each
   policy (``exact``: one forward per state, each keeping its span's log-probs); the
   train/infer mismatch (k3 KL against SGLang's log-probs) per policy, on the GRPO
   samples and on the last turn of the episodes that straddle the push; and takes one
   GRPO step on the ``exact`` forward (group-normalised reward);
4. saves the weights and pushes them to SGLang (``/update_weights_from_disk`` with
   the next step's weight version), then checks that a prompt the engine had cached
   returns rows computed with the new weights (equal to the rows after an explicit
   cache flush);
5. deletes the step's finished rollouts and records Redis memory.

Exit status 1 when a check fails: a replayed forward's routing differs from the rows it
was given, a segment carries the wrong version, an episode has no view of its
recomputed prefix, a cached prefix returns old rows, or Redis memory after the last step
exceeds 1.2 times its figure after the first.  See docs/rl-demo.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sglang_r3.tools.grpo_loop import RLCheckError, Run, StepRecord, run_loop
from sglang_r3.tools.rl_scoring import POLICIES, TRAINED

# ---------------------------------------------------------------- output

PARTS = (
    ("k3_kl", "GRPO samples"),
    ("straddle_k3_kl", "episode last turn (after the push)"),
    ("first_turn_k3_kl", "episode first turn (at its own weights)"),
)
# The native routing's disagreement with the engine's, on the tokens of each part.
DISAGREEMENT = {
    "k3_kl": "router_disagreement",
    "straddle_k3_kl": "straddle_router_disagreement",
    "first_turn_k3_kl": "first_router_disagreement",
}


def _e(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2e}"


def kl_table(records: Sequence[StepRecord]) -> str:
    """Markdown table of the paired k3 KL, one row per step, one column per policy and part."""
    cols = [f"{label.split(' (')[0]}: {p}" for _, label in PARTS for p in POLICIES]
    lines = ["| step | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in records:
        vals = [_e(getattr(r, key)[p]) for key, _ in PARTS for p in POLICIES]
        lines.append(f"| {r.step} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def run_table(records: Sequence[StepRecord]) -> str:
    """Markdown table of the rest of each step (GRPO samples; native and exact)."""
    head = (
        "| step | reward | mean abs dlogp native / exact | F(2) native / exact | "
        "F(5) native / exact | router disagr. native (episode last call; first turn) | "
        "token disagr. native | GRPO samples with a flip: n, k3 KL native / exact | "
        "max abs dlogp native / exact (GRPO; last turn) | "
        "samples (episodes across a push; with views) | bytes moved | bytes stored | "
        "Redis memory | s |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in records:
        d, f2, f5, mx = r.logp_abs_diff, r.f2, r.f5, r.max_abs_dlogp
        lines.append(
            f"| {r.step} | {r.reward:.3f} | {d['native']:.2e} / {d['exact']:.2e} | "
            f"{f2['native']:.4f} / {f2['exact']:.4f} | {f5['native']:.4f} / {f5['exact']:.4f} | "
            f"{r.router_disagreement:.4f} ({_f(r.straddle_router_disagreement)}; "
            f"{_f(r.first_router_disagreement)}) | "
            f"{r.token_disagreement:.4f} | {r.flipped_samples}, "
            f"{_e(r.flipped_k3_kl['native'])} / {_e(r.flipped_k3_kl['exact'])} | "
            f"{_f(mx['grpo']['native'])} / {_f(mx['grpo']['exact'])} "
            f"({_f(mx['straddle']['native'])} / {_f(mx['straddle']['exact'])}) | "
            f"{r.samples} ({r.straddling_episodes}; {r.samples_with_views}) | "
            f"{r.bytes_moved:,} | {r.bytes_stored:,} | {r.redis_memory:,} | {r.seconds:.1f} |"
        )
    return "\n".join(lines)


def _f(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.4f}" if x < 10 else f"{x:.1f}"


def paired_summary(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Per part: mean k3 KL per policy over the steps that have it, and the steps where
    ``exact`` is not at or below ``native`` (with both values, and the native routing's
    disagreement with the engine's there: where it is 0 both forwards routed alike)."""
    out: dict[str, Any] = {}
    for key, _ in PARTS:
        rs = [r for r in records if not math.isnan(getattr(r, key)["exact"])]
        kl = {p: float(np.mean([getattr(r, key)[p] for r in rs])) if rs else None for p in POLICIES}
        worse = [
            {
                "step": r.step,
                "exact": getattr(r, key)["exact"],
                "native": getattr(r, key)["native"],
                "native_router_disagreement": getattr(r, DISAGREEMENT[key]),
            }
            for r in rs
            if getattr(r, key)["exact"] > getattr(r, key)["native"]
        ]
        out[key] = {"mean": kl, "steps": len(rs), "exact_above_native": worse}
    return out


def plots(records: Sequence[StepRecord], out: Path) -> list[Path]:
    """Paired k3 KL per policy, routing disagreement and reward against step (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    style: dict[str, dict[str, Any]] = {
        "native": {"marker": "o"},
        "generated": {"marker": "v", "linestyle": "--"},
        "latest": {"marker": "^", "linestyle": ":"},
        "exact": {"marker": "s", "markersize": 4},
    }
    fig, axes = plt.subplots(1, len(PARTS), figsize=(13, 3.6), sharey=True)
    for ax, (key, label) in zip(axes, PARTS, strict=True):
        for p in POLICIES:
            ax.plot(steps, [getattr(r, key)[p] for r in records], label=p, **style[p])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_yscale("log")  # the policies differ by orders of magnitude
    axes[0].set_ylabel(f"train/infer k3 KL (trained on {TRAINED})")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "k3_kl.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    for name, label, series in (
        (
            "router_disagreement",
            "router disagreement with the engine",
            {
                "native, GRPO samples": [r.router_disagreement for r in records],
                "native, episodes (last call)": [r.straddle_router_disagreement for r in records],
                "replayed, against the rows given (every policy)": [
                    r.replay_router_disagreement for r in records
                ],
            },
        ),
        ("reward", "reward (fraction of even tokens)", {TRAINED: [r.reward for r in records]}),
    ):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for what, ys in series.items():
            ax.plot(steps, ys, marker="o", label=what)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------- command


def add_rl_demo_parser(sub: Any) -> None:
    """Register ``r3 rl-demo``."""
    p = sub.add_parser(
        "rl-demo",
        help="a GRPO loop with weight pushes to SGLang, replay policies vs native, paired "
        "(CPU, tiny MoE)",
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
    """Run the loop; 0 when every check held, 1 otherwise."""
    run = _run_stack(args)
    if run is None:
        return 1
    records = run.records
    args.out.mkdir(parents=True, exist_ok=True)
    text = kl_table(records) + "\n\n" + run_table(records)
    paired = paired_summary(records)
    summary = {
        "trained": TRAINED,
        "policies": list(POLICIES),
        "paired": paired,
        "checks": run.checks,
        "records": [r.__dict__ for r in records],
    }
    (args.out / "rl-demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "rl-demo.md").write_text(text + "\n")
    print("\n" + text + "\n", flush=True)
    _print_paired(paired, records)
    for c in run.checks:
        print(f"check: {c}: ok", flush=True)
    if not args.no_plots:
        for path in plots(records, args.out):
            print(f"wrote {path}", flush=True)
    return 0


def _run_stack(args: argparse.Namespace) -> Run | None:
    """Build the model, start the cache and SGLang, run the loop, stop them; None when
    a check failed (said on stdout)."""
    import transformers

    from sglang_r3.tools.local_stack import LocalStack

    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="r3-rl-demo-"))
    work.mkdir(parents=True, exist_ok=True)
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
        return run_loop(args, engine.url, cache.url, init, work, uuid.uuid4().hex[:6])
    except RLCheckError as exc:
        print(f"r3 rl-demo: check failed: {exc}", flush=True)
        return None
    finally:
        stack.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _print_paired(paired: dict[str, Any], records: Sequence[StepRecord]) -> None:
    """Per part, each policy's mean k3 KL and where ``exact`` was above ``native``; then
    each step's loss on the expansion path against the per-state forwards'."""
    print(f"trained on the {TRAINED} replay; every step scored under each policy:", flush=True)
    for key, label in PARTS:
        got = paired[key]
        if not got["steps"]:
            continue
        means = ", ".join(f"{p} {got['mean'][p]:.3e}" for p in POLICIES)
        worse = got["exact_above_native"]
        where = "; ".join(
            f"step {w['step']}: exact {w['exact']:.3e} > native {w['native']:.3e}, native "
            f"router disagreement {w['native_router_disagreement']:.4f}"
            for w in worse
        )
        held = f"{got['steps'] - len(worse)} of {got['steps']} steps"
        print(
            f"{label}: mean k3 KL {means}; exact <= native on {held}"
            + (f" ({where})" if worse else ""),
            flush=True,
        )
    print(
        f"trained through state expansion (one row per routing state, one batched forward, as "
        f"a framework would); paired with the per-state forwards ({TRAINED}):",
        flush=True,
    )
    for r in records:
        print(
            f"  step {r.step}: loss {r.loss['expansion']:.6e} (expansion) / "
            f"{r.loss['per_state']:.6e} (per state), max |dlogp| {r.expansion_max_abs_dlogp:.1e}",
            flush=True,
        )
