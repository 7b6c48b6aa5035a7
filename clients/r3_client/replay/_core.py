"""The shared replay core: wrap each MoE router, feed it recorded expert ids.

Every supported family's router returns ``(router_logits [T, E], weights [T, K],
ids [T, K])`` and its MoE block hands ``ids``/``weights`` to the experts.  The
wrapper runs the native router (so logits, and the native ids for fallback and
record mode, are exactly what the model computes), then, in replay mode, swaps in
the recorded ids and recomputes the weights *from the training logits* with the
family's own formula.  The recorded set is the mask; the weights stay a
differentiable function of the router, so gradients reach every recorded expert.

Rows of ``-1`` (no recorded routing: padding, the last token) keep native ids.
The wrapper keeps the 3-tuple contract, so the logits recorder, the aux loss and
expert-parallel wrappers (which replace ``module.forward`` on the instance, and
which this wraps rather than overwrites) keep working.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from r3_client._exceptions import R3Error


class ReplayError(R3Error, ValueError):
    """Routing cannot be replayed on this model as given (unsupported model, wrong shape)."""


WeightsFn = Callable[[Any, Any, Any], Any]  # (router, logits [T,E], ids [T,K]) -> weights


@dataclass(frozen=True)
class Family:
    """How one model family routes: where its routers sit and how weights follow ids.

    ``router_attr``: attribute of a decoder layer's ``mlp`` holding the router.
    ``router_classes``: class names that identify that router (dense MLPs have none).
    ``weights``: the native weight formula applied to given ids.
    ``modeling``: module whose ``load_balancing_loss_func`` is made replay-aware
    (None: the family computes no auxiliary loss).
    """

    model_types: tuple[str, ...]
    router_attr: str
    router_classes: tuple[str, ...]
    weights: WeightsFn
    modeling: str | None = None


REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the registry under each of its model types."""
    for model_type in family.model_types:
        REGISTRY[model_type] = family
    return family


OFF, REPLAY, RECORD = "off", "replay", "record"


@dataclass
class ReplayState:
    """Per-model replay state, kept on the model as ``_r3_replay``."""

    family: Family
    layer_ids: tuple[int, ...]  # decoder-layer index of each patched router, ascending
    routers: dict[int, Any]
    originals: dict[int, Any]  # the forward each wrapper wraps (restored on removal)
    mode: str = OFF
    targets: dict[int, Any] = field(default_factory=dict)  # layer -> [T, K] int64
    used: dict[int, Any] = field(default_factory=dict)  # layer -> ids used last forward
    recorded: dict[int, Any] = field(default_factory=dict)  # layer -> native ids


_CURRENT: contextvars.ContextVar[ReplayState | None] = contextvars.ContextVar(
    "r3_replay_state", default=None
)


class _ReplayForward:
    """Replaces ``router.forward`` on one instance; calls the wrapped forward first."""

    def __init__(self, original: Any, state: ReplayState, layer: int, router: Any) -> None:
        self.original = original
        self.state = state
        self.layer = layer
        self.router = router

    def __call__(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if state.mode == OFF:
            return self.original(hidden_states, *args, **kwargs)
        import torch

        logits, weights, ids = self.original(hidden_states, *args, **kwargs)
        if state.mode == RECORD:
            # Overwrite, not append: gradient checkpointing runs the router twice.
            state.recorded[self.layer] = ids.detach()
            return logits, weights, ids
        target = state.targets.get(self.layer)
        if target is None:
            state.used[self.layer] = ids.detach()
            return logits, weights, ids
        if target.shape != ids.shape:
            raise ReplayError(
                f"layer {self.layer}: routing has {tuple(target.shape)} [tokens, top-k] rows "
                f"but the router sees {tuple(ids.shape)}; give routing aligned with input_ids "
                "([batch, seq_len, layers, top-k], e.g. r3_client.layouts.hf_layout)"
            )
        target = target.to(device=ids.device)
        native = (target < 0).all(dim=-1, keepdim=True)
        chosen = torch.where(native, ids, target)
        state.used[self.layer] = chosen.detach()
        new_weights = state.family.weights(self.router, logits, chosen)
        return logits, new_weights, chosen


def _decoder_layers(model: Any) -> Sequence[Any]:
    for path in ("model.layers", "layers", "model.model.layers", "language_model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise ReplayError("cannot find the decoder layers (looked for model.layers)")


def family_of(model: Any) -> Family:
    """The registered family of ``model`` (by ``config.model_type``)."""
    config = getattr(model, "config", None)
    model_type = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    family = REGISTRY.get(str(model_type))
    if family is None:
        raise ReplayError(
            f"routing replay does not support model_type {model_type!r}; "
            f"supported: {sorted(REGISTRY)}"
        )
    return family


def apply_routing_replay(model: Any) -> Any:
    """Patch every MoE router of ``model`` (idempotent); returns ``model``.

    Patched routers behave natively until :func:`replay_routing` or
    :func:`record_routing` is entered.  Undo with :func:`remove_routing_replay`.
    """
    existing = getattr(model, "_r3_replay", None)
    if isinstance(existing, ReplayState):
        return model
    family = family_of(model)
    if family.modeling is not None:
        _patch_aux_loss(family.modeling)
    routers: dict[int, Any] = {}
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        router = getattr(mlp, family.router_attr, None) if mlp is not None else None
        if router is not None and type(router).__name__ in family.router_classes:
            routers[i] = router
    if not routers:
        raise ReplayError(f"no {family.router_classes} router found in the model's layers")
    state = ReplayState(family, tuple(sorted(routers)), routers, {})
    for i, router in routers.items():
        state.originals[i] = router.forward
        router.forward = _ReplayForward(router.forward, state, i, router)
    model._r3_replay = state
    return model


def remove_routing_replay(model: Any) -> Any:
    """Undo :func:`apply_routing_replay` (a no-op on an unpatched model)."""
    state = getattr(model, "_r3_replay", None)
    if not isinstance(state, ReplayState):
        return model
    for i, router in state.routers.items():
        if isinstance(router.forward, _ReplayForward):
            router.forward = state.originals[i]
    del model._r3_replay
    return model


def _state(model: Any) -> ReplayState:
    apply_routing_replay(model)
    state: ReplayState = model._r3_replay
    return state


def _targets(state: ReplayState, routing: Any, layer_ids: Sequence[int] | None) -> dict[int, Any]:
    import numpy as np
    import torch

    if hasattr(routing, "indices") and hasattr(routing, "layer_ids"):  # a Routing
        raise ReplayError(
            "give routing aligned with input_ids ([batch, seq_len, layers, top-k]); "
            "build it with r3_client.layouts.hf_layout([routing, ...], attention_mask)"
        )
    tensor = routing if isinstance(routing, torch.Tensor) else torch.from_numpy(np.asarray(routing))
    if tensor.ndim == 3:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != 4:
        raise ReplayError(
            f"routing must be [batch, seq_len, layers, top-k], got shape {tuple(tensor.shape)}"
        )
    layers = tuple(state.layer_ids if layer_ids is None else layer_ids)
    if tensor.shape[2] != len(layers):
        raise ReplayError(
            f"routing has {tensor.shape[2]} layers, the model has {len(state.layer_ids)} MoE "
            f"layers {state.layer_ids}; pass layer_ids= to say which are given"
        )
    unknown = set(layers) - set(state.layer_ids)
    if unknown:
        raise ReplayError(f"layer ids {sorted(unknown)} are not MoE layers of this model")
    flat = tensor.reshape(-1, tensor.shape[2], tensor.shape[3]).to(torch.int64)
    return {layer: flat[:, j, :] for j, layer in enumerate(layers)}


@contextlib.contextmanager
def replay_routing(
    model: Any, routing: Any, *, layer_ids: Sequence[int] | None = None
) -> Iterator[ReplayState]:
    """Inside the block, every forward (and checkpoint recompute) uses ``routing``.

    ``routing``: ``[batch, seq_len, L, K]`` (numpy or torch) aligned with the
    ``input_ids`` of the forward, ``-1`` where the model should route natively;
    ``L`` covers the model's MoE layers in order, or ``layer_ids``.  Run the
    backward pass inside the block too when gradient checkpointing is on.
    """
    state = _state(model)
    if state.mode != OFF:
        raise ReplayError(f"routing replay is already active on this model ({state.mode})")
    state.targets = _targets(state, routing, layer_ids)
    state.used = {}
    state.mode = REPLAY
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)
        state.mode = OFF
        state.targets = {}


@contextlib.contextmanager
def record_routing(model: Any) -> Iterator[dict[int, Any]]:
    """Inside the block, forwards route natively and their expert ids are recorded.

    Yields ``{decoder layer: [tokens, K] int64}``, filled by each forward (the last
    forward wins), for comparing the trainer's own routing with the engine's.
    """
    state = _state(model)
    if state.mode != OFF:
        raise ReplayError(f"routing replay is already active on this model ({state.mode})")
    state.recorded = {}
    state.mode = RECORD
    try:
        yield state.recorded
    finally:
        state.mode = OFF


def recorded_as_routing(recorded: dict[int, Any], batch: int) -> Any:
    """``record_routing`` ids as ``[batch, seq_len, L, K]`` (layers ascending)."""
    import torch

    layers = sorted(recorded)
    stacked = torch.stack([recorded[i] for i in layers], dim=1)
    return stacked.reshape(batch, -1, len(layers), stacked.shape[-1])


# ---------------------------------------------------------------- auxiliary loss


def replay_load_balancing_loss(
    gate_logits: Any, num_experts: int, top_k: int, attention_mask: Any, selected: Sequence[Any]
) -> Any:
    """Switch-style load-balancing loss (as transformers computes it) over given expert ids.

    The same formula as transformers' ``load_balancing_loss_func``, with the expert
    counts taken from ``selected`` (the ids the forward used) instead of a fresh
    top-k of the logits, so the loss balances the experts that were actually run.
    """
    import torch

    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: Any = 0.0
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits, ids in zip(gate_logits, selected, strict=True):
        weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
        ids = ids.to(device)
        if mask is None:
            counts = counts + torch.bincount(ids.reshape(-1), minlength=num_experts).float()
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, ids.reshape(-1), mask.repeat_interleave(ids.shape[-1]))
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts


_PATCHED_AUX: dict[str, Any] = {}


def _patch_aux_loss(modeling: str) -> None:
    """Make ``<modeling>.load_balancing_loss_func`` use the replayed ids while replaying."""
    if modeling in _PATCHED_AUX:
        return
    module = importlib.import_module(modeling)
    original = module.load_balancing_loss_func

    def load_balancing_loss_func(
        gate_logits: Any, num_experts: Any = None, top_k: Any = 2, attention_mask: Any = None
    ) -> Any:
        state = _CURRENT.get()
        if (
            state is not None
            and state.mode == REPLAY
            and isinstance(gate_logits, tuple)
            and len(gate_logits) == len(state.layer_ids)
            and all(i in state.used for i in state.layer_ids)
        ):
            selected = [state.used[i] for i in state.layer_ids]
            return replay_load_balancing_loss(
                gate_logits, num_experts, top_k, attention_mask, selected
            )
        return original(gate_logits, num_experts, top_k, attention_mask)

    load_balancing_loss_func.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, "load_balancing_loss_func", load_balancing_loss_func)  # noqa: B010
    _PATCHED_AUX[modeling] = original
