"""AReaL trainer side (the trainer's step, on the padded ``[B, S]`` batch before AReaL's
engine packs it into micro-batches): the step's rollouts checked once before
``compute_logp`` / ``ppo_update`` dispatch the batch (:func:`check_areal_step`), and each
sample cut into its routing states inside that step (:func:`expand_areal_batch`,
:func:`gather_by_state`, or :class:`ExactPPOActor` in AReaL's own actor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._views import ViewPolicy
from r3_client.expansion import Expansion, expand_states
from r3_client.integrations.areal._keys import KEY_FIELD, STATE_FIELD, key_rollout_id
from r3_client.layouts import Missing
from r3_client.layouts._rows import as_numpy
from r3_client.rank_local import StatSource, StepCheck, check_step

#: The ``[B]`` column :func:`expand_areal_batch` adds: the original each sample was cut from.
ORIGIN_FIELD = "r3_origin"


def step_rollouts(batch: dict[str, Any]) -> tuple[list[str], npt.NDArray[np.int64]]:
    """A step's (or mini-batch's) rollout ids and token counts, from its ``[B, S]`` batch:
    ``r3_key[:, 0]`` (samples are right-padded) and ``attention_mask.sum(1)``."""
    keys = as_numpy(batch[KEY_FIELD])
    mask = as_numpy(batch["attention_mask"])
    if keys.ndim != 2 or keys.shape != mask.shape:
        raise ShapeError(
            f"{KEY_FIELD!r} has shape {keys.shape}, attention_mask {mask.shape}: expected "
            "the same [B, S] (a batch before packing)"
        )
    return [key_rollout_id(k) for k in keys[:, 0]], mask.sum(axis=1).astype(np.int64)


def check_areal_step(
    source: StatSource,
    batch: dict[str, Any],
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on an AReaL batch (:func:`step_rollouts`):
    call it on the trainer before ``compute_logp`` / ``ppo_update`` dispatch the batch.
    ``view`` / ``states``: the policy the ranks replay under and, under ``exact``, each
    sample's state; returns the :class:`~r3_client.rank_local.StepCheck` (tokens replayed
    off their own state)."""
    ids, num_tokens = step_rollouts(batch)
    return check_step(source, ids, num_tokens, missing=missing, view=view, states=states)


def check_areal_expansion_modes(config: Any) -> None:
    """Refuse an AReaL ``PPOActorConfig`` whose loss changes when a sample is cut into its
    states (:func:`expand_areal_batch`); call it once, before the first step.

    AReaL 1.0.4's actor loss is token-level (``grpo_loss_fn``: per-token ratios under
    ``loss_mask``, each micro-batch weighted by ``loss_mask.count_nonzero()``,
    ``areal/trainer/ppo/actor.py:340-363``), so a partition of each sample's trained tokens
    leaves it unchanged.  Refused, naming the setting: ``importance_sampling_level=
    "sequence"`` (GSPO: one geometric-mean ratio per sequence, ``functional.py:501``; an
    expanded sample would get its own) and ``rejection_sampling.level="sequence"`` (one
    filter decision per sequence).  The alternative: ``"token"``, or replay one state by
    naming ``view="latest"``/``"generated"`` (counted by :func:`check_areal_step`).
    """
    level = getattr(config, "importance_sampling_level", "token")
    if level != "token":
        raise InvalidRequestError(
            f"AReaL importance_sampling_level={level!r} takes one ratio per sequence, which "
            "an expanded sample would take over its own tokens only: use 'token', or replay "
            "one routing per sample with view='latest' / 'generated' (counted, not exact)"
        )
    rs = getattr(config, "rejection_sampling", None)
    rs_level = getattr(rs, "level", "token") if rs is not None else "token"
    if rs_level != "token":
        raise InvalidRequestError(
            f"AReaL rejection_sampling.level={rs_level!r} filters whole sequences, which an "
            "expanded sample would filter by its own tokens only: use level='token', or "
            "replay one routing per sample with view='latest' / 'generated'"
        )


def _rows(value: Any, count: int) -> bool:
    return (
        getattr(value, "shape", None) is not None
        and len(value.shape) >= 1
        and (int(value.shape[0]) == count)
    )


def expand_areal_batch(
    source: StatSource,
    batch: dict[str, Any],
    *,
    expansion: Expansion | None = None,
    rolled: bool = False,
) -> tuple[dict[str, Any], Expansion]:
    """AReaL's padded ``[B, S]`` batch with each sample cut into one sample per routing state
    (:mod:`r3_client.expansion`), and the :class:`~r3_client.Expansion`.

    The samples are named by ``r3_key`` (:func:`step_rollouts`).  Every ``[B, ...]`` value
    is copied to each of its sample's states (``rewards``, ``versions``, ``logprobs``,
    ``advantages``, the keys); ``attention_mask`` keeps each
    state's first ``num_tokens`` tokens; ``loss_mask`` keeps only the tokens the state
    served (``rolled``: the mask is AReaL's after ``compute_advantages``, where position
    ``t`` stands for token ``t + 1``).  Adds ``r3_state`` (per token, the state's first
    row: :func:`areal_micro_batch` reads it on the ranks) and ``r3_origin`` (``[B']``).
    ``expansion``: reuse the one the first call returned (no stat).  One batched stat
    otherwise.

    Where in AReaL's step (``PPOTrainer``: ``compute_logp``, ``compute_advantages``,
    ``ppo_update``), docs/integrations.md: expand before ``compute_logp`` (each state's
    forward), bring its log-probs back to the originals (:func:`gather_by_state`), run
    ``compute_advantages`` on the originals (group statistics count each sample once),
    and expand that with ``expansion=..., rolled=True`` for ``ppo_update``.
    """
    if STATE_FIELD in batch:
        raise ShapeError(
            f"the batch is already expanded (it has {STATE_FIELD!r}): expand the originals"
        )
    ids, num_tokens = step_rollouts(batch)
    if expansion is None:
        expansion = expand_states(source, ids, num_tokens)
    elif expansion.num_samples != len(ids) or any(
        s.rollout_id != ids[s.origin] for s in expansion.states
    ):
        raise ShapeError(
            f"the expansion was made for {expansion.num_samples} other samples than this "
            f"batch's {len(ids)}: expand this batch itself"
        )
    b = len(ids)
    mask = batch["attention_mask"]
    width = int(mask.shape[1])
    out: dict[str, Any] = {k: expansion.take(v) if _rows(v, b) else v for k, v in batch.items()}
    keep = np.arange(width)[None, :] < expansion.num_tokens[:, None]
    served = expansion.token_masks(width, offset=1 if rolled else 0)
    state = np.repeat(np.asarray(expansion.state_rows, np.int64)[:, None], width, axis=1)
    origin = expansion.origin
    if hasattr(mask, "index_select"):
        import torch  # the batch is torch: so is what is added to it

        def like(a: npt.NDArray[Any], ref: Any) -> Any:
            return torch.as_tensor(a, device=ref.device)

        out["attention_mask"] = out["attention_mask"] * like(keep, mask).to(mask.dtype)
        if "loss_mask" in out:
            lm = out["loss_mask"]
            out["loss_mask"] = lm * like(served, lm).to(lm.dtype)
        out[STATE_FIELD] = like(state, mask)
        out[ORIGIN_FIELD] = like(origin, mask)
    else:
        out["attention_mask"] = np.asarray(out["attention_mask"]) * keep.astype(mask.dtype)
        if "loss_mask" in out:
            lm = np.asarray(out["loss_mask"])
            out["loss_mask"] = lm * served.astype(lm.dtype)
        out[STATE_FIELD] = state
        out[ORIGIN_FIELD] = origin
    return out, expansion


def gather_by_state(values: Any, expansion: Expansion, *, rolled: bool = True) -> Any:
    """Per-token ``values`` of an expanded batch (``[B', S]``: ``prox_logp`` from
    ``compute_logp``, entropies) back on the originals (``[B, S]``): each token's value from
    the state that served it, the rest from the original's last state (all its tokens).
    ``rolled``: position ``t`` holds token ``t + 1``'s value (AReaL's ``compute_logp``
    output); ``False``: token ``t``'s."""
    width = int(values.shape[1])
    served = expansion.token_masks(width, offset=1 if rolled else 0)
    last: dict[int, int] = {}
    for j, s in enumerate(expansion.states):
        last[s.origin] = j
    rows = [last[i] for i in range(expansion.num_samples)]
    if hasattr(values, "index_select"):
        import torch

        out = values[torch.as_tensor(rows, device=values.device)].clone()
        for j, s in enumerate(expansion.states):
            m = torch.as_tensor(served[j], device=values.device)
            out[s.origin][m] = values[j][m]
        return out
    arr = np.asarray(values)
    res = arr[rows].copy()
    for j, s in enumerate(expansion.states):
        res[s.origin][served[j]] = arr[j][served[j]]
    return res


class ExactPPOActor:
    """Mixin for AReaL 1.0.4's ``PPOActor`` (put it first) that replays every token in its
    routing state inside AReaL's own ``compute_logp`` and ``ppo_update``::

        class Actor(ExactPPOActor, PPOActor): ...
        actor = Actor(config.actor, engine)
        actor.r3_source = RoutingClient(cache_url, api_key=key)  # stats only

    ``compute_logp`` forwards the expanded batch (:func:`expand_areal_batch`) and returns
    each token's log-prob from the state that served it (:func:`gather_by_state`), so the
    trainer's ``compute_advantages`` runs on the original samples (group normalisation
    counts each once); ``ppo_update`` expands its (advantaged, rolled) batch again and
    trains that, after :func:`check_areal_expansion_modes`.  The ranks read each sample's
    state from ``r3_state`` (:func:`areal_micro_batch`).  AReaL cuts the update into
    ``ppo_n_minibatches`` token-balanced mini-batches (``split_padded_tensor_dict_into_mb_
    list``): with more than one, the optimizer steps group the expanded samples as AReaL
    balances them, each token still trained once, with its own routing.
    """

    r3_source: StatSource | None = None

    def _r3(self) -> StatSource:
        if self.r3_source is None:
            raise InvalidRequestError(
                "ExactPPOActor needs actor.r3_source (a RoutingClient) before the first step"
            )
        return self.r3_source

    def _compute_logp(self, data: dict[str, Any]) -> Any:
        """AReaL's, on the expanded batch; each token's log-prob from its own state."""
        expanded, expansion = expand_areal_batch(self._r3(), data)
        out = super()._compute_logp(expanded)  # type: ignore[misc]
        return None if out is None else gather_by_state(out, expansion)

    def _ppo_update(self, data: dict[str, Any]) -> None:
        """AReaL's, on the batch expanded after ``compute_advantages`` (rolled masks)."""
        check_areal_expansion_modes(self.config)  # type: ignore[attr-defined]
        expanded, _ = expand_areal_batch(self._r3(), data, rolled=True)
        super()._ppo_update(expanded)  # type: ignore[misc]
