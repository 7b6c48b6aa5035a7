"""Feeding Megatron-Core's ``RouterReplay`` from the client's Megatron layout.

Megatron-Core (``moe_enable_routing_replay=True``) gives each ``TopKRouter`` a
``RouterReplay`` and leaves the rest to the caller: which ids, for which micro-batch,
and when to switch from forward replay to backward (recompute) replay.  This driver
does that::

    driver = RouterReplayDriver(config, model=model)  # checks the config; finds MTP routers
    for mb in micro_batches:                          # the schedule's forward order
        batch = megatron_layout(mb.routings, seqlens=mb.seqlens, tp_size=..., ...)
        driver.add_micro_batch(batch, cu_seqlens=mb.cu_seqlens_padded)  # ids for every router
    with driver.forward():                            # REPLAY_FORWARD
        ... forward steps ...
    with driver.backward():                           # REPLAY_BACKWARD (recompute)
        ... backward steps ...
    driver.finish_step()

or, with Megatron's own schedule (``get_forward_backward_func()``), wrap the forward
step so each micro-batch's routing is added and replayed in order::

    step = driver.wrap_forward_step(forward_step, batches)
    forward_backward_func(forward_step_func=step, ...)
    driver.finish_step()

Forward replay reads the ids of the micro-batch most recently added, so in a
1F1B schedule call :meth:`add_micro_batch` right before each forward step; backward
replay pops them first-in first-out, which is the order 1F1B runs backward steps.
Megatron has no per-token fallback: ``-1`` rows (padding, each sequence's last
token; their outputs feed no loss) are replayed as experts ``0..K-1``.

MTP layers (``mtp_num_layers``, DeepSeek-V3 / GLM-4.5) route natively: Megatron gives
their routers a ``RouterReplay`` too, registered after the decoder's, but SGLang ships
no routing for them (it opts draft models out of capture), so the driver gives those
instances no ids and no replay action.  It tells them apart by the model
(``RouterReplayDriver(config, model=model)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from r3_client._exceptions import MegatronReplayError
from r3_client.layouts import MegatronReplayBatch
from r3_client.replay._core import to_device

__all__ = ["MegatronReplayError", "RouterReplayDriver", "check_config"]


def _replay_module() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError as exc:  # pragma: no cover - exercised only without the package
        raise MegatronReplayError(
            "megatron-core with routing replay (>= 0.16) is not installed"
        ) from exc
    return router_replay


def check_config(config: Any) -> None:
    """Raise :class:`MegatronReplayError` unless ``config`` can replay routing.

    ``moe_router_fusion`` sends routing through Transformer Engine's fused kernel,
    which returns before ``RouterReplay`` is consulted, so replay would be silently
    ignored; sinkhorn routing and forced load balancing ignore it too.
    """
    if not getattr(config, "moe_enable_routing_replay", False):
        raise MegatronReplayError(
            "set moe_enable_routing_replay=True in the TransformerConfig "
            "(--moe-enable-routing-replay) so routers get a RouterReplay"
        )
    if getattr(config, "moe_router_fusion", False):
        raise MegatronReplayError(
            "moe_router_fusion=True uses a fused routing kernel that bypasses RouterReplay; "
            "routing would silently not be replayed. Turn moe_router_fusion off"
        )
    if getattr(config, "moe_router_load_balancing_type", "") == "sinkhorn":
        raise MegatronReplayError("sinkhorn routing does not consult RouterReplay")
    if getattr(config, "moe_router_force_load_balancing", False):
        raise MegatronReplayError("moe_router_force_load_balancing ignores RouterReplay")


def _mtp_replays(model: Any, replay_cls: type) -> list[Any]:
    """The ``RouterReplay`` of every router inside an MTP layer of ``model`` (or its chunks)."""
    try:
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    except ImportError:  # pragma: no cover - a megatron-core without MTP has no MTP routers
        return []
    chunks = model if isinstance(model, list | tuple) else [model]
    found: list[Any] = []
    for chunk in chunks:
        for layer in chunk.modules():
            if isinstance(layer, MultiTokenPredictionLayer):
                for module in layer.modules():
                    replay = getattr(module, "router_replay", None)
                    if isinstance(replay, replay_cls) and not any(replay is f for f in found):
                        found.append(replay)
    return found


def _host_ints(values: Any) -> Any:
    """A 1-D int64 numpy copy of a numpy array, list or (CPU or GPU) torch tensor."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().numpy()
    return np.asarray(values).astype(np.int64, copy=False)


def _shown(values: Any, limit: int = 8) -> str:
    items = [int(v) for v in values[:limit]]
    return str(items)[:-1] + (", …]" if len(values) > limit else "]")


def _default_device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RouterReplayDriver:
    """Drives the ``RouterReplay`` instances of this rank's decoder MoE routers.

    ``config``: the ``TransformerConfig`` (checked by :func:`check_config`; gives
    ``topk``); default ``model.config``.  ``model``: this rank's model, or the list of
    model chunks Megatron's schedules take; required when the config has MTP layers
    (``mtp_num_layers``), whose routers the driver finds in it and leaves to route
    natively.  Build the driver after the model: Megatron registers each router's
    ``RouterReplay`` when the router is constructed.
    """

    def __init__(
        self, config: Any | None = None, *, topk: int | None = None, model: Any = None
    ) -> None:
        self._rr = _replay_module()
        if config is None and model is not None:
            first = model[0] if isinstance(model, list | tuple) and model else model
            config = getattr(first, "config", None)
        if config is not None:
            check_config(config)
            topk = topk or getattr(config, "moe_router_topk", None)
            mtp = getattr(config, "mtp_num_layers", None)
            if mtp and model is None:
                # Megatron gives MTP routers a RouterReplay too (router.py TopKRouter.__init__),
                # after the decoder's; only the model says which instances they are.
                raise MegatronReplayError(
                    f"the config has mtp_num_layers={mtp}: Megatron gives each MTP layer's "
                    "router a RouterReplay too, but SGLang ships no routing for MTP layers "
                    "(draft models are opted out of capture), so those routers must route "
                    "natively. Pass model= (this rank's model or model chunks) so the driver "
                    "can tell them apart"
                )
        self.topk = topk
        self._model_given = model is not None
        self._mtp = _mtp_replays(model, self._rr.RouterReplay) if model is not None else []
        self._pending = 0

    @property
    def instances(self) -> list[Any]:
        """This rank's replayed ``RouterReplay`` objects, one per local decoder MoE layer.

        Construction order (Megatron's ``global_router_replay_instances``), MTP routers left out.
        """
        mtp = self._mtp
        return [
            r
            for r in self._rr.RouterReplay.global_router_replay_instances
            if not any(r is m for m in mtp)
        ]

    @property
    def mtp_instances(self) -> list[Any]:
        """This rank's MTP routers' ``RouterReplay`` objects: they route natively."""
        registered = self._rr.RouterReplay.global_router_replay_instances
        return [m for m in self._mtp if any(m is r for r in registered)]

    def _tensors(self, per_layer: Sequence[Any], device: Any) -> list[Any]:
        """One ``[tokens, K]`` int64 view per layer, on ``device``, ``-1`` rows filled.

        The layers are stacked on the host and moved in one pinned, non-blocking
        copy; the ``-1`` rows are filled on the device with ``torch.where`` (no
        ``.any()``, so nothing waits for the device).  Megatron's own
        ``top_indices.to(scores.device)`` then finds them in place: no per-layer
        host-to-device copy in the forward or in the recompute.
        """
        import numpy as np
        import torch

        if not per_layer:
            return []
        if all(isinstance(t, torch.Tensor) for t in per_layer):
            stacked = torch.stack(list(per_layer))
        else:
            stacked = torch.from_numpy(np.stack([np.asarray(a) for a in per_layer]))
        if self.topk is not None and stacked.shape[-1] != self.topk:
            raise MegatronReplayError(
                f"routing has top-k {stacked.shape[-1]}, the routers use "
                f"moe_router_topk={self.topk}"
            )
        device = torch.device(device) if device is not None else _default_device()
        ids = to_device(stacked, device).to(torch.int64)
        holes = (ids < 0).all(dim=-1, keepdim=True)
        fill = torch.arange(ids.shape[-1], device=device, dtype=torch.int64)
        return list(torch.where(holes, fill, ids).unbind(0))

    def add_micro_batch(
        self, batch: MegatronReplayBatch, device: Any = None, *, cu_seqlens: Any = None
    ) -> None:
        """Give every local decoder MoE router its ids for the next micro-batch.

        ``device``: where the routers run; default the current CUDA device when
        CUDA is available, else the CPU.  ``cu_seqlens``: the trainer's padded
        cumulative lengths of the packed micro-batch (``PackedSeqParams``'
        ``cu_seqlens_q_padded``, or ``cu_seqlens_q`` without padding); when given,
        ``batch.cu_seqlens`` must equal it (a GPU tensor costs one device-to-host copy).
        Raises :class:`MegatronReplayError` for a layer count other than this rank's
        routers, a layer whose token rows are not the batch's local tokens, or
        packing other than the trainer's (naming the first sample that differs).
        Nothing is handed to the routers unless every check passes.
        """
        instances = self.instances
        if len(batch.per_layer) != len(instances):
            mtp = len(self.mtp_instances)
            if mtp:
                known = f" (and {mtp} MTP routers, which route natively)"
            elif not self._model_given:  # without the model, MTP routers count as decoder ones
                known = " (MTP layers' routers included unless model= is given)"
            else:
                known = ""
            raise MegatronReplayError(
                f"routing has {len(batch.per_layer)} MoE layers {batch.layer_ids}, this rank has "
                f"{len(instances)} decoder routers with RouterReplay{known}; slice layers for "
                "this pipeline stage (megatron_layout(stage_layers=...)) and build the model "
                "with moe_enable_routing_replay=True"
            )
        self._check_tokens(batch)
        if cu_seqlens is not None:
            self._check_packing(batch, cu_seqlens)
        # Megatron's set_replay_data hands instance i its tensor with set_target_indices
        # (router_replay.py); doing it per instance leaves the MTP routers without ids.
        for instance, ids in zip(instances, self._tensors(batch.per_layer, device), strict=True):
            instance.set_target_indices(ids)
        self._pending += 1

    @staticmethod
    def _check_tokens(batch: MegatronReplayBatch) -> None:
        """Each layer must hold one ``[K]`` row per local token (Megatron's gather would
        accept fewer rows than the router has tokens, without an error)."""
        n = batch.num_local_tokens
        for j, ids in enumerate(batch.per_layer):
            shape = tuple(ids.shape) if hasattr(ids, "shape") else np.shape(ids)
            if len(shape) != 2 or shape[0] != n:
                layer = batch.layer_ids[j] if j < len(batch.layer_ids) else j
                raise MegatronReplayError(
                    f"MoE layer {layer} has {shape[0] if shape else 0} token rows (shape "
                    f"{list(shape)}), the batch has {n} local tokens (batch.positions); every "
                    "layer needs one [K] row per local token"
                )

    @staticmethod
    def _check_packing(batch: MegatronReplayBatch, cu_seqlens: Any) -> None:
        """``batch.cu_seqlens`` against the trainer's: the first sample packed differently."""
        have = _host_ints(batch.cu_seqlens)
        want = _host_ints(cu_seqlens)
        if want.ndim != 1:
            raise MegatronReplayError(f"cu_seqlens must be 1-D, got shape {list(want.shape)}")
        if have.shape == want.shape and bool((have == want).all()):
            return
        both = min(len(have), len(want))
        differ = np.flatnonzero(have[:both] != want[:both])
        vs = f"(padded cu_seqlens {_shown(have)}, the trainer's {_shown(want)})"
        if not differ.size:
            raise MegatronReplayError(
                f"the routing packs {len(have) - 1} samples, the trainer {len(want) - 1} {vs}: "
                "lay out the same samples as the trainer's micro-batch"
            )
        i = max(int(differ[0]) - 1, 0)  # boundaries before differ[0] agree: sample i differs
        ids = batch.rollout_ids
        who = f"sample {i}" + (f" (rollout {ids[i]!r})" if ids and i < len(ids) else "")
        raise MegatronReplayError(
            f"{who}: the routing packs it at [{have[i]}, {have[i + 1]}) of the packed batch, "
            f"the trainer at [{want[i]}, {want[i + 1]}) {vs}; lay out the micro-batch with "
            "the trainer's seqlens and pad_to_multiple"
        )

    def _set_action(self, name: str) -> None:
        """``name`` on the decoder routers; none (native routing) on the MTP routers."""
        action = getattr(self._rr.RouterReplayAction, name)
        for instance in self.instances:
            instance.set_router_replay_action(action)
        # get_replay_topk (router_replay.py) routes natively when an instance has no action;
        # an MTP router under REPLAY_* would read ids it was never given.
        for instance in self.mtp_instances:
            instance.clear_router_replay_action()

    def _action(self, name: str) -> contextlib.AbstractContextManager[None]:
        rr = self._rr

        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            self._set_action(name)
            try:
                yield
            finally:
                rr.RouterReplay.clear_global_router_replay_action()

        return ctx()

    def forward(self) -> contextlib.AbstractContextManager[None]:
        """Forward passes inside the block replay the most recently added ids."""
        if not self._pending:
            raise MegatronReplayError("add_micro_batch() before replaying a forward pass")
        return self._action("REPLAY_FORWARD")

    def backward(self) -> contextlib.AbstractContextManager[None]:
        """Recompute during backward inside the block replays ids first-in first-out."""
        return self._action("REPLAY_BACKWARD")

    def record(self) -> contextlib.AbstractContextManager[None]:
        """Forward passes inside the block route natively; the decoder routers record their ids."""
        return self._action("RECORD")

    def wrap_forward_step(
        self, forward_step_func: Callable[..., Any], batches: Iterable[MegatronReplayBatch]
    ) -> Callable[..., Any]:
        """``forward_step_func`` for Megatron's schedules, replaying ``batches`` in order.

        Give the result to ``get_forward_backward_func()(forward_step_func=...)``.
        Each call takes the next batch, replays it in the forward, and leaves the
        routers in backward replay, which is what runs next on this rank for that
        micro-batch in every schedule (no pipelining, 1F1B): recomputes pop their
        ids first-in first-out.  Call :meth:`finish_step` after the schedule.
        """
        batch_iter = iter(batches)

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            try:
                batch = next(batch_iter)
            except StopIteration:
                raise MegatronReplayError(
                    "the schedule ran more micro-batches than routing batches were given"
                ) from None
            self.add_micro_batch(batch)
            self._set_action("REPLAY_FORWARD")
            try:
                return forward_step_func(*args, **kwargs)
            finally:
                self._set_action("REPLAY_BACKWARD")

        return forward_step

    def recorded(self) -> list[Any]:
        """Ids recorded by the last forward, one ``[tokens, K]`` tensor per decoder MoE router."""
        return [instance.get_recorded_indices() for instance in self.instances]

    def finish_step(self) -> None:
        """Drop every router's ids (call once per optimizer step)."""
        self._rr.RouterReplay.clear_global_indices()
        self._rr.RouterReplay.clear_global_router_replay_action()
        self._pending = 0
