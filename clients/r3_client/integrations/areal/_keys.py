"""The batch columns AReaL's three processes share, and the rollout key they carry.

The rollout workers draw a key per sample (:func:`new_rollout_key`) and write it as the
per-token column ``r3_key``; the trainer reads it back to check and expand the step and
writes ``r3_state`` per token; each training rank reads both back from its micro-batch.
:func:`key_rollout_id` is the one rule from a key to the rollout id it is stored under.
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np

from r3_client._exceptions import ShapeError

#: The per-token batch column carrying each sample's rollout key (:func:`with_rollout_keys`).
KEY_FIELD = "r3_key"
#: The per-token column :func:`expand_areal_batch` adds: each expanded sample's state (its
#: first row), which :func:`areal_micro_batch` reads back on the ranks.
STATE_FIELD = "r3_state"

_KEY_LIMIT = 1 << 63


def new_rollout_key() -> int:
    """A fresh random rollout key: an int in ``[1, 2**63)`` (``0`` is AReaL's padding)."""
    return secrets.randbelow(_KEY_LIMIT - 1) + 1


def key_rollout_id(key: int | np.integer[Any]) -> str:
    """The rollout id stored under ``key``: ``"areal-"`` and 16 hex digits."""
    if isinstance(key, bool) or not isinstance(key, int | np.integer) or not 0 < key < _KEY_LIMIT:
        raise ShapeError(
            f"rollout key {key!r} is not an int in [1, 2**63): a sample without a key "
            f"(no {KEY_FIELD!r} column from with_rollout_keys, or a padding row)"
        )
    return f"areal-{int(key):016x}"
