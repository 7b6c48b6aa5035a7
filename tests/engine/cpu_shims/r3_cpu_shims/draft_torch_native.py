"""torch_native as the EAGLE/MTP draft-extend attention backend.

Stands in for ``speculative/draft_utils.py:115`` (``DraftBackendFactory
.create_draft_extend_backend``), whose backend map has no ``torch_native`` entry, so any
EAGLE-family draft on CPU fails with "EAGLE is not supported in ... attention backend
torch_native".  Only the draft-extend backend is replaced: the multi-step draft-decode
backend (``create_decode_backend``) is ``None`` for ``--speculative-num-steps 1``
(``draft_utils.py:86-88``), so run with one step.
"""

from __future__ import annotations

from typing import Any


def apply() -> None:
    """Make ``create_draft_extend_backend`` return a ``TorchNativeAttnBackend``."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative import draft_utils

    factory = draft_utils.DraftBackendFactory
    upstream = factory.create_draft_extend_backend

    def create_draft_extend_backend(self: Any) -> Any:
        backend = TorchNativeAttnBackend(self.draft_model_runner)
        backend.prefill_attention_backend_str = "torch_native"
        backend.decode_attention_backend_str = "torch_native"
        return backend

    create_draft_extend_backend.__wrapped__ = upstream  # type: ignore[attr-defined]
    factory.create_draft_extend_backend = create_draft_extend_backend
