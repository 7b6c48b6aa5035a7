"""Routing replay for Hugging Face transformers MoE models (R3 on the trainer side).

::

    from r3_client.layouts import hf_layout
    from r3_client.replay import apply_routing_replay, replay_routing

    apply_routing_replay(model)                       # once; idempotent, undoable
    routing = hf_layout(routings, attention_mask, as_torch=True)
    with replay_routing(model, routing):
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()

Under the ``exact`` view policy (a rollout whose calls recomputed stored positions),
:func:`served_logprobs` scores a sample with one replayed forward per state of
``client.get_served(rollout_id)``.

One small module per family registers how its router is found and how its weights
follow the chosen ids (``qwen3_moe``, ``qwen2_moe``, ``olmoe``, ``mixtral``,
``deepseek_v3`` + ``glm4_moe``, ``gpt_oss``); :mod:`r3_client.replay._core` does the rest.
"""

from r3_client.replay import deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from r3_client.replay._core import (
    REGISTRY,
    Family,
    ReplayError,
    apply_routing_replay,
    record_routing,
    recorded_as_routing,
    register,
    remove_routing_replay,
    replay_load_balancing_loss,
    replay_routing,
    replay_served,
    served_logprobs,
)

__all__ = [
    "REGISTRY",
    "Family",
    "ReplayError",
    "apply_routing_replay",
    "deepseek_v3",
    "gpt_oss",
    "mixtral",
    "olmoe",
    "qwen2_moe",
    "qwen3_moe",
    "record_routing",
    "recorded_as_routing",
    "register",
    "remove_routing_replay",
    "replay_load_balancing_loss",
    "replay_routing",
    "replay_served",
    "served_logprobs",
    "supported_model_types",
]


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values routing replay knows."""
    return sorted(REGISTRY)
