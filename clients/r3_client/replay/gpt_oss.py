"""GPT-OSS: router ``mlp.router`` (``GptOssTopKRouter``), softmax over the selected logits.

Training with ``use_kernels=True`` (MegaBlocks) or un-dequantised MXFP4 weights routes
inside a fused kernel that bypasses the router module; load with those off.
"""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import GPT_OSS

FAMILY = register(
    Family(
        ("gpt_oss",),
        "router",
        ("GptOssTopKRouter",),
        GPT_OSS,
        "transformers.models.gpt_oss.modeling_gpt_oss",
    )
)
