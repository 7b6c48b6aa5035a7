"""OLMoE: router ``mlp.gate`` (``OlmoeTopKRouter``), softmax top-k."""

from r3_client.replay._core import Family, register
from r3_client.replay._weights import softmax_topk

FAMILY = register(
    Family(
        ("olmoe",),
        "gate",
        ("OlmoeTopKRouter",),
        softmax_topk,
        "transformers.models.olmoe.modeling_olmoe",
    )
)
