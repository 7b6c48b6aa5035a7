"""PD prefill's KV send on CPU: the plain page-index path instead of pinned host memory.

Stands in for ``sglang/srt/disaggregation/prefill.py:1746-1761`` (SGLang 0.5.23): when
the sender advertises ``supports_host_tensor_indices`` (``MooncakeKVSender``,
``disaggregation/mooncake/conn.py:3312``), prefill copies the page indices into a
pinned host tensor and records a ``torch.cuda.Event()``, which dies without an NVIDIA
driver.  With the flag off it takes the ``kv_to_page_indices`` path, which is what the
sender reads either way.  Nothing here touches routing rows.
"""

from __future__ import annotations


def apply() -> None:
    """Make ``MooncakeKVSender`` say it takes no host tensor indices."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False
