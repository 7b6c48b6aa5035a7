"""A verl training batch as the driver reads it: each sample's rollout id, its lengths and
tokens, and the step check of the batch.

Runs in the driver (trainer) process, on the ``DataProto`` the rollout returned; shared by
the whole-step fetch and the rank-local check (:mod:`~r3_client.integrations.verl.driver`)
and the exact path's state expansion (:mod:`~r3_client.integrations.verl.exact`).  verl
left-pads each sample's prompt to ``prompts.shape[1]`` and right-pads its response to
``responses.shape[1]``; ``attention_mask`` says which tokens are the sample's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._routing import check_rollout_id
from r3_client._step_check import StatsInHand, StatSource, StepCheck, check_step
from r3_client._views import ViewPolicy
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY, STATE_KEY
from r3_client.layouts import Missing

__all__ = [
    "ORIGIN_KEY",
    "BatchLengths",
    "batch_lengths",
    "batch_rollout_ids",
    "check_batch",
    "stats_in_hand",
]

#: The ``non_tensor_batch`` key of an expanded batch's rows' original samples (``-1`` for
#: the rows added to keep the batch divisible); each row's state is under ``STATE_KEY``.
ORIGIN_KEY = "r3_origin"


@dataclass(frozen=True)
class BatchLengths:
    """A verl batch's padded widths (``prompt_len``, ``response_len``) and each sample's
    prompt and response tokens (``prompts[i]``, ``responses[i]``)."""

    prompt_len: int
    response_len: int
    prompts: list[int]
    responses: list[int]

    @property
    def counts(self) -> list[int]:
        """Each sample's tokens."""
        return [p + r for p, r in zip(self.prompts, self.responses, strict=True)]

    def tokens(self, input_ids: Any, i: int) -> Any:
        """Sample ``i``'s token ids (its prompt and response) in ``input_ids`` (an array of
        the batch's ``input_ids``)."""
        return input_ids[i, self.prompt_len - self.prompts[i] : self.prompt_len + self.responses[i]]


def batch_lengths(data: Any) -> BatchLengths:
    """The lengths of ``data``'s samples, from ``attention_mask``."""
    mask = data.batch["attention_mask"]
    plen = int(data.batch["prompts"].shape[1])
    return BatchLengths(
        prompt_len=plen,
        response_len=int(data.batch["responses"].shape[1]),
        prompts=mask[:, :plen].sum(dim=1).tolist(),
        responses=mask[:, plen:].sum(dim=1).tolist(),
    )


def batch_rollout_ids(data: Any, rollout_ids: Sequence[str] | None) -> list[str]:
    """Each sample's rollout id (``rollout_ids``, default
    ``non_tensor_batch["r3_rollout_id"]``), checked: one per sample, each tagged by a routed
    agent loop, none naming two samples (an expanded batch names a rollout once per state;
    its padding rows repeat one)."""
    n = len(data.batch["attention_mask"])
    if rollout_ids is None:
        stored = data.non_tensor_batch.get(ROLLOUT_ID_KEY)
        if stored is None:
            raise InvalidRequestError(
                f"the batch has no non_tensor_batch[{ROLLOUT_ID_KEY!r}]: its agent loops are "
                "not routed (r3_client.integrations.verl.routed_agent_loop); pass rollout_ids"
            )
        rollout_ids = list(stored)
    ids = list(rollout_ids)
    if len(ids) != n:
        raise ShapeError(f"{len(ids)} rollout ids for a batch of {n} samples")
    # An expanded batch (expand_verl_batch) holds a rollout once per state, and its padding
    # rows (origin -1) repeat one: a rollout id and state name one row.
    states = data.non_tensor_batch.get(STATE_KEY)
    origins = data.non_tensor_batch.get(ORIGIN_KEY)
    first: dict[tuple[str, int], int] = {}
    for i, key in enumerate(ids):
        if not key:
            raise InvalidRequestError(
                f"verl sample {i} has no rollout id: its agent loop is not routed "
                "(r3_client.integrations.verl.routed_agent_loop)"
            )
        check_rollout_id(key)
        if origins is not None and int(origins[i]) < 0:
            continue
        tag = (key, 0 if states is None else int(states[i]))
        if tag in first:
            raise InvalidRequestError(f"verl samples {first[tag]} and {i} share rollout id {key!r}")
        first[tag] = i
    return ids


def stats_in_hand(source: object, ids: Sequence[str]) -> StatsInHand | None:
    """``source``'s stats of ``ids`` by one batched stat (``stat_many``), in hand for every
    check of the step; None for a source without one."""
    many = getattr(source, "stat_many", None)
    if many is None:
        return None
    return StatsInHand(dict(zip(ids, many(list(ids)), strict=True)))


def check_batch(
    data: Any,
    source: StatSource,
    ids: list[str],
    missing: Missing,
    view: ViewPolicy,
    *,
    count: bool = True,
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on a verl batch: its samples' token counts
    and tokens from ``attention_mask`` and ``input_ids``, more rows allowed only where verl
    cut the response (as :func:`~r3_client.integrations.verl.attach_routed_experts` fits
    them)."""
    lengths = batch_lengths(data)
    input_ids = data.batch["input_ids"].cpu().numpy()
    tokens = [lengths.tokens(input_ids, i) for i in range(len(lengths.prompts))]
    return check_step(
        source,
        ids,
        [len(t) for t in tokens],
        missing=missing,
        tokens=tokens,
        longer=[int(r) >= lengths.response_len for r in lengths.responses],
        view=view,
        count=count,
    )
