"""What every process of slime and miles knows of a ``Sample``: its framework, its key, its state.

A :class:`Framework` names what the three sides share (the rollout side keys a sample,
the driver checks and expands the step's samples, each training rank rebuilds the keys
from ``sample_indices``); :func:`sample_key` reads the key a sample was generated under,
:func:`sample_states` the state an expanded copy replays.  Imported by the rollout, the
driver and the rank modules alike; it reads nothing from the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from r3_client._exceptions import InvalidRequestError, R3Error
from r3_client._routing import check_rollout_id

#: Where an expanded sample records the state it replays (``Sample.metadata``, a dict in
#: both: slime ``utils/types.py:142``, miles ``utils/types.py:69``).
STATE_KEY = "r3_state"


@dataclass(frozen=True)
class Framework:
    """What differs between slime and miles on every side: the name errors give, the
    ``Sample`` attribute sent as ``X-SMG-Routing-Key``, and the rank-local key a training
    rank rebuilds from ``(run, Sample.index)``."""

    name: str
    key_field: str
    index_key: Callable[[str, int], str]

    def rank_keys(self, run: str, sample_indices: Sequence[int]) -> list[str]:
        """The rollout keys of a training rank's samples, from the ``sample_indices`` the
        trainer ships to every DP rank (slime ``ray/rollout.py:665,786-807``; miles
        ``ray/rollout/train_data_conversion.py:81,349-381``): what ``wrap_generate(...,
        fill=False)`` keyed them with."""
        return [self.index_key(run, int(i)) for i in sample_indices]


def sample_key(fw: Framework, sample: Any) -> str:
    """The rollout key ``sample`` was generated under; InvalidRequestError when it has none."""
    key = getattr(sample, fw.key_field, None)
    if not key:
        raise InvalidRequestError(
            f"{fw.name} sample (index={getattr(sample, 'index', '?')}) has no {fw.key_field}: "
            f"it was not generated under a rollout key (r3_client.integrations.{fw.name}."
            "wrap_generate sets it)"
        )
    return check_rollout_id(key)


def sample_states(samples: Sequence[Any]) -> list[int | None]:
    """The state each sample records (``metadata[STATE_KEY]``, set by ``expand_samples``;
    ``None`` for a sample that was not cut)."""
    out: list[int | None] = []
    for s in samples:
        meta = getattr(s, "metadata", None)
        state = meta.get(STATE_KEY) if isinstance(meta, dict) else None
        out.append(None if state is None else int(state))
    return out


def said_of(fw: Framework, exc: R3Error) -> R3Error:
    """``exc`` said of the framework's samples (each key names its ``Sample.index``)."""
    return type(exc)(f"{fw.name} rank-local routing: {exc}")
