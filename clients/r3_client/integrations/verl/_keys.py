"""The ``non_tensor_batch`` keys the three sides share: each sample's rollout id (the rollout
side puts it in ``extra_fields``, the driver and the training workers read it), and an
expanded batch's row states (the driver writes them, the workers read under them)."""

from __future__ import annotations

#: The ``extra_fields`` key (so ``non_tensor_batch`` key) holding each sample's rollout id.
ROLLOUT_ID_KEY = "r3_rollout_id"
#: An expanded batch's key (:func:`~r3_client.integrations.verl.expand_verl_batch`): each
#: row's routing state, the first row of the state it replays.
STATE_KEY = "r3_state"
