"""verl 0.9.1's own ``RayPPOTrainer`` step methods with :class:`ExactReplayTrainer`: every
token is trained with the routing state it was sampled under, in the optimizer step verl
would have trained it in.

``fit`` (``ray_trainer.py:1405-1720``) calls, on the driver, ``_compute_old_log_prob``, then
the module-level ``compute_advantage``, then ``_update_actor``.  This test calls those, in
that order, on a ``RayPPOTrainer`` built without Ray (``tests.support.verl_stubs.
import_ray_trainer``): verl's own methods convert the batch (``to_tensordict``,
``left_right_2_no_padding``, ``no_padding_2_padding``) and set the update's mini-batch
size.  The actor worker group is a stand-in on one process doing what verl's workers do
with what they receive: ``compute_log_prob`` forwards every row (a row's log-probs are a
function of its sample, token and the routing state it replays: ``_score``), and
``update_actor`` dispatches the batch to ``DP`` ranks in equal contiguous chunks and cuts
each into mini-batches with verl's own ``tu.make_iterator`` (``engine_workers.py:243-289``),
scoring each optimizer step with verl's ``get_policy_loss_fn("vanilla")`` under
``token-mean``.

The reference is the plain ``RayPPOTrainer`` on the original batch with the *exact*
forward (each token scored in its own state, which no real forward of one routing per
sample can do): old log-probs and every optimizer step's loss are equal.  The plain trainer
with one routing per sample (``latest``) is not.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (the verl test extra)", allow_module_level=True)

from r3_client import InvalidRequestError, RolloutNotFoundError, RoutingClient, Segment
from r3_client.integrations.verl import ExactReplayTrainer
from tests.support.frames import rid
from tests.support.service_process import KEY_A, Service
from tests.support.verl_stubs import import_ray_trainer, verl_tensors

E, K, LAYERS = 16, 2, (0, 1)
PROMPTS = (3, 2, 4, 5, 3, 4, 2, 5)
RESPONSES = (9, 7, 3, 6, 8, 5, 9, 4)
STATES = {0: [0, 4, 8], 1: [0, 5], 4: [0, 6], 6: [0, 3, 7]}  # each straddled sample's states
PROMPT_LEN, RESPONSE_LEN = 6, 10
DP, MINI_BATCH = 2, 4  # two data-parallel ranks, two optimizer steps of four samples

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def verl() -> Any:
    ray_trainer = import_ray_trainer()
    from omegaconf import OmegaConf
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.config import ActorConfig

    return SimpleNamespace(
        trainer=ray_trainer.RayPPOTrainer,
        compute_advantage=ray_trainer.compute_advantage,
        grpo=ray_trainer.AdvantageEstimator.GRPO,
        omegaconf=OmegaConf,
        data_proto=DataProto,
        core_algos=core_algos,
        tu=tu,
        position_ids=compute_position_id_with_mask,
        actor_config=ActorConfig,
    )


def _store(client: RoutingClient) -> list[str]:
    """The step's rollouts: a view before each later state, as a push or a retraction
    leaves them (only the states' boundaries matter to the loss)."""
    g = np.random.default_rng(7)
    ids = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        key = rid()
        n = p + r - 1
        rows = np.sort(np.argsort(g.random((n, len(LAYERS), E)), -1)[..., :K], -1)
        bounds = [*STATES.get(i, [0]), n]
        for a, b in itertools.pairwise(bounds):
            if a > 0:
                seg = Segment(1, a, "tiny", f"w{a}")
                client.put(key, rows[1:a][:, :, ::-1].copy(), num_experts=E, layer_ids=LAYERS,
                           segment=seg, view=a)  # fmt: skip
            client.put(key, rows[a:b], num_experts=E, layer_ids=LAYERS,
                       segment=Segment(a, b, "tiny", f"w{a}"))  # fmt: skip
        ids.append(key)
    return ids


def _score(i: int, t: int, state: int) -> float:
    """Token ``t`` of sample ``i``'s log-prob in a forward replaying ``state``."""
    return -0.1 * (1 + i) - 0.01 * t - 0.37 * state


def _exact_state(i: int, t: int) -> int:
    """The state token ``t`` of sample ``i`` was sampled under (rows ``[0, t)``)."""
    return max(a for a in STATES.get(i, [0]) if a < t) if t > 0 else 0


def _latest_state(i: int, t: int) -> int:
    return STATES.get(i, [0])[-1]


class ActorGroup:
    """What ``RayPPOTrainer``'s step methods use of ``actor_rollout_wg``, on one process.

    ``state_of(i, t, row_state)``: the state a row's token is scored under (a real forward
    replays one state per row: the row's ``r3_state`` when the batch was expanded)."""

    def __init__(self, verl: Any, ids: list[str], state_of: Callable[[int, int, int | None], int]):
        self.verl, self.index, self.state_of = verl, {r: i for i, r in enumerate(ids)}, state_of
        self._dispatch_info = {"actor": list(range(DP))}  # RayPPOTrainer._get_dp_size
        self.steps: list[float] = []
        self.rows_per_step: list[int] = []
        self.forwards = 0

    def _rows(self, td: Any) -> list[tuple[int, int | None]]:
        tu = self.verl.tu
        ids = tu.get(td, "r3_rollout_id")
        states = tu.get(td, "r3_state")
        return [
            (self.index[r], None if states is None else int(states[j])) for j, r in enumerate(ids)
        ]

    def compute_log_prob(self, td: Any) -> Any:
        """Each row's log-prob of token ``u + 1`` at position ``u`` (verl's convention)."""
        self.forwards += 1
        lengths = td["input_ids"].offsets().diff().tolist()
        values = []
        for (i, state), n in zip(self._rows(td), lengths, strict=True):
            values.append(
                torch.tensor([_score(i, u + 1, self.state_of(i, u + 1, state)) for u in range(n)])
            )
        nested = torch.nested.as_nested_tensor(values, layout=torch.jagged)
        entropy = torch.nested.as_nested_tensor([v * 0 + 1.0 for v in values], layout=torch.jagged)
        return self.verl.tu.get_tensordict(
            {"log_probs": nested, "entropy": entropy}, non_tensor_dict={"metrics": {"mfu": 0.0}}
        )

    def update_actor(self, td: Any) -> Any:
        """verl's dispatch and mini-batching; each optimizer step's token-mean loss."""
        tu = self.verl.tu
        mini_batch = tu.pop(td, key="mini_batch_size")
        epochs = tu.pop(td, key="epochs", default=1)
        seed = tu.pop(td, key="seed", default=42)
        kwargs = tu.pop(td, key="dataloader_kwargs", default={})
        chunks = tu.chunk_tensordict(td, DP)
        iters = [
            list(tu.make_iterator(c, mini_batch // DP, epochs, seed + r, kwargs))
            for r, c in enumerate(chunks)
        ]
        config = self.verl.actor_config(
            strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
            clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
        )  # fmt: skip
        config.global_batch_info.update(dp_size=1, global_batch_size=None)
        loss_fn = self.verl.core_algos.get_policy_loss_fn("vanilla")
        for step in zip(*iters, strict=True):
            rows, old, adv, mask, now = 0, [], [], [], []
            for mb in step:
                prompt_lens = mb["attention_mask"][:, :PROMPT_LEN].sum(1).tolist()
                for j, (i, state) in enumerate(self._rows(mb)):
                    p = int(prompt_lens[j])
                    now.append(
                        [
                            1.01 * _score(i, p + k, self.state_of(i, p + k, state))
                            for k in range(RESPONSE_LEN)
                        ]
                    )
                old.append(mb["old_log_probs"])
                adv.append(mb["advantages"])
                mask.append(mb["response_mask"])
                rows += len(mb["advantages"])
            value, _ = loss_fn(
                old_log_prob=torch.cat(old).double(),
                log_prob=torch.tensor(now, dtype=torch.float64),
                advantages=torch.cat(adv).double(),
                response_mask=torch.cat(mask).double(),
                loss_agg_mode="token-mean",
                config=config,
            )
            self.steps.append(float(value))
            self.rows_per_step.append(rows)
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"mfu": 0.0}})


def _trainer(verl: Any, cls: type, group: ActorGroup, source: Any = None) -> Any:
    trainer = object.__new__(cls)
    trainer.config = verl.omegaconf.create(
        {
            "actor_rollout_ref": {
                "actor": {
                    "loss_agg_mode": "token-mean",
                    "policy_loss": {"loss_mode": "vanilla"},
                    "calculate_sum_pi_squared": False,
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": MINI_BATCH,
                    "ppo_epochs": 1,
                    "data_loader_seed": 1,
                    "shuffle": False,
                },
                "rollout": {"n": 1, "multi_turn": {"enable": True}, "temperature": 1.0},
            },
            "distillation": None,
        }
    )
    trainer.actor_rollout_wg = group
    trainer.ref_in_actor = True
    if source is not None:
        trainer.r3_source = source
    return trainer


def _batch(verl: Any, ids: list[str]) -> Any:
    data = verl.data_proto.from_dict(
        tensors=verl_tensors(PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, 256, verl.position_ids)
    )
    data.non_tensor_batch["r3_rollout_id"] = np.array(ids, dtype=object)
    data.non_tensor_batch["uid"] = np.array(list("aabbccdd"), dtype=object)
    rewards = torch.zeros(len(PROMPTS), RESPONSE_LEN)
    for i, r in enumerate(RESPONSES):
        rewards[i, r - 1] = float(i % 3)  # verl puts the score on the last response token
    data.batch["token_level_rewards"] = rewards
    return data


def _step(verl: Any, trainer: Any, data: Any) -> Any:
    """``fit``'s order: old log-probs, ``compute_advantage`` (GRPO), the actor update."""
    old, _mfu = trainer._compute_old_log_prob(data)
    data = data.union(old)
    data = verl.compute_advantage(data, adv_estimator=verl.grpo, num_repeat=1)
    trainer._update_actor(data)
    return data


def test_fit_step_trains_each_token_in_its_state_and_step(
    verl: Any, service_single: Service
) -> None:
    cls = type("Trainer", (ExactReplayTrainer, verl.trainer), {})
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client)
        ours = ActorGroup(verl, ids, lambda i, t, state: state)  # a real forward: its row's
        got = _step(verl, _trainer(verl, cls, ours, client), _batch(verl, ids))
        for key in ids:  # the actor update trained on them: the step released them
            with pytest.raises(RolloutNotFoundError):
                client.stat(key)
    exact = ActorGroup(verl, ids, lambda i, t, _s: _exact_state(i, t))
    want = _step(verl, _trainer(verl, verl.trainer, exact), _batch(verl, ids))
    latest = ActorGroup(verl, ids, lambda i, t, _s: _latest_state(i, t))
    _step(verl, _trainer(verl, verl.trainer, latest), _batch(verl, ids))
    mask = want.batch["response_mask"].bool()
    for key in ("old_log_probs", "advantages"):
        torch.testing.assert_close(got.batch[key][mask], want.batch[key][mask])
    assert len(ours.steps) == len(exact.steps) == len(PROMPTS) // MINI_BATCH
    np.testing.assert_allclose(ours.steps, exact.steps, rtol=1e-12, atol=1e-12)
    assert not np.allclose(latest.steps, exact.steps)
    assert ours.rows_per_step[0] > MINI_BATCH  # the extra states ride in their own step
    assert set(got.batch.keys()) == set(want.batch.keys())  # fit's batch: the originals


def test_a_step_keeps_its_rollouts_when_told_to(verl: Any, service_single: Service) -> None:
    cls = type("Trainer", (ExactReplayTrainer, verl.trainer), {"r3_release_step": False})
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client)
        group = ActorGroup(verl, ids, lambda i, t, state: state)
        _step(verl, _trainer(verl, cls, group, client), _batch(verl, ids))
        assert all(client.stat(key).num_rows > 0 for key in ids)
        assert sum(d.existed for d in client.delete_many(ids)) == len(set(ids))


def test_sequence_level_settings_are_refused(verl: Any, service_single: Service) -> None:
    cls = type("Trainer", (ExactReplayTrainer, verl.trainer), {})
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client)
        group = ActorGroup(verl, ids, lambda i, t, state: state)
        trainer = _trainer(verl, cls, group, client)
        data = _batch(verl, ids)
        old, _ = trainer._compute_old_log_prob(data)
        data = verl.compute_advantage(data.union(old), adv_estimator=verl.grpo, num_repeat=1)
        trainer.config.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-sum"
        with pytest.raises(InvalidRequestError, match="seq-mean-token-sum"):
            trainer._update_actor(data)
        forwards = group.forwards
        with pytest.raises(InvalidRequestError, match="seq-mean-token-sum"):
            trainer._compute_old_log_prob(_batch(verl, ids))  # before any forward
        assert group.forwards == forwards
        trainer.config.actor_rollout_ref.actor.loss_agg_mode = "seq-mean-token-mean"
        with pytest.raises(InvalidRequestError, match="seq-mean-token-mean"):
            trainer._compute_old_log_prob(_batch(verl, ids))
        unset = _trainer(verl, cls, group)
        with pytest.raises(InvalidRequestError, match="r3_source"):
            unset._compute_old_log_prob(_batch(verl, ids))
