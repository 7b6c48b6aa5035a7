"""HiCache's device<->host KV copy in torch, for ``--hicache-io-backend direct
--hicache-mem-layout layer_first`` on CPU.

Stands in for ``sgl_kernel.kvcacheio.transfer_kv_direct``, which
``sglang/srt/mem_cache/pool_host/mha.py:60-88`` imports only on CUDA/HIP (or XPU).  On
CPU the name is never bound, so the first write-back to the host tier dies with a
``NameError`` at ``mha.py:677`` (surfacing as ``'Stream' object has no attribute
'synchronize'`` from the error path of ``mem_cache/l2_transfer.py``).  The direct,
layer-first paths call it at ``mha.py:513, 677, 1106, 1177`` with per-layer source and
destination tensors and token (slot) indices; this copies ``dst[dst_indices] =
src[src_indices]`` layer by layer, which is what the kernel does.  Rows (routing) are
not touched here: moving them with the KV is the product's job (``sglang_r3.scheduler.hicache``).

It also sets ``HICACHE_HOST_MEMORY_RESERVE_BYTES`` (``pool_host/base.py:28``, subtracted
from the free host memory at ``:104-107`` before any host pool is allowed) from 10 GiB
to 0: on a small CI machine running several engines, less than 10 GiB is often free, and
SGLang then refuses even a host tier of a few kilobytes ("Requesting 0.00 GB but only
have -1.76 GB free").  The check that the pool fits in free memory is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Copy slots ``src_indices`` of each source layer to ``dst_indices`` of its destination."""
    del page_size  # token indices already cover whole pages
    src = src_indices.to("cpu").long()
    dst = dst_indices.to("cpu").long()
    for s, d in zip(src_layers, dst_layers, strict=True):
        d[dst] = s[src].to(d.dtype)


def apply() -> None:
    """Bind ``transfer_kv_direct`` in ``pool_host/mha.py`` (unbound on CPU); no host
    memory reserve."""
    from sglang.srt.mem_cache.pool_host import base, mha

    mha.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
