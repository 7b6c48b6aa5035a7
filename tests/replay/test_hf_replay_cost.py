"""What HF replay costs inside a training step, and that it stays exact at a realistic size.

Counted, not timed: every op the step dispatches (``TorchDispatchMode``).  Replay
must add no copy from the host, no top-k where the routing has no ``-1`` row, and
at most a ``where`` and a ``gather`` per MoE layer where it has.  Each test runs
on CPU with the tiny models and, with the ``gpu`` marker, on CUDA at a realistic
size (64 experts, top-8, hidden 1024, bf16), where the routers are also called
under ``torch.cuda.set_sync_debug_mode("error")``: nothing in them may wait for
the device.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from r3_client import Routing
from r3_client.layouts import hf_layout
from r3_client.replay import apply_routing_replay, record_routing, replay_routing
from tests.support.tiny_hf_models import FAMILIES, build

WHERE = [
    pytest.param(("cpu", "tiny", torch.float32, 2, 11), id="cpu-tiny"),
    pytest.param(("cuda", "real", torch.bfloat16, 2, 1024), id="cuda-real", marks=pytest.mark.gpu),
]


class Ops(TorchDispatchMode):
    """Counts ops dispatched inside router calls by name, and copies from the host anywhere."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()
        self.from_host = 0
        self.inside = False
        self.hooks = []
        for router in model._r3_replay.routers.values():
            self.hooks.append(router.register_forward_pre_hook(lambda *_: self._enter(True)))
            self.hooks.append(router.register_forward_hook(lambda *_: self._enter(False)))

    def _enter(self, inside: bool) -> None:
        self.inside = inside

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.inside:
            self.names[name] += 1
        if name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0].device if name == "copy_" else kwargs.get("device", src.device)
            if src.device.type == "cpu" and torch.device(dst).type != "cpu":
                self.from_host += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Ops dispatched inside router calls."""
        return sum(self.names.values())


def setup(where: tuple[Any, ...], family: str) -> tuple[Any, torch.Tensor, np.ndarray]:
    """Model, input ids and its own routing as ``hf_layout`` hands it over (host int16)."""
    device, size, dtype, batch, seq = where
    model = apply_routing_replay(build(family, dtype=dtype, size=size, device=device))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, seq), generator=g).to(device)
    with torch.no_grad(), record_routing(model) as rec:
        model(ids)
    layers = sorted(rec)
    own = torch.stack([rec[i] for i in layers], 1).reshape(batch, seq, len(layers), -1)
    experts = num_experts(model)
    routings = [
        Routing.from_array(own[b, :-1].cpu().numpy(), num_experts=experts, layer_ids=tuple(layers))
        for b in range(batch)
    ]
    return model, ids, hf_layout(routings, np.ones((batch, seq), dtype=np.int64))


def num_experts(model: Any) -> int:
    return int(next(iter(model._r3_replay.routers.values())).num_experts)


def counted(model: Any, ids: torch.Tensor, routing: Any | None) -> Ops:
    ops = Ops(model)
    try:
        with torch.no_grad():
            if routing is None:
                with ops:
                    model(ids)
            else:
                with replay_routing(model, routing), ops:
                    model(ids)
    finally:
        ops.close()
    return ops


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("family", FAMILIES)
def test_replay_adds_no_host_copy_and_top_k_only_for_holes(
    family: str, where: tuple[Any, ...]
) -> None:
    model, ids, routing = setup(where, family)
    moe_layers = len(model._r3_replay.layer_ids)
    native = counted(model, ids, None)
    whole = routing.copy()
    whole[:, -1] = whole[:, -2]  # no -1 row at all (router op counts do not depend on ids)
    full = counted(model, ids, whole)
    holes = counted(model, ids, routing)  # as hf_layout returns it: -1 on the last token
    # Replay adds no copy from the host. The model may make its own: GPT-OSS's sliding-window
    # KV cache moves a scalar to the device when it starts (transformers 5.19,
    # cache_utils.py:235), 2 per forward on an H200, with or without replay.
    assert full.from_host == native.from_host and holes.from_host == native.from_host
    assert full.names["topk"] == 0, full.names
    assert holes.names["topk"] > 0  # the -1 rows are routed natively
    assert full.total <= native.total, (full.total, native.total)
    assert holes.total <= native.total + 2 * moe_layers, (holes.total, native.total)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("family", FAMILIES)
def test_own_routing_from_hf_layout_reproduces_the_native_logits(
    family: str, where: tuple[Any, ...]
) -> None:
    model, ids, routing = setup(where, family)
    with torch.no_grad():
        native = model(ids).logits
        with replay_routing(model, routing):
            replayed = model(ids).logits
    assert torch.equal(replayed, native)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("family", FAMILIES)
def test_foreign_routing_is_dispatched_and_trained_under_checkpointing(
    family: str, where: tuple[Any, ...]
) -> None:
    model, ids, routing = setup(where, family)
    state = model._r3_replay
    experts = num_experts(model)
    g = torch.Generator().manual_seed(3)
    b, s, n_layers, k = routing.shape
    foreign = torch.rand(b, s, n_layers, experts, generator=g).topk(k, dim=-1).indices
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with replay_routing(model, foreign.numpy().astype(np.int16)):
        model(ids, labels=ids).loss.backward()
    for j, layer in enumerate(state.layer_ids):
        assert torch.equal(state.used[layer].cpu(), foreign[:, :, j].reshape(-1, k))
        grad = state.routers[layer].weight.grad
        assert grad is not None
        used = foreign[:, :, j].unique().to(grad.device)
        assert (grad[used].float().abs().sum(dim=-1) > 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_router_calls_never_wait_for_the_device(family: str) -> None:
    model, ids, routing = setup(("cuda", "real", torch.bfloat16, 2, 1024), family)
    state = model._r3_replay
    hidden = torch.randn(ids.numel(), model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), replay_routing(model, routing):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for router in state.routers.values():
                router(hidden)
        finally:
            torch.cuda.set_sync_debug_mode("default")
