"""Feeding Megatron-Core's ``RouterReplay`` from the client's Megatron layout.

Megatron-Core (``moe_enable_routing_replay=True``) gives each ``TopKRouter`` a
``RouterReplay`` and leaves the rest to the caller: which ids, for which micro-batch,
and when to switch from forward replay to backward (recompute) replay.  This driver
does that::

    driver = RouterReplayDriver(config)              # checks the config
    for mb in micro_batches:                          # the schedule's forward order
        batch = megatron_layout(mb.routings, tp_size=..., cp_size=..., ...)
        driver.add_micro_batch(batch)                 # ids for every local router
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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

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


def _default_device() -> Any:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RouterReplayDriver:
    """Drives the ``RouterReplay`` instances of this rank's routers (construction order)."""

    def __init__(self, config: Any | None = None, *, topk: int | None = None) -> None:
        self._rr = _replay_module()
        if config is not None:
            check_config(config)
            topk = topk or getattr(config, "moe_router_topk", None)
        self.topk = topk
        self._pending = 0

    @property
    def instances(self) -> list[Any]:
        """This rank's ``RouterReplay`` objects, one per local MoE layer."""
        return list(self._rr.RouterReplay.global_router_replay_instances)

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

    def add_micro_batch(self, batch: MegatronReplayBatch, device: Any = None) -> None:
        """Give every local router its ids for the next micro-batch.

        ``device``: where the routers run; default the current CUDA device when
        CUDA is available, else the CPU.
        """
        instances = self.instances
        if len(batch.per_layer) != len(instances):
            raise MegatronReplayError(
                f"routing has {len(batch.per_layer)} MoE layers {batch.layer_ids}, this rank has "
                f"{len(instances)} routers with RouterReplay; slice layers for this pipeline "
                "stage (megatron_layout(stage_layers=...)) and build the model with "
                "moe_enable_routing_replay=True"
            )
        self._rr.RouterReplay.set_replay_data(self._tensors(batch.per_layer, device))
        self._pending += 1

    def _action(self, name: str) -> contextlib.AbstractContextManager[None]:
        rr = self._rr

        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            rr.RouterReplay.set_global_router_replay_action(getattr(rr.RouterReplayAction, name))
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
        """Forward passes inside the block route natively and record their ids."""
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
        rr = self._rr

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            try:
                batch = next(batch_iter)
            except StopIteration:
                raise MegatronReplayError(
                    "the schedule ran more micro-batches than routing batches were given"
                ) from None
            self.add_micro_batch(batch)
            rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.REPLAY_FORWARD)
            try:
                return forward_step_func(*args, **kwargs)
            finally:
                rr.RouterReplay.set_global_router_replay_action(
                    rr.RouterReplayAction.REPLAY_BACKWARD
                )

        return forward_step

    def recorded(self) -> list[Any]:
        """Ids recorded by the last forward, one ``[tokens, K]`` tensor per local router."""
        return list(self._rr.RouterReplay.get_recorded_data())

    def finish_step(self) -> None:
        """Drop every router's ids (call once per optimizer step)."""
        self._rr.RouterReplay.clear_global_indices()
        self._rr.RouterReplay.clear_global_router_replay_action()
        self._pending = 0
