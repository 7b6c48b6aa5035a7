"""Routing rows follow their KV between the device pool and HiCache's host tier.

Upstream (sglang#26975) keeps routing rows only in the capturer's host buffer, indexed
by *device* KV slot (``state_capturer/base.py``).  HiCache copies a prefix's KV to host
slots, frees the device slots, and later loads the KV back into *new* device slots
without a forward pass: the rows at those slots belong to whichever tokens used them
last.  A request whose prompt hits a host-tier prefix then reads stale rows, and a new
rollout stores them.

This module gives the host tier its own row buffer, ``[host slots, layers, K]`` in the
capturer's dtype (int32), indexed by host slot, and moves rows at the two places the
radix cache moves KV between the tiers, both in the scheduler process and both in the
controller's id space (the ids ``req_to_token`` holds, which index the capturer):

- ``HybridCacheController.write`` (a back-up, device -> host): ``rows[host] =
  capturer[device]``;
- ``HybridCacheController.load`` (a load-back, host -> device): ``capturer[device] =
  rows[host]``.

**Order under overlap scheduling.**  With overlap on, a forward's rows reach the
capturer only at ``TopkCaptureOutput.finalize()``, when the scheduler processes that
batch's result, one step after launching it.  A back-up or load issued meanwhile may
concern slots that the batch in flight writes: the last token of a request that just
finished (cached while the next forward computes its KV), or a freed slot handed to a
load-back while that forward still writes it.  SGLang orders the KV copies after the
forward on the device (``write_fence_stream``/``load_fence_stream``); rows get the same
order here.  Each capture output launched is numbered; a row move is applied at once
when no output is awaiting ``finalize()``, else right after the ``finalize()`` of the
output in flight when it was issued (moves keep their issue order).  Without overlap
the capturer writes rows at the end of each forward, so every move is applied at once.

Memory: the host-tier row buffer costs ``host slots x num_hidden_layers x K x 4``
bytes (host slots = ``--hicache-ratio`` x the device pool, or what ``--hicache-size``
gives): e.g. 2M host slots x 48 layers x 8 = 3.1 GB.  It is logged at start-up.

Supported: the model's plain KV stack (``MHATokenToKVPoolHost`` anchor, no side pools),
``--hicache-io-backend direct --hicache-mem-layout layer_first``, ``--hicache-write-policy
write_through``, overlap scheduling on or off.  :func:`unsupported_hicache_options` lists
what stays refused and why.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("sglang_r3")

# Set on the controller whose moves we follow (the tree cache's).
_ROWS_ATTR = "_r3_host_rows"
# Set on a TopkCaptureOutput of the routed-experts capturer: its launch number.
_SEQ_ATTR = "_r3_seq"


def unsupported_hicache_options(server_args: Any) -> list[str]:
    """Why HiCache under these options could ship stale rows (empty: supported)."""

    def on(name: str) -> Any:
        return getattr(server_args, name, None)

    if not (on("enable_hierarchical_cache") or on("hicache_storage_backend")):
        return []
    problems = []
    if on("hicache_storage_backend"):
        problems.append(
            "--hicache-storage-backend (HiCache L3) restores KV pages by content hash "
            "from storage that this or another engine wrote, without their routing rows "
            "(sglang#26975; sglang_r3 moves rows only between the device and the host "
            "tier), so restored tokens would get stale rows: drop it and keep the host "
            "tier (--enable-hierarchical-cache alone)"
        )
    if on("hicache_host_memory_mode") not in (None, "cache"):
        problems.append(
            "--hicache-host-memory-mode buffer_only keeps KV only in L3 storage, whose "
            "pages carry no routing rows: use the default host memory mode 'cache'"
        )
    not_verified = []
    if on("hicache_io_backend") != "direct":
        not_verified.append(f"--hicache-io-backend {on('hicache_io_backend')}")
    if on("hicache_mem_layout") != "layer_first":
        not_verified.append(f"--hicache-mem-layout {on('hicache_mem_layout')}")
    if on("hicache_write_policy") not in (None, "write_through"):
        not_verified.append(f"--hicache-write-policy {on('hicache_write_policy')}")
    if on("enable_unified_memory"):
        not_verified.append("--enable-unified-memory")
    if (on("dcp_size") or 1) > 1:
        not_verified.append("--dcp-size > 1")
    if on("disaggregation_mode") not in (None, "null"):
        not_verified.append(f"--disaggregation-mode {on('disaggregation_mode')}")
    if on("radix_cache_backend"):
        not_verified.append(f"--radix-cache-backend {on('radix_cache_backend')}")
    if not_verified:
        problems.append(
            "HiCache with " + ", ".join(not_verified) + ": sglang_r3 moves routing rows "
            "with the KV between the device and the host tier (sglang#26975), but has "
            "verified that only with --hicache-io-backend direct --hicache-mem-layout "
            "layer_first --hicache-write-policy write_through on the default radix "
            "cache; use those, or run without HiCache"
        )
    return problems


@dataclass
class _Move:
    seq: int  # capture outputs launched when the move was issued
    to_host: bool
    rows: Any  # torch.Tensor [host slots, L, K]
    host: Any  # torch.Tensor of host slots
    device: Any  # torch.Tensor of device slots (controller ids)


class _RowMover:
    """Per scheduler process: pending row moves, in issue order."""

    def __init__(self) -> None:
        self.launched = 0  # capture outputs returned by on_forward_end (overlap only)
        self.finalized = 0  # highest launch number finalized
        self.pending: deque[_Move] = deque()
        # Reads of the capture buffer that must see every forward in flight (a view's
        # rows kept at a retraction, sglang_r3.scheduler.row_hooks), by launch number.
        self.later: deque[tuple[int, Callable[[], None]]] = deque()

    def after_in_flight(self, read: Callable[[], None]) -> None:
        """Run ``read`` once every capture output launched so far is finalized (now,
        without overlap scheduling or when none is in flight)."""
        if not self.later and self.launched <= self.finalized:
            read()
        else:
            self.later.append((self.launched, read))

    def issue(self, move: _Move) -> None:
        if not self.pending and move.seq <= self.finalized:
            _apply(move)
        else:
            # Own copies: the caller's index tensors may be reused before we apply.
            move.host, move.device = move.host.clone(), move.device.clone()
            self.pending.append(move)

    def finalized_upto(self, seq: int) -> None:
        self.finalized = max(self.finalized, seq)
        while self.pending and self.pending[0].seq <= self.finalized:
            _apply(self.pending.popleft())
        while self.later and self.later[0][0] <= self.finalized:
            self.later.popleft()[1]()


_MOVER = _RowMover()
# True once a host tier got a row buffer in this process: the capture hooks run on every
# forward and do nothing else until then.
_ACTIVE = False


def _capturer() -> Any:
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    return get_global_experts_capturer()


def _apply(move: _Move) -> None:
    cap = _capturer()
    if cap is None or cap.host_cache.buffer is None:
        return
    host = move.host.to("cpu", non_blocking=False).long()
    device = move.device.to("cpu", non_blocking=False).long()
    if move.to_host:
        move.rows[host] = cap.host_cache.buffer[device]
    else:
        cap.host_cache.buffer[device] = move.rows[host]


def _stack_problems(controller: Any) -> list[str]:
    """What about this HiCache stack our row moves were not verified on."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
        HybridCacheController,
    )
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if not isinstance(controller, HybridCacheController):
        return [f"HiCache controller {type(controller).__name__} is not HybridCacheController"]
    group = controller.mem_pool_host
    entries = list(getattr(group, "entries", ()))
    problems = []
    if len(entries) != 1:
        problems.append(
            f"HiCache host pools {[str(e.name) for e in entries]}: only a plain KV "
            "stack (one pool) is verified"
        )
    anchor = group.anchor_entry
    if type(anchor.host_pool) is not MHATokenToKVPoolHost:
        problems.append(
            f"HiCache host pool {type(anchor.host_pool).__name__}: only "
            "MHATokenToKVPoolHost is verified"
        )
    if anchor.packed_draft_device_pools or getattr(anchor.host_pool, "dcp_size", 1) != 1:
        problems.append("HiCache host pool with draft layers or DCP is not verified")
    return problems


def around_init_hicache(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``UnifiedRadixCache.init_hicache`` (scheduler): give the host tier a row
    buffer when routing is captured, or refuse a HiCache stack we have not verified."""
    result = original(self, *args, **kwargs)
    controller = getattr(self, "cache_controller", None)
    cap = _capturer()
    if controller is None or cap is None:
        return result
    problems = _stack_problems(controller)
    server_args = kwargs.get("server_args", args[0] if args else None)
    if problems and not getattr(server_args, "enable_hierarchical_cache", False):
        # A host pool SGLang builds for something else (PD decode's retraction backup):
        # not ours to refuse; rows are then simply not moved.
        log.debug("sglang_r3: no HiCache row moves: %s", problems)
        return result
    if problems:
        from sglang_r3.config import engine_config
        from sglang_r3.errors import StartupError

        message = (
            "sglang_r3 cannot move routing rows with HiCache here (sglang#26975):\n  - "
            + "\n  - ".join(problems)
            + "\nrun without --enable-hierarchical-cache (evicted prefixes are then "
            "recomputed, rows included)"
        )
        if engine_config().enabled:
            raise StartupError(message)
        log.warning("%s\n(routing shipping is off; upstream rows of loaded KV stay stale)", message)
        return result
    import torch

    buf = cap.host_cache.buffer
    slots = int(controller.mem_pool_host.logical_size)
    rows = torch.zeros((slots, *buf.shape[1:]), dtype=buf.dtype)
    setattr(controller, _ROWS_ATTR, rows)
    global _ACTIVE
    _ACTIVE = True
    log.info(
        "sglang_r3: HiCache host-tier routing rows %s %s, %.1f MiB",
        tuple(rows.shape),
        rows.dtype,
        rows.numel() * rows.element_size() / 2**20,
    )
    return result


def _rows_of(controller: Any) -> Any:
    return getattr(controller, _ROWS_ATTR, None)


def around_controller_write(
    original: Callable[..., Any], self: Any, device_indices: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``HybridCacheController.write`` (a back-up to the host tier): the rows
    of ``device_indices`` go to the host slots it returns."""
    host = original(self, device_indices, *args, **kwargs)
    rows = _rows_of(self)
    if host is not None and rows is not None and len(device_indices):
        _MOVER.issue(_Move(_MOVER.launched, True, rows, host, device_indices))
    return host


def around_controller_load(
    original: Callable[..., Any], self: Any, host_indices: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``HybridCacheController.load`` (a load-back from the host tier): the
    rows of ``host_indices`` go to the device slots it returns."""
    device = original(self, host_indices, *args, **kwargs)
    rows = _rows_of(self)
    if device is not None and rows is not None and len(host_indices):
        _MOVER.issue(_Move(_MOVER.launched, False, rows, host_indices, device))
    return device


def around_capture_forward_end(
    original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``BaseTopkCapturer.on_forward_end``: number each routed-experts capture
    output that will be finalized later (overlap scheduling)."""
    out = original(self, *args, **kwargs)
    # Numbered with or without HiCache: a retraction's rows are read after the forwards
    # in flight land (after_in_flight).
    if out is not None and self is _capturer():
        _MOVER.launched += 1
        setattr(out, _SEQ_ATTR, _MOVER.launched)
    return out


def around_capture_finalize(original: Callable[..., Any], self: Any) -> Any:
    """AROUND ``TopkCaptureOutput.finalize``: after a forward's rows land, apply the
    row moves issued while it was in flight."""
    result = original(self)
    seq = getattr(self, _SEQ_ATTR, None)
    if seq is not None:
        _MOVER.finalized_upto(seq)
    return result


def after_in_flight(read: Callable[[], None]) -> None:
    """Run ``read`` once the routing rows of every forward launched so far are in the
    capture buffer (under overlap scheduling a forward's rows land when its output is
    finalized, after the scheduler may already have retracted a request)."""
    _MOVER.after_in_flight(read)
