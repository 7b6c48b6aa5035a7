"""sglang_r3.layers: which layers are MoE layers, per model family."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_r3.layers import moe_shape


def test_moe_shape_rules() -> None:
    qwen = SimpleNamespace(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts_per_tok=2,
        num_experts=8,
        mlp_only_layers=[1],
    )
    assert moe_shape(qwen).moe_layer_ids == (0, 1, 2, 3)  # SGLang ignores mlp_only_layers
    glm = SimpleNamespace(
        model_type="glm4_moe",
        num_hidden_layers=4,
        num_experts_per_tok=2,
        n_routed_experts=8,
        first_k_dense_replace=1,
    )
    assert moe_shape(glm).moe_layer_ids == (1, 2, 3)
    ds = SimpleNamespace(
        model_type="deepseek_v3",
        num_hidden_layers=6,
        num_experts_per_tok=2,
        n_routed_experts=8,
        first_k_dense_replace=1,
        moe_layer_freq=2,
    )
    assert moe_shape(ds).moe_layer_ids == (2, 4)
    mix = SimpleNamespace(
        model_type="mixtral", num_hidden_layers=2, num_experts_per_tok=2, num_local_experts=8
    )
    assert moe_shape(mix).num_experts == 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        moe_shape(SimpleNamespace(num_hidden_layers=2))
