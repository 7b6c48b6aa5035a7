"""DP attention's batch padding with the torch-native attention backend on CPU.

With ``--enable-dp-attention`` each DP rank pads its batch to the size gathered over
the ranks, and on CPU it asks the attention backend for the sequence length of a
padded request: ``ForwardBatch`` at ``model_executor/forward_batch_info.py:2013-2017``
calls ``attn_backend.get_cpu_graph_seq_len_fill_value()``.  Only
``intel_amx_backend.py:198`` (which returns 1) and the hybrid linear-attention
backends define it; ``TorchNativeAttnBackend`` does not, so the first forward dies with
``AttributeError: 'TorchNativeAttnBackend' object has no attribute
'get_cpu_graph_seq_len_fill_value'``.  (intel_amx itself is no option here: this
``sgl_kernel`` wheel is a CUDA build with no ``*_cpu`` ops.)

This shim gives ``TorchNativeAttnBackend`` the method with intel_amx's answer: a padded
request attends to one slot.  Padded requests produce no output, so their value never
reaches a row.
"""

from __future__ import annotations

from typing import Any


def _fill_value(self: Any) -> int:
    return 1


def apply() -> None:
    """Add ``get_cpu_graph_seq_len_fill_value`` to ``TorchNativeAttnBackend`` (if missing)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = _fill_value
