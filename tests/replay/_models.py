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


def config(family: str) -> Any:
    tf: Any = transformers
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=False,
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**{**COMMON, "intermediate_size": 32}, num_experts=8)
    if family == "mixtral":
        return tf.MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **COMMON,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            routed_scaling_factor=2.5,
        )
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(
            **COMMON,
            head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **{**COMMON, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=8,
            sliding_window=64,
        )
    raise ValueError(family)


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(seed)
    tf: Any = transformers
    model = tf.AutoModelForCausalLM.from_config(config(family), dtype=dtype)
    for name, p in model.named_parameters():
        # Random router weights (some families init them to zero) so routing is non-trivial.
        if name.endswith(("gate.weight", "router.weight")):
            torch.nn.init.normal_(p, std=0.5)
    model.eval()
    return model
