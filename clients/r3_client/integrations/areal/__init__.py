"""AReaL 1.0.4: requests tagged by rollout id, ``ModelResponse.routed_experts`` from the cache.

AReaL builds each SGLang request in ``SGLangBackend.build_generation_request``
(``areal/engine/sglang_remote.py:44-90``), which ``RemoteSGLangEngine`` holds as
``engine._engine.backend``.  :func:`install` wraps that backend (once; installing
again is harmless) so every request carries ``custom_params.r3`` with its rollout id
and AReaL's weight version, and no ``return_routed_experts``.  AReaL resumes a request
aborted for a weight update with the same ``ModelRequest`` (``input_ids`` += output so
far), so the resumed call carries the same id and the engine stores only the new
rows, under the new version.  The id is :func:`rollout_id`: ``req.metadata[
"r3_rollout_id"]`` where set (one id for a multi-turn episode's turns), else
``req.rid`` (the built-in workflows make one per sample).

Trainer side, :func:`fill_routed_experts` sets ``ModelResponse.routed_experts`` as
AReaL's remote engine fills it from inline routing today, ``int32 [prompt + completion
- 1, num_layers * K]`` over all of SGLang's ``num_hidden_layers`` (dense layers ``0``),
which its Megatron replay (PR #1207) consumes -- one row per token, also after a
resume.  :class:`RoutedEngine` does both around ``agenerate``, so an unchanged
workflow gets filled responses::

    class R3RLVRWorkflow(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            engine = RoutedEngine(engine, client, num_layers=hf_config.num_hidden_layers)
            return await super().arun_episode(engine, data)

**Rank-local mode** (AReaL's Megatron R3, PR inclusionAI/AReaL#1207, read at commit
``a9f0b0400e8937242e0994e6a10ec271b75dba06``): the rollout carries a key per sample instead
of routing (:class:`KeyedEngine`, :func:`with_rollout_keys`: a per-token ``int64`` column
``r3_key`` that AReaL's batching splits, reorders, packs and pads like ``input_ids``), the
trainer checks the step once (:func:`check_areal_step`), and each training rank, for each
micro-batch, reads only its rows of its stage's layers and gets exactly what the PR's
``set_router_replay_data`` sets on that rank (:func:`fetch_areal_rank_targets`,
:func:`areal_micro_batch`, :func:`set_router_targets`); docs/integrations.md.

One module per process it runs in: ``rollout`` on AReaL's rollout workers (the workflow's
engine: the tag, the fill, the keys), ``driver`` in the trainer's step (the check before
dispatch, state expansion), ``worker`` on each training rank (one micro-batch's targets);
``_keys`` holds the batch columns and the key rule the three share.  Nothing here imports
AReaL: its objects are used by the attributes named above.
"""

from __future__ import annotations

from r3_client.integrations.areal._keys import (
    KEY_FIELD,
    STATE_FIELD,
    key_rollout_id,
    new_rollout_key,
)
from r3_client.integrations.areal.driver import (
    ORIGIN_FIELD,
    ExactPPOActor,
    check_areal_expansion_modes,
    check_areal_step,
    expand_areal_batch,
    gather_by_state,
    step_rollouts,
)
from r3_client.integrations.areal.rollout import (
    ROLLOUT_ID_KEY,
    KeyedEngine,
    RoutedEngine,
    TaggingBackend,
    fill_routed_experts,
    install,
    rollout_id,
    routed_experts,
    with_rollout_keys,
)
from r3_client.integrations.areal.worker import (
    ArealMicroBatch,
    ArealReplayTargets,
    areal_micro_batch,
    areal_rank_plan,
    fetch_areal_rank_targets,
    set_router_targets,
    stage_moe_layers,
)

__all__ = [
    "KEY_FIELD",
    "ORIGIN_FIELD",
    "ROLLOUT_ID_KEY",
    "STATE_FIELD",
    "ArealMicroBatch",
    "ArealReplayTargets",
    "ExactPPOActor",
    "KeyedEngine",
    "RoutedEngine",
    "TaggingBackend",
    "areal_micro_batch",
    "areal_rank_plan",
    "check_areal_expansion_modes",
    "check_areal_step",
    "expand_areal_batch",
    "fetch_areal_rank_targets",
    "fill_routed_experts",
    "gather_by_state",
    "install",
    "key_rollout_id",
    "new_rollout_key",
    "rollout_id",
    "routed_experts",
    "set_router_targets",
    "stage_moe_layers",
    "step_rollouts",
    "with_rollout_keys",
]
