"""``torch.cuda.synchronize`` / ``torch.cuda.empty_cache`` as no-ops where there is no CUDA.

Stands in for ``models/qwen3_moe_mtp.py:89-90``: the Qwen3-MoE MTP draft's
``set_embed_and_head`` calls both unconditionally after sharing the target's embedding
and LM head, which raises on a machine without an NVIDIA driver.  Nothing is patched when
CUDA is available.
"""

from __future__ import annotations

from typing import Any

import torch


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def apply() -> None:
    """Replace the two calls with no-ops when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = _noop
    torch.cuda.empty_cache = _noop
