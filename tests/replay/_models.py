"""Tiny random MoE models of every supported family, built from transformers configs."""

from __future__ import annotations

from typing import Any

import torch
import transformers

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss"]
COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)


# A realistic shape for GPU runs: wide enough that kernels, not Python, set the pace.
REAL: dict[str, Any] = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    num_experts_per_tok=8,
    tie_word_embeddings=False,
)


def config(family: str, size: str = "tiny") -> Any:
    """The family's config: ``tiny`` (8 experts, top-2) or ``real`` (64 experts, top-8)."""
    tf: Any = transformers
    real = size == "real"
    common = REAL if real else COMMON
    experts, moe, head = (64, 256, 64) if real else (8, 32, 16)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            head_dim=head,
            moe_intermediate_size=moe,
            num_experts=experts,
            norm_topk_prob=True,
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=moe,
            num_experts=experts,
            norm_topk_prob=False,
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**{**common, "intermediate_size": moe}, num_experts=experts)
    if family == "mixtral":
        return tf.MixtralConfig(**{**common, "intermediate_size": moe}, num_local_experts=experts)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common,
            moe_intermediate_size=moe,
            n_routed_experts=experts,
            n_shared_experts=1,
            n_group=8 if real else 2,
            topk_group=4 if real else 1,
            first_k_dense_replace=1,
            kv_lora_rank=256 if real else 16,
            q_lora_rank=None,
            qk_rope_head_dim=32 if real else 8,
            qk_nope_head_dim=head if real else 8,
            v_head_dim=head,
            routed_scaling_factor=2.5,
        )
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(
            **common,
            head_dim=head,
            moe_intermediate_size=moe,
            n_routed_experts=experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **{**common, "intermediate_size": moe},
            head_dim=head,
            num_local_experts=experts,
            sliding_window=64 if not real else 512,
        )
    raise ValueError(family)


def build(
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    size: str = "tiny",
    device: str | torch.device = "cpu",
) -> Any:
    """A random model of ``family`` (fixed seed), in eval mode, on ``device``."""
    torch.manual_seed(seed)
    tf: Any = transformers
    model = tf.AutoModelForCausalLM.from_config(config(family, size), dtype=dtype)
    for name, p in model.named_parameters():
        # Random router weights (some families init them to zero) so routing is non-trivial.
        if name.endswith(("gate.weight", "router.weight")):
            torch.nn.init.normal_(p, std=0.5)
    model.eval()
    return model.to(device)
