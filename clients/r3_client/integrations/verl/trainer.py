"""verl's own ``RayPPOTrainer.fit`` replaying every token in its routing state (``exact``).

``fit`` builds, scores and trains its batch in one method (``ray_trainer.py:1405-1720``):
balance, reward, ``_compute_old_log_prob``, ``_compute_ref_log_prob``, the module-level
``compute_advantage``, ``_update_actor``.  There is no hook between the reward and the
first forward, but the forwards and the update are methods, so :class:`ExactReplayTrainer`
(a mixin put before ``RayPPOTrainer``) expands the batch inside them and nowhere else:

* ``_compute_old_log_prob`` / ``_compute_ref_log_prob``: the batch is expanded (one row per
  routing state, :func:`~r3_client.integrations.verl.expand_verl_batch`), verl's own method
  forwards it (each row replays its state on the ranks: :class:`RankLocalReplay` reads
  ``r3_state``), and each token's log-prob (and entropy) comes back to the original row
  from the state that served it (:func:`gather_by_state`).  ``fit`` goes on with the
  original batch: its rewards, its metrics and verl's ``compute_advantage`` (GRPO's ``uid``
  groups, RLOO's baselines) see every sample once;
* ``_update_actor``: the batch, now holding advantages and the per-token log-probs of each
  token's own state, is expanded again and arranged so that every optimizer step trains
  the states of exactly the samples verl would have put in that step on each data-parallel
  rank (:func:`arrange_mini_batches`); verl's own method trains it.

So every token is trained once, with the routing it was sampled under, in the same
optimizer step as without expansion; the cost is the extra rows' forwards.  Accepted:
``loss_agg_mode`` ``token-mean`` (verl's default) and ``token-sum``; refused
(:class:`~r3_client.InvalidRequestError`): the sequence-level aggregations and losses of
:func:`~r3_client.integrations.verl.check_expansion_modes`, and ``seq-mean-token-sum(-norm)``
here (verl divides it by the mini-batch's row count, which the arrangement changes).  The
critic (``_compute_values``, ``_update_critic``) is left as verl runs it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY
from r3_client.integrations.verl.driver import ORIGIN_KEY, expand_verl_batch
from r3_client.rank_local import StatsInHand, StatSource

__all__ = ["ExactReplayTrainer", "arrange_mini_batches", "gather_by_state"]

#: ``loss_agg_mode``\\ s whose per-step loss the arrangement leaves unchanged.
_STEP_EXACT = ("token-mean", "token-sum")


def _origins(expanded: Any) -> np.ndarray:
    return np.asarray(expanded.non_tensor_batch[ORIGIN_KEY], dtype=np.int64)


def gather_by_state(values: Any, expanded: Any, num_samples: int) -> Any:
    """A ``DataProto`` of per-response-token values computed on an expanded batch
    (``old_log_probs``, ``entropys``, ``ref_log_prob``: ``[rows, response_len]``) brought
    back to the ``num_samples`` originals: each token's value from the row of the state that
    trained it (``expanded.batch["response_mask"]``), the other tokens' (prompt-side,
    masked, padding) from the original's last state.  Values of another shape are refused
    (:class:`~r3_client.ShapeError`): an expanded row's value is not the original's."""
    import torch
    from verl.protocol import DataProto

    origin = _origins(expanded)
    rows = int(origin.shape[0])
    last: dict[int, int] = {}
    for j, i in enumerate(origin.tolist()):
        if i >= 0:
            last[i] = j
    if sorted(last) != list(range(num_samples)):
        raise ShapeError(f"the expanded batch covers samples {sorted(last)}, not {num_samples}")
    mask = expanded.batch["response_mask"].bool()
    index = torch.as_tensor([last[i] for i in range(num_samples)], device=mask.device)
    out: dict[str, Any] = {}
    for key in values.batch.keys():  # noqa: SIM118 (a TensorDict)
        value = values.batch[key]
        if value.dim() != 2 or tuple(value.shape) != (rows, mask.shape[1]):
            raise ShapeError(
                f"{key!r} has shape {tuple(value.shape)}, not the expanded batch's "
                f"[{rows}, {mask.shape[1]}] response tokens: it cannot be brought back per token"
            )
        merged = value.index_select(0, index).clone()
        for j, i in enumerate(origin.tolist()):
            if i >= 0:
                merged[i][mask[j]] = value[j][mask[j]]
        out[key] = merged
    return DataProto.from_dict(tensors=out, meta_info=dict(values.meta_info or {}))


def arrange_mini_batches(
    expanded: Any, num_samples: int, *, dp_size: int, mini_batch_size: int, row_multiple: int = 1
) -> tuple[Any, int]:
    """An expanded batch reordered and padded so that verl's update trains, in each optimizer
    step and on each data-parallel rank, the states of exactly the original samples it would
    have trained there; and the rows of one step (the ``global_batch_size`` to give verl).

    verl dispatches a batch to its ``dp_size`` ranks in equal contiguous chunks and each rank
    cuts its chunk into mini-batches of ``mini_batch_size / dp_size`` rows
    (``engine_workers.py:243-289``, unshuffled): original samples ``r * B/dp + g * G ..
    + G`` (``G = mini_batch_size / dp_size``) form rank ``r``'s part of step ``g``.  Here each
    such cell's states are placed at rank ``r``'s step ``g`` and padded to ``c`` rows (the
    largest cell, rounded up so that ``c * dp_size`` is a multiple of ``row_multiple``) with
    copies of the cell's last row that train nothing (``response_mask`` 0, ``r3_origin``
    -1).  Returns ``(batch, c * dp_size)``.
    """
    if mini_batch_size % dp_size or num_samples % mini_batch_size:
        raise ShapeError(
            f"{num_samples} samples in mini-batches of {mini_batch_size} over {dp_size} "
            "data-parallel ranks: verl needs both to divide"
        )
    origin = _origins(expanded)
    per_rank, cell = num_samples // dp_size, mini_batch_size // dp_size
    steps = per_rank // cell
    by_cell: dict[tuple[int, int], list[int]] = {}
    for j, i in enumerate(origin.tolist()):
        if i >= 0:
            by_cell.setdefault((i // per_rank, (i % per_rank) // cell), []).append(j)
    width = max(len(v) for v in by_cell.values())
    step = row_multiple // math.gcd(row_multiple, dp_size)  # c * dp_size % row_multiple == 0
    width = -(-width // step) * step
    order: list[int] = []
    pads: list[int] = []
    for r in range(dp_size):
        for g in range(steps):
            rows = by_cell[(r, g)]
            order.extend(rows)
            pads.extend(range(len(order), len(order) + width - len(rows)))
            order.extend([rows[-1]] * (width - len(rows)))
    out = expanded.select_idxs(np.asarray(order, dtype=np.int64))
    if pads:
        at = np.asarray(pads, dtype=np.int64)
        out.batch["response_mask"][at] = 0
        out.non_tensor_batch[ORIGIN_KEY][at] = -1
    return out, width * dp_size


class ExactReplayTrainer:
    """Mixin for verl's ``RayPPOTrainer`` (put it first) that trains every token with the
    routing state it was sampled under (module docstring)::

        class Trainer(ExactReplayTrainer, RayPPOTrainer): ...
        trainer = Trainer(config, ...)
        trainer.r3_source = RoutingClient(cache_url, api_key=key)  # stats only
        trainer.fit()

    with the rank-local replay on the workers (:class:`RankLocalReplay`, ``view="exact"``).
    One batched stat per step (cached for the step's methods), no rows on the driver.
    """

    r3_source: StatSource | None = None
    _r3_stats: tuple[tuple[str, ...], StatsInHand] | None = None

    def _r3_stat_source(self, batch: Any) -> StatsInHand:
        if self.r3_source is None:
            raise InvalidRequestError(
                "ExactReplayTrainer needs trainer.r3_source (a RoutingClient) before fit()"
            )
        ids = tuple(str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY])
        if self._r3_stats is None or self._r3_stats[0] != ids:
            many = getattr(self.r3_source, "stat_many", None)
            got = list(many(list(ids))) if many is not None else None
            if got is None:
                raise InvalidRequestError("r3_source answers no batched stat (stat_many)")
            self._r3_stats = (ids, StatsInHand(dict(zip(ids, got, strict=True))))
        return self._r3_stats[1]

    def _r3_expand(self, batch: Any, divisor: int = 1) -> Any:
        actor = self.config.actor_rollout_ref.actor  # type: ignore[attr-defined]
        return expand_verl_batch(
            batch,
            self._r3_stat_source(batch),
            loss_agg_mode=actor.loss_agg_mode,
            policy_loss_mode=actor.policy_loss.loss_mode,
            divisor=divisor,
        )

    def _r3_dp_size(self) -> int:
        return int(self._get_dp_size(self.actor_rollout_wg, "actor"))  # type: ignore[attr-defined]

    def _compute_old_log_prob(self, batch: Any) -> Any:
        """verl's, on the expanded batch; each token's log-prob and entropy from its state."""
        expanded = self._r3_expand(batch, self._r3_dp_size())
        out, mfu = super()._compute_old_log_prob(expanded)  # type: ignore[misc]
        if "routed_experts" in out.batch.keys():  # noqa: SIM118
            raise InvalidRequestError(
                "router_replay.mode='R2' records routing in compute_log_prob: R3's exact "
                "replay replays the rollout's routing instead; use one of them"
            )
        return gather_by_state(out, expanded, len(batch)), mfu

    def _compute_ref_log_prob(self, batch: Any) -> Any:
        """verl's, on the expanded batch; each token's reference log-prob from its state."""
        expanded = self._r3_expand(batch, self._r3_dp_size())
        out = super()._compute_ref_log_prob(expanded)  # type: ignore[misc]
        return gather_by_state(out, expanded, len(batch))

    def _update_actor(self, batch: Any) -> Any:
        """verl's, on the expanded batch arranged step by step (:func:`arrange_mini_batches`)."""
        config = self.config.actor_rollout_ref  # type: ignore[attr-defined]
        mode = config.actor.loss_agg_mode
        if mode not in _STEP_EXACT:
            raise InvalidRequestError(
                f"ExactReplayTrainer: loss_agg_mode={mode!r} is divided by the mini-batch's "
                "row count, which expansion changes: use token-mean or token-sum, or expand "
                "in your own loop (expand_verl_batch) with one mini-batch per step"
            )
        n = int(config.rollout.n)
        expanded = self._r3_expand(batch)
        arranged, rows = arrange_mini_batches(
            expanded,
            len(batch),
            dp_size=self._r3_dp_size(),
            mini_batch_size=int(config.actor.ppo_mini_batch_size) * n,
            row_multiple=n,
        )
        before = config.actor.ppo_mini_batch_size
        config.actor.ppo_mini_batch_size = rows // n  # verl multiplies it by n again
        try:
            return super()._update_actor(arranged)  # type: ignore[misc]
        finally:
            config.actor.ppo_mini_batch_size = before
