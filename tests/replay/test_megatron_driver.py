"""The Megatron-Core driver against the real ``megatron-core`` package, on CPU.

What runs here: megatron-core 0.16.1's ``TransformerConfig``, ``RouterReplay`` and
``topk_routing_with_score_function`` (the routing step ``TopKRouter.routing`` calls,
softmax and grouped-sigmoid scoring).  ``TopKRouter`` itself calls
``torch.cuda.current_device()`` and cannot be built without a GPU, so the routers'
``RouterReplay`` objects are created here the way its ``__init__`` creates them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from r3_client import Routing
from r3_client.layouts import megatron_layout
from r3_client.replay.megatron import MegatronReplayError, RouterReplayDriver, check_config
from r3_client.synthetic import synthetic_routing

rr = pytest.importorskip("megatron.core.transformer.moe.router_replay")
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

E, K, LAYERS = 16, 2, (1, 3)


def config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_enable_routing_replay=True,
    )
    return TransformerConfig(**{**base, **kw})


@pytest.fixture
def routers() -> Iterator[list[Any]]:
    """One RouterReplay per local MoE layer, as TopKRouter.__init__ makes them."""
    rr.RouterReplay.clear_global_router_replay_instances()
    made = [rr.RouterReplay() for _ in LAYERS]
    yield made
    rr.RouterReplay.clear_global_router_replay_instances()


def micro_batch(seed: int) -> tuple[Any, list[np.ndarray]]:
    routings = [
        Routing.from_array(
            synthetic_routing(t, len(LAYERS), E, K, seed=seed + i), num_experts=E, layer_ids=LAYERS
        )
        for i, t in enumerate((7, 4))
    ]
    batch = megatron_layout(routings, seqlens=[r.num_rows + 1 for r in routings])
    return batch, [np.asarray(p) for p in batch.per_layer]


def route(
    router: Any, tokens: int, seed: int, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g, requires_grad=True)
    probs, routing_map = topk_routing_with_score_function(logits, K, router_replay=router, **kw)
    return logits, probs, routing_map


def ids_of(routing_map: torch.Tensor) -> torch.Tensor:
    return torch.stack([row.nonzero().flatten() for row in routing_map])


def test_config_checks() -> None:
    check_config(config())
    with pytest.raises(MegatronReplayError, match="moe_enable_routing_replay"):
        check_config(config(moe_enable_routing_replay=False))
    with pytest.raises(MegatronReplayError, match="moe_router_fusion"):
        check_config(config(moe_router_fusion=True))


@pytest.mark.parametrize(
    "scoring",
    [
        {},
        {"score_function": "sigmoid", "num_groups": 4, "group_topk": 2, "scaling_factor": 2.5},
        {"use_pre_softmax": True},
    ],
)
def test_forward_replay_routes_to_the_given_experts_with_gradients(
    routers: list[Any], scoring: dict[str, Any]
) -> None:
    driver = RouterReplayDriver(config())
    batch, per_layer = micro_batch(0)
    driver.add_micro_batch(batch)
    with driver.forward():
        for j, router in enumerate(routers):
            logits, probs, routing_map = route(router, batch.num_local_tokens, j, **scoring)
            given = per_layer[j]
            real = (given >= 0).all(axis=1)
            got = ids_of(routing_map)
            np.testing.assert_array_equal(np.sort(got.numpy()[real], 1), np.sort(given[real], 1))
            probs.sum().backward()
            assert logits.grad is not None
            assert (logits.grad[torch.arange(len(got))[:, None], got].abs() > 0).any()
    driver.finish_step()


def test_backward_recompute_pops_micro_batches_in_order(routers: list[Any]) -> None:
    driver = RouterReplayDriver(config())
    batches = [micro_batch(10), micro_batch(20)]
    for batch, _ in batches:
        driver.add_micro_batch(batch)
        with driver.forward():
            for j, router in enumerate(routers):
                route(router, batch.num_local_tokens, j)
    with driver.backward():
        for batch, per_layer in batches:  # 1F1B runs backward in forward order
            for j, router in enumerate(routers):
                _, _, routing_map = route(router, batch.num_local_tokens, 99)
                real = (per_layer[j] >= 0).all(axis=1)
                got = ids_of(routing_map).numpy()
                np.testing.assert_array_equal(np.sort(got[real], 1), np.sort(per_layer[j][real], 1))
    driver.finish_step()
    assert all(not r.replay_backward_list for r in routers)


def test_record_mode_returns_native_ids(routers: list[Any]) -> None:
    driver = RouterReplayDriver(config())
    with driver.record():
        maps = [route(r, 9, j)[2] for j, r in enumerate(routers)]
    for recorded, routing_map in zip(driver.recorded(), maps, strict=True):
        assert torch.equal(torch.sort(recorded, 1).values, ids_of(routing_map))


def test_mismatches_are_clear(routers: list[Any]) -> None:
    driver = RouterReplayDriver(config())
    with pytest.raises(MegatronReplayError, match="add_micro_batch"):
        driver.forward()
    routings = [Routing.from_array(synthetic_routing(5, 1, E, K), num_experts=E, layer_ids=(1,))]
    with pytest.raises(MegatronReplayError, match="this rank has 2 decoder routers"):
        driver.add_micro_batch(megatron_layout(routings, seqlens=[6]))
    wide = [Routing.from_array(synthetic_routing(5, 2, E, 4), num_experts=E, layer_ids=LAYERS)]
    with pytest.raises(MegatronReplayError, match="moe_router_topk=2"):
        driver.add_micro_batch(megatron_layout(wide, seqlens=[6]))


def test_packing_is_checked_against_the_trainers_cu_seqlens(routers: list[Any]) -> None:
    driver = RouterReplayDriver(config())
    batch, _ = micro_batch(0)  # samples of 8 and 5 tokens: cu_seqlens [0, 8, 13]
    driver.add_micro_batch(batch, cu_seqlens=torch.tensor([0, 8, 13], dtype=torch.int32))
    with pytest.raises(MegatronReplayError, match=r"routing packs 2 samples, the trainer 3"):
        driver.add_micro_batch(batch, cu_seqlens=[0, 8, 13, 20])
    with pytest.raises(
        MegatronReplayError,
        match=r"^sample 1: the routing packs it at \[8, 13\) .*the trainer at \[8, 14\)",
    ):
        driver.add_micro_batch(batch, cu_seqlens=np.array([0, 8, 14]))
    with pytest.raises(MegatronReplayError, match="cu_seqlens must be 1-D"):
        driver.add_micro_batch(batch, cu_seqlens=np.array([[0, 8, 13]]))
    assert [len(r.replay_backward_list) for r in routers] == [1, 1]  # refused ones set nothing
    driver.finish_step()
