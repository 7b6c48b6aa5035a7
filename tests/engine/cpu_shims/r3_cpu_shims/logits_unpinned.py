"""SGLang 0.5.12's logits processor without pinned host memory where there is no CUDA.

Stands in for ``sglang/srt/layers/logits_processor.py:541-546`` (SGLang 0.5.12): a
prefill batch that returns logprobs builds its ``sample_indices`` and
``input_logprob_indices`` with ``torch.tensor(..., pin_memory=True)`` unconditionally,
which raises "Found no NVIDIA driver" on a CPU-only machine and takes the scheduler down
(seen with the forced retractions of the GLM engine: a retracted request re-prefills with
``return_logprob``).  SGLang 0.5.23 asks ``is_pin_memory_available()`` there (:836-841);
this does the same for that one module: its ``torch`` becomes a view of torch whose
``tensor`` drops ``pin_memory`` while CUDA is unavailable.  Nothing is patched when CUDA is
available or when the module already asks (a release that has ``is_pin_memory_available``
in it).  Nothing here touches routing rows.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class _UnpinnedTorch(types.ModuleType):
    """``torch`` for one module, with ``tensor(..., pin_memory=True)`` made unpinned."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


def apply() -> None:
    """Give the logits processor the unpinned ``torch`` when CUDA is unavailable."""
    from sglang.srt.layers import logits_processor

    if torch.cuda.is_available() or hasattr(logits_processor, "is_pin_memory_available"):
        return
    logits_processor.torch = _UnpinnedTorch()  # type: ignore[assignment]
