"""miles' driver side: a step's samples checked or expanded before they become train data.

Runs in miles' rollout manager once a step's samples are generated and rewarded, before
``train_data_conversion`` ships them to the training ranks.  :func:`check_samples` and
:func:`expand_samples` are :class:`~r3_client.integrations.samples.driver.SampleDriver`'s,
with nothing of miles' own to refuse: its reward normalization already counts each
rollout once (one shared reward per ``rollout_id`` / ``index`` in each ``group_index``
group, ``ray/rollout/train_data_conversion.py:172-254``; ``group_index`` set, as miles'
data source sets it, else it falls back to counting samples, ``:196-204``), and its loss
divides by per-rollout mask sums (``:101, 162-169``;
``backends/training_utils/loss_hub/losses.py:264-272``), so the copies train what the
original did.  Not with multi-LoRA's ``prompt_group_sizes``, which count samples
(``:174-186``).
"""

from __future__ import annotations

from r3_client.integrations.miles._keys import MILES
from r3_client.integrations.samples.driver import SampleDriver

__all__ = ["check_samples", "expand_samples"]

_DRIVER = SampleDriver(MILES)

check_samples = _DRIVER.check_samples
expand_samples = _DRIVER.expand_samples
