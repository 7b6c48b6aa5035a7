"""verl 0.9.1: agent-loop trajectories tagged by rollout id, ``routed_experts`` from the cache.

Rollout side.  verl's agent loops call SGLang in-process, never over HTTP: an agent
loop's ``self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
(``LLMServerClient``, ``workers/rollout/llm_server.py:99-163``) reaches
``SGLangHttpServer.generate`` (``workers/rollout/sglang_rollout/async_sglang_server.py:546``),
which puts the ``sampling_params`` it was given into a ``GenerateReqInput`` and calls
``tokenizer_manager.generate_request`` (:625-657), where the plugin reads the tag.  So
the tag travels in ``sampling_params["custom_params"]["r3"]``; the ``X-SMG-Routing-Key``
header has no HTTP request to ride on.  :class:`RoutedAgentLoop` gives each ``run`` of
an agent loop (one trajectory: verl builds one agent loop per sample,
``agent_loop.py:682-694``) a fresh rollout id and tags every ``generate`` it makes with
it, so a multi-turn trajectory's turns, and the resumes of
``FullyAsyncLLMServerClient`` (``llm_server.py:289-345``), continue one rollout.  The id
is ``f"{prefix}.{uuid4().hex}"``: unique per trajectory whatever verl's own request ids
are (``det-{priority}`` under ``full_determinism``).  It comes back in the trajectory's
``extra_fields``, which verl turns into ``non_tensor_batch["r3_rollout_id"]``
(``agent_loop.py:1129-1135``), so it follows its sample through ``union``, balancing
and slicing.  Install it by verl's agent-loop config file (:func:`routed_agent_loop`)::

    # actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: r3_single_turn_agent
      _target_: r3_client.integrations.verl.routed_agent_loop
      agent_loop: verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop

or as the first base of an agent loop class of your own.  Inline routing stays off:
``rollout.enable_rollout_routing_replay=False`` (checked on each ``run``).

Trainer side, :func:`attach_routed_experts` fetches the batch's rollouts (one streamed
``get_many``) into ``data.batch["routed_experts"]``, laid out by
:func:`~r3_client.layouts.verl_layout`; :class:`RoutedRolloutManager` does it to every
training batch the trainer's ``async_rollout_manager`` returns.

Rank-local (nothing but ids crosses Ray): ``RoutedRolloutManager(..., rank_local=True)``
only checks the step's rollouts (:func:`check_rank_local_batch`) and leaves
``non_tensor_batch["r3_rollout_id"]`` as the batch's only routing; on each training
worker, :class:`RankLocalReplay` makes verl's Megatron engine replay every micro-batch
from the rank's own slice (:func:`r3_client.rank_local.fetch_verl_rank_slice`) in place
of the ``routed_experts`` its R3 branch would read.  :class:`ExactReplayTrainer` makes
verl's own ``RayPPOTrainer.fit`` train every token in its routing state (state expansion
inside its step methods).  Nothing here imports verl at module level; torch and verl are
imported when a batch is attached or an engine hooked.
"""

from __future__ import annotations

from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY
from r3_client.integrations.verl.driver import (
    ExactReplayTrainer,
    RoutedRolloutManager,
    advantages_by_origin,
    arrange_mini_batches,
    attach_routed_experts,
    check_expansion_modes,
    check_rank_local_batch,
    expand_verl_batch,
    gather_by_state,
)
from r3_client.integrations.verl.rollout import (
    RoutedAgentLoop,
    TaggingServerClient,
    new_rollout_id,
    routed_agent_loop,
)
from r3_client.integrations.verl.worker import (
    RankLocalReplay,
    check_verl_hooks,
)

__all__ = [
    "ROLLOUT_ID_KEY",
    "ExactReplayTrainer",
    "RankLocalReplay",
    "RoutedAgentLoop",
    "RoutedRolloutManager",
    "TaggingServerClient",
    "advantages_by_origin",
    "arrange_mini_batches",
    "attach_routed_experts",
    "check_expansion_modes",
    "check_rank_local_batch",
    "check_verl_hooks",
    "expand_verl_batch",
    "gather_by_state",
    "new_rollout_id",
    "routed_agent_loop",
]
