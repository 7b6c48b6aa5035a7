"""``r3 mismatch-report``: the R3 paper's measurement, on your model, from one command.

It generates rollouts on a real SGLang server running this extension, fetches their
routing by rollout id, and recomputes the log-probabilities of the sampled tokens
with the Hugging Face model twice: with its own (native) routing and with the
engine's routing replayed.  It prints router- and token-level routing disagreement,
the k3 KL, mean |Δlogp| and F(2)/F(5) side by side, and draws p_infer against
p_train (the paper's Fig. 2) and the F(τ) curve.

With ``--engine-url``/``--cache-url`` it uses running servers (GPU fleets); without
them it starts the cache service and SGLang in CPU mode on a tiny model it builds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client import Routing, RoutingClient
from r3_client.layouts import hf_layout
from r3_client.mismatch import extreme_frac, logprob_mismatch, routing_disagreement

TAUS = (1.5, 2.0, 3.0, 5.0, 10.0, 20.0)


@dataclass
class Rollout:
    """One generated sample: its tokens, the engine's log-probs and routing.

    ``logp_infer`` is ``None`` when the engine's log-probs did not line up with its
    output tokens (:class:`MisalignedLogprobsError`): such a rollout counts for routing
    but not for the log-prob measures.
    """

    rollout_id: str
    prompt: list[int]
    output: list[int]
    logp_infer: list[float] | None
    routing: Routing | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def generate_rollouts(
    engine_url: str,
    *,
    count: int,
    prompt_len: int,
    new_tokens: int,
    temperature: float,
    vocab: int,
    seed: int,
) -> list[Rollout]:
    """Sample ``count`` rollouts with random prompts, tagged with fresh rollout ids."""
    import httpx

    rng = np.random.default_rng(seed)
    run = uuid.uuid4().hex[:8]
    prompts = [[int(t) for t in rng.integers(3, vocab, prompt_len)] for _ in range(count)]
    ids = [f"report-{run}-{i}" for i in range(count)]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": new_tokens,
            "temperature": temperature,
            "ignore_eos": True,
            "custom_params": {"r3": {"rollout_id": ids}},
        },
    }
    r = httpx.post(f"{engine_url}/generate", json=body, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"generation failed ({r.status_code}): {r.text[:500]}")
    out = []
    for rid, prompt, item in zip(ids, prompts, r.json(), strict=True):
        try:
            logp: list[float] | None = output_logprobs(item)
        except MisalignedLogprobsError as e:
            _stage(f"{rid}: its log-probs are left out of the log-prob measures: {e}")
            logp = None
        out.append(Rollout(rid, prompt, list(item["output_ids"]), logp))
    return out


class MisalignedLogprobsError(ValueError):
    """An output's ``output_token_logprobs`` do not name its ``output_ids``, one each.

    Seen on SGLang 0.5.12 for a request the scheduler retracted and re-ran (upstream's own
    server, forced retractions): the first output token's log-prob is missing, 11 for 12
    tokens.  Pairing them by position would score the wrong tokens, so nothing is paired.
    """


def output_logprobs(item: dict[str, Any]) -> list[float]:
    """The engine's log-prob of each sampled token of one ``/generate`` output
    (asked for with ``"return_logprob": true``).

    Raises :class:`MisalignedLogprobsError` unless there is one per output token and each
    names that token.
    """
    entries = item["meta_info"]["output_token_logprobs"]
    output_ids = [int(t) for t in item["output_ids"]]
    named = [int(tok) for _lp, tok, *_ in entries]
    if named != output_ids:
        first = next(
            (i for i, (a, b) in enumerate(zip(named, output_ids, strict=False)) if a != b), None
        )
        where = f"; the first differs at {first}" if first is not None else ""
        raise MisalignedLogprobsError(
            f"the engine returned {len(named)} log-probs for {len(output_ids)} output tokens{where}"
        )
    return [float(lp) for lp, _tok, *_ in entries]


def hf_forward(
    model: Any, tokens: Sequence[Sequence[int]], routings: Sequence[Routing] | None
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Log-prob of every next token ``[B, T-1]`` and the routing used ``[B, T, L, K]``.

    ``routings=None``: the model's own routing (recorded); otherwise the engine's
    routing replayed (``-1`` where it has none: the last token). Sequences must be
    of equal length (one batch, no padding).
    """
    import torch

    from r3_client.replay import record_routing, recorded_as_routing, replay_routing

    ids = torch.tensor([list(t) for t in tokens])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if routings is not None:
            layout = hf_layout(list(routings), mask.numpy(), as_torch=True, dtype=torch.int64)
            with replay_routing(model, layout) as state:
                logits = model(ids, attention_mask=mask).logits
                used = torch.stack([state.used[i] for i in state.layer_ids], dim=1)
                routing = used.reshape(len(ids), ids.shape[1], len(state.layer_ids), -1)
        else:
            with record_routing(model) as rec:
                logits = model(ids, attention_mask=mask).logits
            routing = recorded_as_routing(rec, len(ids))
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return picked.double().numpy(), routing.numpy()


def train_side(
    model: Any, rollouts: Sequence[Rollout], *, replay: bool
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Trainer log-probs of every output token ``[B, N]`` and routing ``[B, T, L, K]``.

    ``replay=False``: the model's own routing (recorded); ``True``: the engine's
    routing replayed (``-1`` where it has none: the last token).
    """
    routings = None
    if replay:
        routings = [r.routing for r in rollouts if r.routing is not None]
        if len(routings) != len(rollouts):
            raise ValueError("fetch every rollout's routing before replaying")
    logp, routing = hf_forward(model, [r.tokens for r in rollouts], routings)
    n_out = len(rollouts[0].output)
    return logp[:, -n_out:], routing


def measure(model: Any, rollouts: Sequence[Rollout]) -> dict[str, Any]:
    """The paper's measures for native routing and for replay, plus the raw log-probs.

    Routing is measured on every rollout; log-probs on those whose engine log-probs
    line up with their tokens (``results["n_without_logprobs"]`` counts the others).
    """
    engine = np.stack([np.asarray(r.routing.indices) for r in rollouts if r.routing is not None])
    scored = [i for i, r in enumerate(rollouts) if r.logp_infer is not None]
    if not scored:
        raise ValueError("no rollout has engine log-probs that line up with its tokens")
    infer = np.array([rollouts[i].logp_infer for i in scored])
    results: dict[str, Any] = {"n_without_logprobs": len(rollouts) - len(scored)}
    for name, replay in (("native", False), ("replay", True)):
        logp, routing = train_side(model, rollouts, replay=replay)
        logp = logp[scored]
        rows = routing[:, : engine.shape[1]]  # the last token has no engine row
        disagreement = routing_disagreement(engine, rows)
        disagreement["n_routing_tokens"] = disagreement.pop("n_tokens")
        results[name] = {
            **disagreement,
            **logprob_mismatch(logp, infer),
            "F": {str(t): extreme_frac(logp, infer, tau=t) for t in TAUS},
            "logp_train": logp,
        }
    results["logp_infer"] = infer
    return results


def table(results: dict[str, Any]) -> str:
    """Markdown table of both columns."""
    rows = [
        ("router-level disagreement", "router_disagreement", "{:.2%}"),
        ("token-level disagreement", "token_disagreement", "{:.2%}"),
        ("mean differing routers per token", "differing_routers_per_token", "{:.3f}"),
        ("k3 KL(train ‖ infer)", "k3_kl", "{:.3e}"),
        ("mean |Δlogp|", "logp_abs_diff", "{:.4f}"),
        ("F(2)", "extreme_frac_tau2", "{:.3%}"),
        ("F(5)", "extreme_frac_tau5", "{:.3%}"),
    ]
    lines = ["| measure | native routing | R3 replay |", "|---|---:|---:|"]
    for label, key, fmt in rows:
        vals = [fmt.format(results[c][key]) for c in ("native", "replay")]
        lines.append(f"| {label} | {vals[0]} | {vals[1]} |")
    return "\n".join(lines)


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Fig. 2-style scatter of p_infer vs p_train, and the F(τ) curve, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    infer = np.exp(results["logp_infer"]).ravel()
    lo = float(
        min(infer.min(), *(np.exp(results[n]["logp_train"]).min() for n in ("native", "replay")))
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    for ax, name in zip(axes, ("native", "replay"), strict=True):
        train = np.exp(results[name]["logp_train"]).ravel()
        ax.scatter(infer, train, s=4, alpha=0.35)
        ax.plot([lo, 1], [lo, 1], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{'native routing' if name == 'native' else 'R3 replay'}")
        ax.set_xlabel("p_infer (SGLang), sampled token")
    axes[0].set_ylabel("p_train (HF transformers)")
    fig.tight_layout()
    scatter = out / "p_infer_vs_p_train.png"
    fig.savefig(scatter, dpi=120)
    plt.close(fig)

    taus = np.linspace(1.05, 20, 80)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name in ("native", "replay"):
        d = np.abs(results[name]["logp_train"] - results["logp_infer"]).ravel()
        ax.plot(taus, [(d > np.log(t)).mean() for t in taus], label=name)
    ax.set_xlabel("τ")
    ax.set_ylabel("F(τ): share of tokens with ratio > τ")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.legend()
    fig.tight_layout()
    curve = out / "f_tau.png"
    fig.savefig(curve, dpi=120)
    plt.close(fig)
    return [scatter, curve]


def add_report_parser(sub: Any) -> None:
    """Register ``r3 mismatch-report``."""
    p = sub.add_parser(
        "mismatch-report",
        help="measure train/infer routing and log-prob mismatch with and without R3 replay",
    )
    p.add_argument("--engine-url", help="a running sglang_r3 server (default: start one on CPU)")
    p.add_argument("--cache-url", help="its routing cache (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("R3_API_KEY"), help="cache API key")
    p.add_argument("--model-path", help="HF checkpoint (default: build a tiny one)")
    p.add_argument("--family", default="qwen3_moe", help="tiny model family to build")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--init-std", type=float, default=0.2, help="tiny model init std (peakier when larger)"
    )
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("mismatch-report"), help="output directory")
    p.set_defaults(func=run_report)


def _stage(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_report(args: argparse.Namespace) -> int:
    """Run the whole report; 0 on success."""
    import torch
    import transformers

    from sglang_r3.tools.local_stack import LocalStack

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="r3-report-"))
    with LocalStack(work) as stack:
        model_path = Path(args.model_path) if args.model_path else None
        if model_path is None:
            _stage(f"building a tiny {args.family} ({args.layers} layers, {args.experts} experts)")
            model_path = stack.build_model(
                args.family,
                layers=args.layers,
                experts=args.experts,
                topk=args.topk,
                hidden=args.hidden,
                init_std=args.init_std,
                seed=args.seed,
            )
        cache_url, api_key = args.cache_url, args.api_key
        if cache_url is None:
            _stage("starting the cache service (embedded redis-server)")
            cache = stack.start_cache()
            cache_url, api_key = cache.url, None
        engine_url = args.engine_url
        if engine_url is None:
            _stage("starting SGLang (CPU) with the extension; ~30-60 s")
            engine = stack.start_engine(model_path, routing_cache=cache_url, api_key=api_key)
            engine_url = engine.url
        _stage(f"generating {args.rollouts} rollouts")
        config = json.loads((model_path / "config.json").read_text())
        rollouts = generate_rollouts(
            engine_url,
            count=args.rollouts,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            temperature=args.temperature,
            vocab=int(config["vocab_size"]),
            seed=args.seed,
        )
        _stage("fetching routing by rollout id")
        with RoutingClient(cache_url, api_key=api_key) as client:
            for r in rollouts:
                r.routing = client.get(r.rollout_id)
        _stage("recomputing log-probs in HF transformers (native, then replayed)")
        tf: Any = transformers
        model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
        model.eval()
        from r3_client.replay import apply_routing_replay

        apply_routing_replay(model)
        results = measure(model, rollouts)
    _write_report(results, out)
    return 0


def _write_report(results: dict[str, Any], out: Path) -> None:
    """``mismatch.md``, ``mismatch.json`` and the plots in ``out``; the table printed."""
    md = table(results)
    pngs = plots(results, out)
    summary = {
        name: {k: v for k, v in results[name].items() if k != "logp_train"}
        for name in ("native", "replay")
    }
    summary["n_without_logprobs"] = results["n_without_logprobs"]
    (out / "mismatch.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "mismatch.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out / 'mismatch.md'}, {out / 'mismatch.json'}, " + ", ".join(map(str, pngs)))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sglang_r3.tools.mismatch_report`` (same as ``r3 mismatch-report``)."""
    parser = argparse.ArgumentParser(prog="r3")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["mismatch-report", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
