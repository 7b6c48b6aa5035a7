"""AReaL 1.0.4's own advantage and loss code on a step expanded by ``expand_areal_batch``.

The recipe (docs/integrations.md, "Exact replay by state expansion", AReaL): expand before
``compute_logp``; each state's forward gives the log-probs of the tokens it served; bring
them back to the originals (``gather_by_state``); AReaL's ``PPOActor.compute_advantages``
runs on the originals (its reward normalisation by group counts each sample once); the
result is expanded again (``rolled=True``) for ``ppo_update``, whose ``grpo_loss_fn``
(``areal/trainer/ppo/actor.py:340-363``) is AReaL's, unchanged.

A "forward under state ``s``" is a deterministic function of (sample, state, position):
what matters is which state's value each token gets.  The expanded batch's loss equals
the loss of the originals with each token's log-prob from its own state (the exact loss),
for the token-level settings; the sequence-level ones (GSPO) differ and are refused by
``check_areal_expansion_modes``.  AReaL is imported with stubs for ray, hydra and its
experiment loggers (none is on this path), as in test_areal_contract.py.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from r3_client import InvalidRequestError, RoutingClient
from r3_client.integrations.areal import (
    STATE_FIELD,
    check_areal_expansion_modes,
    expand_areal_batch,
    gather_by_state,
    with_rollout_keys,
)
from tests.support.service_process import KEY_A, Service
from tests.support.stubs import StubModule, installed

if importlib.util.find_spec("areal") is None:
    pytest.skip("AReaL is not installed (the `areal` extra)", allow_module_level=True)

torch = pytest.importorskip("torch")

from tests.integrations.test_areal_contract import _stubs  # noqa: E402
from tests.integrations.test_areal_rank_local import X_LENGTHS, _store_straddled  # noqa: E402

PROMPT = 4


@pytest.fixture(scope="module")
def areal() -> Iterator[SimpleNamespace]:
    """AReaL's PPO actor, config and loss, imported with the stubs in place."""
    with pytest.MonkeyPatch.context() as mp:
        for name, module in _stubs().items():
            mp.setitem(sys.modules, name, module)
        for name in ("swanlab", "trackio", "wandb", "tensorboardX"):  # experiment loggers
            if not installed(name):
                stub = StubModule(name)
                stub.__path__ = []
                mp.setitem(sys.modules, name, stub)
        from areal.api.cli_args import NormConfig, PPOActorConfig, RejectionSamplingConfig
        from areal.trainer.ppo.actor import PPOActor, grpo_loss_fn

        yield SimpleNamespace(
            PPOActor=PPOActor,
            PPOActorConfig=PPOActorConfig,
            NormConfig=NormConfig,
            RejectionSamplingConfig=RejectionSamplingConfig,
            grpo_loss_fn=grpo_loss_fn,
        )


def _forward(sample: int, state: int, width: int) -> Any:
    """Log-probs a forward of ``sample`` under the state starting at ``state`` gives."""
    g = np.random.default_rng(1000 * sample + state)
    return torch.as_tensor(-g.random(width) - 0.1, dtype=torch.float32)


def _step(client: RoutingClient) -> tuple[dict[str, Any], list[str]]:
    ids, _ = _store_straddled(client, seed=9)
    width = max(X_LENGTHS) + 2
    g = np.random.default_rng(4)
    batch: dict[str, Any] = {
        "input_ids": torch.zeros(3, width, dtype=torch.int64),
        "attention_mask": torch.zeros(3, width, dtype=torch.bool),
        "loss_mask": torch.zeros(3, width, dtype=torch.int32),
        "logprobs": torch.as_tensor(-g.random((3, width)), dtype=torch.float32),
        "versions": torch.zeros(3, width, dtype=torch.int32),
        "rewards": torch.tensor([1.0, 0.0, 1.0]),
    }
    for i, t in enumerate(X_LENGTHS):
        batch["input_ids"][i, :t] = torch.arange(1, t + 1)
        batch["attention_mask"][i, :t] = True
        batch["loss_mask"][i, PROMPT:t] = 1
    keys = [int(r.removeprefix("areal-"), 16) for r in ids]
    return {**batch, **with_rollout_keys(batch, keys)}, ids


def _exact_logp(batch: dict[str, Any], exp: Any) -> Any:
    """Each original's log-probs, position ``t`` (token ``t + 1``) from the state that
    served token ``t + 1``: the exact loss's inputs, made without the expansion's code."""
    width = batch["attention_mask"].shape[1]
    out = torch.zeros(exp.num_samples, width)
    for i in range(exp.num_samples):
        for t in range(width):
            out[i, t] = _forward(i, _token_state(exp, i, t + 1), width)[t]
    return out


def _loss(areal: Any, config: Any, data: dict[str, Any], logp: Any) -> float:
    """AReaL's actor loss over one batch, weighted as ``train_batch`` weighs micro-batches
    (``loss_mask.count_nonzero()``): the token mean of the per-token loss."""
    from areal.utils import stats_tracker

    with stats_tracker.scope("t"):
        loss = areal.grpo_loss_fn(
            logp,
            torch.zeros_like(logp),
            data,
            eps_clip=config.eps_clip,
            eps_clip_higher=config.eps_clip_higher,
            c_clip=config.c_clip,
            importance_sampling_level=config.importance_sampling_level,
        )
    return float(loss)


@pytest.mark.parametrize("adv_norm", [False, True])
def test_areal_loss_on_the_expanded_step_is_the_exact_loss(
    areal: Any, service_single: Service, adv_norm: bool
) -> None:
    norm = areal.NormConfig(mean_level="group", std_level="group", group_size=3)
    config = areal.PPOActorConfig(
        experiment_name="r3", trial_name="t", kl_ctl=0.1, recompute_logprob=True,
        use_decoupled_loss=False, adv_norm=norm if adv_norm else None, reward_norm=norm,
    )  # fmt: skip
    check_areal_expansion_modes(config)
    actor = areal.PPOActor(config, engine=None)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        batch, _ = _step(client)
        x, exp = expand_areal_batch(client, batch)  # before compute_logp
    assert exp.extra_samples == 3
    assert x["attention_mask"].sum(1).tolist() == exp.num_tokens.tolist()
    width = batch["attention_mask"].shape[1]
    # compute_logp on the expanded batch: each sample forwarded under its own state
    x_prox = torch.stack([_forward(s.origin, s.state, width) for s in exp.states])
    exact = _exact_logp(batch, exp)
    original = {k: v.clone() for k, v in batch.items()}
    original["prox_logp"] = gather_by_state(x_prox, exp)
    np.testing.assert_array_equal(  # every trained token's log-prob is its own state's
        (original["prox_logp"] * torch.roll(batch["loss_mask"], -1, 1)).numpy(),
        (exact * torch.roll(batch["loss_mask"], -1, 1)).numpy(),
    )
    adv = actor.compute_advantages([original])[0]  # AReaL's own, on the originals
    train, again = expand_areal_batch(client, adv, expansion=exp, rolled=True)
    assert again is exp and STATE_FIELD in train
    # ppo_update: the expanded batch under each state's forward, against the exact loss
    x_logp = torch.stack([_forward(s.origin, s.state, width) for s in exp.states]) * 1.01
    got = _loss(areal, config, train, x_logp)
    want = _loss(areal, config, adv, exact * 1.01)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert int(train["loss_mask"].sum()) == int(adv["loss_mask"].sum())
    # one routing per sample (the last state's, "latest") is not the exact loss
    last = {s.origin: s.state for s in exp.states}
    latest = torch.stack([_forward(i, last[i], width) for i in range(exp.num_samples)])
    assert _loss(areal, config, adv, latest * 1.01) != pytest.approx(want, rel=1e-6)


def test_sequence_level_settings_are_refused(areal: Any) -> None:
    gspo = areal.PPOActorConfig(experiment_name="r3", trial_name="t",
                                importance_sampling_level="sequence")  # fmt: skip
    with pytest.raises(InvalidRequestError, match="importance_sampling_level='sequence'"):
        check_areal_expansion_modes(gspo)
    rs = areal.PPOActorConfig(
        experiment_name="r3", trial_name="t",
        rejection_sampling=areal.RejectionSamplingConfig(level="sequence", upper=2.0),
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"rejection_sampling\.level='sequence'"):
        check_areal_expansion_modes(rs)
    check_areal_expansion_modes(areal.PPOActorConfig(experiment_name="r3", trial_name="t"))


def test_gspo_would_change_under_the_cut(areal: Any, service_single: Service) -> None:
    """Why GSPO is refused: its per-sequence ratio over an expanded sample's tokens is not
    the original's (AReaL's own loss, 2-D padded inputs: sequences by row)."""
    config = areal.PPOActorConfig(experiment_name="r3", trial_name="t", kl_ctl=0.0,
                                  importance_sampling_level="sequence")  # fmt: skip
    actor = areal.PPOActor(config, engine=None)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        batch, _ = _step(client)
        _, exp = expand_areal_batch(client, batch)
    width = batch["attention_mask"].shape[1]
    original = {k: v.clone() for k, v in batch.items()}
    original["prox_logp"] = gather_by_state(
        torch.stack([_forward(s.origin, s.state, width) for s in exp.states]), exp
    )
    adv = actor.compute_advantages([original])[0]
    train, _ = expand_areal_batch(client, adv, expansion=exp, rolled=True)
    x_logp = torch.stack([_forward(s.origin, s.state, width) for s in exp.states]) * 1.3
    exact = _exact_logp(batch, exp) * 1.3
    assert _loss(areal, config, train, x_logp) != pytest.approx(
        _loss(areal, config, adv, exact), rel=1e-4
    )


class Engine:
    """What AReaL's ``PPOActor`` uses of its ``TrainEngine`` on this path: ``forward`` (a
    row's log-prob of token ``t + 1`` at position ``t``, scored in the state ``state_of``
    names for it) and ``train_batch`` (AReaL's loss on each mini-batch it is given, and the
    weight it gives it)."""

    def __init__(self, ids: list[str], exp: Any, state_of: Any) -> None:
        self.index = {int(r.removeprefix("areal-"), 16): i for i, r in enumerate(ids)}
        self.exp, self.state_of = exp, state_of
        self.steps: list[tuple[float, int]] = []

    def eval(self) -> None: ...

    def train(self) -> None: ...

    def get_version(self) -> int:
        return 0

    def _scores(self, data: dict[str, Any], scale: float = 1.0) -> Any:
        width = data["attention_mask"].shape[1]
        out = torch.zeros(data["attention_mask"].shape[0], width)
        for j in range(out.shape[0]):
            i = self.index[int(data["r3_key"][j, 0])]
            row_state = int(data[STATE_FIELD][j, 0]) if STATE_FIELD in data else None
            for t in range(width):
                state = self.state_of(i, t + 1, row_state)
                out[j, t] = scale * _forward(i, state, width)[t]
        return out

    def forward(self, input_: dict[str, Any], aggregate_fn: Any = None) -> Any:
        return self._scores(input_)

    def train_batch(self, input_: Any, loss_fn: Any, loss_weight_fn: Any) -> dict[str, float]:
        from areal.utils import stats_tracker

        with stats_tracker.scope("t"):
            logp = self._scores(input_, 1.01)
            loss = loss_fn(logp, torch.zeros_like(logp), input_)
        self.steps.append((float(loss), int(loss_weight_fn(input_))))
        return {}


def test_exact_ppo_actor_runs_areals_own_step_exactly(areal: Any, service_single: Service) -> None:
    """AReaL's ``PPOActor`` with :class:`ExactPPOActor`: its own ``compute_logp``,
    ``compute_advantages`` and ``ppo_update`` (one mini-batch) give the proximal log-probs
    and the update's loss of the original step scored exactly; one routing per sample
    does not."""
    from r3_client.integrations.areal import ExactPPOActor

    config = areal.PPOActorConfig(
        experiment_name="r3", trial_name="t", kl_ctl=0.0, recompute_logprob=True,
        use_decoupled_loss=False, ppo_n_minibatches=1,
        reward_norm=areal.NormConfig(mean_level="group", std_level="group", group_size=3),
    )  # fmt: skip
    cls = type("Actor", (ExactPPOActor, areal.PPOActor), {})
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        batch, ids = _step(client)
        _, exp = expand_areal_batch(client, batch)
        runs = {}
        for name, actor_cls, state_of in (
            ("ours", cls, lambda i, t, row: row),
            ("exact", areal.PPOActor, lambda i, t, row: _token_state(exp, i, t)),
            ("latest", areal.PPOActor, lambda i, t, row: _last_state(exp, i)),
        ):
            engine = Engine(ids, exp, state_of)
            actor = actor_cls(config, engine)
            actor.r3_source = client
            data = {k: v.clone() for k, v in batch.items()}
            data["prox_logp"] = actor.compute_logp([data])[0]
            adv = actor.compute_advantages([data])[0]
            actor.ppo_update([adv])
            runs[name] = (data["prox_logp"], adv, engine.steps)
    trained = torch.roll(batch["loss_mask"], -1, 1).bool()
    ours, exact, latest = runs["ours"], runs["exact"], runs["latest"]
    torch.testing.assert_close(ours[0][trained], exact[0][trained])
    torch.testing.assert_close(ours[1]["advantages"], exact[1]["advantages"])
    (loss, weight), (want, want_weight) = ours[2][0], exact[2][0]
    assert weight == want_weight == int(trained.sum())
    assert loss == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert latest[2][0][0] != pytest.approx(want, rel=1e-6)


def _token_state(exp: Any, i: int, token: int) -> int:
    mine = [s for s in exp.states if s.origin == i]
    return next((s for s in mine if s.state < token < s.num_tokens), mine[-1]).state


def _last_state(exp: Any, i: int) -> int:
    return [s for s in exp.states if s.origin == i][-1].state
