"""Mixtral: router ``mlp.gate`` (``MixtralTopKRouter``), softmax top-k renormalised in fp32."""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import MIXTRAL

FAMILY = register(
    Family(
        ("mixtral",),
        "gate",
        ("MixtralTopKRouter",),
        MIXTRAL,
        "transformers.models.mixtral.modeling_mixtral",
    )
)
