"""The host allocator of SGLang's CPU engine, per release (:mod:`sglang_r3.releases`).

Upstream's default allocator registers host buffers with CUDA; on a machine without a
GPU the routed-experts buffer (and HiCache's host pool) must be plain memory.  The
plugin installs :func:`install_allocator` in every SGLang process on ``--device cpu``;
the start-up check asks :func:`allocator_installed`.
"""

from __future__ import annotations

from typing import Any

from sglang_r3 import releases


def _cpu_alloc(
    dims: tuple[int, ...],
    dtype: Any,
    device: str,
    pin_memory: bool = False,
    allocator: Any = None,
    registration_granularity_bytes: int | None = None,
) -> Any:
    """Host buffer on a CPU-only machine: plain zeroed memory (pinning needs a GPU)."""
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


def alloc_funcs() -> Any:
    """SGLang's ``ALLOC_MEMORY_FUNCS`` (``mem_cache.pool_host.common`` from 0.5.14,
    ``mem_cache.memory_pool_host`` before)."""
    if releases.current().has("pool_host_package"):
        from sglang.srt.mem_cache.pool_host import common

        return common.ALLOC_MEMORY_FUNCS
    from sglang.srt.mem_cache import memory_pool_host

    return memory_pool_host.ALLOC_MEMORY_FUNCS


def _cpu_host_cache_init(
    self: Any, num_tokens: int, num_layers: int, topk_size: int, name: str
) -> None:
    """``state_capturer.base.BaseHostCache.__init__`` before SGLang 0.5.20, less the
    pinning: that release allocates the routed-experts host buffer with
    ``torch.zeros(..., pin_memory=True)`` itself (no ALLOC_MEMORY_FUNCS), which needs a
    GPU driver.  The same fields, zeroed host memory."""
    import torch

    self.buffer = torch.zeros((num_tokens, num_layers, topk_size), dtype=torch.int32, device="cpu")
    self.num_tokens = num_tokens
    self.num_layers = num_layers
    self.topk_size = topk_size
    self.name = name
    self._log_allocation()


def install_allocator() -> None:
    """Register :func:`_cpu_alloc` for SGLang's ``cpu`` device, and before SGLang 0.5.20
    the capturer's host buffer without pinning (idempotent)."""
    alloc_funcs()["cpu"] = _cpu_alloc
    if not releases.current().has("capturer_alloc_funcs"):
        from sglang.srt.state_capturer import base

        base.BaseHostCache.__init__ = _cpu_host_cache_init


def allocator_installed() -> bool:
    """True when the CPU host allocator is the one SGLang will use."""
    if alloc_funcs().get("cpu") is not _cpu_alloc:
        return False
    if releases.current().has("capturer_alloc_funcs"):
        return True
    from sglang.srt.state_capturer import base

    return base.BaseHostCache.__init__ is _cpu_host_cache_init
