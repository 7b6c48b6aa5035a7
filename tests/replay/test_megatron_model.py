"""Megatron-Core replay on a real ``GPTModel``: real ``TopKRouter``, ``RouterReplay``, schedule.

Runs on CPU in CI (with the patches ``tests/support/megatron_model.py`` documents) and on CUDA
(``gpu`` marker) unpatched but for ``te_general_gemm``.  Which experts each router
really used is read from its output ``routing_map`` by a forward hook, which fires
in the forward and again in every full-recompute during backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from r3_client.layouts import MegatronReplayBatch
from r3_client.replay.megatron import MegatronReplayError, RouterReplayDriver
from tests.support.megatron_model import Shape, build_gpt, forward, megatron_env, schedule_env

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
    """Collects the expert ids each ``TopKRouter`` routed to, per call, in call order."""

    def __init__(self, model: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = []
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(routers) == SHAPE.layers
        for j, router in enumerate(routers):
            self.handles.append(router.register_forward_hook(self._hook(j)))

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            routing_map = out[1].detach()
            ids = torch.stack([row.nonzero().flatten() for row in routing_map.cpu()])
            self.calls.append((layer, ids))

        return hook

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
