"""slime's key scheme, which its rollout side sets and its training ranks rebuild.

``f"{run}.{sample.index}"``: slime numbers every copy of a prompt (group siblings differ)
and resubmits the same ``Sample`` when a partial rollout resumes (the key is kept, the
engine continues the stored rollout); a training rank sees ``sample_indices``
(``ray/rollout.py:665, 786-807``), so it rebuilds the same key.  ``run`` must be unique
per training run *and* per restart, since slime restores its index counter from the
last checkpoint.
"""

from __future__ import annotations

from typing import Any

from r3_client._exceptions import InvalidRequestError
from r3_client._routing import check_rollout_id
from r3_client.integrations.samples.framework import Framework


def rollout_key(run: str, sample: Any, conversation: int | None = None) -> str:
    """``f"{run}.{sample.index}"``, plus ``f".{conversation}"`` for a generate function
    that runs several conversations for one ``Sample``."""
    if sample.index is None:
        raise InvalidRequestError("slime sample has no index: the data source numbers every sample")
    key = f"{run}.{sample.index}" + ("" if conversation is None else f".{conversation}")
    return check_rollout_id(key)


def index_key(run: str, index: int) -> str:
    """The key of sample ``index`` of ``run``, as a training rank rebuilds it."""
    return check_rollout_id(f"{run}.{index}")


SLIME = Framework(name="slime", key_field="session_id", index_key=index_key)
