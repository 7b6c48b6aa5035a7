"""miles' rollout side: its custom generate function keys each generation, fills the ``Sample``.

Runs in miles' rollout process, where miles calls ``--custom-generate-function-path``
(a legacy ``(args, sample, sampling_params, evaluation)`` function,
``inference_rollout/compatibility.py:51-65``) once per sample.  :func:`wrap_generate` is
such a function (miles sends ``sample.routing_key`` as ``X-SMG-Routing-Key`` whenever it
is set, ``generate_endpoint_utils.py:42-49``), or, in a generate function of your own,
:func:`rollout_key` before the call and :func:`fill_routed_experts` (``miles_layout``,
int32) after it; on the rank-local path (``fill=False``) :func:`check_stored` only
checks that the rollout is stored.  miles' ``generate``
(``miles.rollout.sglang_rollout:generate``) is imported on the first call that needs it.
The calls are :class:`~r3_client.integrations.samples.rollout.SampleRollout`'s.
"""

from __future__ import annotations

from typing import Any

from r3_client._exceptions import InvalidRequestError
from r3_client.integrations.miles._keys import ATTEMPT_KEY, MILES, index_key, rollout_key
from r3_client.integrations.samples.rollout import SampleRollout
from r3_client.layouts import miles_layout

__all__ = ["ATTEMPT_KEY", "check_stored", "fill_routed_experts", "rollout_key", "wrap_generate"]


def _assign_key(run: str, sample: Any) -> str:
    sample.routing_key = rollout_key(run, sample)
    return str(sample.routing_key)


def _assign_rank_key(run: str, sample: Any) -> tuple[str, bool]:
    """Rank-local mode: ``f"{run}.{sample.index}.0"`` for every attempt, since a training
    rank sees ``sample_indices`` but not ``Sample.metadata`` (not among the fields miles
    ships per DP rank, ``train_data_conversion.py:349-381``).  A generation that starts
    from no tokens after an earlier attempt (``reset_for_retry``) is ``restarted``: the
    earlier attempt's rows are dropped before it runs."""
    if sample.index is None:
        raise InvalidRequestError("miles sample has no index: the data source numbers every sample")
    meta = sample.metadata
    restarted = ATTEMPT_KEY in meta and not sample.tokens
    meta[ATTEMPT_KEY] = 0
    sample.routing_key = index_key(run, int(sample.index))
    return str(sample.routing_key), restarted


def _check_args(args: Any) -> None:
    """Nothing to refuse: miles sends a set routing_key under every router policy
    (miles/rollout/generate_utils/generate_endpoint_utils.py:42-49)."""


_ROLLOUT = SampleRollout(
    MILES,
    generate_path="miles.rollout.sglang_rollout:generate",
    layout=miles_layout,
    assign_key=_assign_key,
    assign_rank_key=_assign_rank_key,
    check_args=_check_args,
)

fill_routed_experts = _ROLLOUT.fill_routed_experts
wrap_generate = _ROLLOUT.wrap_generate
check_stored = _ROLLOUT.check_stored
