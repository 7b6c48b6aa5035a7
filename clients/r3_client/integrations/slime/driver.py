"""slime's driver side: a step's samples checked or expanded before they become train data.

Runs in slime's ``RolloutManager`` once a step's samples are generated and rewarded,
before ``_convert_samples_to_train_data`` ships them to the training ranks: e.g. at the
end of a ``--rollout-function-path`` function (returning each group as ``[[copies of
sample 0], [copies of sample 1], ...]``: slime flattens nested groups and checks that
siblings share ``rollout_id``, ``ray/rollout.py:595-604``) or in a
``--custom-convert-samples-to-train-data-path`` function.  :func:`check_samples` and
:func:`expand_samples` are :class:`~r3_client.integrations.samples.driver.SampleDriver`'s;
slime's own reward normalization reshapes by count (``ray/rollout.py:618-623``) and would
weigh an expansion's copies, so :func:`expand_samples` refuses it unless
:func:`normalize_rewards` is slime's ``--custom-reward-post-process-path``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from r3_client._exceptions import InvalidRequestError
from r3_client.integrations.samples.driver import SampleDriver
from r3_client.integrations.slime._keys import SLIME

__all__ = ["NORMALIZED", "check_samples", "expand_samples", "normalize_rewards"]

#: Estimators under which slime normalizes rewards per group (``ray/rollout.py:612-631``).
NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")


def _check_normalization(args: Any) -> None:
    """Refuse slime's count-reshaping reward normalization, which expanded samples break."""
    if (
        getattr(args, "advantage_estimator", None) in NORMALIZED
        and getattr(args, "rewards_normalization", False)
        and getattr(args, "custom_reward_post_process_path", None) is None
    ):
        raise InvalidRequestError(
            "slime normalizes rewards by reshaping them into groups of n_samples_per_prompt "
            "(slime/ray/rollout.py:618-623): expanded samples break that count and it falls "
            "back to one group of every copy.  Pass --custom-reward-post-process-path "
            "r3_client.integrations.slime.normalize_rewards (each original counted once)"
        )


_DRIVER = SampleDriver(SLIME, check_args=_check_normalization)

check_samples = _DRIVER.check_samples
expand_samples = _DRIVER.expand_samples


def _rollout_groups(args: Any, samples: Sequence[Any]) -> tuple[dict[Any, list[int]], int]:
    """Each rollout's samples (``rollout_id``, else ``index``; in order of their first
    sample) and slime's group size: ``n_samples_per_prompt`` consecutive rollouts when
    there are ``n_samples_per_prompt * rollout_batch_size`` of them, else all of them."""
    rollouts: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        rid = s.rollout_id if getattr(s, "rollout_id", None) is not None else s.index
        rollouts.setdefault(("row", i) if rid is None else rid, []).append(i)
    n = int(args.n_samples_per_prompt)
    if len(rollouts) != n * int(args.rollout_batch_size):
        n = len(rollouts)  # slime: "when samples count are not equal in each group", one group
    return rollouts, n


def normalize_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[Any], list[float]]:
    """slime's ``_post_process_rewards`` (``ray/rollout.py:608-633``) counting each rollout
    once: usable as ``--custom-reward-post-process-path
    r3_client.integrations.slime.normalize_rewards`` (called as ``f(args, samples)``,
    ``:609-610``).  Returns ``(raw_rewards, rewards)``, one each per sample.

    Under ``rewards_normalization`` with ``advantage_estimator`` in ``grpo``, ``gspo``,
    ``cispo``, ``reinforce_plus_plus_baseline``, slime's grouping applied to rollouts
    instead of samples: each rollout (``rollout_id``, else ``index``) counts once with its
    reward (its samples must share it); ``n_samples_per_prompt`` consecutive rollouts form
    a group when there are ``n_samples_per_prompt * rollout_batch_size`` of them, else
    all form one (``:619-623``); centred on the group's mean and, for ``grpo`` / ``gspo`` /
    ``cispo`` with ``grpo_std_normalization``, divided by ``std + 1e-6`` (unbiased, as
    ``torch.std``, ``:624-629``); every sample of a rollout gets its rollout's value.  On
    samples that were not expanded this is slime's own result.  Otherwise the raw
    rewards, as slime.
    """
    key = getattr(args, "reward_key", None)
    raw = [s.reward if not key else s.reward[key] for s in samples]
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in NORMALIZED or not getattr(args, "rewards_normalization", False):
        return raw, list(raw)
    rollouts, n = _rollout_groups(args, samples)
    order = list(rollouts)
    out = [0.0] * len(samples)
    use_std = estimator in ("grpo", "gspo", "cispo") and getattr(
        args, "grpo_std_normalization", False
    )
    for group in (order[i : i + n] for i in range(0, len(order), n)):
        shared = []
        for rid in group:
            values = [raw[i] for i in rollouts[rid]]
            if any(v != values[0] for v in values[1:]):
                raise InvalidRequestError(
                    f"slime rollout {rid!r}: its samples {rollouts[rid]} must share one reward, "
                    f"got {values}"
                )
            shared.append(values[0])
        r = np.asarray(shared, dtype=np.float32)
        r = r - r.mean(dtype=np.float32)
        if use_std:
            std = r.std(ddof=1, dtype=np.float32) if r.size > 1 else np.float32(np.nan)
            r = r / (std + np.float32(1e-6))
        for rid, value in zip(group, r.tolist(), strict=True):
            for i in rollouts[rid]:
                out[i] = float(value)
    return raw, out
