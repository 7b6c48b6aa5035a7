"""The trainer side of ``r3 rl-demo``: paired scoring under each routing policy, the GRPO step.

Every step scores the *same* samples with the *same* weights four ways (:data:`POLICIES`):

* ``native``: the trainer's own routers;
* ``generated``: the engine's routing, each position's first computation
  (``RoutingClient.get(view="generated")``);
* ``latest``: the engine's routing with every view applied: what the rollout's last call
  attended to (``get(view="latest")``);
* ``exact``: one forward per state of ``get_served(view="exact")``, each replaying what the
  tokens of its span attended to and keeping only that span's log-probs, concatenated.

The loop trains on the ``exact`` forward (:data:`TRAINED`); the other three run without
gradients beside it.  A rollout without views has one state, so its four forwards differ
only by native against replayed routing.  A multi-turn episode whose last turn came after a
weight push has two states (its prefix was recomputed under the new weights and stored as a
view): ``generated`` is right for its first turn only, ``latest`` for its last turn only,
``exact`` for both (docs/rl-demo.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client import Routing, ServedRouting
from r3_client.mismatch import extreme_frac, logprob_mismatch, routing_disagreement

POLICIES = ("native", "generated", "latest", "exact")
REPLAYED = ("generated", "latest", "exact")
TRAINED = "exact"  # the policy whose log-probs the GRPO loss uses


@dataclass
class Sample:
    """One finished rollout the trainer learns from, with its routing under each policy."""

    rollout_id: str
    tokens: list[int]
    sampled_at: list[int]  # positions in ``tokens`` the engine sampled
    logp_infer: list[float]
    versions: list[tuple[int, str]]  # (first row of a turn, the version that generated it)
    group: int  # samples of one prompt share a group; an episode is its own
    since: int = 0  # first token sampled under this step's weights (earlier: older ones)
    generated: Routing | None = None
    latest: Routing | None = None
    served: list[ServedRouting] = field(default_factory=list)
    # The framework path: one training row per state (r3_client.expand_states), each row's
    # rows read rank-locally under its state (get_ranges): (state, tokens, routing) per row.
    expanded: list[tuple[int, int, Routing]] = field(default_factory=list)

    @property
    def reward(self) -> float:
        picked = [self.tokens[p] for p in self.sampled_at]
        return float(np.mean([t % 2 == 0 for t in picked])) if picked else 0.0

    @property
    def straddles(self) -> bool:
        """Its turns were generated under more than one weight version."""
        return len(self.versions) > 1


def _forward(model: Any, tokens: Sequence[int], routing: Routing | None) -> tuple[Any, Any]:
    """Log-prob of every next token ``[T-1]`` and the routing used ``[T-1, L, K]``.

    ``routing``: rows ``[0, T-1)`` replayed; None: the model's own routers (recorded).
    """
    import torch

    from r3_client.layouts import hf_layout
    from r3_client.replay import record_routing, recorded_as_routing, replay_routing

    ids = torch.tensor([list(tokens)])
    mask = torch.ones_like(ids)
    if routing is not None:
        layout = hf_layout([routing], mask.numpy(), as_torch=True, dtype=torch.int64)
        with replay_routing(model, layout) as state:
            logits = model(ids, attention_mask=mask).logits
            used = torch.stack([state.used[i] for i in state.layer_ids], dim=1)
            used = used.reshape(1, ids.shape[1], len(state.layer_ids), -1)
    else:
        with record_routing(model) as rec:
            logits = model(ids, attention_mask=mask).logits
        used = recorded_as_routing(rec, 1)
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
    return picked, used[0, : len(tokens) - 1].detach().numpy()


@dataclass
class Scored:
    """One sample under one policy: log-probs of its sampled tokens (``sampled_at`` order)
    and, per forward, (routing used, the engine's rows it should equal or be compared to)."""

    logp: Any  # torch [len(sampled_at)]
    rows: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]


def score(model: Any, s: Sample, policy: str) -> Scored:
    """``s``'s sampled tokens' log-probs under ``policy`` (one forward, two for ``exact``
    on a rollout with a view)."""
    import torch

    at = np.asarray(s.sampled_at)
    if policy != "exact":
        given = {"native": None, "generated": s.generated, "latest": s.latest}[policy]
        picked, used = _forward(model, s.tokens, given)
        # The engine's rows the native routing is compared to: what the tokens attended to.
        ref = s.served[-1].routing if given is None else given
        return Scored(picked[torch.from_numpy(at - 1)], [(used, np.asarray(ref.indices))])
    parts, rows, covered = [], [], 0
    for st in s.served:
        # Replay the state in a forward over tokens [0, serves_end]; keep the log-probs of
        # tokens serves_start+1 .. serves_end (row t's forward gives token t+1's log-prob).
        picked, used = _forward(model, s.tokens[: st.serves_end + 1], st.routing)
        keep = at[(at > st.serves_start) & (at <= st.serves_end)]
        parts.append(picked[torch.from_numpy(keep - 1)])
        rows.append((used, np.asarray(st.routing.indices)))
        covered += len(keep)
    if covered != len(at):
        raise ValueError(f"{s.rollout_id}: the exact states cover {covered} of {len(at)} tokens")
    return Scored(torch.cat(parts), rows)


def expanded_logps(model: Any, samples: Sequence[Sample]) -> list[Any]:
    """Each sample's sampled tokens' log-probs as a framework computes them after state
    expansion: every sample cut into one row per state (``Sample.expanded``), the rows
    right-padded into one batch, each replaying its own state's rows (``hf_layout``), one
    forward; token ``t`` taken from the row of the state that trains it (``state < t <=
    end``).  Differentiable; equal to :func:`score` under ``exact`` (one forward per state)
    but for the padded batch's float rounding."""
    import torch

    from r3_client.layouts import hf_layout
    from r3_client.replay import replay_routing

    rows = [(i, st, n, r) for i, s in enumerate(samples) for st, n, r in s.expanded]
    width = max(n for _, _, n, _ in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, (i, _, n, _) in enumerate(rows):
        ids[j, :n] = torch.tensor(samples[i].tokens[:n])
        mask[j, :n] = 1
    layout = hf_layout([r for *_, r in rows], mask.numpy(), as_torch=True, dtype=torch.int64)
    with replay_routing(model, layout):
        logits = model(ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [rows, width - 1]: token t at t-1
    out: list[Any] = []
    for i, s in enumerate(samples):
        at = np.asarray(s.sampled_at)
        parts: list[Any] = []
        mine = [(j, st, n) for j, (k, st, n, _) in enumerate(rows) if k == i]
        for n_row, (j, st, n) in enumerate(mine):
            end = mine[n_row + 1][1] if n_row + 1 < len(mine) else len(s.tokens) - 1
            keep = at[(at > st) & (at <= min(end, n - 1))]
            parts.append(picked[j, torch.from_numpy(keep - 1)])
        got = torch.cat(parts)
        if got.shape[0] != len(at):
            raise ValueError(f"{s.rollout_id}: its expanded rows train {got.shape[0]} of {len(at)}")
        out.append(got)
    return out


def _k3(train: list[npt.NDArray[Any]], infer: list[npt.NDArray[Any]]) -> float:
    if not train:
        return float("nan")
    mismatch = logprob_mismatch(np.concatenate(train)[None], np.concatenate(infer)[None])
    return float(mismatch["k3_kl"])


def _disagreement(pairs: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]) -> dict[str, float]:
    if not pairs:
        return {"router_disagreement": float("nan"), "token_disagreement": float("nan")}
    used = np.concatenate([u for u, _ in pairs])[None]
    ref = np.concatenate([r for _, r in pairs])[None]
    dis = routing_disagreement(ref, used)
    return {k: float(dis[k]) for k in ("router_disagreement", "token_disagreement")}


#: The samples a step's mismatch is reported on: ``grpo`` (generated wholly under this
#: step's weights), ``straddle`` (the last turn of episodes across the push), ``first``
#: (their first turn, under the weights before), ``flipped`` (the GRPO samples whose
#: native routing differs from the engine's somewhere).
_PARTS = ("grpo", "straddle", "first", "flipped")


def train_step(
    model: Any, optimizer: Any, samples: Sequence[Sample], previous: Any | None
) -> dict[str, Any]:
    """One GRPO step over ``samples``, trained on :data:`TRAINED`; the paired mismatch.

    Every sample is scored under every policy with the current weights.  Reported per
    policy: k3 KL, mean |dlogp|, F(2), F(5) on the GRPO samples (generated wholly under
    this step's weights), k3 KL on the last turn of episodes that straddle the push
    (``straddle_k3_kl``) and, with ``previous`` (the weights of the step before, which
    generated their first turn), k3 KL on those episodes' first turn
    (``first_turn_k3_kl``); ``flipped_k3_kl``: on the GRPO samples whose native routing
    differs from the engine's at one router or more (``flipped_samples`` of them; on the
    others native and replayed forwards route alike).  ``replay_router_disagreement``:
    largest disagreement between the routing a replayed forward used and the rows it was
    given (must be 0).  The step trains on the state-expansion path
    (:func:`expanded_logps`, as a framework would: one row per state, one batched
    forward); ``loss`` pairs its loss with the per-state forwards' (``per_state``) and
    ``expansion_max_abs_dlogp`` is the largest difference of a token's log-prob between
    the two.
    """
    import torch

    rewards = np.array([s.reward for s in samples])
    adv = _advantages(samples, rewards)
    optimizer.zero_grad()
    # The framework path (state expansion, one batched forward) is what is trained; the
    # per-state forwards (exact) are scored beside it and must give the same loss.
    expanded = expanded_logps(model, samples)
    loss_expanded = torch.zeros(())
    for lp, a in zip(expanded, adv, strict=True):
        loss_expanded = loss_expanded - float(a) * lp.mean() / len(samples)
    tally = _Tally(loss=torch.zeros(()))
    for s, a, lp_exp in zip(samples, adv, expanded, strict=True):
        tally.add(model, s, float(a), len(samples), lp_exp)
        if s.straddles and previous is not None:
            tally.add_first_turn(previous, s)
    loss_expanded.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    out: dict[str, Any] = {"reward": float(rewards.mean())}
    out["loss"] = {"expansion": float(loss_expanded.detach()), "per_state": float(tally.loss)}
    out["expansion_max_abs_dlogp"] = tally.expansion_dlogp
    out.update(tally.report())
    return out


def _advantages(samples: Sequence[Sample], rewards: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """GRPO advantages: each reward normalised within its group (a group of one, an
    episode, against the step's mean reward)."""
    adv = np.zeros(len(samples))
    for g in {s.group for s in samples}:
        idx = [i for i, s in enumerate(samples) if s.group == g]
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std() + 1e-6) if len(idx) > 1 else r - rewards.mean()
    return adv


def _inference_logps(s: Sample) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """SGLang's log-probs of ``s``'s sampled tokens, and which were sampled under this
    step's weights."""
    at, lp_infer = np.asarray(s.sampled_at), np.asarray(s.logp_infer, dtype=np.float64)
    return lp_infer, at >= s.since


@dataclass
class _Tally:
    """What a step gathers, sample by sample: the trained and inference log-probs by
    policy and part (``_PARTS``), the native forwards' (routing used, engine rows) pairs, the
    per-state loss and the checks of the replayed forwards."""

    loss: Any  # torch scalar: the per-state (exact) forwards' loss
    train: dict[tuple[str, str], list[Any]] = field(
        default_factory=lambda: {(p, q): [] for p in POLICIES for q in _PARTS}
    )
    infer: dict[str, list[Any]] = field(default_factory=lambda: {q: [] for q in _PARTS})
    native_rows: dict[str, list[Any]] = field(default_factory=lambda: {q: [] for q in _PARTS})
    replay_dis: float = 0.0
    expansion_dlogp: float = 0.0

    def add(self, model: Any, s: Sample, a: float, n: int, lp_exp: Any) -> None:
        """Score ``s`` under every policy with the current weights; ``a``: its advantage,
        one of ``n`` samples; ``lp_exp``: its log-probs on the expansion path."""
        import torch

        lp_infer, now = _inference_logps(s)
        part = "straddle" if s.straddles else "grpo"
        self.infer[part].append(lp_infer[now])
        got, flipped = {}, False
        for policy in POLICIES:
            with torch.no_grad():
                sc = score(model, s, policy)
            if policy == TRAINED:
                self.loss = self.loss - a * sc.logp.mean() / n
                dlogp = (sc.logp.double() - lp_exp.detach().double()).abs().max()
                self.expansion_dlogp = max(self.expansion_dlogp, float(dlogp))
            got[policy] = sc.logp.detach().double().numpy()[now]
            self.train[policy, part].append(got[policy])
            if policy == "native":
                self.native_rows[part].extend(sc.rows)
                flipped = _disagreement(sc.rows)["router_disagreement"] > 0.0
            else:
                self.replay_dis = max(
                    self.replay_dis, _disagreement(sc.rows)["router_disagreement"]
                )
        if part == "grpo" and flipped:
            # The GRPO samples where the native routing differs from the engine's somewhere:
            # elsewhere the native and replayed forwards route alike.
            self.infer["flipped"].append(lp_infer[now])
            for policy in POLICIES:
                self.train[policy, "flipped"].append(got[policy])

    def add_first_turn(self, previous: Any, s: Sample) -> None:
        """The first turn of an episode across the push, under the weights that generated
        it: what each policy's routing does to tokens that attended to the first
        computation."""
        import torch

        lp_infer, now = _inference_logps(s)
        self.infer["first"].append(lp_infer[~now])
        with torch.no_grad():
            for policy in POLICIES:
                sc = score(previous, s, policy)
                self.train[policy, "first"].append(sc.logp.double().numpy()[~now])
                if policy == "native":  # against the rows the first turn attended to
                    end, (used, _) = s.served[0].serves_end, sc.rows[0]
                    self.native_rows["first"].append((used[:end], s.served[0].routing.indices))

    def report(self) -> dict[str, Any]:
        """The step's mismatch per policy and part (:func:`train_step` says which)."""
        train, infer = self.train, self.infer
        out: dict[str, Any] = {key: {} for key in ("k3_kl", "logp_abs_diff", "f2", "f5")}
        for policy in POLICIES:
            t = np.concatenate(train[policy, "grpo"])[None]
            i = np.concatenate(infer["grpo"])[None]
            mismatch = logprob_mismatch(t, i)
            out["k3_kl"][policy] = float(mismatch["k3_kl"])
            out["logp_abs_diff"][policy] = float(mismatch["logp_abs_diff"])
            out["f2"][policy] = extreme_frac(t, i, tau=2.0)
            out["f5"][policy] = extreme_frac(t, i, tau=5.0)
        out["straddle_k3_kl"] = {p: _k3(train[p, "straddle"], infer["straddle"]) for p in POLICIES}
        out["first_turn_k3_kl"] = {p: _k3(train[p, "first"], infer["first"]) for p in POLICIES}
        # The largest single-token |dlogp|: k3 is a mean over few tokens, and one token the
        # engine sampled at a low bf16 probability can outweigh the rest.
        out["max_abs_dlogp"] = {
            q: {
                p: float(np.max(np.abs(np.concatenate(train[p, q]) - np.concatenate(infer[q]))))
                if infer[q]
                else float("nan")
                for p in POLICIES
            }
            for q in ("grpo", "straddle")
        }
        out["flipped_samples"] = len(infer["flipped"])
        out["flipped_k3_kl"] = {p: _k3(train[p, "flipped"], infer["flipped"]) for p in POLICIES}
        out.update(_disagreement(self.native_rows["grpo"]))
        for q in ("straddle", "first"):
            out[f"{q}_router_disagreement"] = _disagreement(self.native_rows[q])[
                "router_disagreement"
            ]
        out["replay_router_disagreement"] = self.replay_dis
        return out
