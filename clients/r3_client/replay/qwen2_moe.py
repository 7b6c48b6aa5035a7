"""Qwen2-MoE: router ``mlp.gate`` (``Qwen2MoeTopKRouter``), softmax top-k; shared expert as is."""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import SOFTMAX_TOPK

FAMILY = register(
    Family(
        ("qwen2_moe",),
        "gate",
        ("Qwen2MoeTopKRouter",),
        SOFTMAX_TOPK,
        "transformers.models.qwen2_moe.modeling_qwen2_moe",
    )
)
