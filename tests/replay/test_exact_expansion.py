"""One exact loss, by state expansion, in a batched forward: equal to the per-state forwards.

A straddled rollout (three turns, a weight push before each later one, so three states),
a call retracted and re-prefilled mid-response (two states) and a plain one are stored in
the real service.  The step is expanded one training sample
per state (:func:`r3_client.expand_states`), each expanded sample's rows are read rank-
locally under its state (``get_ranges`` / ``fetch_megatron_rank_batch`` with ``states``),
and the frameworks' own batched forward runs on the expanded batch:

* HF transformers (a tiny Qwen3-MoE): the padded batch of expanded samples, each row
  replaying its state, gives for every trained token (the expansion's loss masks) the
  log-prob ``served_logprobs`` computes with one forward per state; the token-mean loss
  of the expanded batch equals the one of the per-state forwards;
* Megatron-Core (a real ``GPTModel``'s ``TopKRouter``\\ s under ``RouterReplayDriver``):
  the packed expanded micro-batch routes every token of every MoE layer exactly as its
  own state holds it, in the forward and the recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from r3_client import RoutingClient, Segment, encode_frame, expand_states
from r3_client.layouts import hf_layout
from r3_client.rank_local import fetch_megatron_rank_batch
from r3_client.replay import apply_routing_replay, replay_routing, served_logprobs
from tests.support.frames import rid
from tests.support.service_process import KEY_A, Service, url_of
from tests.support.tiny_hf_models import build


def _put(
    c: RoutingClient, r: str, rows: np.ndarray, start: int, e: int, layers: Any, **kw: Any
) -> None:
    seg = Segment(start, start + rows.shape[0], "tiny", kw.pop("version", "w1"))
    c.put(r, encode_frame(rows, num_experts=e, layer_ids=layers, segment=seg), **kw)


def _random_rows(g: torch.Generator, n: int, layers: int, e: int, k: int) -> np.ndarray:
    return torch.rand(n, layers, e, generator=g).topk(k).indices.numpy().astype(np.int16)


def store_step(
    c: RoutingClient, e: int, k: int, layers: tuple[int, ...], seed: int
) -> tuple[list[str], list[int], list[list[np.ndarray]]]:
    """A three-state agent of 24 tokens (turns of rows [0, 6), [6, 15), [15, 23)), a plain
    rollout of 10 tokens, and a 14-token call retracted mid-response, as the engine's shipper
    stores one (docs/engine.md, "Recomputed positions: views"): rows [0, 8) kept at the
    retraction, re-prefilled from the radix hit at 3, so segments [0, 8) and [8, 13) and the
    view [3, 8) serving 8, one weight version; each sample's states' rows ``[0, end)``."""
    g = torch.Generator().manual_seed(seed)
    agent, plain = rid(), rid()
    first = _random_rows(g, 23, len(layers), e, k)
    again = _random_rows(g, 6, len(layers), e, k)
    third = _random_rows(g, 15, len(layers), e, k)
    _put(c, agent, first[:6], 0, e, layers)
    _put(c, agent, again, 0, e, layers, version="w2", view=6)
    _put(c, agent, first[6:15], 6, e, layers, version="w2")
    _put(c, agent, third, 0, e, layers, version="w3", view=15)
    _put(c, agent, first[15:23], 15, e, layers, version="w3")
    rows = _random_rows(g, 9, len(layers), e, k)
    _put(c, plain, rows, 0, e, layers)
    retracted = rid()
    kept = _random_rows(g, 13, len(layers), e, k)
    redo = _random_rows(g, 5, len(layers), e, k)
    _put(c, retracted, redo, 3, e, layers, view=8)  # views are written first
    _put(c, retracted, kept[:8], 0, e, layers)
    _put(c, retracted, kept[8:], 8, e, layers)
    states = [
        [first[:6], np.concatenate([again, first[6:15]]), np.concatenate([third, first[15:23]])],
        [rows],
        [kept[:8], np.concatenate([kept[:3], redo, kept[8:]])],
    ]
    return [agent, plain, retracted], [24, 10, 14], states


def test_hf_expanded_batch_scores_each_token_as_served_logprobs(
    svc: Service, transport: str
) -> None:
    model = apply_routing_replay(build("qwen3_moe"))
    layers = tuple(model._r3_replay.layer_ids)
    e, k = 8, 2
    g = torch.Generator().manual_seed(5)
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        ids, lengths, _ = store_step(c, e, k, layers, seed=11)
        tokens = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
        exp = expand_states(c, ids, lengths)
        assert [(s.origin, s.state, s.num_tokens) for s in exp.states] == [
            (0, 0, 7),
            (0, 6, 16),
            (0, 15, 24),
            (1, 0, 10),
            (2, 0, 9),
            (2, 8, 14),
        ]
        # each expanded sample's rows, read under its state (what a rank reads)
        reads = [(s.rollout_id, 0, s.num_tokens - 1, s.state) for s in exp.states]
        routings = [routing for _, routing in c.get_ranges(reads)]
        per_state = [c.get_served(r) for r in ids]
        latest = c.get(ids[0], view="latest")
    width = int(exp.num_tokens.max())
    batch = torch.zeros((len(exp.states), width), dtype=torch.long)
    attention = np.zeros((len(exp.states), width), dtype=np.int64)
    for i, s in enumerate(exp.states):
        batch[i, : s.num_tokens] = tokens[s.origin][: s.num_tokens]
        attention[i, : s.num_tokens] = 1
    layout = hf_layout(routings, attention, as_torch=True)
    masks = torch.as_tensor(exp.token_masks(width))
    with torch.no_grad():
        with replay_routing(model, layout):
            logits = model(batch, attention_mask=torch.as_tensor(attention)).logits
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        lp = lp.gather(-1, batch[:, 1:, None]).squeeze(-1)  # token t's log-prob at t - 1
        trained = masks[:, 1:]
        want = [served_logprobs(model, tokens[i], per_state[i]) for i in range(len(ids))]
    for i in range(len(ids)):
        got = torch.zeros(lengths[i] - 1)
        for n, s in enumerate(exp.states):
            if s.origin == i:
                m = trained[n, : s.num_tokens - 1]
                got[: s.num_tokens - 1][m] = lp[n, : s.num_tokens - 1][m]
        torch.testing.assert_close(got, want[i], atol=1e-5, rtol=1e-5)
    # the loss a framework computes: token mean over the masked expanded batch
    loss = -(lp * trained).sum() / trained.sum()
    ref = -torch.cat(want).mean()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    assert int(trained.sum()) == sum(n - 1 for n in lengths)  # every token once
    # and one routing per sample (latest, what a framework replayed before) is not it: the
    # first turn's tokens attended to rows the later turns recomputed
    with (
        torch.no_grad(),
        replay_routing(model, hf_layout([latest], np.ones((1, 24)), as_torch=True)),
    ):
        one = torch.log_softmax(model(tokens[0][None]).logits[0, :-1].float(), dim=-1)
    one = one.gather(-1, tokens[0][1:, None]).squeeze(-1)
    assert not torch.allclose(one[:6], want[0][:6], atol=1e-3)
    torch.testing.assert_close(one[15:], want[0][15:], atol=1e-5, rtol=1e-5)


pytest.importorskip("megatron.core.transformer.moe.router_replay")


@pytest.fixture
def cpu() -> Iterator[torch.device]:
    from tests.support.megatron_model import megatron_env

    dev = torch.device("cpu")
    with megatron_env(dev):
        yield dev


def test_megatron_routers_replay_each_expanded_sample_in_its_own_state(
    svc: Service, cpu: torch.device
) -> None:
    from r3_client.replay.megatron import RouterReplayDriver
    from tests.replay.test_megatron_model import (
        SHAPE,
        RoutingSpy,
        assert_routes,
        loss_of,
        packed_tokens,
        replayed,
    )
    from tests.support.megatron_model import build_gpt, forward

    shape = SHAPE
    layers = tuple(shape.moe_layer_ids)
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        ids, lengths, states = store_step(c, shape.experts, shape.topk, layers, seed=3)
        exp = expand_states(c, ids, lengths)
        batch = fetch_megatron_rank_batch(
            c, [s.rollout_id for s in exp.states], seqlens=exp.num_tokens, states=exp.state_rows
        )
    model = build_gpt(shape, cpu, recompute=True)
    n_moe = len(layers)
    spy = RoutingSpy(model, count=n_moe)
    driver = RouterReplayDriver(model.config, model=model)
    tokens = packed_tokens(batch, 13, cpu)
    driver.add_micro_batch(batch, cpu, cu_seqlens=batch.cu_seqlens)
    with driver.forward():
        loss = loss_of(forward(model, tokens))
    with driver.backward():
        loss.backward()
    driver.finish_step()
    spy.close()
    assert [layer for layer, _ in spy.calls] == [*range(n_moe), *reversed(range(n_moe))]
    lens = exp.num_tokens.tolist()
    starts = {i: [x.state for x in exp.states if x.origin == i] for i in range(len(ids))}
    own = [states[s.origin][starts[s.origin].index(s.state)] for s in exp.states]
    for layer, got in spy.calls:
        want = np.full((sum(lens), shape.topk), -1)
        at = 0
        for t, rows in zip(lens, own, strict=True):
            assert rows.shape[0] == t - 1
            want[at : at + t - 1] = rows[:, layer]
            at += t
        np.testing.assert_array_equal(np.sort(batch.per_layer[layer], 1), np.sort(want, 1))
        assert_routes(got, replayed(want, shape.topk))
