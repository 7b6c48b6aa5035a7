"""Qwen3-MoE: router ``mlp.gate`` (``Qwen3MoeTopKRouter``), softmax top-k."""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import SOFTMAX_TOPK

FAMILY = register(
    Family(
        ("qwen3_moe",),
        "gate",
        ("Qwen3MoeTopKRouter",),
        SOFTMAX_TOPK,
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
    )
)
