"""The native weight formulas of each family, applied to given expert ids.

Each equals the family's router output bit for bit when the ids are the router's
own (checked by the tests); all are differentiable in the logits.
"""

from __future__ import annotations

from typing import Any


def softmax_topk(router: Any, logits: Any, ids: Any) -> Any:
    """Qwen2/Qwen3-MoE, OLMoE: fp32 softmax over all experts, gather, optional renorm, cast."""
    import torch

    weights = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_topk_renorm_fp32(router: Any, logits: Any, ids: Any) -> Any:
    """Mixtral: fp32 softmax, gather, always renormalised, left in fp32."""
    import torch

    weights = torch.nn.functional.softmax(logits.float(), dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def sigmoid_scaled(router: Any, logits: Any, ids: Any) -> Any:
    """DeepSeek-V3, GLM-4-MoE: unbiased sigmoid scores at the ids, renorm, scaling.

    The correction bias and the group-limited choice only decide *which* experts;
    given ids skip both, as the engine already chose.
    """
    weights = logits.sigmoid().gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_of_selected(router: Any, logits: Any, ids: Any) -> Any:
    """GPT-OSS: softmax over the selected (biased) logits only, in their dtype."""
    import torch

    selected = logits.gather(1, ids)
    return torch.nn.functional.softmax(selected, dim=1, dtype=selected.dtype)
