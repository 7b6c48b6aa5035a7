"""HF transformers routing replay on tiny random models of every supported family."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers

from r3_client import Routing, Segment, ViewInfo
from r3_client._views import ServedRouting, run_steps, served
from r3_client.layouts import hf_layout
from r3_client.replay import (
    ReplayError,
    apply_routing_replay,
    record_routing,
    recorded_as_routing,
    remove_routing_replay,
    replay_load_balancing_loss,
    replay_routing,
    replay_served,
    served_logprobs,
    supported_model_types,
)
from r3_client.replay._core import _ReplayForward
from tests.support.tiny_hf_models import FAMILIES, build, config

B, S, E, K = 2, 11, 8, 2
WITH_AUX = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss"]


def inputs(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (B, S), generator=g)


def random_routing(num_layers: int, seed: int = 2) -> torch.Tensor:
    """Distinct expert ids per row, [B, S, L, K]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, S, num_layers, E, generator=g)
    return scores.topk(K, dim=-1).indices


def native(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), record_routing(model) as rec:
        logits = model(ids).logits
    return logits, recorded_as_routing(rec, B)


def test_all_six_families_are_registered() -> None:
    assert set(supported_model_types()) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_routing_equals_given(family: str) -> None:
    model = apply_routing_replay(build(family))
    state = model._r3_replay
    routing = random_routing(len(state.layer_ids))
    with torch.no_grad(), replay_routing(model, routing):
        model(inputs())
    for j, layer in enumerate(state.layer_ids):
        assert torch.equal(state.used[layer], routing[:, :, j, :].reshape(-1, K))


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routing_replays_to_the_native_forward(family: str) -> None:
    model = apply_routing_replay(build(family))
    ids = inputs()
    logits, routing = native(model, ids)
    with torch.no_grad(), replay_routing(model, routing):
        replayed = model(ids).logits
    assert torch.equal(replayed, logits)
    # and a different routing really changes the output
    with torch.no_grad(), replay_routing(model, random_routing(routing.shape[2])):
        assert not torch.equal(model(ids).logits, logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_reach_every_router_under_checkpointing(family: str) -> None:
    model = apply_routing_replay(build(family))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = inputs()
    routing = random_routing(len(model._r3_replay.layer_ids))
    with replay_routing(model, routing):
        loss = model(ids, labels=ids).loss
        loss.backward()
    for layer, router in model._r3_replay.routers.items():
        grad = router.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"no gradient at layer {layer}"
        # Gradient rows of the replayed experts are non-zero.
        used = routing[:, :, model._r3_replay.layer_ids.index(layer)].unique()
        assert (grad[used].abs().sum(dim=-1) > 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_minus_one_rows_fall_back_to_native(family: str) -> None:
    model = apply_routing_replay(build(family))
    ids = inputs()
    logits, native_routing = native(model, ids)
    state = model._r3_replay
    # Native routing with holes: the holes route natively, so nothing changes.
    holes = native_routing.clone()
    holes[0, 3:7] = -1
    holes[1, -1] = -1
    with torch.no_grad(), replay_routing(model, holes):
        assert torch.equal(model(ids).logits, logits)
    for j, layer in enumerate(state.layer_ids):
        assert torch.equal(state.used[layer].reshape(B, S, K), native_routing[:, :, j])
    # Foreign routing with holes: the holes of the first MoE layer (whose input does
    # not depend on routing) get exactly the native ids; the rest is replayed.
    routing = random_routing(native_routing.shape[2])
    routing[0, 3:7] = -1
    with torch.no_grad(), replay_routing(model, routing):
        model(ids)
    first = state.used[state.layer_ids[0]].reshape(B, S, K)
    assert torch.equal(first[0, 3:7], native_routing[0, 3:7, 0])
    assert torch.equal(first[0, :3], routing[0, :3, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_double_patching_is_harmless_and_removal_restores(family: str) -> None:
    model = build(family)
    ids = inputs()
    with torch.no_grad():
        before = model(ids).logits
    apply_routing_replay(model)
    apply_routing_replay(model)
    for router in model._r3_replay.routers.values():
        assert isinstance(router.forward, _ReplayForward)
        assert not isinstance(router.forward.original, _ReplayForward)
    routers = list(model._r3_replay.routers.values())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    remove_routing_replay(model)
    remove_routing_replay(model)
    assert not hasattr(model, "_r3_replay")
    assert all(not isinstance(r.forward, _ReplayForward) for r in routers)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("family", WITH_AUX)
def test_aux_loss_counts_the_replayed_experts(family: str) -> None:
    model = apply_routing_replay(build(family))
    ids = inputs()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        with record_routing(model) as rec:
            native_aux = model(ids, attention_mask=mask, output_router_logits=True).aux_loss
        recorded = recorded_as_routing(rec, B)
        with replay_routing(model, recorded):
            same = model(ids, attention_mask=mask, output_router_logits=True).aux_loss
        routing = random_routing(recorded.shape[2])
        with replay_routing(model, routing):
            out = model(ids, attention_mask=mask, output_router_logits=True)
            selected = [routing[:, :, j].reshape(-1, K) for j in range(routing.shape[2])]
            expected = replay_load_balancing_loss(
                out.router_logits,
                model.config.num_local_experts
                if family in ("mixtral", "gpt_oss")
                else model.config.num_experts,
                K,
                mask,
                selected,
            )
    torch.testing.assert_close(same, native_aux)
    torch.testing.assert_close(out.aux_loss, expected)
    assert not torch.allclose(out.aux_loss, native_aux)


def test_errors_are_clear() -> None:
    model = apply_routing_replay(build("qwen3_moe"))
    with (
        pytest.raises(ReplayError, match="3 MoE layers"),
        replay_routing(model, torch.zeros(B, S, 2, K)),
    ):
        pass
    with (
        pytest.raises(ReplayError, match=r"\[batch, seq_len, layers, top-k\]"),
        replay_routing(model, torch.zeros(S, K)),
    ):
        pass
    with (
        replay_routing(model, random_routing(3)),
        pytest.raises(ReplayError, match="already active"),
        replay_routing(model, random_routing(3)),
    ):
        pass
    with (
        replay_routing(model, random_routing(3)[:, :5]),
        pytest.raises(ReplayError, match="router sees"),
    ):
        model(inputs())

    class Dense(torch.nn.Module):
        config = type("C", (), {"model_type": "llama"})()

    with pytest.raises(ReplayError, match="does not support model_type 'llama'"):
        apply_routing_replay(Dense())


def test_removal_restores_the_aux_loss_function_with_the_last_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    from r3_client.replay import _core

    module = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    # Start unpatched: models of earlier tests in this process are still patched.
    current = module.load_balancing_loss_func
    original = getattr(current, "__wrapped__", current)
    monkeypatch.setattr(_core, "_PATCHED_AUX", {})
    monkeypatch.setattr(module, "load_balancing_loss_func", original)
    first, second = build("qwen3_moe"), build("qwen3_moe", seed=1)
    apply_routing_replay(first)
    apply_routing_replay(second)
    assert module.load_balancing_loss_func is not original
    remove_routing_replay(first)
    assert module.load_balancing_loss_func is not original  # the second still replays
    remove_routing_replay(second)
    assert module.load_balancing_loss_func is original


def test_an_unchecked_transformers_version_warns_and_runs_the_routers_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    from r3_client.replay._core import ReplayVersionWarning

    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.warns(ReplayVersionWarning, match=r"checked against transformers 5\.19"):
        model = apply_routing_replay(build("deepseek_v3"))
    assert not any(r.forward.own for r in model._r3_replay.routers.values())
    ids = inputs()
    logits, routing = native(model, ids)
    holes = routing.clone()
    holes[0, 2:4] = -1
    with torch.no_grad(), replay_routing(model, holes):
        assert torch.equal(model(ids).logits, logits)
    remove_routing_replay(model)


# ---------------------------------------------------------------- exact: one forward per state


def served_states(
    model: Any, serves: int | None, seed: int = 3
) -> tuple[torch.Tensor, list[ServedRouting]]:
    """One sample's tokens and what ``get_served`` answers under ``exact`` for its rollout:
    rows ``[0, S - 1)`` first computed with one routing and, when ``serves`` is given, rows
    ``[2, serves)`` recomputed (a view serving the segment at ``serves``), built with the
    client's own state logic (``r3_client._views.served``)."""
    layers = model._r3_replay.layer_ids
    ids = inputs(seed)[0]
    first = random_routing(len(layers), seed=seed)[0, : S - 1].numpy().astype(np.int16)
    base = Routing.from_array(first, num_experts=E, layer_ids=layers)
    segments = (Segment(0, serves or S - 1, "tiny", "v1"),)
    if serves is None:
        return ids, run_steps(served(base, [], S - 1, "exact", max_bytes=1 << 30), _no_view)
    segments += (Segment(serves, S - 1, "tiny", "v2"),)
    base = Routing(base.indices, E, base.layer_ids, 0, segments)
    again = random_routing(len(layers), seed=seed + 10)[0, 2:serves].numpy().astype(np.int16)
    rows = Routing.from_array(again, num_experts=E, layer_ids=layers, start=2)
    view = ViewInfo(serves, 2, serves, "v2", 0)
    steps = served(base, [view], S - 1, "exact", max_bytes=1 << 30)
    return ids, run_steps(steps, lambda v: rows)


def _no_view(v: ViewInfo) -> Routing:
    raise AssertionError(f"no view to read, asked for {v}")


def plain_logprobs(model: Any, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Plain replay (hf_layout over the whole sample): fp32 log-probs of tokens 1 … N - 1."""
    layout = hf_layout([routing], np.ones((1, ids.shape[0]), dtype=np.int64), as_torch=True)
    with replay_routing(model, layout):
        logits = model(ids[None]).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, ids[1:, None]).squeeze(-1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_exact_scores_each_state_in_its_own_forward(family: str) -> None:
    model = apply_routing_replay(build(family))
    serves = 6
    ids, states = served_states(model, serves)
    assert [(s.serves_start, s.serves_end) for s in states] == [(0, serves), (serves, S - 1)]
    with torch.no_grad():
        got = served_logprobs(model, ids, states)
        assert got.shape == (S - 1,) and got.dtype == torch.float32
        # Each span computed separately: the first state's routing over tokens [0, 6] gives
        # tokens 1..6, the second's (the view applied) over all tokens gives tokens 7..10.
        spans = []
        for s in states:
            b = s.serves_end
            short = ids[: b + 1]
            spans.append(plain_logprobs(model, short, s.routing)[s.serves_start : b])
        assert torch.equal(got, torch.cat(spans))
        # The last state is plain replay of the latest routing, for its span.
        latest = plain_logprobs(model, ids, states[-1].routing)
        assert torch.equal(got[serves:], latest[serves:])
        # and the view matters: the first span is not what the latest routing gives
        assert not torch.allclose(got[:serves], latest[:serves])
        # replay_served yields the same spans, each from its own replay block
        parts = [(s.serves_start, lp) for s, lp in replay_served(model, ids, states)]
        assert [a for a, _ in parts] == [0, serves]
        assert torch.equal(torch.cat([lp for _, lp in parts]), got)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_exact_with_one_state_is_plain_replay(family: str) -> None:
    model = apply_routing_replay(build(family))
    ids, states = served_states(model, None)
    assert len(states) == 1 and states[0].views == ()
    with torch.no_grad():
        got = served_logprobs(model, ids, states)
        assert torch.equal(got, plain_logprobs(model, ids, states[0].routing))
        assert torch.equal(got, served_logprobs(model, ids[None], states))  # [1, N] too


def test_exact_gradients_and_refusals() -> None:
    model = apply_routing_replay(build("qwen3_moe"))
    ids, states = served_states(model, 6)
    model.train()
    served_logprobs(model, ids, states).sum().backward()  # no checkpointing: one graph
    assert all(r.weight.grad is not None for r in model._r3_replay.routers.values())
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ReplayError, match="replay_served"):
        served_logprobs(model, ids, states)
    for _, lp in replay_served(model, ids, states):
        lp.sum().backward()  # the recompute runs inside the state's replay block
    assert all(r.weight.grad is not None for r in model._r3_replay.routers.values())
    model.eval()
    with pytest.raises(ReplayError, match="sample has 10 tokens"):
        served_logprobs(model, ids[:-1], states)
    with pytest.raises(ReplayError, match="in order"):
        served_logprobs(model, ids, states[1:])
    with pytest.raises(ReplayError, match="one sample"):
        served_logprobs(model, ids.reshape(1, 1, -1), states)
    with pytest.raises(ReplayError, match="one state at least"):
        served_logprobs(model, ids, [])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_real_shape_of_every_family_runs_on_cpu(family: str) -> None:
    """The GPU tests' ``real`` configs, with fewer layers and experts (the attention shapes
    kept), run a forward here: a config transformers cannot run fails on CPU, not only
    on a GPU machine (DeepSeek-V3 with fewer KV heads than query heads did, in 5.19)."""
    small = dict(layers=2, experts=16, moe_ffn=64, ffn=256, vocab=512)
    cfg = config(family, "real", **small)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        out = model(torch.randint(3, 500, (1, 12)))
    assert out.logits.shape == (1, 12, 512)
