"""Which decoder layers of a model route tokens to experts, as SGLang runs it.

Upstream's capture buffer has a column for *every* decoder layer; dense layers are
never written and read as expert 0.  The extension keeps only MoE layers, decided
here from the Hugging Face config with SGLang's own rules (checked in SGLang 0.5.23's
model files; the canary test pins them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The routing geometry of a model: experts, top-k, all layers, MoE layers."""

    num_experts: int
    topk: int
    num_layers: int
    moe_layer_ids: tuple[int, ...]


def _get(cfg: Any, *names: str) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def moe_shape(hf_text_config: Any) -> MoeShape:
    """:class:`MoeShape` of a transformers text config; ``ValueError`` if it is not MoE.

    Rules (SGLang 0.5.23): DeepSeek-V2/V3, GLM-4-MoE and their relatives have dense
    layers below ``first_k_dense_replace`` (and, for DeepSeek, only every
    ``moe_layer_freq``-th layer is sparse).  Qwen2/Qwen3-MoE, Mixtral, OLMoE and
    GPT-OSS run every layer sparse in SGLang: ``mlp_only_layers`` and
    ``decoder_sparse_step`` are ignored by its model code, so they are ignored here.
    """
    num_layers = _get(hf_text_config, "num_hidden_layers")
    topk = _get(hf_text_config, "num_experts_per_tok", "moe_topk", "top_k")
    experts = _get(hf_text_config, "n_routed_experts", "num_experts", "num_local_experts")
    if not isinstance(num_layers, int) or not isinstance(topk, int) or not isinstance(experts, int):
        raise ValueError(
            "model config does not describe a mixture-of-experts model "
            f"(num_hidden_layers={num_layers!r}, num_experts_per_tok={topk!r}, "
            f"experts={experts!r}); routing capture needs an MoE model"
        )
    first_dense = _get(hf_text_config, "first_k_dense_replace")
    if isinstance(first_dense, int):
        model_type = str(getattr(hf_text_config, "model_type", ""))
        freq = _get(hf_text_config, "moe_layer_freq") if model_type.startswith("deepseek") else 1
        freq = freq if isinstance(freq, int) and freq > 0 else 1
        layers = tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    else:
        layers = tuple(range(num_layers))
    if not layers:
        raise ValueError("model config has no MoE layer (first_k_dense_replace covers them all)")
    return MoeShape(experts, topk, num_layers, layers)
