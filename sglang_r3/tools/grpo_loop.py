"""The GRPO loop of ``r3 rl-demo``: generation, routing checks, train steps, weight pushes.

See :mod:`sglang_r3.tools.rl_demo` for what a step does and the command around it.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from r3_client import Routing, RoutingClient
from r3_client.mismatch import extreme_frac, logprob_mismatch, routing_disagreement
from sglang_r3.tools.mismatch_report import output_logprobs

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


@dataclass
class _Step:
    """What one step generated: GRPO groups, finished episodes, episodes begun."""

    prompts: list[list[int]]
    samples: list[Sample]
    finished: list[Sample]
    begun: list[Episode]
    moved: int = 0


def _sample_of(
    item: dict[str, Any], rollout_id: str, prompt: list[int], version: str, group: int
) -> Sample:
    out = list(item["output_ids"])
    return Sample(
        rollout_id,
        prompt + out,
        list(range(len(prompt), len(prompt) + len(out))),
        output_logprobs(item),
        [(0, version)],
        group=group,
    )


def _generate_step(
    args: argparse.Namespace,
    engine: str,
    client: RoutingClient,
    rng: np.random.Generator,
    pending: list[Episode],
    tag: str,
    version: str,
    last: bool,
) -> _Step:
    """The step's generation: GRPO groups, the second turns of ``pending`` episodes (now
    under new weights) and, unless ``last``, the first turns of new episodes."""

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, args.vocab, n)]

    prompts = [draw(args.prompt_len) for _ in range(args.prompts)]
    step = _Step(prompts, [], [], [])
    for p, prompt in enumerate(prompts):
        for item in _generate(engine, prompt, f"{tag}-p{p}", version, args.samples, args.new):
            ref = item["meta_info"]["r3"]
            step.moved += int(ref["nbytes"])
            step.samples.append(_sample_of(item, ref["rollout_id"], prompt, version, p))
    for e in pending:
        tokens = e.tokens + draw(args.tool)
        (item,) = _generate(engine, tokens, e.rollout_id, version, 1, args.new)
        ref = item["meta_info"]["r3"]
        step.moved += int(ref["nbytes"])
        out = list(item["output_ids"])
        step.finished.append(
            Sample(
                e.rollout_id,
                tokens + out,
                e.sampled_at + list(range(len(tokens), len(tokens) + len(out))),
                e.logp_infer + output_logprobs(item),
                [*e.versions, (int(ref["start"]), version)],
                group=-1 - len(step.finished),
                since=len(tokens),
            )
        )
    for i in range(0 if last else args.episodes):
        prompt, rid = draw(args.prompt_len), f"{tag}-e{i}"
        (item,) = _generate(engine, prompt, rid, version, 1, args.new)
        step.moved += int(item["meta_info"]["r3"]["nbytes"])
        first = _sample_of(item, rid, prompt, version, 0)
        step.begun.append(
            Episode(
                rid,
                first.tokens,
                first.sampled_at,
                first.logp_infer,
                first.versions,
                np.asarray(client.get(rid).indices),
            )
        )
    return step


def _fetch_checked(
    client: RoutingClient, batch: list[Sample], pending: list[Episode], finished: list[Sample]
) -> int:
    """Fetch the batch's routing and check it; the bytes stored for it.

    Each segment's weight version must be the generating step's, and an episode's
    first turn must read as it did when it was generated.
    """
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
    return stored


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
    memory: list[int] = []  # Redis memory after each step
    with RoutingClient(cache_url) as client:
        bar = tqdm(range(args.steps), desc=f"{mode:>6}", unit="step", ncols=80)
        for n in bar:
            t0, version, tag = time.perf_counter(), f"{mode}-{n}", f"{run_id}-{mode}-s{n}"
            step = _generate_step(
                args, engine, client, rng, pending, tag, version, n + 1 == args.steps
            )
            batch = step.samples + step.finished
            stored = _fetch_checked(client, batch, pending, step.finished)
            m = train_step(model, optimizer, batch, replay)
            _check(
                not replay or m["router_disagreement"] == 0.0,
                f"step {n}: replayed routing differs from the engine's in "
                f"{m['router_disagreement']:.4%} of routers",
            )
            nxt = work / f"{mode}-{n + 1}"
            model.save_pretrained(nxt)
            push_weights(engine, nxt, f"{mode}-{n + 1}")
            stale_prefix_check(engine, client, step.prompts[0], f"{mode}-{n + 1}", tag)
            shutil.rmtree(work / f"{mode}-{n}", ignore_errors=True)
            for s in batch:
                client.delete(s.rollout_id)
            pending = step.begun
            memory.append(redis_memory(cache_url))
            result.records.append(
                StepRecord(
                    mode=mode,
                    step=n,
                    version=version,
                    samples=len(batch),
                    straddling_episodes=len(step.finished),
                    bytes_moved=step.moved,
                    bytes_stored=stored,
                    redis_memory=memory[-1],
                    seconds=time.perf_counter() - t0,
                    **m,
                )
            )
            bar.set_postfix(reward=f"{m['reward']:.2f}", kl=f"{m['k3_kl']:.2e}")
        bar.close()
    result.checks = _run_checks(mode, memory)
    return result


def _run_checks(mode: str, memory: list[int]) -> list[str]:
    """Check Redis memory over the run; the checks the run passed, for the report."""
    _check(
        memory[-1] <= MEMORY_GROWTH_LIMIT * memory[0],
        f"{mode}: Redis memory grew from {memory[0]:,} B after step 0 to "
        f"{memory[-1]:,} B after the last",
    )
    return [
        *(["replayed routing disagreement 0 every step"] if mode == "replay" else []),
        "segment weight versions match the generating step",
        "episodes' first turns unchanged after the push",
        "no stale prefix rows after a push",
        f"Redis memory last/first {memory[-1] / memory[0]:.2f} <= 1.2",
    ]
