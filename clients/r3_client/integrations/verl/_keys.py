"""The ``non_tensor_batch`` key of each sample's rollout id, shared by the rollout side (which
puts it in ``extra_fields``), the driver and the training workers (which read it)."""

from __future__ import annotations

#: The ``extra_fields`` key (so ``non_tensor_batch`` key) holding each sample's rollout id.
ROLLOUT_ID_KEY = "r3_rollout_id"
