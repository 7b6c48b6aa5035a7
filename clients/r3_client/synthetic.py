"""Synthetic routing and tiny MoE model configs, for tests, benchmarks and demos.

``synthetic_routing`` draws router scores and takes their top-k, so rows are
genuine top-k sets in the engine's order (descending score):

* ``skew`` — per-layer Zipf expert popularity: expert of popularity rank ``r``
  gets a score bias ``-skew * ln(r + 1)`` (0 = uniform);
* ``rho`` — correlation between consecutive tokens: scores follow an AR(1)
  process ``z_t = rho * z_{t-1} + sqrt(1 - rho^2) * eps_t`` per layer;
* ``empty`` — share of (token, layer) rows replaced by ``-1``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["TINY_FAMILIES", "synthetic_routing", "tiny_moe_config"]

_CHUNK_TOKENS = 1024


def synthetic_routing(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    topk: int,
    *,
    skew: float = 0.0,
    rho: float = 0.0,
    empty: float = 0.0,
    seed: int = 0,
) -> npt.NDArray[np.int32]:
    """``[num_tokens, num_layers, topk]`` int32 routing drawn as described above."""
    rng = np.random.default_rng(seed)
    t, nl, e, k = num_tokens, num_layers, num_experts, topk
    ranks = np.argsort(rng.random((nl, e)), axis=1).astype(np.float32)
    bias = (-skew * np.log1p(ranks)).astype(np.float32)
    a = np.float32(math.sqrt(max(0.0, 1.0 - rho * rho)))
    z = rng.standard_normal((nl, e), dtype=np.float32)
    out = np.empty((t, nl, k), dtype=np.int32)
    buf: npt.NDArray[Any] = np.empty((_CHUNK_TOKENS, nl, e), dtype=np.float32)
    for c0 in range(0, t, _CHUNK_TOKENS):
        n = min(_CHUNK_TOKENS, t - c0)
        eps = rng.standard_normal((n, nl, e), dtype=np.float32)
        if rho:
            for i in range(n):  # the AR(1) recurrence is sequential in time
                z = np.float32(rho) * z + a * eps[i]
                buf[i] = z
            scores = buf[:n] + bias
        else:
            scores = eps + bias
        top = np.argpartition(scores, -k, axis=-1)[..., -k:]
        order = np.argsort(-np.take_along_axis(scores, top, axis=-1), axis=-1)
        out[c0 : c0 + n] = np.take_along_axis(top, order, axis=-1)
    if empty:
        out[rng.random((t, nl)) < empty] = -1
    return out


# ---------------------------------------------------------------- tiny MoE configs

#: The model types :func:`tiny_moe_config` builds (every family ``r3_client.replay`` knows).
TINY_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")


def tiny_moe_config(
    family: str,
    *,
    layers: int = 3,
    experts: int = 8,
    topk: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 96,
    moe_ffn: int = 32,
    vocab: int = 256,
    positions: int = 512,
    **extra: Any,
) -> Any:
    """A small random-init ``transformers`` config of ``family`` (nothing is downloaded).

    The one builder behind the replay tests' models and the engine's test
    checkpoints (``sglang_r3.tools.local_stack``).  ``ffn`` sizes dense MLPs, ``moe_ffn`` each
    expert; ``extra`` adds or overrides config fields (e.g. DeepSeek's ``n_group``).
    """
    import transformers

    tf: Any = transformers  # configs take **kwargs that the stubs do not list
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        num_experts_per_tok=topk,
        tie_word_embeddings=False,
    )
    experts_only = {**common, "intermediate_size": moe_ffn}  # no dense MLP in these
    if family == "qwen3_moe":
        kw = dict(
            common, head_dim=head_dim, moe_intermediate_size=moe_ffn, num_experts=experts,
            norm_topk_prob=True,
        )  # fmt: skip
        return tf.Qwen3MoeConfig(**{**kw, **extra})
    if family == "qwen2_moe":
        kw = dict(
            common, moe_intermediate_size=moe_ffn, shared_expert_intermediate_size=moe_ffn,
            num_experts=experts, norm_topk_prob=False,
        )  # fmt: skip
        return tf.Qwen2MoeConfig(**{**kw, **extra})
    if family == "olmoe":
        return tf.OlmoeConfig(**{**experts_only, "num_experts": experts, **extra})
    if family == "mixtral":
        return tf.MixtralConfig(**{**experts_only, "num_local_experts": experts, **extra})
    if family == "deepseek_v3":
        kw = dict(
            common, moe_intermediate_size=moe_ffn, n_routed_experts=experts, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=head_dim,
            routed_scaling_factor=2.5,
        )  # fmt: skip
        return tf.DeepseekV3Config(**{**kw, **extra})
    if family == "glm4_moe":
        kw = dict(
            common, head_dim=head_dim, moe_intermediate_size=moe_ffn, n_routed_experts=experts,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        )  # fmt: skip
        return tf.Glm4MoeConfig(**{**kw, **extra})
    if family == "gpt_oss":
        kw = dict(experts_only, head_dim=head_dim, num_local_experts=experts, sliding_window=64)
        return tf.GptOssConfig(**{**kw, **extra})
    raise ValueError(f"unknown family {family!r}; choose from {TINY_FAMILIES}")
