"""A real Megatron-Core ``GPTModel`` with MoE layers and routing replay, on CUDA or on CPU.

Used by the Megatron replay tests and by ``bench/replay_bench.py``.  On CUDA the
model is built as Megatron builds it (local layer spec, no Transformer Engine).
Megatron-Core assumes CUDA in a handful of places, so on CPU :func:`megatron_env`
patches exactly those, each for the duration of the block only:

- ``torch.cuda.current_device`` answers the CPU device: ``Router.gating`` moves
  router weights to it on every forward, and some buffers are created on it;
- the CUDA RNG state helpers of ``tensor_parallel.random`` become no-ops and the
  RNG tracker gets empty named states: full recompute and attention dropout fork
  the CUDA RNG (dropout is 0 here, so nothing random depends on them);
- the ``allgather`` token dispatcher is used, because ``alltoall`` creates a
  ``torch.cuda.Stream`` in its constructor;
- an explicit causal mask is passed, because the default one is made on ``"cuda"``;
- around Megatron's schedule only, :func:`schedule_env` makes tensors asked for on
  ``"cuda"`` on the CPU (``forward_backward_no_pipelining`` counts tokens in a
  ``torch.zeros(..., device="cuda")``); it is a ``TorchFunctionMode``, which costs
  every op a Python call, so it is not used where steps are timed.

On both devices, without Transformer Engine megatron-core 0.16.1 raises
``NameError: te_general_gemm`` in ``router_gating_linear`` (the name is only bound
when TE imports); it is bound to ``None`` here, which selects the plain ``torch.mm``
path.  ``flash_mla`` (pulled in by SGLang) fails to load its CUDA library without a
driver, with an ``OSError`` Megatron's ``except ImportError`` does not catch, so
where it cannot load it is made to raise ``ImportError`` instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VOCAB = 256


def _hide_broken_flash_mla() -> None:
    if "flash_mla" in sys.modules:
        return
    try:
        import flash_mla  # noqa: F401
    except Exception:  # OSError without a CUDA driver; Megatron catches only ImportError
        sys.modules["flash_mla"] = None  # type: ignore[assignment]


def _init_parallel(device: torch.device) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="r3-megatron-"), "store")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


@contextlib.contextmanager
def megatron_env(device: torch.device) -> Iterator[None]:
    """One-rank Megatron parallel state; on CPU, the patches listed in the module docstring."""
    _hide_broken_flash_mla()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel import random as mrandom

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16.1 without TE: NameError otherwise
    _init_parallel(device)
    if device.type == "cuda":
        mrandom.model_parallel_cuda_manual_seed(1234)
        yield
        return
    saved = (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    names = (
        mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        mrandom._DATA_PARALLEL_RNG_TRACKER_NAME,
    )
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.set_states({name: torch.empty(0) for name in names})
    try:
        yield
    finally:
        torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved
        tracker.reset()


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def schedule_env(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Around ``get_forward_backward_func()(...)``: on CPU, ``"cuda"`` tensors on the CPU."""
    return _CudaFactoriesOnCpu() if device.type == "cpu" else contextlib.nullcontext()


@dataclass(frozen=True)
class Shape:
    """A Qwen3-MoE-like Megatron model shape.

    ``moe_pattern``: Megatron's ``moe_layer_freq`` as a list (``1`` MoE, ``0`` dense; e.g.
    ``(0, 1, 1)`` for DeepSeek-V3's dense first layers), ``None`` for MoE in every layer.
    ``mtp_layers``: Megatron's ``mtp_num_layers`` (DeepSeek-V3 / GLM-4.5 MTP block after the
    decoder, built from the last decoder layer's spec, so MoE when that layer is MoE).
    """

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 8
    topk: int = 2
    ffn: int = 32
    moe_pattern: tuple[int, ...] | None = None
    mtp_layers: int = 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Absolute (0-based) ids of the decoder's MoE layers, as our routing names them."""
        pattern = self.moe_pattern or (1,) * self.layers
        return tuple(i for i, moe in enumerate(pattern) if moe)


def build_gpt(
    shape: Shape,
    device: torch.device,
    *,
    replay: bool = True,
    recompute: bool = True,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Any:
    """A ``GPTModel`` with MoE layers per ``shape`` (call inside :func:`megatron_env`).

    ``replay``: ``moe_enable_routing_replay`` (each ``TopKRouter`` gets a ``RouterReplay``).
    ``recompute``: full activation recompute of every layer, so backward re-runs routers.
    With ``shape.moe_pattern`` or ``shape.mtp_layers`` the layers come from Megatron's own
    ``get_gpt_decoder_block_spec`` / ``get_gpt_mtp_block_spec`` (local backend).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(seed)
    recompute_kw: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute
        else {}
    )
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn,
        moe_ffn_hidden_size=shape.ffn,
        num_moe_experts=shape.experts,
        moe_router_topk=shape.topk,
        moe_token_dispatcher_type="alltoall" if device.type == "cuda" else "allgather",
        moe_enable_routing_replay=replay,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type != "cuda",
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        moe_layer_freq=list(shape.moe_pattern) if shape.moe_pattern else 1,
        mtp_num_layers=shape.mtp_layers or None,
        **recompute_kw,
    )
    spec: Any = get_gpt_layer_local_spec(num_experts=shape.experts)
    mtp_spec = None
    if shape.moe_pattern or shape.mtp_layers:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        if shape.mtp_layers:
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=4096, mtp_block_spec=mtp_spec
    )
    return model.to(device=device, dtype=dtype)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's attention mask (``True`` = masked out), ``[1, 1, S, S]``."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def forward(model: Any, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of ``tokens`` ``[B, S]``; with ``labels``, the per-token loss
    ``[B, S]`` (a model with MTP layers needs labels: its MTP loss is computed in the forward)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    mask = causal_mask(tokens.shape[1], tokens.device)
    return model(tokens, positions, mask, labels=labels)  # type: ignore[no-any-return]
