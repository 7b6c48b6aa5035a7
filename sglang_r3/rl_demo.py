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
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from r3_client import Routing, RoutingClient
from r3_client.mismatch import extreme_frac, logprob_mismatch, routing_disagreement
from sglang_r3.report import output_logprobs

MODES = ("replay", "native")
MEMORY_GROWTH_LIMIT = 1.2


class RLCheckError(Exception):
    """An invariant of the loop did not hold."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RLCheckError(what)


@dataclass
class Sample:
    """One finished rollout the trainer learns from."""

    rollout_id: str
    tokens: list[int]
    sampled_at: list[int]  # positions in ``tokens`` the engine sampled
    logp_infer: list[float]
    versions: list[tuple[int, str]]  # (first row of a turn, the version that generated it)
    group: int  # samples of one prompt share a group; an episode is its own
    since: int = 0  # first token sampled under this step's weights (earlier: older ones)
    routing: Routing | None = None

    @property
    def reward(self) -> float:
        picked = [self.tokens[p] for p in self.sampled_at]
        return float(np.mean([t % 2 == 0 for t in picked])) if picked else 0.0


@dataclass
class Episode:
    """A multi-turn episode waiting for its next turn."""

    rollout_id: str
    tokens: list[int]
    sampled_at: list[int]
    logp_infer: list[float]
    versions: list[tuple[int, str]]
    first_rows: npt.NDArray[Any] | None = None  # turn 1's rows as stored when generated


@dataclass
class StepRecord:
    mode: str
    step: int
    version: str
    reward: float
    k3_kl: float
    logp_abs_diff: float
    f2: float
    f5: float
    router_disagreement: float
    token_disagreement: float
    straddle_k3_kl: float
    samples: int
    straddling_episodes: int
    bytes_moved: int
    bytes_stored: int
    redis_memory: int
    seconds: float


@dataclass
class Run:
    records: list[StepRecord] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- engine side


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> Any:
    r = httpx.post(url, json=body, timeout=timeout)
    if r.status_code != 200:
        raise RLCheckError(f"{url} answered {r.status_code}: {r.text[:400]}")
    return r.json()


def _generate(
    engine: str, tokens: list[int], rollout_id: str, version: str, n: int, new: int
) -> list[dict[str, Any]]:
    """One tagged request; the list of outputs (``n`` of them)."""
    out = _post(
        f"{engine}/generate",
        {
            "input_ids": tokens,
            "return_logprob": True,
            "sampling_params": {
                "n": n,
                "max_new_tokens": new,
                "temperature": 1.0,
                "ignore_eos": True,
                "custom_params": {"r3": {"rollout_id": rollout_id, "weight_version": version}},
            },
        },
    )
    items = out if isinstance(out, list) else [out]
    for item in items:
        ref = item["meta_info"]["r3"]
        _check(ref["stored"] is True, f"{ref.get('rollout_id')} was not stored: {ref}")
    return items


def push_weights(engine: str, path: Path, version: str) -> None:
    """Load ``path`` into SGLang as ``version`` (its radix cache is flushed)."""
    out = _post(
        f"{engine}/update_weights_from_disk",
        {"model_path": str(path), "weight_version": version},
    )
    _check(bool(out.get("success")), f"weight push to {version} failed: {out}")
    info = httpx.get(f"{engine}/model_info", timeout=30).json()
    _check(info.get("weight_version") == version, f"after the push the engine reports {info}")


def stale_prefix_check(
    engine: str, client: RoutingClient, prompt: list[int], version: str, tag: str
) -> None:
    """After a push: a prompt the engine served before must not return old rows.

    The prompt is sent twice under the new weights, first as it comes (a radix hit
    would return rows cached under the old weights), then after an explicit flush
    (rows computed now); the prompt rows must be equal.
    """
    rows = []
    for i in range(2):
        if i == 1:
            httpx.post(f"{engine}/flush_cache", timeout=60)
        rid = f"{tag}-probe{i}"
        _generate(engine, prompt, rid, version, 1, 1)
        rows.append(np.asarray(client.get(rid).indices)[: len(prompt) - 1])
        client.delete(rid)
    _check(
        np.array_equal(np.sort(rows[0], -1), np.sort(rows[1], -1)),
        f"after the push to {version}, a cached prompt returned rows of the old weights",
    )


# ---------------------------------------------------------------- trainer side


def _forward(model: Any, sample: Sample, replay: bool) -> tuple[Any, npt.NDArray[Any]]:
    """Log-probs (with grad) at the sampled positions, and the routing used ``[T-1, L, K]``."""
    import torch

    from r3_client.layouts import hf_layout
    from r3_client.replay import record_routing, recorded_as_routing, replay_routing

    ids = torch.tensor([sample.tokens])
    mask = torch.ones_like(ids)
    n = len(sample.tokens) - 1
    if replay:
        assert sample.routing is not None
        layout = hf_layout([sample.routing], mask.numpy(), as_torch=True, dtype=torch.int64)
        with replay_routing(model, layout) as state:
            logits = model(ids, attention_mask=mask).logits
            used = torch.stack([state.used[i] for i in state.layer_ids], dim=1)
            routing = used.reshape(1, ids.shape[1], len(state.layer_ids), -1)
    else:
        with record_routing(model) as rec:
            logits = model(ids, attention_mask=mask).logits
        routing = recorded_as_routing(rec, 1)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    at = torch.tensor(sample.sampled_at) - 1  # logits at p-1 predict the token at p
    return picked[at], routing[0, :n].detach().numpy()


def train_step(
    model: Any, optimizer: Any, samples: Sequence[Sample], replay: bool
) -> dict[str, float]:
    """One GRPO step over ``samples``; the train/infer mismatch measured on the way.

    The mismatch (k3 KL, |dlogp|, F, routing disagreement) is measured on the GRPO
    samples, generated entirely under this step's weights.  Episodes whose turns
    straddle a weight push are measured apart (``straddle_k3_kl``: their last turn's
    tokens): the engine generated that turn after recomputing the whole prefix under
    the new weights (the push flushed its cache) and shipped only the new rows, so
    the stored rows of the earlier turn are those that generated *that* turn, not the
    prefix the last turn attended to (docs/rl-demo.md).
    """
    import torch

    rewards = np.array([s.reward for s in samples])
    adv = np.zeros(len(samples))
    for g in {s.group for s in samples}:
        idx = [i for i, s in enumerate(samples) if s.group == g]
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std() + 1e-6) if len(idx) > 1 else r - rewards.mean()
    optimizer.zero_grad()
    lp: dict[bool, tuple[list[Any], list[Any]]] = {False: ([], []), True: ([], [])}
    engine_rows, used_rows = [], []
    loss = torch.zeros(())
    for s, a in zip(samples, adv, strict=True):
        logp, used = _forward(model, s, replay)
        loss = loss - float(a) * logp.mean() / len(samples)
        straddles = len(s.versions) > 1
        now = np.asarray(s.sampled_at) >= s.since
        lp[straddles][0].append(logp.detach().double().numpy()[now])
        lp[straddles][1].append(np.asarray(s.logp_infer, dtype=np.float64)[now])
        if not straddles:
            assert s.routing is not None
            engine_rows.append(np.asarray(s.routing.indices)[: len(s.tokens) - 1])
            used_rows.append(used)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    train = np.concatenate(lp[False][0])[None]
    infer = np.concatenate(lp[False][1])[None]
    mismatch = logprob_mismatch(train, infer)
    dis = routing_disagreement(np.concatenate(engine_rows)[None], np.concatenate(used_rows)[None])
    straddle = float("nan")
    if lp[True][0]:
        straddle = float(
            logprob_mismatch(np.concatenate(lp[True][0])[None], np.concatenate(lp[True][1])[None])[
                "k3_kl"
            ]
        )
    return {
        "reward": float(rewards.mean()),
        "k3_kl": float(mismatch["k3_kl"]),
        "logp_abs_diff": float(mismatch["logp_abs_diff"]),
        "f2": extreme_frac(train, infer, tau=2.0),
        "f5": extreme_frac(train, infer, tau=5.0),
        "router_disagreement": float(dis["router_disagreement"]),
        "token_disagreement": float(dis["token_disagreement"]),
        "straddle_k3_kl": straddle,
    }


# ---------------------------------------------------------------- the loop


def redis_memory(cache_url: str) -> int:
    """Redis ``used_memory`` as the cache service exports it (auth off in the demo)."""
    text = httpx.get(f"{cache_url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("r3_store_used_memory_bytes"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise RLCheckError("the cache service exports no r3_store_used_memory_bytes")


def check_versions(client: RoutingClient, sample: Sample) -> int:
    """Every stored segment carries the version of the step that generated its rows;
    the rollout's stored bytes (from the same ``stat``)."""
    info = client.stat(sample.rollout_id)
    starts = [v[0] for v in sample.versions]
    for seg in info.segments:
        # The turn a segment belongs to: the last one starting at or before it.
        turn = max(i for i, s in enumerate(starts) if s <= seg.segment.start)
        want = sample.versions[turn][1]
        got = seg.segment.weight_version
        _check(
            got == want,
            f"{sample.rollout_id}: rows [{seg.segment.start}, {seg.segment.end}) carry "
            f"weight version {got!r}, generated under {want!r}",
        )
    return info.stored_bytes


def run_mode(
    mode: str,
    args: argparse.Namespace,
    engine: str,
    cache_url: str,
    init: Path,
    work: Path,
    run_id: str,
) -> Run:
    """One GRPO run (``replay`` or ``native``) from the initial weights."""
    import torch
    import transformers
    from tqdm import tqdm

    from r3_client.replay import apply_routing_replay

    replay = mode == "replay"
    rng = np.random.default_rng(args.seed + 1)  # the same prompts in both runs
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.train()
    apply_routing_replay(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    push_weights(engine, init, f"{mode}-0")
    result = Run()
    pending: list[Episode] = []
    memory_after: list[int] = []
    with RoutingClient(cache_url) as client:
        bar = tqdm(range(args.steps), desc=f"{mode:>6}", unit="step", ncols=80)
        for step in bar:
            t0 = time.perf_counter()
            version = f"{mode}-{step}"
            tag = f"{run_id}-{mode}-s{step}"
            samples: list[Sample] = []
            moved = 0
            prompts = [
                [int(t) for t in rng.integers(3, args.vocab, args.prompt_len)]
                for _ in range(args.prompts)
            ]
            for p, prompt in enumerate(prompts):
                items = _generate(engine, prompt, f"{tag}-p{p}", version, args.samples, args.new)
                for item in items:
                    ref = item["meta_info"]["r3"]
                    moved += int(ref["nbytes"])
                    out = list(item["output_ids"])
                    samples.append(
                        Sample(
                            ref["rollout_id"],
                            prompt + out,
                            list(range(len(prompt), len(prompt) + len(out))),
                            output_logprobs(item),
                            [(0, version)],
                            group=p,
                        )
                    )
            # Episodes: the second turn of those begun last step (now under new
            # weights), then the first turn of new ones (finished next step).
            finished: list[Sample] = []
            for e in pending:
                tokens = e.tokens + [int(t) for t in rng.integers(3, args.vocab, args.tool)]
                (item,) = _generate(engine, tokens, e.rollout_id, version, 1, args.new)
                ref = item["meta_info"]["r3"]
                moved += int(ref["nbytes"])
                out = list(item["output_ids"])
                finished.append(
                    Sample(
                        e.rollout_id,
                        tokens + out,
                        e.sampled_at + list(range(len(tokens), len(tokens) + len(out))),
                        e.logp_infer + output_logprobs(item),
                        [*e.versions, (int(ref["start"]), version)],
                        group=-1 - len(finished),
                        since=len(tokens),
                    )
                )
            pending_next: list[Episode] = []
            if step + 1 < args.steps:
                for i in range(args.episodes):
                    prompt = [int(t) for t in rng.integers(3, args.vocab, args.prompt_len)]
                    rid = f"{tag}-e{i}"
                    (item,) = _generate(engine, prompt, rid, version, 1, args.new)
                    moved += int(item["meta_info"]["r3"]["nbytes"])
                    out = list(item["output_ids"])
                    pending_next.append(
                        Episode(
                            rid,
                            prompt + out,
                            list(range(len(prompt), len(prompt) + len(out))),
                            output_logprobs(item),
                            [(0, version)],
                            np.asarray(client.get(rid).indices),
                        )
                    )
            batch = samples + finished
            fetched = dict(client.get_many([s.rollout_id for s in batch]))
            stored = 0
            for s in batch:
                got = fetched[s.rollout_id]
                _check(isinstance(got, Routing), f"{s.rollout_id}: {got}")
                s.routing = got if isinstance(got, Routing) else None
                stored += check_versions(client, s)
            for e, s in zip(pending, finished, strict=True):
                assert e.first_rows is not None and s.routing is not None
                first = np.asarray(s.routing.indices)[: len(e.first_rows)]
                _check(
                    np.array_equal(first, e.first_rows),
                    f"{e.rollout_id}: its first turn's rows changed after the weight push",
                )
            m = train_step(model, optimizer, batch, replay)
            if replay:
                _check(
                    m["router_disagreement"] == 0.0,
                    f"step {step}: replayed routing differs from the engine's in "
                    f"{m['router_disagreement']:.4%} of routers",
                )
            nxt = work / f"{mode}-{step + 1}"
            model.save_pretrained(nxt)
            push_weights(engine, nxt, f"{mode}-{step + 1}")
            stale_prefix_check(engine, client, prompts[0], f"{mode}-{step + 1}", tag)
            shutil.rmtree(work / f"{mode}-{step}", ignore_errors=True)
            for s in batch:
                client.delete(s.rollout_id)
            pending = pending_next
            memory_after.append(redis_memory(cache_url))
            result.records.append(
                StepRecord(
                    mode=mode,
                    step=step,
                    version=version,
                    samples=len(batch),
                    straddling_episodes=len(finished),
                    bytes_moved=moved,
                    bytes_stored=stored,
                    redis_memory=memory_after[-1],
                    seconds=time.perf_counter() - t0,
                    **m,
                )
            )
            bar.set_postfix(reward=f"{m['reward']:.2f}", kl=f"{m['k3_kl']:.2e}")
        bar.close()
    _check(
        memory_after[-1] <= MEMORY_GROWTH_LIMIT * memory_after[0],
        f"{mode}: Redis memory grew from {memory_after[0]:,} B after step 0 to "
        f"{memory_after[-1]:,} B after the last",
    )
    result.checks = [
        "segment weight versions match the generating step",
        "episodes' first turns unchanged after the push",
        "no stale prefix rows after a push",
        f"Redis memory last/first {memory_after[-1] / memory_after[0]:.2f} <= 1.2",
    ]
    if replay:
        result.checks.insert(0, "replayed routing disagreement 0 every step")
    return result


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
    p.add_argument("--family", default="qwen3_moe", help="sglang_r3.harness.FAMILIES")
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

    from cache_service.redis_proc import free_port
    from sglang_r3.harness import build_tiny_model, start_cache, start_engine

    tf: Any = transformers
    tf.utils.logging.disable_progress_bar()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="r3-rl-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    started: list[Any] = []
    runs: dict[str, Run] = {}
    try:
        print(f"building a tiny {args.family} ({args.layers} layers, {args.experts} experts, "
              f"top-{args.topk}), seed {args.seed}", flush=True)  # fmt: skip
        init = build_tiny_model(
            args.family,
            work / "init",
            layers=args.layers,
            experts=args.experts,
            topk=args.topk,
            hidden=args.hidden,
            seed=args.seed,
        )
        print("starting the cache service (embedded Redis) and SGLang (CPU) ...", flush=True)
        cache = start_cache(work / "cache", http_port=free_port(), grpc_port=free_port())
        started.append(cache)
        engine = start_engine(
            init,
            port=free_port(),
            log=work / "sglang.log",
            routing_cache=cache.grpc_url,
            # bf16, as rollout engines run; the trainer keeps float32 (master weights).
            # The precision gap is what makes their routers disagree.
            extra_args=("--dtype", args.engine_dtype),
        )
        started.append(engine)
        run_id = uuid.uuid4().hex[:6]
        for mode in MODES:
            runs[mode] = run_mode(mode, args, engine.url, cache.url, init, work, run_id)
    except RLCheckError as exc:
        print(f"r3 rl-demo: check failed: {exc}", flush=True)
        return 1
    finally:
        for proc in reversed(started):
            proc.stop()
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
