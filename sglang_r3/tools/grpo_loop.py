"""The GRPO loop of ``r3 rl-demo``: generation, routing checks, train steps, weight pushes.

See :mod:`sglang_r3.tools.rl_demo` for what a step does and the command around it, and
:mod:`sglang_r3.tools.rl_scoring` for the trainer side (the paired scoring per policy).
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from r3_client import Routing, RoutingClient, expand_states
from sglang_r3.tools.mismatch_report import output_logprobs
from sglang_r3.tools.rl_scoring import TRAINED, Sample, train_step

MEMORY_GROWTH_LIMIT = 1.2


class RLCheckError(Exception):
    """An invariant of the loop did not hold."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RLCheckError(what)


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
    """One step; the per-policy figures are ``{policy: value}`` (rl_scoring.POLICIES)."""

    step: int
    version: str
    reward: float
    k3_kl: dict[str, float]
    logp_abs_diff: dict[str, float]
    f2: dict[str, float]
    f5: dict[str, float]
    straddle_k3_kl: dict[str, float]
    first_turn_k3_kl: dict[str, float]
    max_abs_dlogp: dict[str, dict[str, float]]  # {"grpo"/"straddle": {policy: value}}
    flipped_samples: int  # GRPO samples whose native routing differs from the engine's
    flipped_k3_kl: dict[str, float]  # k3 KL on those samples only
    router_disagreement: float  # native routing against the engine's, GRPO samples
    token_disagreement: float
    straddle_router_disagreement: float  # the same on the straddling episodes
    first_router_disagreement: float  # and on their first turn, at its own weights
    replay_router_disagreement: float  # replayed routing against the rows given: 0
    loss: dict[str, float]  # {"expansion": trained, "per_state": exact forwards}: equal
    expansion_max_abs_dlogp: float  # largest token log-prob gap between the two paths
    samples: int
    samples_with_views: int
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
    """Fetch the batch's routing under each policy and check it; the bytes stored for it.

    Each segment's weight version must be the generating step's; an episode's first turn
    must read (``generated``) as it did when it was generated; the ``exact`` states of an
    episode that straddles the push must start at its turns (the push flushed the radix
    cache, so its last turn recomputed the prefix: a view serving that turn); and the
    policies must agree with each other (``generated`` is the first state's rows,
    ``latest`` the last state's).
    """
    fetched = dict(client.get_many([s.rollout_id for s in batch]))
    stored = 0
    for s in batch:
        got = fetched[s.rollout_id]
        _check(isinstance(got, Routing), f"{s.rollout_id}: {got}")
        s.generated = got if isinstance(got, Routing) else None
        s.latest = client.get(s.rollout_id, view="latest")
        s.served = client.get_served(s.rollout_id, view="exact")
        stored += check_versions(client, s)
        assert s.generated is not None
        first, last = s.served[0], s.served[-1]
        _check(
            np.array_equal(
                np.asarray(first.routing.indices),
                np.asarray(s.generated.indices)[: first.serves_end],
            )
            and np.array_equal(np.asarray(last.routing.indices), np.asarray(s.latest.indices))
            and last.serves_end == len(s.tokens) - 1,
            f"{s.rollout_id}: the generated/latest/exact reads disagree",
        )
        if s.straddles:
            turns = [start for start, _ in s.versions]
            _check(
                [st.serves_start for st in s.served] == turns,
                f"{s.rollout_id}: turns start at rows {turns} but its exact states at "
                f"{[st.serves_start for st in s.served]} (no view of the recomputed prefix?)",
            )
            views = s.served[-1].views
            _check(
                all(v.weight_version == s.versions[-1][1] for v in views),
                f"{s.rollout_id}: its view carries {[v.weight_version for v in views]}, "
                f"recomputed under {s.versions[-1][1]!r}",
            )
    # The framework path: the step expanded one training row per state (metadata only), each
    # row's rows read by range under its state, as a training rank reads them.
    exp = expand_states(client, [s.rollout_id for s in batch], [len(s.tokens) for s in batch])
    reads = [(st.rollout_id, 0, st.num_tokens - 1, st.state) for st in exp.states]
    for st, (_, rows) in zip(exp.states, client.get_ranges(reads), strict=True):
        assert isinstance(rows, Routing)
        batch[st.origin].expanded.append((st.state, st.num_tokens, rows))
    for s in batch:
        _check(
            [st for st, _, _ in s.expanded] == [st.serves_start for st in s.served],
            f"{s.rollout_id}: its expansion's states differ from get_served's",
        )
    for e, s in zip(pending, finished, strict=True):
        assert e.first_rows is not None and s.generated is not None
        first_rows = np.asarray(s.generated.indices)[: len(e.first_rows)]
        _check(
            np.array_equal(first_rows, e.first_rows),
            f"{e.rollout_id}: its first turn's rows changed after the weight push",
        )
    return stored


def run_loop(
    args: argparse.Namespace,
    engine: str,
    cache_url: str,
    init: Path,
    work: Path,
    run_id: str,
) -> Run:
    """The GRPO run from the initial weights, trained on the ``exact`` replay; every
    step's samples scored under every policy (paired)."""
    import torch
    import transformers
    from tqdm import tqdm

    from r3_client.replay import apply_routing_replay

    rng = np.random.default_rng(args.seed + 1)
    torch.manual_seed(args.seed)

    def load(path: Path) -> Any:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.train()
        return apply_routing_replay(m)

    model = load(init)
    previous = load(init)  # the weights of the step before (episodes' first turns)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    push_weights(engine, init, "step-0")
    result = Run()
    pending: list[Episode] = []
    memory: list[int] = []  # Redis memory after each step
    with RoutingClient(cache_url) as client:
        bar = tqdm(range(args.steps), desc=f"train on {TRAINED}", unit="step", ncols=80)
        for n in bar:
            t0, version, tag = time.perf_counter(), f"step-{n}", f"{run_id}-s{n}"
            step = _generate_step(
                args, engine, client, rng, pending, tag, version, n + 1 == args.steps
            )
            batch = step.samples + step.finished
            stored = _fetch_checked(client, batch, pending, step.finished)
            current = {k: v.detach().clone() for k, v in model.state_dict().items()}
            m = train_step(model, optimizer, batch, previous if step.finished else None)
            previous.load_state_dict(current)
            _check(
                m["expansion_max_abs_dlogp"] < 1e-4,
                f"step {n}: the expanded batch's log-probs differ from the per-state forwards' "
                f"by {m['expansion_max_abs_dlogp']:.3e}",
            )
            _check(
                m["replay_router_disagreement"] == 0.0,
                f"step {n}: replayed routing differs from the rows given in "
                f"{m['replay_router_disagreement']:.4%} of routers",
            )
            nxt = work / f"step-{n + 1}"
            model.save_pretrained(nxt)
            push_weights(engine, nxt, f"step-{n + 1}")
            stale_prefix_check(engine, client, step.prompts[0], f"step-{n + 1}", tag)
            shutil.rmtree(work / f"step-{n}", ignore_errors=True)
            for s in batch:
                client.delete(s.rollout_id)
            pending = step.begun
            memory.append(redis_memory(cache_url))
            result.records.append(
                StepRecord(
                    step=n,
                    version=version,
                    samples=len(batch),
                    samples_with_views=sum(len(s.served) > 1 for s in batch),
                    straddling_episodes=len(step.finished),
                    bytes_moved=step.moved,
                    bytes_stored=stored,
                    redis_memory=memory[-1],
                    seconds=time.perf_counter() - t0,
                    **m,
                )
            )
            bar.set_postfix(reward=f"{m['reward']:.2f}", kl=f"{m['k3_kl'][TRAINED]:.2e}")
        bar.close()
    result.checks = _run_checks(memory)
    return result


def _run_checks(memory: list[int]) -> list[str]:
    """Check Redis memory over the run; the checks the run passed, for the report."""
    _check(
        memory[-1] <= MEMORY_GROWTH_LIMIT * memory[0],
        f"Redis memory grew from {memory[0]:,} B after step 0 to {memory[-1]:,} B after the last",
    )
    return [
        "replayed routing equals the rows given, every forward of every step",
        "segment weight versions match the generating step",
        "episodes' first turns unchanged after the push",
        "episodes across a push: exact states start at their turns (a view of the prefix)",
        "generated/latest/exact reads agree (first and last state)",
        "trained through state expansion: every token's log-prob within 1e-4 of the per-state "
        "forwards', the expansion's states get_served's",
        "no stale prefix rows after a push",
        f"Redis memory last/first {memory[-1] / memory[0]:.2f} <= 1.2",
    ]
