"""slime (THUDM/slime @ 624b824): rollouts keyed per ``Sample``, routing fetched into it.

One module per slime process, as slime runs them:

* :mod:`~r3_client.integrations.slime.rollout` -- the rollout process: use
  :func:`wrap_generate` as slime's ``--custom-generate-function-path`` (with
  ``--router-policy consistent_hashing``, under which slime sends ``sample.session_id``
  as ``X-SMG-Routing-Key``)::

      # my_r3.py
      generate_r3 = wrap_generate(run="grpo-0412-r2", client=AsyncRoutingClient(url),
                                  num_layers=args_num_layers)

  or, in a generate function of your own, :func:`rollout_key` before the call and
  :func:`fill_routed_experts` after it (:func:`check_stored` on the rank-local path);
* :mod:`~r3_client.integrations.slime.driver` -- before slime converts a step's samples
  to train data: :func:`check_samples`, :func:`expand_samples` (one ``Sample`` per
  routing state) and :func:`normalize_rewards` (slime's reward normalization counting
  each rollout once);
* :mod:`~r3_client.integrations.slime.rank` -- each training rank:
  :func:`install_rank_local` (``--custom-megatron-init-path``) makes slime's actor read
  its own slice of the routing replay (:func:`fetch_rank_replay`, keys
  :func:`rank_keys`).

The key is ``f"{run}.{sample.index}"``: slime numbers every copy of a prompt (group
siblings differ) and resubmits the same ``Sample`` when a partial rollout resumes (the
key is kept, the engine continues the stored rollout).  ``run`` must be unique per
training run *and* per restart, since slime restores its index counter from the last
checkpoint.  What slime and miles share is :mod:`r3_client.integrations.samples`.  See
docs/integrations.md.  Nothing here imports slime; its functions are imported on the
first call that needs them.
"""

from __future__ import annotations

from r3_client.integrations.slime.driver import check_samples, expand_samples, normalize_rewards
from r3_client.integrations.slime.rank import (
    RankReplay,
    SampleRank,
    check_slime_hooks,
    fetch_rank_replay,
    install_rank_local,
    rank_keys,
    rank_local_fill_routing_replay,
    sample_rank,
)
from r3_client.integrations.slime.rollout import (
    check_stored,
    fill_routed_experts,
    rollout_key,
    wrap_generate,
)

__all__ = [
    "RankReplay",
    "SampleRank",
    "check_samples",
    "check_slime_hooks",
    "check_stored",
    "expand_samples",
    "fetch_rank_replay",
    "fill_routed_experts",
    "install_rank_local",
    "normalize_rewards",
    "rank_keys",
    "rank_local_fill_routing_replay",
    "rollout_key",
    "sample_rank",
    "wrap_generate",
]
