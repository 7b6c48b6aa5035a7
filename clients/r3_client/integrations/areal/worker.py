"""AReaL training-rank side (each Megatron rank, each micro-batch, in place of PR #1207's
``setup_per_microbatch_replay_forward``): the micro-batch's rollouts read back from its
``r3_key`` column (:func:`areal_micro_batch`), only the rank's own rows of its stage's MoE
layers fetched (:func:`fetch_areal_rank_targets`), and handed to its routers
(:func:`set_router_targets`).  Paths and lines are those of the PR's head commit
``a9f0b0400e89``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.integrations.areal._keys import KEY_FIELD, STATE_FIELD, key_rollout_id
from r3_client.layouts import Missing, RankPlan
from r3_client.layouts._packing import check_rank, row_runs, sp_part, zigzag_positions
from r3_client.layouts._rows import as_numpy
from r3_client.rank_local import RangeSource, fetch_plan_rows


@dataclass(frozen=True)
class ArealMicroBatch:
    """One AReaL micro-batch as a rank sees it: its samples' rollout ids and token counts in
    packing order, the padded ``cu_seqlens`` the model runs on (with the batch-padding
    sequence when AReaL appended one), and each sample's state when the batch was expanded
    (:func:`expand_areal_batch`; ``None``: not expanded)."""

    rollout_ids: tuple[str, ...]
    seqlens: npt.NDArray[np.int64]
    cu_seqlens: npt.NDArray[np.int64]
    states: tuple[int, ...] | None = None


def areal_micro_batch(mb_item: Any, *, key_field: str = KEY_FIELD) -> ArealMicroBatch:
    """The :class:`ArealMicroBatch` of a ``MicroBatchItem`` (what ``iter(mb_list)`` yields in
    ``MegatronEngine.forward_backward_batch``, ``areal/utils/data.py:586-602``).

    Token counts from ``mb_item.old_cu_seqlens`` (the packed ``cu_seqlens`` before the
    per-sequence alignment, ``pad_packed_tensor_dict``, data.py:843), else
    ``orig_mb["cu_seqlens"]``; the padded ``cu_seqlens`` from ``padded_mb`` (what
    ``megatron_engine_r3_patch.py:218-250`` passes on); each sample's key at its first
    token of ``padded_mb[key_field]``; each sample's state from ``r3_state`` when the batch
    was expanded (pass ``mb.states`` to :func:`fetch_areal_rank_targets`).
    """
    padded = mb_item.padded_mb
    cu = as_numpy(padded["cu_seqlens"]).astype(np.int64).reshape(-1)
    old = getattr(mb_item, "old_cu_seqlens", None)
    if old is None:
        old = mb_item.orig_mb["cu_seqlens"]
    seqlens = np.diff(as_numpy(old).astype(np.int64).reshape(-1))
    n = int(seqlens.shape[0])
    if key_field not in padded:
        raise ShapeError(
            f"the micro-batch has no {key_field!r} column: the workflow did not add rollout "
            "keys (with_rollout_keys)"
        )
    keys = as_numpy(padded[key_field]).reshape(-1)
    if cu.shape[0] not in (n + 1, n + 2) or int(cu[-1]) != keys.shape[0]:
        raise ShapeError(
            f"padded cu_seqlens {cu.tolist()} do not fit {n} samples and "
            f"{keys.shape[0]} packed tokens"
        )
    ids = []
    for i in range(n):
        try:
            ids.append(key_rollout_id(keys[cu[i]]))
        except ShapeError as exc:
            raise ShapeError(f"micro-batch sample {i}: {exc}") from exc
    states = None
    if STATE_FIELD in padded:
        column = as_numpy(padded[STATE_FIELD]).reshape(-1)
        if column.shape[0] != keys.shape[0]:
            raise ShapeError(
                f"{STATE_FIELD!r} has {column.shape[0]} packed tokens, {key_field!r} "
                f"{keys.shape[0]}"
            )
        states = tuple(int(column[cu[i]]) for i in range(n))
    return ArealMicroBatch(tuple(ids), seqlens, cu, states)


def areal_rank_plan(
    seqlens: Sequence[int] | npt.ArrayLike,
    cu_seqlens: Sequence[int] | npt.ArrayLike,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> RankPlan:
    """The rows one rank's routers replay for an AReaL micro-batch, from lengths alone.

    ``cu_seqlens``: the padded micro-batch's (``padded_mb["cu_seqlens"]``: each sample padded
    to a multiple of ``tp*cp*2`` when ``cp > 1`` else ``tp``, then possibly one
    batch-padding sequence); ``seqlens``: the samples' token counts.  As
    ``router_replay_utils.set_router_replay_data`` lays them out: sample ``i``'s token ``t``
    at ``cu[i] + t`` (:246-315), the CP split of ``split_packed_seqs_for_context_parallel``
    (Megatron's zigzag: chunks ``r`` and ``2cp-1-r`` of ``2cp`` per sequence,
    ``packed_context_parallel.py:91-114``; router_replay_utils.py:355-366), then, whenever
    ``tp > 1``, ``scatter_to_sequence_parallel_region`` (``tp`` equal contiguous parts,
    :369-381).  Row ``t`` of the rollout replays token ``t`` for ``t < seqlens[i] - 1``.
    """
    check_rank(tp_size, tp_rank, "tp")
    check_rank(cp_size, cp_rank, "cp")
    tokens = as_numpy(seqlens).astype(np.int64).reshape(-1)
    cu = as_numpy(cu_seqlens).astype(np.int64).reshape(-1)
    n = int(tokens.shape[0])
    if n < 1 or cu.shape[0] not in (n + 1, n + 2) or cu[0] != 0:
        raise ShapeError(
            f"cu_seqlens {cu.tolist()} are not the padded cu_seqlens of {n} samples "
            "(n + 1 entries, or n + 2 with AReaL's batch-padding sequence, from 0)"
        )
    padded = np.diff(cu)
    if (padded[:n] < tokens).any() or (tokens < 0).any() or (padded < 0).any():
        raise ShapeError(f"seqlens {tokens.tolist()} do not fit in cu_seqlens {cu.tolist()}")
    align = tp_size * cp_size * 2 if cp_size > 1 else tp_size  # megatron_engine_r3_patch.py:333
    if (padded % align).any():
        # AReaL refuses such a batch itself (packed_context_parallel.py:31-37).
        raise ShapeError(
            f"padded lengths {padded.tolist()} are not multiples of {align} "
            f"(tp_size={tp_size}, cp_size={cp_size}), as AReaL's _prepare_mb_list pads them"
        )
    # The batch-padding sequence (if any) has no tokens of a sample: no rows.
    rows_of = np.concatenate([tokens, np.zeros(padded.shape[0] - n, np.int64)])
    positions = zigzag_positions(cu, padded, cp_size, cp_rank)
    if tp_size > 1:
        positions = sp_part(positions, tp_size, tp_rank, "pad as AReaL does")
    return RankPlan(cu, tokens, positions, row_runs(cu, rows_of, positions))


@dataclass(frozen=True)
class ArealReplayTargets:
    """What AReaL's ``set_router_replay_data`` hands each of a rank's routers, for one micro-batch.

    ``per_layer``   one ``int64 [local_tokens, K]`` array (or tensor) per local MoE layer,
                    ascending (the order of ``RouterReplay`` instances on the stage):
                    the recorded experts, ``0`` where there is none (router_replay_utils.py:440).
    ``valid_mask``  one ``bool [local_tokens]`` per layer: ``True`` where the rollout has a
                    row (replayed), ``False`` on each sample's last token, alignment and
                    batch padding, and rows nobody shipped under ``missing="fill"``: the
                    patched router routes those live (router_replay_patch.py:262-272).
    ``layer_ids``   the absolute MoE layer ids of ``per_layer``.
    ``cu_seqlens``  the padded micro-batch's ``cu_seqlens``; ``seqlens``: token counts;
    ``positions``   each local token's index in the padded micro-batch.
    """

    per_layer: list[Any]
    valid_mask: list[Any]
    layer_ids: tuple[int, ...]
    cu_seqlens: npt.NDArray[np.int64]
    seqlens: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    rollout_ids: tuple[str, ...]

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see."""
        return int(self.positions.shape[0])


def fetch_areal_rank_targets(
    source: RangeSource,
    rollout_ids: Sequence[str],
    *,
    seqlens: Sequence[int] | npt.ArrayLike,
    cu_seqlens: Sequence[int] | npt.ArrayLike,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    stage_layers: Sequence[int] | None = None,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> ArealReplayTargets:
    """One rank's :class:`ArealReplayTargets` for one AReaL micro-batch, read for that rank alone.

    Equal, router by router, to what ``set_router_replay_data`` (router_replay_utils.py:206-443)
    sets from AReaL's inline ``routed_experts`` of the same rollouts: the rank's rows
    (:func:`areal_rank_plan`) of ``stage_layers`` (absolute MoE layer ids the rank's routers
    own, :func:`stage_moe_layers`; default every layer the rollouts hold; ``()``: a stage of
    dense layers, nothing fetched) are read through ``source`` and decoded, nothing else.
    ``rollout_ids``, ``seqlens``: the micro-batch's samples in packing order
    (:func:`areal_micro_batch`).  Raises as :func:`~r3_client.rank_local.fetch_megatron_rank_batch`
    does; ``missing="fill"`` marks rows nobody shipped invalid (routed live, as AReaL treats
    rows it has no routing for).  ``as_torch``: CPU torch tensors.

    ``view``: the policy every read is made under (docs/store.md, "Views"); under
    ``"exact"`` (the default) ``states`` names each sample's state (its first row; ``None``:
    ``0``; :func:`r3_client.expand_states` gives them, ``Expansion.state_rows``), and a
    sample whose rows span several states is refused
    (:class:`~r3_client.InvalidRequestError`, "expand the sample") rather than replayed
    with one of them.
    """
    ids = tuple(check_rollout_id(r) for r in rollout_ids)
    plan = areal_rank_plan(
        seqlens, cu_seqlens, tp_size=tp_size, tp_rank=tp_rank, cp_size=cp_size, cp_rank=cp_rank
    )
    layers = None if stage_layers is None else tuple(sorted(int(x) for x in stage_layers))
    local, layer_ids = fetch_plan_rows(source, list(ids), plan, layers, missing, -1, view, states)
    valid: npt.NDArray[np.bool_] = np.asarray((local >= 0).all(axis=2))  # [L, local_tokens]
    local[local < 0] = 0
    per_layer: list[Any] = [local[j] for j in range(local.shape[0])]
    masks: list[Any] = [valid[j] for j in range(valid.shape[0])]
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
        masks = [torch.from_numpy(np.ascontiguousarray(m)) for m in masks]
    return ArealReplayTargets(
        per_layer=per_layer,
        valid_mask=masks,
        layer_ids=layer_ids,
        cu_seqlens=plan.cu_seqlens,
        seqlens=plan.seqlens,
        positions=plan.positions,
        rollout_ids=ids,
    )


def stage_moe_layers(
    start: int, end: int, moe_layer_freq: int | Sequence[int] | None = None
) -> tuple[int, ...]:
    """The MoE layers among decoder layers ``[start, end)``, by AReaL's ``is_moe_layer``
    (router_replay_utils.py:109-122: every layer when ``moe_layer_freq`` is ``None``,
    ``i % freq == 0`` for an int, ``freq[i] == 1`` for a list).  ``start``/``end``: the
    rank's layer range, ``get_current_rank_layer_info(tf_config)`` (:146-161)."""
    if moe_layer_freq is None:
        return tuple(range(start, end))
    if isinstance(moe_layer_freq, int):
        return tuple(i for i in range(start, end) if i % moe_layer_freq == 0)
    return tuple(i for i in range(start, end) if moe_layer_freq[i] == 1)


def set_router_targets(
    routers: Sequence[Any], targets: ArealReplayTargets, *, device: Any = None
) -> None:
    """Hand each of a rank's ``RouterReplay`` instances (ascending layers, e.g.
    ``RouterReplayHelper.get_micro_batch_router_list(tf_config)``) its targets and mask, as
    ``router.set_target_indices(slab, valid_mask=mask)`` (router_replay_utils.py:441).

    Raises :class:`~r3_client.ShapeError` when the counts differ (AReaL warns and skips).
    """
    import torch  # lazy

    if len(routers) != len(targets.per_layer):
        raise ShapeError(
            f"{len(routers)} routers on this rank but targets for {len(targets.per_layer)} MoE "
            f"layers {list(targets.layer_ids)}: pass stage_layers= the rank's MoE layers"
        )
    for router, slab, mask in zip(routers, targets.per_layer, targets.valid_mask, strict=True):
        t = torch.as_tensor(slab, dtype=torch.int64)
        m = torch.as_tensor(mask, dtype=torch.bool)
        router.set_target_indices(t.to(device), valid_mask=m.to(device))
