"""Megatron-Core replay on a real ``GPTModel``: real ``TopKRouter``, ``RouterReplay``, schedule.

Runs on CPU in CI (with the patches ``tests/support/megatron_model.py`` documents) and on CUDA
(``gpu`` marker) unpatched but for ``te_general_gemm``.  Which experts each router
really used is read from its output ``routing_map`` by a forward hook, which fires
in the forward and again in every full-recompute during backward.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from r3_client import Routing, ShapeError
from r3_client.layouts import MegatronReplayBatch, megatron_layout
from r3_client.replay.megatron import MegatronReplayError, RouterReplayDriver
from tests.support.megatron_model import (
    VOCAB,
    Shape,
    build_gpt,
    forward,
    megatron_env,
    schedule_env,
)

pytest.importorskip("megatron.core.transformer.moe.router_replay")

SHAPE = Shape(layers=2, hidden=64, heads=4, experts=8, topk=2, ffn=32)
B, S = 2, 12
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    dev = torch.device(request.param)
    with megatron_env(dev):
        yield dev


class RoutingSpy:
    """Collects the expert ids each ``TopKRouter`` routed to, per call, in call order.

    Routers are numbered in module order (the decoder's MoE layers, then any MTP layer's);
    ``inputs`` keeps each call's input, to recompute a router's own (native) top-k.
    """

    def __init__(self, model: Any, count: int = SHAPE.layers) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls: list[tuple[int, torch.Tensor]] = []
        self.inputs: list[torch.Tensor] = []
        self.handles = []
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(self.routers) == count
        for j, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(self._hook(j)))

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            routing_map = out[1].detach()
            rows = [row.nonzero().flatten() for row in routing_map.cpu()]
            # -1 pads a token routed to fewer experts than the others (to none, even)
            ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
            self.calls.append((layer, ids))
            self.inputs.append(args[0].detach())

        return hook

    def native_ids(self, call: int) -> torch.Tensor:
        """The experts call ``call``'s router picks itself for its input (softmax top-k)."""
        layer, _ = self.calls[call]
        router = self.routers[layer]
        with torch.no_grad():
            logits = router.gating(self.inputs[call]).reshape(-1, router.config.num_moe_experts)
        return logits.topk(router.topk).indices.cpu()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def tokens_of(seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, S), generator=g).to(device)


def foreign_batch(seed: int) -> MegatronReplayBatch:
    """Random distinct expert ids per token (not what the model would choose), host int64."""
    g = torch.Generator().manual_seed(seed)
    per_layer = [
        torch.rand(B * S, SHAPE.experts, generator=g).topk(SHAPE.topk).indices.numpy()
        for _ in range(SHAPE.layers)
    ]
    return batch_of(per_layer)


def batch_of(per_layer: list[Any]) -> MegatronReplayBatch:
    return MegatronReplayBatch(
        per_layer=per_layer,
        layer_ids=tuple(range(SHAPE.layers)),
        cu_seqlens=np.arange(B + 1, dtype=np.int32) * S,
        seqlens=np.full(B, S, dtype=np.int32),
        positions=np.arange(B * S, dtype=np.int64),
    )


def assert_routes(got: torch.Tensor, given: Any) -> None:
    expected = np.sort(np.asarray(given), axis=1)
    np.testing.assert_array_equal(np.sort(got.numpy(), axis=1), expected)


def foreign_routings(
    lengths: Sequence[int], layer_ids: Sequence[int], seed: int, shape: Shape = SHAPE
) -> list[Routing]:
    """One rollout per length ``T``: ``T - 1`` rows of random distinct experts (not the model's
    choice), as the cache returns them."""
    g = torch.Generator().manual_seed(seed)
    return [
        Routing.from_array(
            torch.rand(t - 1, len(layer_ids), shape.experts, generator=g)
            .topk(shape.topk)
            .indices.numpy(),
            num_experts=shape.experts,
            layer_ids=layer_ids,
        )
        for t in lengths
    ]


def replayed(given: Any, topk: int) -> Any:
    """What the driver replays for a layer's rows: ``-1`` rows as experts ``0..K-1``."""
    arr = np.array(given)
    arr[(arr < 0).all(axis=1)] = np.arange(topk)
    return arr


def packed_tokens(batch: MegatronReplayBatch, seed: int, device: torch.device) -> torch.Tensor:
    """The micro-batch's samples packed into one ``[1, total]`` sequence.

    With one sequence of ``[S, 1, H]`` hidden states the routers see the tokens in packed
    order, as Megatron's THD path does (the causal mask here spans samples; which experts
    the routers use, the thing checked, does not depend on it).
    """
    g = torch.Generator().manual_seed(seed)
    total = int(batch.cu_seqlens[-1])
    return torch.randint(0, VOCAB, (1, total), generator=g).to(device)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().logsumexp(-1).mean()


def router_grads(model: Any) -> list[torch.Tensor]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m.weight.grad.detach().clone() for m in model.modules() if isinstance(m, TopKRouter)]


def test_record_then_replay_reproduces_the_native_forward(device: torch.device) -> None:
    model = build_gpt(SHAPE, device)
    driver = RouterReplayDriver(model.config)
    tokens = tokens_of(0, device)
    with torch.no_grad(), driver.record():
        native = forward(model, tokens)
    recorded = [r.detach().cpu().numpy() for r in driver.recorded()]
    driver.finish_step()
    driver.add_micro_batch(batch_of(recorded))
    with torch.no_grad(), driver.forward():
        replayed = forward(model, tokens)
    driver.finish_step()
    if device.type == "cpu":
        assert torch.equal(replayed, native)
    else:  # GPU kernels may accumulate in another order; the routing is what must match
        torch.testing.assert_close(replayed, native, rtol=1e-5, atol=1e-5)


def test_forward_and_full_recompute_replay_foreign_routing(device: torch.device) -> None:
    model = build_gpt(SHAPE, device, recompute=True)
    spy = RoutingSpy(model)
    driver = RouterReplayDriver(model.config)
    batch = foreign_batch(1)
    tokens = tokens_of(1, device)
    driver.add_micro_batch(batch)
    with driver.forward():
        loss = loss_of(forward(model, tokens))
    with driver.backward():
        loss.backward()
    driver.finish_step()
    spy.close()
    # forward 0, 1; backward recomputes 1, then 0: each routed exactly as given
    assert [layer for layer, _ in spy.calls] == [0, 1, 1, 0]
    for layer, ids in spy.calls:
        assert_routes(ids, batch.per_layer[layer])
    with_recompute = router_grads(model)
    # The same replay without recompute gives the same gradients: the recompute replayed.
    plain = build_gpt(SHAPE, device, recompute=False)
    plain_driver = RouterReplayDriver(plain.config)
    plain_driver.add_micro_batch(batch)
    with plain_driver.forward():
        loss = loss_of(forward(plain, tokens))
    loss.backward()
    plain_driver.finish_step()
    for got, want in zip(with_recompute, router_grads(plain), strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want)


def test_several_micro_batches_through_megatrons_schedule(device: torch.device) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_gpt(SHAPE, device, recompute=True)
    spy = RoutingSpy(model)
    driver = RouterReplayDriver(model.config)
    batches = [foreign_batch(10 + i) for i in range(3)]
    data = iter([tokens_of(10 + i, device) for i in range(3)])

    def forward_step(data_iterator: Any, model: Any) -> Any:
        output = forward(model, next(data_iterator))

        def loss_func(output_tensor: torch.Tensor) -> Any:
            loss = loss_of(output_tensor)
            return loss, {"loss": loss.detach()}

        return output, loss_func

    with schedule_env(device):
        get_forward_backward_func()(
            forward_step_func=driver.wrap_forward_step(forward_step, batches),
            data_iterator=data,
            model=[model],
            num_microbatches=len(batches),
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
    driver.finish_step()
    spy.close()
    # no pipelining: F0 B0 F1 B1 F2 B2, each B re-running both routers (full recompute)
    assert len(spy.calls) == len(batches) * 2 * SHAPE.layers
    for n, (layer, ids) in enumerate(spy.calls):
        assert_routes(ids, batches[n // (2 * SHAPE.layers)].per_layer[layer])
    assert all(g.abs().sum() > 0 for g in router_grads(model))
    assert all(not r.replay_backward_list for r in driver.instances)


def test_schedule_with_too_few_routing_batches_is_a_clear_error(device: torch.device) -> None:
    model = build_gpt(SHAPE, device)
    driver = RouterReplayDriver(model.config)
    step = driver.wrap_forward_step(lambda *a: None, [foreign_batch(0)])
    step()
    with pytest.raises(MegatronReplayError, match="more micro-batches"):
        step()
    driver.finish_step()


def test_holes_become_experts_0_to_k_on_the_device(device: torch.device) -> None:
    model = build_gpt(SHAPE, device)
    driver = RouterReplayDriver(model.config)
    batch = foreign_batch(3)
    for arr in batch.per_layer:
        arr[-1] = -1
    driver.add_micro_batch(batch, device)
    for inst in driver.instances:
        target = inst.target_topk_idx
        assert target.device.type == device.type and target.dtype == torch.int64
        assert target[-1].tolist() == list(range(SHAPE.topk))
    driver.finish_step()


# --------------------------------------------------------------------------- issue 35


def test_a_gap_between_segments_is_refused_not_replayed_as_experts_0_to_k(
    device: torch.device,
) -> None:
    """Rows nobody shipped (a gap between stored segments, ``-1`` inside a sample's rows)
    were laid out and replayed as experts ``0..K-1`` with no error.  The layout refuses
    them, naming the rollout; ``missing="fill"`` is the explicit way to replay them so."""
    model = build_gpt(SHAPE, device)
    spy = RoutingSpy(model)
    driver = RouterReplayDriver(model.config)
    lengths, ids = [7, 5], ("r-0", "r-1")
    routings = foreign_routings(lengths, SHAPE.moe_layer_ids, 5)
    holed = np.array(routings[1].indices)
    holed[1:3] = -1  # what decode_rollout gives for rows no segment covered
    routings[1] = Routing(holed, SHAPE.experts, routings[1].layer_ids)
    msg = "sample 1's routing (rollout 'r-1') has no recorded route for token rows [1, 3)"
    with pytest.raises(ShapeError, match=re.escape(msg)):
        megatron_layout(routings, seqlens=lengths, rollout_ids=ids)

    batch = megatron_layout(routings, seqlens=lengths, missing="fill")
    driver.add_micro_batch(batch, device, cu_seqlens=batch.cu_seqlens)
    with torch.no_grad(), driver.forward():
        forward(model, packed_tokens(batch, 5, device))
    driver.finish_step()
    spy.close()
    gap = [7 + 1, 7 + 2]  # sample 1 starts at packed position 7
    assert [layer for layer, _ in spy.calls] == [0, 1]
    for layer, got in spy.calls:
        assert_routes(got, replayed(batch.per_layer[layer], SHAPE.topk))
        assert got[gap].sort(1).values.tolist() == [[0, 1], [0, 1]]


def test_a_partial_rollout_is_refused_where_megatron_accepts_it_silently(
    device: torch.device,
) -> None:
    """The trainer packs samples of 8 and 6 tokens (cu_seqlens [0, 8, 14]); sample 0's
    rollout stopped 2 tokens short.  Laid out from its own rows the batch packs [0, 6, 12],
    every row of sample 1 lands 2 positions early, and Megatron's gather takes the 12-row
    index for 14 tokens without a word.  The trainer's lengths are checked instead."""
    from megatron.core.transformer.moe import router_replay as rr

    model = build_gpt(SHAPE, device)
    spy = RoutingSpy(model)
    driver = RouterReplayDriver(model.config)
    trainer, ids = [8, 6], ("r-0", "r-1")
    trainer_cu = torch.tensor([0, 8, 14], dtype=torch.int32, device=device)
    short = foreign_routings([6, 6], SHAPE.moe_layer_ids, 7)
    stale = megatron_layout(short, seqlens=[6, 6], rollout_ids=ids)  # the old rows + 1
    tokens = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(7))
    tokens = tokens.to(device)

    # The defect's other half: Megatron's own RouterReplay replays the shifted, short ids.
    for inst, arr in zip(driver.instances, stale.per_layer, strict=True):
        inst.set_target_indices(torch.from_numpy(replayed(arr, SHAPE.topk)).to(device))
    rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        assert forward(model, tokens).shape == (1, 14, VOCAB)  # no error from Megatron
    driver.finish_step()
    for layer, got in spy.calls:  # sample 1 went 2 rows early; its last 2 tokens: no expert
        assert_routes(got[:12], replayed(stale.per_layer[layer], SHAPE.topk))
        assert (got[12:] == -1).all()
    spy.calls.clear()

    msg = (
        "sample 0 (rollout 'r-0'): routing has 5 rows but the sample has 8 tokens "
        "(the trainer's seqlens); expected 7 rows"
    )
    with pytest.raises(ShapeError, match=re.escape(msg)):
        megatron_layout(short, seqlens=trainer, rollout_ids=ids)
    packed_at = r"sample 0 \(rollout 'r-0'\): the routing packs it at \[0, 6\).*trainer at \[0, 8\)"
    with pytest.raises(MegatronReplayError, match=packed_at):
        driver.add_micro_batch(stale, device, cu_seqlens=trainer_cu)
    good = megatron_layout(foreign_routings(trainer, SHAPE.moe_layer_ids, 8), seqlens=trainer)
    cut = dataclasses.replace(good, per_layer=[arr[:-2] for arr in good.per_layer])
    with pytest.raises(MegatronReplayError, match=r"layer 0 has 12 token rows.*14 local tokens"):
        driver.add_micro_batch(cut, device)
    assert all(not inst.replay_backward_list for inst in driver.instances)  # nothing half-set

    driver.add_micro_batch(good, device, cu_seqlens=trainer_cu)
    with torch.no_grad(), driver.forward():
        forward(model, tokens)
    driver.finish_step()
    spy.close()
    for layer, got in spy.calls:
        assert_routes(got, replayed(good.per_layer[layer], SHAPE.topk))


DENSE_FIRST = Shape(layers=3, hidden=64, heads=4, experts=8, topk=2, ffn=32, moe_pattern=(0, 1, 1))
WITH_MTP = dataclasses.replace(DENSE_FIRST, mtp_layers=1)


def test_an_mtp_model_needs_the_model_to_tell_its_mtp_routers_apart(device: torch.device) -> None:
    """Megatron gives the MTP layer's router a RouterReplay too (after the decoder's): with
    only the config the driver cannot leave it to route natively, and says so."""
    model = build_gpt(WITH_MTP, device)
    with pytest.raises(MegatronReplayError, match=r"mtp_num_layers=1.*model=") as info:
        RouterReplayDriver(model.config)
    assert "stage_layers" not in str(info.value)
    driver = RouterReplayDriver(model.config, model=[model])  # Megatron's list of chunks works
    assert len(driver.instances) == 2 and len(driver.mtp_instances) == 1


def test_record_then_replay_with_an_mtp_layer_reproduces_the_native_forward(
    device: torch.device,
) -> None:
    """Record gives the decoder's MoE layers only (what SGLang ships); replaying them, with
    the MTP router routing itself, reproduces the native forward and MTP loss exactly."""
    model = build_gpt(WITH_MTP, device)
    driver = RouterReplayDriver(model.config, model=model)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    with torch.no_grad(), driver.record():
        native = forward(model, tokens, tokens)
    recorded = [r.detach().cpu().numpy() for r in driver.recorded()]
    assert len(recorded) == 2  # decoder layers 1 and 2; the MTP router records nothing
    driver.finish_step()
    driver.add_micro_batch(
        dataclasses.replace(
            batch_of(recorded),
            layer_ids=WITH_MTP.moe_layer_ids,
            cu_seqlens=np.array([0, 12], dtype=np.int32),
            seqlens=np.array([12], dtype=np.int32),
            positions=np.arange(12, dtype=np.int64),
        )
    )
    with torch.no_grad(), driver.forward():
        replayed_loss = forward(model, tokens, tokens)
    driver.finish_step()
    if device.type == "cpu":
        assert torch.equal(replayed_loss, native)
    else:
        torch.testing.assert_close(replayed_loss, native, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [DENSE_FIRST, WITH_MTP], ids=["dense-first", "dense-first+mtp"])
def test_every_moe_layer_replays_and_mtp_routes_natively(
    device: torch.device, shape: Shape
) -> None:
    """A DeepSeek-V3-style model (dense first layer, MoE layers 1 and 2, optionally an MoE
    MTP layer): each decoder MoE router replays its own layer's rows in the forward and in
    the full recompute; the MTP router picks its own top-k each time (SGLang ships no MTP
    rows: draft models are opted out of capture)."""
    model = build_gpt(shape, device, recompute=True)
    spy = RoutingSpy(model, count=2 + shape.mtp_layers)
    driver = RouterReplayDriver(model.config, model=model)
    lengths = [7, 5]
    routings = foreign_routings(lengths, shape.moe_layer_ids, 11, shape)
    batch = megatron_layout(routings, seqlens=lengths)
    assert batch.layer_ids == (1, 2)
    tokens = packed_tokens(batch, 11, device)
    driver.add_micro_batch(batch, device, cu_seqlens=batch.cu_seqlens)
    with driver.forward():
        out = forward(model, tokens, tokens if shape.mtp_layers else None)
        loss = out.float().mean() if shape.mtp_layers else loss_of(out)
    with driver.backward():
        loss.backward()
    driver.finish_step()
    spy.close()
    order = [layer for layer, _ in spy.calls]
    assert order == ([0, 1, 2, 2, 1, 0] if shape.mtp_layers else [0, 1, 1, 0])
    for n, (layer, got) in enumerate(spy.calls):
        if layer < 2:
            assert_routes(got, replayed(batch.per_layer[layer], shape.topk))
        else:  # the MTP router: native in the forward and in its recompute
            assert_routes(got, spy.native_ids(n))
    assert all(g.abs().sum() > 0 for g in router_grads(model))
    assert all(not r.replay_backward_list for r in driver.instances)
