"""slime's rollout side: its custom generate function keys each ``Sample``, fills its routing.

Runs in slime's rollout process (the ``RolloutManager``), where slime calls
``--custom-generate-function-path`` once per sample.  :func:`wrap_generate` is such a
function (with ``--router-policy consistent_hashing``, under which slime sends
``sample.session_id`` as ``X-SMG-Routing-Key``, ``sglang_rollout.py:196-200``), or, in
a generate function of your own, :func:`rollout_key` before the call and
:func:`fill_routed_experts` (``slime_layout``) after it; on the rank-local path
(``fill=False``) :func:`check_stored` only checks that the rollout is stored.  slime's
``generate`` (``slime.rollout.sglang_rollout:generate``) is imported on the first call
that needs it.  The calls are :class:`~r3_client.integrations.samples.rollout.SampleRollout`'s.
"""

from __future__ import annotations

from typing import Any

from r3_client._exceptions import InvalidRequestError
from r3_client.integrations.samples.rollout import SampleRollout
from r3_client.integrations.slime._keys import SLIME, rollout_key
from r3_client.layouts import slime_layout

__all__ = ["check_stored", "fill_routed_experts", "rollout_key", "wrap_generate"]


def _assign_key(run: str, sample: Any) -> str:
    sample.session_id = rollout_key(run, sample)
    return str(sample.session_id)


def _assign_rank_key(run: str, sample: Any) -> tuple[str, bool]:
    """Rank-local mode: the same key (a training rank rebuilds it from ``sample_indices``);
    slime resubmits the same ``Sample`` to resume, never restarts it from the prompt."""
    return _assign_key(run, sample), False


def _check_args(args: Any) -> None:
    policy = getattr(args, "router_policy", None)
    if policy != "consistent_hashing":
        raise InvalidRequestError(
            "slime sends sample.session_id as X-SMG-Routing-Key only with --router-policy "
            f"consistent_hashing (slime/rollout/sglang_rollout.py:196-200), got {policy!r}: "
            "without it the rollout key never reaches the engine and nothing is stored"
        )


_ROLLOUT = SampleRollout(
    SLIME,
    generate_path="slime.rollout.sglang_rollout:generate",
    layout=slime_layout,
    assign_key=_assign_key,
    assign_rank_key=_assign_rank_key,
    check_args=_check_args,
)

fill_routed_experts = _ROLLOUT.fill_routed_experts
wrap_generate = _ROLLOUT.wrap_generate
check_stored = _ROLLOUT.check_stored
