"""verl's exact path on the driver (the trainer process): one training row per routing state.

A sample whose tokens attended to several routing states (views: positions the engine
computed again) is replayed exactly by cutting it into one row per state
(:func:`expand_verl_batch`, one batched stat, no rows); each rank then replays each row
under its own state (:class:`~r3_client.integrations.verl.RankLocalReplay` reads
``r3_state``).  Used in the trainer's own loop (:func:`check_expansion_modes`,
:func:`expand_verl_batch`, :func:`advantages_by_origin`), or inside verl's own
``RayPPOTrainer.fit`` (:class:`ExactReplayTrainer`, with :func:`gather_by_state` and
:func:`arrange_mini_batches`).  Nothing here imports verl or torch at module level.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from r3_client._exceptions import InvalidRequestError, R3Error, ShapeError
from r3_client._step_check import StatsInHand, StatSource
from r3_client.expansion import SampleState, expand_states
from r3_client.integrations.verl._batch import (
    ORIGIN_KEY,
    BatchLengths,
    batch_lengths,
    batch_rollout_ids,
    check_batch,
    stats_in_hand,
)
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY, STATE_KEY

__all__ = [
    "FULL_MASK_KEY",
    "ExactReplayTrainer",
    "advantages_by_origin",
    "arrange_mini_batches",
    "check_expansion_modes",
    "expand_verl_batch",
    "gather_by_state",
]

# The logger keeps the name it had when this lived in driver.py: operators filter on it.
_log = logging.getLogger("r3_client.integrations.verl.driver")

#: The batch key holding each row's original ``response_mask`` (before the state's cut),
#: which :func:`advantages_by_origin` computes advantages with.
FULL_MASK_KEY = "r3_full_response_mask"

# verl 0.9.1's loss aggregations and policy losses that are sums of per-token terms (each
# token trained once in an expanded batch: the same loss) and those that are not.
_TOKEN_AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_SEQUENCE_LOSSES = {
    "gspo": "a sequence-level importance ratio (core_algos.py:1545, the mean log-ratio of the "
    "sequence's tokens)",
    "sapo": "its loss aggregated seq-mean-token-mean whatever loss_agg_mode says "
    "(core_algos.py:1622)",
    "geo_mean": "a sequence-level geometric-mean ratio and advantage (core_algos.py:1928)",
}


def check_expansion_modes(loss_agg_mode: str, policy_loss_mode: str = "vanilla") -> None:
    """Refuse (:class:`~r3_client.InvalidRequestError`) verl loss settings under which an
    expanded batch does not train the loss of the original one.

    An expanded batch trains each token once, in the sample of its own routing state, so
    a loss that adds per-token terms is unchanged: ``token-mean`` and ``token-sum``, and
    ``seq-mean-token-sum(-norm)`` under verl's trainer, which divides by the mini-batch's
    configured size (``global_batch_size=ppo_mini_batch_size``, ``ray_trainer.py:1362``)
    rather than by the rows it holds.  ``seq-mean-token-mean`` averages within each
    sequence first, so a sample cut into states would weigh each part as a sequence; the
    ``gspo``, ``sapo`` and ``geo_mean`` policy losses take sequence-level statistics of
    the tokens trained together.  Those are refused under ``exact``: name ``view="latest"``
    (or ``"generated"``) to replay one routing per sample (the pre-dispatch check counts
    the tokens replayed off their own state), or use a token-level aggregation.
    """
    if loss_agg_mode not in _TOKEN_AGG:
        raise InvalidRequestError(
            f"verl loss_agg_mode={loss_agg_mode!r} is not a sum of per-token terms: a sample "
            "expanded into one training sample per routing state (view='exact') would be "
            f"weighed as several sequences. Use one of {', '.join(_TOKEN_AGG)}, or replay one "
            "routing per sample with view='latest' or 'generated' (its off-state tokens are "
            "counted by the pre-dispatch check)"
        )
    why = _SEQUENCE_LOSSES.get(policy_loss_mode)
    if why is not None:
        raise InvalidRequestError(
            f"verl policy_loss.loss_mode={policy_loss_mode!r} takes {why}: a sample expanded "
            "into one training sample per routing state (view='exact') would change it. Use a "
            "token-level policy loss (vanilla, dppo_tv, dppo_kl, gpg, clip_cov, kl_cov, dro, "
            "cispo), or replay one routing per sample with view='latest' or 'generated'"
        )


def expand_verl_batch(
    data: Any,
    source: StatSource,
    rollout_ids: Sequence[str] | None = None,
    *,
    loss_agg_mode: str = "token-mean",
    policy_loss_mode: str = "vanilla",
    divisor: int = 1,
    count: bool = True,
) -> Any:
    """A verl ``DataProto`` with one row per routing state of each sample (``exact``).

    Call it on the driver where the training batch is complete (its rewards computed, the
    rollout's per-sample fields set) and before ``compute_log_prob``: every later stage
    (old and reference log-probs, values, advantages through :func:`advantages_by_origin`,
    the update) then runs on the expanded batch, and each rank reads each row under its
    state (:class:`~r3_client.integrations.verl.RankLocalReplay` reads
    ``non_tensor_batch["r3_state"]``; or :func:`attach_routed_experts` on the expanded
    batch).  One batched stat (:func:`r3_client.expand_states`), no rows.

    Row ``j``, state ``s`` of sample ``i`` (rows ``[a, b)``), is sample ``i`` with its
    ``attention_mask`` cut after token ``b`` (tokens past it are padding: they were
    sampled after another routing) and its ``response_mask`` kept only on tokens
    ``a + 1 .. b`` (AND-ed with the sample's own: tool tokens stay masked); every other
    field is sample ``i``'s (old / reference / rollout log-probs, rewards, uids: per-token
    fields are masked by ``response_mask`` where verl's losses read them).  A state whose
    tokens are all prompt trains nothing and is left out.  The original mask is kept in
    ``batch["r3_full_response_mask"]``; ``non_tensor_batch["r3_state"]`` and
    ``["r3_origin"]`` say where each row comes from; ``meta_info["r3_expansion"]`` holds
    the counts (samples, rows, extra rows, extra tokens).  ``divisor``: the row count is
    padded to a multiple of it (verl's dispatch splits the batch evenly over its data-
    parallel ranks) with copies of the last row that train nothing (``response_mask`` 0,
    ``r3_origin`` -1).  A batch without views comes back with the same rows (and the keys).

    The check of the originals counts the step (:func:`r3_client.rank_local.check_step`):
    no off-state token (the exact replay has none), the samples it expands and their cost
    under ``r3_client_expansion_*``; ``count=False`` counts nothing (the same step expanded
    again).  Refuses (:class:`~r3_client.InvalidRequestError`, before any stat) the loss
    settings of :func:`check_expansion_modes`.
    """
    check_expansion_modes(loss_agg_mode, policy_loss_mode)
    if STATE_KEY in data.non_tensor_batch:
        raise InvalidRequestError("the batch is expanded already (it carries r3_state)")
    ids = batch_rollout_ids(data, rollout_ids)
    if "routed_experts" in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        raise InvalidRequestError(
            "the batch carries batch['routed_experts']: each row of an expanded batch needs "
            "its own state's rows; expand first, then attach_routed_experts (or rank-local)"
        )
    # one batched stat (where the source has one) serves the check and the expansion
    source = stats_in_hand(source, ids) or source
    # the originals held to every rule of the rank-local check (rows for each token, the
    # sample's own tokens, longer only where verl cut the response), before any row is cut
    check_batch(data, source, ids, "raise", "exact", count=count)
    lengths = batch_lengths(data)
    counts = lengths.counts
    exp = expand_states(source, ids, counts)
    states = [  # a state whose tokens are all prompt trains nothing: left out, unless last
        s
        for s in exp.states
        if s.num_tokens > lengths.prompts[s.origin] or s.end >= counts[s.origin] - 1
    ]
    pad = (-len(states)) % max(1, divisor)
    rows = [s.origin for s in states] + [states[-1].origin] * pad
    out = data.select_idxs(np.asarray(rows, dtype=np.int64))
    _cut_to_states(out, states, lengths, pad)
    out.non_tensor_batch[STATE_KEY] = np.asarray(
        [s.state for s in states] + [states[-1].state] * pad, dtype=np.int64
    )
    out.non_tensor_batch[ORIGIN_KEY] = np.asarray(
        [s.origin for s in states] + [-1] * pad, dtype=np.int64
    )
    out.non_tensor_batch[ROLLOUT_ID_KEY] = np.asarray([ids[i] for i in rows], dtype=object)
    meta = dict(out.meta_info) if isinstance(out.meta_info, dict) else {}
    meta["r3_expansion"] = {
        "samples": len(ids),
        "rows": len(rows),
        "extra_rows": len(rows) - len(ids),
        "extra_tokens": int(sum(s.num_tokens for s in states) - sum(counts)),
        "padding_rows": pad,
    }
    out.meta_info = meta
    return out


def _cut_to_states(
    out: Any, states: Sequence[SampleState], lengths: BatchLengths, pad: int
) -> None:
    """Each row of ``out`` (an expanded batch: row ``j`` a copy of ``states[j]``'s sample,
    then ``pad`` padding rows) cut to its state: its ``attention_mask`` after the state's
    last token, its ``response_mask`` to the state's tokens (the padding rows' to none);
    the original response mask kept under ``FULL_MASK_KEY``."""
    import torch

    plen = lengths.prompt_len
    full = out.batch["response_mask"] if "response_mask" in out.batch.keys() else None  # noqa: SIM118
    attention = out.batch["attention_mask"].clone()
    if full is None:
        full = attention[:, plen:].clone()
    response = full.clone()
    width = attention.shape[1]
    for j, s in enumerate(states):
        p = lengths.prompts[s.origin]
        start = plen - p  # the sample's token 0 (verl left-pads prompts)
        attention[j, start + s.num_tokens :] = 0
        state_mask = torch.as_tensor(s.token_mask(width - plen, offset=p), device=response.device)
        response[j] = response[j] * state_mask.to(response.dtype)
    if pad:
        response[len(states) :] = 0
    out.batch["attention_mask"] = attention
    out.batch["response_mask"] = response
    out.batch[FULL_MASK_KEY] = full


def _origins(expanded: Any) -> np.ndarray:
    return np.asarray(expanded.non_tensor_batch[ORIGIN_KEY], dtype=np.int64)


def _last_rows(origin: np.ndarray) -> dict[int, int]:
    """Each original's last row in an expanded batch (its last state: its whole response);
    padding rows (origin -1) are none's."""
    last: dict[int, int] = {}
    for j, i in enumerate(origin.tolist()):
        if i >= 0:
            last[i] = j  # a sample's states are consecutive, its last state last
    return last


def advantages_by_origin(data: Any, compute: Any, **kwargs: Any) -> Any:
    """Run verl's advantage estimator over an expanded batch's original samples, once each,
    and give every row its original's advantages and returns; return ``data``.

    ``compute(originals, **kwargs)``: verl's ``compute_advantage`` (``ray_trainer.py``) or
    any function that sets ``batch["advantages"]`` / ``["returns"]`` on the ``DataProto``
    it is given and returns it.  The originals are each sample's last state's row (its
    whole response) with its original ``response_mask``, so group statistics (GRPO's by
    ``uid``, RLOO's baseline) and rewards count each sample once, as without expansion.
    """
    origin = _origins(data)
    last = _last_rows(origin)
    order = sorted(last)
    originals = data.select_idxs(np.asarray([last[i] for i in order], dtype=np.int64))
    originals.batch["response_mask"] = originals.batch[FULL_MASK_KEY].clone()
    originals = compute(originals, **kwargs)
    where = {i: n for n, i in enumerate(order)}
    take = np.asarray([where[i] if i >= 0 else 0 for i in origin.tolist()], dtype=np.int64)
    import torch

    index = torch.as_tensor(take, device=data.batch["response_mask"].device)
    for key in ("advantages", "returns"):
        if key in originals.batch.keys():  # noqa: SIM118
            data.batch[key] = originals.batch[key].index_select(0, index) * data.batch[
                "response_mask"
            ].to(originals.batch[key].dtype)
    return data


# ------------------------------------------------------------------ inside verl's own fit
#
# verl's own ``RayPPOTrainer.fit`` replaying every token in its routing state (``exact``).
#
# ``fit`` builds, scores and trains its batch in one method (``ray_trainer.py:1405-1720``):
# balance, reward, ``_compute_old_log_prob``, ``_compute_ref_log_prob``, the module-level
# ``compute_advantage``, ``_update_actor``.  There is no hook between the reward and the
# first forward, but the forwards and the update are methods, so :class:`ExactReplayTrainer`
# (a mixin put before ``RayPPOTrainer``) expands the batch inside them and nowhere else:
#
# * ``_compute_old_log_prob`` / ``_compute_ref_log_prob``: the batch is expanded (one row per
#   routing state, :func:`~r3_client.integrations.verl.expand_verl_batch`), verl's own method
#   forwards it (each row replays its state on the ranks: :class:`RankLocalReplay` reads
#   ``r3_state``), and each token's log-prob (and entropy) comes back to the original row
#   from the state that served it (:func:`gather_by_state`).  ``fit`` goes on with the
#   original batch: its rewards, its metrics and verl's ``compute_advantage`` (GRPO's ``uid``
#   groups, RLOO's baselines) see every sample once;
# * ``_update_actor``: the batch, now holding advantages and the per-token log-probs of each
#   token's own state, is expanded again and arranged so that every optimizer step trains
#   the states of exactly the samples verl would have put in that step on each data-parallel
#   rank (:func:`arrange_mini_batches`); verl's own method trains it.
#
# So every token is trained once, with the routing it was sampled under, in the same
# optimizer step as without expansion; the cost is the extra rows' forwards.  Accepted:
# ``loss_agg_mode`` ``token-mean`` (verl's default) and ``token-sum``; refused
# (:class:`~r3_client.InvalidRequestError`): the sequence-level aggregations and losses of
# :func:`~r3_client.integrations.verl.check_expansion_modes`, and ``seq-mean-token-sum(-norm)``
# here (verl divides it by the mini-batch's row count, which the arrangement changes).  The
# critic (``_compute_values``, ``_update_critic``) is left as verl runs it.

#: ``loss_agg_mode``\\ s whose per-step loss the arrangement leaves unchanged.
_STEP_EXACT = ("token-mean", "token-sum")


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
    last = _last_rows(origin)
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
    routing state it was sampled under (the section comment above)::

        class Trainer(ExactReplayTrainer, RayPPOTrainer): ...
        trainer = Trainer(config, ...)
        trainer.r3_source = RoutingClient(cache_url, api_key=key)  # stats only
        trainer.fit()

    with the rank-local replay on the workers (:class:`RankLocalReplay`, ``view="exact"``).
    One batched stat per step (cached for the step's methods), no rows on the driver.
    """

    r3_source: StatSource | None = None
    #: Once the actor update has trained on a step, delete the step's rollouts from the
    #: cache (``r3_source.delete_many``, one request per 1,024 ids).  A source without it
    #: (a ``DirectReader``: read-only) leaves them to their TTL; set False where something
    #: after the update still reads them.  A failed delete is logged, never the step's.
    r3_release_step: bool = True
    _r3_stats: tuple[tuple[str, ...], StatsInHand] | None = None
    #: The step whose check was counted: verl's step expands its batch three times (old
    #: log-probs, reference log-probs, update), the metrics count it once.
    _r3_counted: tuple[str, ...] | None = None

    def _r3_stat_source(self, batch: Any) -> StatsInHand:
        if self.r3_source is None:
            raise InvalidRequestError(
                "ExactReplayTrainer needs trainer.r3_source (a RoutingClient) before fit()"
            )
        ids = tuple(str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY])
        if self._r3_stats is None or self._r3_stats[0] != ids:
            held = stats_in_hand(self.r3_source, ids)
            if held is None:
                raise InvalidRequestError("r3_source answers no batched stat (stat_many)")
            self._r3_stats = (ids, held)
        return self._r3_stats[1]

    def _r3_expand(self, batch: Any, divisor: int = 1) -> Any:
        actor = self.config.actor_rollout_ref.actor  # type: ignore[attr-defined]
        if actor.loss_agg_mode not in _STEP_EXACT:  # before any forward is spent
            raise InvalidRequestError(
                f"ExactReplayTrainer: loss_agg_mode={actor.loss_agg_mode!r} is not kept by "
                "expansion inside fit (verl divides the sequence-level modes by the "
                "mini-batch's row count, which the expansion changes): use token-mean or "
                "token-sum, or expand in your own loop (expand_verl_batch) with one "
                "mini-batch per step"
            )
        source = self._r3_stat_source(batch)
        ids = tuple(str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY])
        count, self._r3_counted = self._r3_counted != ids, ids
        return expand_verl_batch(
            batch,
            source,
            loss_agg_mode=actor.loss_agg_mode,
            policy_loss_mode=actor.policy_loss.loss_mode,
            divisor=divisor,
            count=count,
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
            out = super()._update_actor(arranged)  # type: ignore[misc]
        finally:
            config.actor.ppo_mini_batch_size = before
        self._r3_release(batch)
        return out

    def _r3_release(self, batch: Any) -> None:
        """The step's rollouts leave the cache (``r3_release_step``), after its last read."""
        delete_many = getattr(self.r3_source, "delete_many", None)
        if not self.r3_release_step or not callable(delete_many):
            return
        ids = [str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY]]
        try:
            delete_many(list(dict.fromkeys(ids)))
        except R3Error as exc:  # the rollouts expire with their TTL: training goes on
            _log.warning("r3: the step's %d rollouts were not deleted: %s", len(ids), exc)
        self._r3_stats = None
