"""DeepSeek-V3 and GLM-4-MoE: grouped sigmoid routing with a selection-only correction bias.

Routers ``mlp.gate`` (``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``).  Neither
family computes an auxiliary loss in transformers, so there is nothing to patch there.
"""

from r3_client.replay._core import Family, register
from r3_client.replay._scoring import GROUPED_SIGMOID

FAMILY = register(
    Family(
        ("deepseek_v3", "glm4_moe"),
        "gate",
        ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"),
        GROUPED_SIGMOID,
        None,
    )
)
