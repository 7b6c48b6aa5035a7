"""State expansion: one training sample per routing state, so every token replays its own routing.

When the engine recomputed positions of a rollout (a weight push flushed the radix cache
between turns, an eviction, a retraction, a resumed partial rollout), the tokens after
the recompute attended to other routing than the tokens before it (docs/store.md,
"Views").  A trainer replays one routing per sample per forward, so such a sample is
replayed right only if it is cut where its states change:

* state ``s`` of a sample covers rows ``[state, end)`` (:func:`r3_client._views.states_of`);
  its tokens ``state + 1 .. end`` took their log-probs from a forward that attended to
  rows ``[0, end)`` as that state holds them;
* the expanded training sample ``s`` is the original sample's first ``end + 1`` tokens
  (the last state: all of them), replayed under state ``s``
  (``get_ranges((rollout_id, a, b, state))``, ``fetch_*(view="exact", states=...)``), and
  its loss keeps only tokens ``state + 1 .. end`` (:meth:`SampleState.token_mask`).

Every token of the original sample is trained in exactly one expanded sample, so a loss
that sums (or averages) over tokens is unchanged; a sample without views is one state,
itself.  Per-sample quantities (advantages, group statistics, rewards, lengths) belong
to the original sample (:attr:`Expansion.origin`): compute them before expanding and
copy them with :meth:`Expansion.take`, and report metrics over originals
(:attr:`Expansion.first`).  docs/integrations.md ("Exact replay by state expansion")
says what each framework's glue does with this and which loss aggregations it refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._answers import RolloutInfo, ViewInfo
from r3_client._exceptions import R3Error, RolloutNotFoundError, ShapeError
from r3_client._routing import check_rollout_id
from r3_client._views import applicable_views, states_of

__all__ = [
    "Expansion",
    "SampleState",
    "applicable_views",
    "expand_infos",
    "expand_states",
    "rollout_states",
    "states_of",
]


@dataclass(frozen=True, slots=True)
class SampleState:
    """One training sample of an expanded step: the first ``num_tokens`` tokens of sample
    ``origin``, replayed under the rollout's state starting at row ``state`` (rows
    ``[0, end)`` with the views serving rows up to ``state`` applied), training tokens
    ``state + 1 .. num_tokens - 1`` only."""

    origin: int
    rollout_id: str
    state: int
    end: int
    num_tokens: int
    views: tuple[int, ...]  # the rows the applied views serve (empty: first computations)

    @property
    def first_token(self) -> int:
        """The first token this sample trains (``state + 1``; tokens before it are context)."""
        return self.state + 1

    def token_mask(self, length: int | None = None, *, offset: int = 0) -> npt.NDArray[np.bool_]:
        """A mask over ``length`` positions (default ``num_tokens``), True where this sample
        trains: tokens ``state + 1 .. num_tokens - 1``, the sample's token ``t`` at
        position ``t - offset`` (``offset``: tokens the caller's tensor leaves out in
        front, e.g. verl's ``response_mask`` starts at the prompt's length).  AND it with
        the framework's own mask (prompt tokens, padding)."""
        n = self.num_tokens - offset if length is None else length
        mask = np.zeros(max(0, n), dtype=bool)
        lo, hi = max(0, self.first_token - offset), min(n, self.num_tokens - offset)
        if lo < hi:
            mask[lo:hi] = True
        return mask


@dataclass(frozen=True)
class Expansion:
    """A step's samples expanded into one training sample per state, in order (each
    original's states consecutive)."""

    states: tuple[SampleState, ...]
    num_samples: int  # originals

    @property
    def origin(self) -> npt.NDArray[np.int64]:
        """For each expanded sample, the index of the original it was cut from."""
        return np.fromiter((s.origin for s in self.states), np.int64, len(self.states))

    @property
    def first(self) -> npt.NDArray[np.bool_]:
        """True on each original's first expanded sample: per-sample metrics and baselines
        computed over these count each original once."""
        return np.fromiter((s.state == 0 for s in self.states), bool, len(self.states))

    @property
    def state_rows(self) -> list[int]:
        """Each expanded sample's state (the ``states`` of ``fetch_*(view="exact")``)."""
        return [s.state for s in self.states]

    @property
    def num_tokens(self) -> npt.NDArray[np.int64]:
        """Each expanded sample's token count."""
        return np.fromiter((s.num_tokens for s in self.states), np.int64, len(self.states))

    @property
    def extra_samples(self) -> int:
        """Training samples added by the expansion."""
        return len(self.states) - self.num_samples

    @property
    def extra_tokens(self) -> int:
        """Tokens forwarded more than once: every state's tokens but each original's last
        (the one holding all its tokens)."""
        last: dict[int, int] = {}
        total = 0
        for s in self.states:
            total += s.num_tokens
            last[s.origin] = s.num_tokens
        return total - sum(last.values())

    def take(self, values: Any, axis: int = 0) -> Any:
        """``values`` (numpy array, torch tensor or list) of the originals, one entry per
        expanded sample: advantages, rewards, uids, group ids, copied, never recomputed."""
        idx = self.origin
        if isinstance(values, list | tuple):
            return [values[i] for i in idx]
        if hasattr(values, "index_select"):  # torch
            import torch

            return values.index_select(axis, torch.as_tensor(idx, device=values.device))
        return np.take(np.asarray(values), idx, axis=axis)

    def token_masks(self, length: int, *, offset: int = 0) -> npt.NDArray[np.bool_]:
        """``[len(states), length]``: each expanded sample's :meth:`SampleState.token_mask`."""
        out = np.zeros((len(self.states), length), dtype=bool)
        for i, s in enumerate(self.states):
            out[i] = s.token_mask(length, offset=offset)
        return out


def rollout_states(
    info: RolloutInfo, num_tokens: int
) -> list[tuple[int, int, tuple[ViewInfo, ...]]]:
    """The routing states ``(first row, end row, views applied)`` of a sample of
    ``num_tokens`` tokens whose rollout is ``info``: its rows are ``[0, num_tokens - 1)``,
    cut to what the rollout holds; a sample with no rows has the one state ``(0, 0, ())``."""
    rows = max(0, min(info.num_rows, int(num_tokens) - 1))
    if not rows:
        return [(0, 0, ())]
    return [(a, b, tuple(applied)) for a, b, applied in states_of(applicable_views(info), rows)]


def expand_infos(
    infos: Sequence[RolloutInfo], num_tokens: Sequence[int] | npt.ArrayLike
) -> Expansion:
    """The expansion of samples of ``num_tokens[i]`` tokens whose rollouts are ``infos[i]``
    (their stats: which views serve which rows).  A sample's rows are
    ``[0, num_tokens - 1)``, cut to what the rollout holds; views serving rows past them
    (a rollout longer than its sample) start no state of it."""
    counts = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    if counts.shape[0] != len(infos):
        raise ShapeError(f"{len(infos)} rollouts for {counts.shape[0]} token counts")
    out: list[SampleState] = []
    for i, (info, n) in enumerate(zip(infos, counts.tolist(), strict=True)):
        if n < 1:
            raise ShapeError(f"sample {i} (rollout {info.rollout_id!r}) has {n} tokens")
        rows = max(0, min(info.num_rows, n - 1))
        for a, b, applied in rollout_states(info, n):
            last = b >= rows
            out.append(
                SampleState(
                    i, info.rollout_id, a, b, n if last else b + 1, tuple(v.serves for v in applied)
                )
            )
    return Expansion(tuple(out), len(infos))


def stat_each(source: Any, rollout_ids: Sequence[str]) -> list[RolloutInfo | R3Error]:
    """Each rollout's stat as ``stat_many`` answers it: one batched call where ``source``
    has ``stat_many`` (a :class:`~r3_client.RoutingClient`), else one ``stat`` per id, a
    rollout the cache does not hold answered in its place by its
    :class:`~r3_client.RolloutNotFoundError` (any other error raises)."""
    many = getattr(source, "stat_many", None)
    if many is not None:
        return list(many(rollout_ids))
    got: list[RolloutInfo | R3Error] = []
    for rid in rollout_ids:
        try:
            got.append(source.stat(rid))
        except RolloutNotFoundError as exc:
            got.append(exc)
    return got


def expand_states(
    source: Any, rollout_ids: Sequence[str], num_tokens: Sequence[int] | npt.ArrayLike
) -> Expansion:
    """:func:`expand_infos` of the step's rollouts, stat'ed through ``source`` (:func:`stat_each`:
    a :class:`~r3_client.RoutingClient` answers one batched stat per 1,024 ids, anything
    with ``stat`` one per rollout).  Metadata only.  A rollout the cache does not hold
    raises :class:`~r3_client.RolloutNotFoundError` naming its sample."""
    ids = [check_rollout_id(r) for r in rollout_ids]
    infos: list[RolloutInfo] = []
    for i, (rid, info) in enumerate(zip(ids, stat_each(source, ids), strict=True)):
        if isinstance(info, RolloutNotFoundError):
            raise RolloutNotFoundError(f"sample {i} (rollout {rid!r}): {info}") from info
        if isinstance(info, R3Error):
            raise info
        infos.append(info)
    return expand_infos(infos, num_tokens)
