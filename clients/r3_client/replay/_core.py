"""The shared replay core: wrap each MoE router, feed it recorded expert ids.

Every supported family's router returns ``(router_logits [T, E], weights [T, K],
ids [T, K])`` and its MoE block hands ``ids``/``weights`` to the experts.  In
replay mode the wrapper computes the router's logits and scores with the family's
own ops (:mod:`r3_client.replay._scoring`), takes the recorded ids, and computes the
weights *from the training logits* at those ids with the family's own formula.  The
recorded set is the mask; the weights stay a differentiable function of the
router, so gradients reach every recorded expert.

Rows of ``-1`` (no recorded routing: padding, the last token) take the native ids,
selected from the same scores.  The wrapper keeps the 3-tuple contract, so the
logits recorder, the aux loss and expert-parallel wrappers (which replace
``module.forward`` on the instance, and which this wraps rather than overwrites:
then the wrapped forward runs and its logits and ids are used) keep working.

Cost: :func:`replay_routing` moves the routing to each router's device once per
block (one pinned, non-blocking copy per device) and finds the ``-1`` rows there;
inside the forward a layer only takes a view, so nothing copies from the host or
waits for the device, and a layer with no ``-1`` rows skips the native top-k.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from r3_client._exceptions import ReplayError as ReplayError  # re-exported; defined with the others
from r3_client.replay._scoring import Scoring

if TYPE_CHECKING:
    from r3_client._views import ServedRouting


@dataclass(frozen=True)
class Family:
    """How one model family routes: where its routers sit and how they score.

    ``router_attr``: attribute of a decoder layer's ``mlp`` holding the router.
    ``router_classes``: class names that identify that router (dense MLPs have none).
    ``scoring``: the router's native steps (logits, scores, selection, weights).
    ``modeling``: module whose ``load_balancing_loss_func`` is made replay-aware
    (None: the family computes no auxiliary loss).
    """

    model_types: tuple[str, ...]
    router_attr: str
    router_classes: tuple[str, ...]
    scoring: Scoring
    modeling: str | None = None


REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the registry under each of its model types."""
    for model_type in family.model_types:
        REGISTRY[model_type] = family
    return family


OFF, REPLAY, RECORD = "off", "replay", "record"


@dataclass(frozen=True)
class Target:
    """One layer's replay ids, already on the router's device.

    ``ids``: ``[T, K]`` int64.  ``holes``: ``[T, 1]`` bool, True where the row is
    ``-1`` (route natively); None when the layer has no such row.
    """

    ids: Any
    holes: Any | None


@dataclass
class ReplayState:
    """Per-model replay state, kept on the model as ``_r3_replay``."""

    family: Family
    layer_ids: tuple[int, ...]  # decoder-layer index of each patched router, ascending
    routers: dict[int, Any]
    originals: dict[int, Any]  # the forward each wrapper wraps (restored on removal)
    mode: str = OFF
    targets: dict[int, Target] = field(default_factory=dict)
    used: dict[int, Any] = field(default_factory=dict)  # layer -> ids used last forward
    recorded: dict[int, Any] = field(default_factory=dict)  # layer -> native ids


_CURRENT: contextvars.ContextVar[ReplayState | None] = contextvars.ContextVar(
    "r3_replay_state", default=None
)


class _ReplayForward:
    """Replaces ``router.forward`` on one instance; OFF and RECORD call the wrapped forward.

    ``own``: the wrapped forward is the router class's own (and transformers is a
    checked version), so replay may compute its steps directly instead of running
    it (no native top-k, no native weights).
    """

    def __init__(
        self, original: Any, state: ReplayState, layer: int, router: Any, *, checked: bool
    ) -> None:
        self.original = original
        self.state = state
        self.layer = layer
        self.router = router
        self.own = (
            checked
            and getattr(original, "__self__", None) is router
            and getattr(original, "__func__", None) is getattr(type(router), "forward", None)
        )

    def __call__(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        target = state.targets.get(self.layer) if state.mode == REPLAY else None
        if target is None:
            out = self.original(hidden_states, *args, **kwargs)
            if state.mode == RECORD:
                # Overwrite, not append: gradient checkpointing runs the router twice.
                state.recorded[self.layer] = out[2]
            elif state.mode == REPLAY:
                state.used[self.layer] = out[2]
            return out
        import torch

        scoring, router = state.family.scoring, self.router
        if self.own and not args and not kwargs:
            logits = scoring.logits(router, hidden_states)
            native = None
        else:
            logits, _, native = self.original(hidden_states, *args, **kwargs)
        if target.ids.shape[0] != logits.shape[0]:
            raise ReplayError(
                f"layer {self.layer}: routing has {tuple(target.ids.shape)} [tokens, top-k] "
                f"rows but the router sees {logits.shape[0]} tokens; give routing aligned with "
                "input_ids ([batch, seq_len, layers, top-k], e.g. r3_client.layouts.hf_layout)"
            )
        scores = scoring.scores(router, logits)
        chosen = target.ids
        if target.holes is not None:
            if native is None:
                native = scoring.select(router, scores)
            chosen = torch.where(target.holes, native, chosen)
        state.used[self.layer] = chosen  # integer ids: no graph to detach
        return logits, scoring.weights(router, logits, scores, chosen), chosen


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
    On a transformers version outside :data:`CHECKED_TRANSFORMERS` it warns, and
    replay runs each router's own forward for the logits and native ids instead
    of the mirrored steps (the weight formulas are still this package's).
    """
    existing = getattr(model, "_r3_replay", None)
    if isinstance(existing, ReplayState):
        return model
    family = family_of(model)
    routers: dict[int, Any] = {}
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        router = getattr(mlp, family.router_attr, None) if mlp is not None else None
        if router is not None and type(router).__name__ in family.router_classes:
            routers[i] = router
    if not routers:
        raise ReplayError(f"no {family.router_classes} router found in the model's layers")
    checked = transformers_checked()
    state = ReplayState(family, tuple(sorted(routers)), routers, {})
    for i, router in routers.items():
        state.originals[i] = router.forward
        router.forward = _ReplayForward(router.forward, state, i, router, checked=checked)
    if family.modeling is not None:
        _patch_aux_loss(family.modeling)
    model._r3_replay = state
    return model


# transformers minor versions whose router code r3_client/replay/_scoring.py mirrors op
# for op (tests/replay checks each family bit for bit).  Like Liger-Kernel's patch
# modules, other versions are not refused; they get a warning and the safer path.
CHECKED_TRANSFORMERS = ("5.19",)


def transformers_checked() -> bool:
    """True on a checked transformers version; otherwise warns and returns False."""
    import transformers

    version = str(transformers.__version__)
    if ".".join(version.split(".")[:2]) in CHECKED_TRANSFORMERS:
        return True
    warnings.warn(
        f"r3_client.replay was checked against transformers {', '.join(CHECKED_TRANSFORMERS)}"
        f" and this is {version}: replay runs each router's own forward for its logits and "
        "native ids; run tests/replay against this version before trusting the weights",
        ReplayVersionWarning,
        stacklevel=3,
    )
    return False


class ReplayVersionWarning(UserWarning):
    """transformers is a version the router patches were not checked against."""


def remove_routing_replay(model: Any) -> Any:
    """Undo :func:`apply_routing_replay` (a no-op on an unpatched model)."""
    state = getattr(model, "_r3_replay", None)
    if not isinstance(state, ReplayState):
        return model
    for i, router in state.routers.items():
        if isinstance(router.forward, _ReplayForward):
            router.forward = state.originals[i]
    if state.family.modeling is not None:
        _unpatch_aux_loss(state.family.modeling)
    del model._r3_replay
    return model


def _state(model: Any) -> ReplayState:
    apply_routing_replay(model)
    state: ReplayState = model._r3_replay
    return state


def _as_tensor(routing: Any) -> Any:
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
    return tensor


def to_device(tensor: Any, device: Any) -> Any:
    """``tensor`` on ``device``; host to GPU goes through pinned memory, without waiting.

    The one transfer of a replay block (HF) or a micro-batch (Megatron driver).
    """
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.contiguous().pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _check_ids(state: ReplayState, flat: Any, layers: Sequence[int]) -> list[bool]:
    """Validate ``flat`` ``[T, L, K]`` and say which layers have ``-1`` rows.

    One pass over the routing where it lies: free on the host, one device sync
    at block entry when it is already on a GPU (never inside the forward).  An
    out-of-range id would otherwise be a device-side assert inside ``gather``.
    """
    import torch

    router = state.routers[layers[0]]
    experts = int(getattr(router, "num_experts", 0) or 0)
    topk = int(getattr(router, "top_k", flat.shape[-1]))
    if flat.shape[-1] != topk:
        raise ReplayError(f"routing has top-k {flat.shape[-1]}, the routers choose {topk}")
    if flat.dtype.is_floating_point:
        flat = flat.to(torch.int64)
    neg = flat < 0
    holes = neg.all(dim=-1)  # [T, L]
    partial = (neg.any(dim=-1) & ~holes).any()
    too_big = (flat >= experts).any() if experts else torch.zeros((), dtype=torch.bool)
    facts = torch.cat([holes.any(dim=0), partial.reshape(1), too_big.reshape(1)]).tolist()
    if facts[-2]:
        raise ReplayError("routing has rows mixing -1 and expert ids; a row is all -1 or none")
    if facts[-1]:
        raise ReplayError(f"routing has expert ids >= {experts}, the number of experts")
    return [bool(x) for x in facts[:-2]]


def _targets(
    state: ReplayState, routing: Any, layer_ids: Sequence[int] | None
) -> dict[int, Target]:
    import torch

    tensor = _as_tensor(routing)
    layers = tuple(state.layer_ids if layer_ids is None else layer_ids)
    if tensor.shape[2] != len(layers):
        raise ReplayError(
            f"routing has {tensor.shape[2]} layers, the model has {len(state.layer_ids)} MoE "
            f"layers {state.layer_ids}; pass layer_ids= to say which are given"
        )
    unknown = set(layers) - set(state.layer_ids)
    if unknown:
        raise ReplayError(f"layer ids {sorted(unknown)} are not MoE layers of this model")
    flat = tensor.reshape(-1, tensor.shape[2], tensor.shape[3])  # [T, L, K], a view
    has_holes = _check_ids(state, flat, layers)
    by_device: dict[Any, list[int]] = {}
    for j, layer in enumerate(layers):
        by_device.setdefault(state.routers[layer].weight.device, []).append(j)
    targets: dict[int, Target] = {}
    for device, js in by_device.items():
        part = flat if len(js) == len(layers) else flat[:, js, :]
        moved = to_device(part, device)  # the block's one transfer to this device
        ids = torch.empty((len(js), flat.shape[0], flat.shape[2]), dtype=torch.int64, device=device)
        ids.copy_(moved.permute(1, 0, 2))  # [L', T, K]: each layer a contiguous view
        holes = (ids < 0).all(dim=-1, keepdim=True) if any(has_holes[j] for j in js) else None
        for i, j in enumerate(js):
            layer_holes = holes[i] if holes is not None and has_holes[j] else None
            targets[layers[j]] = Target(ids[i], layer_holes)
    return targets


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


# ---------------------------------------------------------------- exact: one forward per state


def _served_spans(input_ids: Any, served: Sequence[ServedRouting]) -> Any:
    """``input_ids`` as ``[N]``, checked against the states: their spans cover rows
    ``[0, N - 1)`` in order, one row per token but the last."""
    ids = input_ids.reshape(-1) if input_ids.ndim == 2 and input_ids.shape[0] == 1 else input_ids
    if ids.ndim != 1:
        raise ReplayError(
            f"input_ids must be one sample's tokens [N] or [1, N], got {tuple(input_ids.shape)}"
        )
    if not served:
        raise ReplayError("no served routing given (get_served answers one state at least)")
    at = 0
    for s in served:
        if s.serves_start != at or s.serves_end <= s.serves_start:
            raise ReplayError(
                f"the states must cover rows [0, N - 1) in order; got [{s.serves_start}, "
                f"{s.serves_end}) after row {at} (pass get_served's list as it is)"
            )
        if s.routing.start != 0 or s.routing.num_rows != s.serves_end:
            raise ReplayError(
                f"the state serving rows [{s.serves_start}, {s.serves_end}) holds routing rows "
                f"[{s.routing.start}, {s.routing.end}), not [0, {s.serves_end})"
            )
        at = s.serves_end
    if at != ids.shape[0] - 1:
        raise ReplayError(
            f"the states cover {at} rows and the sample has {ids.shape[0]} tokens: a rollout "
            "holds one row per token but the last"
        )
    return ids


def replay_served(
    model: Any,
    input_ids: Any,
    served: Sequence[ServedRouting],
    *,
    layer_ids: Sequence[int] | None = None,
) -> Iterator[tuple[ServedRouting, Any]]:
    """Score one sample under the ``exact`` view policy: one replayed forward per state.

    ``served``: :meth:`RoutingClient.get_served` of the sample's rollout (one
    :class:`~r3_client.ServedRouting` per state; one for a rollout without views);
    ``input_ids``: the sample's tokens ``[N]`` (or ``[1, N]``), ``N - 1`` the rollout's rows.
    For each state ``(a, b, routing)`` it replays ``routing`` (rows ``[0, b)``; the last
    token routes natively) in a forward over tokens ``[0, b]`` and yields ``(state,
    logprobs)``, the fp32 log-probs of tokens ``a + 1 … b``, while the state's
    :func:`replay_routing` block is still open: run a backward of that span's loss in the
    loop body when gradient checkpointing is on (its recompute must replay the same
    routing).  ``layer_ids``: the decoder layers the routing covers (default: each
    routing's own ``layer_ids``).  Cost: one forward per state, each over the tokens up to
    its span's end; a rollout without views costs the one forward of plain replay.
    """
    import numpy as np
    import torch

    ids = _served_spans(input_ids, served)
    for s in served:
        a, b = s.serves_start, s.serves_end
        rows = np.asarray(s.routing.indices)
        routing = np.full((1, b + 1, *rows.shape[1:]), -1, dtype=rows.dtype)
        routing[0, :b] = rows  # the last token has no row: it routes natively
        layers = s.routing.layer_ids if layer_ids is None else layer_ids
        with replay_routing(model, routing, layer_ids=layers):
            logits = model(ids[None, : b + 1]).logits[0, a:b]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = ids[a + 1 : b + 1].to(logprobs.device)
            yield s, logprobs.gather(-1, targets[:, None]).squeeze(-1)


def served_logprobs(
    model: Any,
    input_ids: Any,
    served: Sequence[ServedRouting],
    *,
    layer_ids: Sequence[int] | None = None,
) -> Any:
    """The fp32 log-probs of tokens ``1 … N - 1`` of one sample under the ``exact`` view
    policy: :func:`replay_served`'s spans, concatenated (``[N - 1]``; differentiable).

    Each token's log-prob comes from a forward replaying the routing that token attended to
    when it was sampled.  With one state (a rollout without views) it is plain replay.
    Refused (:class:`ReplayError`) while gradient checkpointing would recompute a forward
    in the backward outside its state's replay block: use :func:`replay_served` and run
    each span's backward in the loop.
    """
    import torch

    if (
        getattr(model, "is_gradient_checkpointing", False)
        and getattr(model, "training", False)
        and torch.is_grad_enabled()
    ):
        raise ReplayError(
            "gradient checkpointing recomputes each forward in the backward, which must replay "
            "the same state's routing: iterate replay_served(...) and run each span's backward "
            "inside the loop"
        )
    return torch.cat([lp for _, lp in replay_served(model, input_ids, served, layer_ids=layer_ids)])


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


_PATCHED_AUX: dict[str, tuple[Any, int]] = {}  # modeling module -> (original, models patched)


def _patch_aux_loss(modeling: str) -> None:
    """Make ``<modeling>.load_balancing_loss_func`` use the replayed ids while replaying.

    One patch per modeling module, shared by every patched model of the family and
    counted, so :func:`_unpatch_aux_loss` restores the original with the last one.
    """
    if modeling in _PATCHED_AUX:
        original, count = _PATCHED_AUX[modeling]
        _PATCHED_AUX[modeling] = (original, count + 1)
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
    _PATCHED_AUX[modeling] = (original, 1)


def _unpatch_aux_loss(modeling: str) -> None:
    """Undo one :func:`_patch_aux_loss`; the last one restores the original function."""
    if modeling not in _PATCHED_AUX:
        return
    original, count = _PATCHED_AUX[modeling]
    if count > 1:
        _PATCHED_AUX[modeling] = (original, count - 1)
        return
    del _PATCHED_AUX[modeling]
    setattr(importlib.import_module(modeling), "load_balancing_loss_func", original)  # noqa: B010
