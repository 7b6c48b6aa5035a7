"""Each family's native router, split into the steps replay needs separately.

A native router is ``logits -> scores -> (native ids, weights)``.  Replay needs the
logits and scores (the weights stay a differentiable function of the router), the
native ids only for rows without recorded routing, and the weights at *given* ids.
Each step here is the family's own code, op for op, so replaying a model's own
routing reproduces its router output bit for bit (checked by the tests), and the
native ids of ``-1`` rows are the ids the native router would have chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LogitsFn = Callable[[Any, Any], Any]  # (router, hidden) -> logits [T, E]
ScoresFn = Callable[[Any, Any], Any]  # (router, logits) -> scores [T, E]
SelectFn = Callable[[Any, Any], Any]  # (router, scores) -> native ids [T, K]
WeightsFn = Callable[[Any, Any, Any, Any], Any]  # (router, logits, scores, ids) -> [T, K]


@dataclass(frozen=True)
class Scoring:
    """One family's router as ``logits``, ``scores``, native ``select`` and ``weights``."""

    logits: LogitsFn
    scores: ScoresFn
    select: SelectFn
    weights: WeightsFn

    def route(self, router: Any, hidden: Any) -> tuple[Any, Any, Any]:
        """The native router output ``(logits, weights, ids)``, from the steps."""
        logits = self.logits(router, hidden)
        scores = self.scores(router, logits)
        ids = self.select(router, scores)
        return logits, self.weights(router, logits, scores, ids), ids


# ---------------------------------------------------------------- steps


def linear_logits(router: Any, hidden: Any) -> Any:
    """Qwen2/Qwen3-MoE, OLMoE, Mixtral: ``F.linear`` of the flattened hidden states."""
    import torch

    return torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)


def linear_fp32_logits(router: Any, hidden: Any) -> Any:
    """DeepSeek-V3, GLM-4-MoE: the linear in fp32."""
    import torch

    flat = hidden.view(-1, router.hidden_dim).type(torch.float32)
    return torch.nn.functional.linear(flat, router.weight.type(torch.float32))


def linear_bias_logits(router: Any, hidden: Any) -> Any:
    """GPT-OSS: a linear with bias (its MLP flattens the hidden states first)."""
    import torch

    return torch.nn.functional.linear(hidden, router.weight, router.bias)


def softmax_fp32(router: Any, logits: Any) -> Any:
    """Qwen2/Qwen3-MoE, OLMoE: softmax computed in fp32."""
    import torch

    return torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)


def softmax_of_float(router: Any, logits: Any) -> Any:
    """Mixtral: softmax of the logits cast to fp32."""
    import torch

    return torch.nn.functional.softmax(logits.float(), dim=-1)


def sigmoid(router: Any, logits: Any) -> Any:
    """DeepSeek-V3, GLM-4-MoE: sigmoid scores."""
    return logits.sigmoid()


def identity(router: Any, logits: Any) -> Any:
    """GPT-OSS: selection is on the logits themselves."""
    return logits


def topk_of_scores(router: Any, scores: Any) -> Any:
    """The top ``router.top_k`` experts of ``scores`` (sorted, as ``torch.topk`` returns)."""
    import torch

    return torch.topk(scores, router.top_k, dim=-1)[1]


def grouped_biased_topk(router: Any, scores: Any) -> Any:
    """DeepSeek-V3, GLM-4-MoE: group-limited top-k of the bias-corrected scores."""
    import torch

    groups, experts = router.num_group, router.num_experts
    for_choice = scores + router.e_score_correction_bias
    group_scores = for_choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(for_choice, k=router.top_k, dim=-1, sorted=False)[1]


def gather_renorm_cast(router: Any, logits: Any, scores: Any, ids: Any) -> Any:
    """Qwen2/Qwen3-MoE, OLMoE: scores at the ids, optional renorm, cast to the logits' dtype."""
    weights = scores.gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def gather_renorm(router: Any, logits: Any, scores: Any, ids: Any) -> Any:
    """Mixtral: scores at the ids, always renormalised, left in fp32."""
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def gather_renorm_scale(router: Any, logits: Any, scores: Any, ids: Any) -> Any:
    """DeepSeek-V3, GLM-4-MoE: unbiased scores at the ids, renorm, routed scaling.

    The correction bias and the group limit only decide *which* experts; given ids
    skip both, as the engine already chose.
    """
    weights = scores.gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


def softmax_of_selected(router: Any, logits: Any, scores: Any, ids: Any) -> Any:
    """GPT-OSS: softmax over the selected logits only, in their dtype."""
    import torch

    selected = logits.gather(1, ids)
    return torch.nn.functional.softmax(selected, dim=1, dtype=selected.dtype)


# ---------------------------------------------------------------- families' scorings

SOFTMAX_TOPK = Scoring(linear_logits, softmax_fp32, topk_of_scores, gather_renorm_cast)
MIXTRAL = Scoring(linear_logits, softmax_of_float, topk_of_scores, gather_renorm)
GROUPED_SIGMOID = Scoring(linear_fp32_logits, sigmoid, grouped_biased_topk, gather_renorm_scale)
GPT_OSS = Scoring(linear_bias_logits, identity, topk_of_scores, softmax_of_selected)
