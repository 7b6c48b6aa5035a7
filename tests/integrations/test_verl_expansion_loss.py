"""verl 0.9.1's own loss and advantage code on an expanded ``DataProto``: the loss it computes
is the loss of the original batch with every token scored in its own routing state.

A step of verl samples (prompts left-, responses right-padded, as verl's agent loop hands
them) whose rollouts, stored in the real service, hold views: a three-turn agent with a
push before each later turn, a partial recompute after an eviction, and single calls.
:func:`~r3_client.integrations.verl.expand_verl_batch` cuts it into one row per state.
Each token ``t`` of sample ``i`` has one right log-prob, the one its own state gives
(``f(i, t, state)`` here: a forward's log-probs depend on the routing replayed, so a row
replaying state ``s`` scores every token with ``f(i, t, s)``); the original batch scored
exactly holds ``f(i, t, state(t))``.  Then verl's real code:

* ``get_policy_loss_fn(mode)`` (vanilla, dppo_tv, cispo) with ``agg_loss``'s
  ``token-mean``, ``token-sum`` and ``seq-mean-token-sum`` (the mini-batch size given, as
  verl's trainer gives it): the expanded batch's loss equals the exact original's, where
  one routing per sample (every token scored with the last state, ``latest``) does not;
* ``seq-mean-token-mean`` and the sequence-level losses (gspo, sapo, geo_mean) are refused
  before any stat;
* ``compute_grpo_outcome_advantage`` through ``advantages_by_origin``: every row holds its
  original's advantages (each sample counted once in its ``uid`` group).
"""

from __future__ import annotations

import importlib.util
import itertools
import types
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (the verl test extra)", allow_module_level=True)

from r3_client import InvalidRequestError, RoutingClient, Segment
from r3_client.integrations import verl as r3_verl
from tests.support.frames import rid
from tests.support.service_process import KEY_A, Service, url_of
from tests.support.verl_stubs import stub_ray, verl_tensors

E, K, LAYERS = 16, 2, (0, 1)
PROMPTS = (3, 2, 4, 5)
RESPONSES = (9, 7, 3, 6)  # sample 0: three states; sample 1: two; 2 and 3: one each
PROMPT_LEN, RESPONSE_LEN = 6, 10
STATES = {0: [0, 4, 8], 1: [0, 5]}  # each straddled sample's state starts (rows)


@pytest.fixture(scope="module")
def verl() -> Any:
    stub_ray()
    import verl as verl_pkg

    assert verl_pkg.__version__ == "0.9.1", verl_pkg.__version__
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.config import ActorConfig

    return types.SimpleNamespace(
        data_proto=DataProto,
        core_algos=core_algos,
        position_ids=compute_position_id_with_mask,
        actor_config=ActorConfig,
    )


def _store(client: RoutingClient) -> list[str]:
    """The step's rollouts: views where STATES says, rows of no interest (only the states'
    boundaries matter to the loss)."""
    g = np.random.default_rng(3)
    ids = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        key = rid()
        n = p + r - 1
        rows = np.sort(np.argsort(g.random((n, len(LAYERS), E)), -1)[..., :K], -1)
        starts = STATES.get(i, [0])
        bounds = [*starts, n]
        for a, b in itertools.pairwise(bounds):
            if a > 0:  # the turn starting at a recomputed rows [1, a) first (a view)
                seg = Segment(1, a, "tiny", f"w{a}")
                client.put(key, rows[1:a][:, :, ::-1].copy(), num_experts=E, layer_ids=LAYERS,
                           segment=seg, view=a)  # fmt: skip
            seg = Segment(a, b, "tiny", f"w{a}")
            client.put(key, rows[a:b], num_experts=E, layer_ids=LAYERS, segment=seg)
        ids.append(key)
    return ids


def _f(i: int, t: int, state: int) -> float:
    """The log-prob token ``t`` of sample ``i`` gets in a forward replaying ``state``."""
    return -0.1 * (1 + i) - 0.01 * t - 0.37 * state


def _state_of(i: int, t: int) -> int:
    """The state whose rows token ``t`` attended to (it is trained there)."""
    starts = STATES.get(i, [0])
    return max(a for a in starts if a < t) if t > 0 else 0


def _logprobs(rows: list[tuple[int, int, int]], score: Any) -> torch.Tensor:
    """``[rows, RESPONSE_LEN]`` log-probs: row ``(i, prompt_len, state)``, response position
    ``k`` is token ``p + k``, scored ``score(i, t, state)``."""
    out = torch.zeros(len(rows), RESPONSE_LEN, dtype=torch.float64)
    for j, (i, p, state) in enumerate(rows):
        for k in range(RESPONSE_LEN):
            out[j, k] = score(i, p + k, state)
    return out


def _config(verl: Any, mini_batch: int | None) -> Any:
    """verl's own ``ActorConfig`` (what its policy losses assert), with the global batch
    info its trainer sets (``losses.py:65-68``)."""
    config = verl.actor_config(
        strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
    )  # fmt: skip
    config.global_batch_info.update(dp_size=1, global_batch_size=mini_batch)
    return config


@pytest.mark.parametrize("mode", ["vanilla", "dppo_tv", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum"])
def test_verls_loss_on_the_expanded_batch_is_the_exact_loss(
    verl: Any, service_single: Service, transport: str, mode: str, agg: str
) -> None:
    core_algos, position_ids = verl.core_algos, verl.position_ids
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as client:
        ids = _store(client)
        data = verl.data_proto.from_dict(
            tensors=verl_tensors(PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, 256, position_ids)
        )
        data.non_tensor_batch["r3_rollout_id"] = np.array(ids, dtype=object)
        exp = r3_verl.expand_verl_batch(data, client, loss_agg_mode=agg, policy_loss_mode=mode)
    origin = exp.non_tensor_batch["r3_origin"].tolist()
    state = exp.non_tensor_batch["r3_state"].tolist()
    assert origin == [0, 0, 0, 1, 1, 2, 3] and state == [0, 4, 8, 0, 5, 0, 0]
    mask = data.batch["response_mask"].float()
    emask = exp.batch["response_mask"].float()
    # every response token of the original trained exactly once across its rows
    for i in range(len(PROMPTS)):
        rows = [j for j, o in enumerate(origin) if o == i]
        assert torch.equal(emask[rows].sum(0), mask[i])
    old = -0.5 * torch.ones(len(PROMPTS), RESPONSE_LEN, dtype=torch.float64)
    adv = torch.linspace(-1.0, 1.0, len(PROMPTS), dtype=torch.float64)[:, None].expand(
        -1, RESPONSE_LEN
    )
    original_rows = [(i, PROMPTS[i], 0) for i in range(len(PROMPTS))]
    exact = _logprobs(original_rows, lambda i, t, _s: _f(i, t, _state_of(i, t)))
    latest = _logprobs(original_rows, lambda i, t, _s: _f(i, t, STATES.get(i, [0])[-1]))
    expanded = _logprobs([(o, PROMPTS[o], s) for o, s in zip(origin, state, strict=True)], _f)
    loss_fn = core_algos.get_policy_loss_fn(mode)
    config = _config(verl, len(PROMPTS) if agg.startswith("seq") else None)

    def loss(lp: torch.Tensor, rows: list[int], m: torch.Tensor) -> torch.Tensor:
        value, _ = loss_fn(
            old_log_prob=old[rows], log_prob=lp, advantages=adv[rows], response_mask=m,
            loss_agg_mode=agg, config=config,
        )  # fmt: skip
        return value

    want = loss(exact, list(range(len(PROMPTS))), mask)
    got = loss(expanded, origin, emask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(loss(latest, list(range(len(PROMPTS))), mask), want)


def test_loss_modes_expansion_cannot_keep_are_refused_before_any_stat(verl: Any) -> None:
    position_ids = verl.position_ids
    data = verl.data_proto.from_dict(
        tensors=verl_tensors(PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, 256, position_ids)
    )
    data.non_tensor_batch["r3_rollout_id"] = np.array([rid() for _ in PROMPTS], dtype=object)

    class NoStat:
        def stat(self, rollout_id: str) -> Any:
            raise AssertionError("stat before the refusal")

    with pytest.raises(InvalidRequestError, match=r"seq-mean-token-mean.*token-mean"):
        r3_verl.expand_verl_batch(data, NoStat(), loss_agg_mode="seq-mean-token-mean")
    for mode in ("gspo", "sapo", "geo_mean"):
        with pytest.raises(InvalidRequestError, match=f"loss_mode='{mode}'"):
            r3_verl.expand_verl_batch(data, NoStat(), policy_loss_mode=mode)


def test_grpo_advantages_count_each_sample_once(verl: Any, service_single: Service) -> None:
    core_algos, position_ids = verl.core_algos, verl.position_ids
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client)
        data = verl.data_proto.from_dict(
            tensors=verl_tensors(PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, 256, position_ids)
        )
        data.non_tensor_batch["r3_rollout_id"] = np.array(ids, dtype=object)
        data.non_tensor_batch["uid"] = np.array(["a", "a", "b", "b"], dtype=object)
        rewards = torch.zeros(len(PROMPTS), RESPONSE_LEN)
        for i, (r, score) in enumerate(zip(RESPONSES, [1.0, 0.0, 0.5, 2.0], strict=True)):
            rewards[i, r - 1] = score  # verl puts the score on the last response token
        data.batch["token_level_rewards"] = rewards
        exp = r3_verl.expand_verl_batch(data, client, divisor=4)  # padded to 8 rows
    assert exp.meta_info["r3_expansion"]["padding_rows"] == 1
    assert exp.non_tensor_batch["r3_origin"].tolist()[-1] == -1
    assert exp.batch["response_mask"][-1].sum() == 0  # the padding row trains nothing

    def grpo(batch: Any) -> Any:
        adv, ret = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=batch.batch["token_level_rewards"],
            response_mask=batch.batch["response_mask"],
            index=batch.non_tensor_batch["uid"],
        )
        batch.batch["advantages"], batch.batch["returns"] = adv, ret
        return batch

    want, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards,
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )
    r3_verl.advantages_by_origin(exp, grpo)
    for j, o in enumerate(exp.non_tensor_batch["r3_origin"].tolist()):
        m = exp.batch["response_mask"][j]
        if o < 0:
            assert exp.batch["advantages"][j].abs().sum() == 0
            continue
        torch.testing.assert_close(exp.batch["advantages"][j], want[o] * m)
    # on the expanded batch as it is, GRPO would count the straddled samples once per state
    wrong, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=exp.batch["token_level_rewards"][:7],
        response_mask=exp.batch["response_mask"][:7],
        index=exp.non_tensor_batch["uid"][:7],
    )
    assert not torch.allclose(
        wrong[2] * exp.batch["response_mask"][2], want[0] * exp.batch["response_mask"][2]
    )
