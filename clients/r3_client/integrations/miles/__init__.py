"""miles (radixark/miles @ 31f1ca9): rollouts keyed per attempt, routing fetched into ``Sample``.

One module per miles process, as miles runs them:

* :mod:`~r3_client.integrations.miles.rollout` -- the rollout process: use
  :func:`wrap_generate` as miles' ``--custom-generate-function-path`` (a legacy
  ``(args, sample, sampling_params, evaluation)`` function; miles sends
  ``sample.routing_key`` as ``X-SMG-Routing-Key`` whenever it is set), or, in a generate
  function of your own, :func:`rollout_key` before the call and
  :func:`fill_routed_experts` after it (:func:`check_stored` on the rank-local path);
* :mod:`~r3_client.integrations.miles.driver` -- before miles converts a step's samples
  to train data: :func:`check_samples` and :func:`expand_samples`;
* :mod:`~r3_client.integrations.miles.rank` -- each training rank:
  :func:`install_rank_local` (``--custom-megatron-init-path``) makes miles' actor read
  its own slice of the routing replay (:func:`fetch_rank_replay`, keys
  :func:`rank_keys`).

The key is ``f"{run}.{sample.index}.{attempt}"``.  miles' ``reset_for_retry`` clears a
sample's tokens but keeps its ``index`` and ``routing_key``: regenerating from the
prompt under the old key would not extend the stored rollout (the engine refuses it,
409).  So the attempt, kept in ``sample.metadata["r3_attempt"]`` (:data:`ATTEMPT_KEY`),
moves on whenever a generation starts from no tokens, and stays when a partial rollout
resumes (tokens kept: the engine continues the stored rollout).  What slime and miles
share is :mod:`r3_client.integrations.samples`.  See docs/integrations.md.  Nothing here
imports miles; its functions are imported on the first call that needs them.
"""

from __future__ import annotations

from r3_client.integrations.miles.driver import check_samples, expand_samples
from r3_client.integrations.miles.rank import (
    RankReplay,
    SampleRank,
    check_miles_hooks,
    fetch_rank_replay,
    install_rank_local,
    rank_keys,
    rank_local_fill_replay_data,
    sample_rank,
)
from r3_client.integrations.miles.rollout import (
    ATTEMPT_KEY,
    check_stored,
    fill_routed_experts,
    rollout_key,
    wrap_generate,
)

__all__ = [
    "ATTEMPT_KEY",
    "RankReplay",
    "SampleRank",
    "check_miles_hooks",
    "check_samples",
    "check_stored",
    "expand_samples",
    "fetch_rank_replay",
    "fill_routed_experts",
    "install_rank_local",
    "rank_keys",
    "rank_local_fill_replay_data",
    "rollout_key",
    "sample_rank",
    "wrap_generate",
]
