"""miles' key scheme: an attempt per generation from the prompt, or one key per sample rank-locally.

``f"{run}.{sample.index}.{attempt}"``.  miles' ``reset_for_retry`` clears a sample's
tokens but keeps its ``index`` and ``routing_key``: regenerating from the prompt under
the old key would not extend the stored rollout (the engine refuses it, 409).  So the
attempt, kept in ``sample.metadata["r3_attempt"]``, moves on whenever a generation starts
from no tokens, and stays when a partial rollout resumes (tokens kept: the engine
continues the stored rollout).  A training rank sees ``sample_indices`` but not
``Sample.metadata`` (``train_data_conversion.py:349-381``): on the rank-local path every
attempt is keyed ``f"{run}.{sample.index}.0"`` (:func:`index_key`), the rollout side
dropping an earlier attempt's rows before a new one runs.
"""

from __future__ import annotations

from typing import Any

from r3_client._exceptions import InvalidRequestError
from r3_client._routing import check_rollout_id
from r3_client.integrations.samples.framework import Framework

#: Where the attempt counter lives in ``Sample.metadata``.
ATTEMPT_KEY = "r3_attempt"


def rollout_key(run: str, sample: Any) -> str:
    """The key of the generation about to start: ``f"{run}.{sample.index}.{attempt}"``.

    Call it once per generate call, before it: a sample with no tokens starts a new
    attempt (counted in ``sample.metadata``), one with tokens (a partial rollout
    resuming) keeps its attempt.
    """
    if sample.index is None:
        raise InvalidRequestError("miles sample has no index: the data source numbers every sample")
    meta = sample.metadata
    if ATTEMPT_KEY not in meta or not sample.tokens:
        meta[ATTEMPT_KEY] = int(meta.get(ATTEMPT_KEY, -1)) + 1
    return check_rollout_id(f"{run}.{sample.index}.{meta[ATTEMPT_KEY]}")


def index_key(run: str, index: int) -> str:
    """The rank-local key of sample ``index`` of ``run``, every attempt's."""
    return check_rollout_id(f"{run}.{index}.0")


MILES = Framework(name="miles", key_field="routing_key", index_key=index_key)
