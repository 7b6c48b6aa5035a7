"""Mixtral: router ``mlp.gate`` (``MixtralTopKRouter``), softmax top-k renormalised in fp32."""

from r3_client.replay._core import Family, register
from r3_client.replay._weights import softmax_topk_renorm_fp32

FAMILY = register(
    Family(
        ("mixtral",),
        "gate",
        ("MixtralTopKRouter",),
        softmax_topk_renorm_fp32,
        "transformers.models.mixtral.modeling_mixtral",
    )
)
