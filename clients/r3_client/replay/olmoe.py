"""OLMoE: router ``mlp.gate`` (``OlmoeTopKRouter``), softmax top-k."""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import SOFTMAX_TOPK

FAMILY = register(
    Family(
        ("olmoe",),
        "gate",
        ("OlmoeTopKRouter",),
        SOFTMAX_TOPK,
        "transformers.models.olmoe.modeling_olmoe",
    )
)
