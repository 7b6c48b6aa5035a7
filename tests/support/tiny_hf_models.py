"""Tiny random MoE models of every supported family, built from transformers configs."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from r3_client.synthetic import TINY_FAMILIES, tiny_moe_config

FAMILIES = list(TINY_FAMILIES)
# A realistic shape for GPU runs: wide enough that kernels, not Python, set the pace.
REAL: dict[str, Any] = dict(
    layers=4, experts=64, topk=8, hidden=1024, heads=16, kv_heads=4, head_dim=64, ffn=2048,
    moe_ffn=256, vocab=4096, positions=4096,
)  # fmt: skip
REAL_EXTRA: dict[str, dict[str, Any]] = {
    # MLA has one KV head per query head (DeepSeek-V3's own config: 128 and 128);
    # transformers 5.19 repeats MLA's keys by heads / kv_heads again, so fewer do not run.
    "deepseek_v3": dict(
        n_group=8,
        topk_group=4,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        kv_heads=16,
    ),
    "gpt_oss": dict(sliding_window=512),
}


def config(family: str, size: str = "tiny", **overrides: Any) -> Any:
    """The family's config: ``tiny`` (8 experts, top-2) or ``real`` (64 experts, top-8);
    ``overrides`` replace any of their fields."""
    if size == "real":
        return tiny_moe_config(family, **{**REAL, **REAL_EXTRA.get(family, {}), **overrides})
    return tiny_moe_config(family, **overrides)


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
