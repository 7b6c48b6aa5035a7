"""Megatron-Core: a rank's routing per MoE layer for ``RouterReplay`` (:func:`megatron_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client.layouts._packing import (
    RankPlan,
    check_rank,
    cumulative,
    gather_local,
    row_runs,
    sp_part,
    stage_layer_positions,
    zigzag_positions,
)
from r3_client.layouts._rows import (
    Missing,
    RoutingLike,
    as_numpy,
    check_rows_match_tokens,
    collect,
    lengths,
    uncovered,
)

__all__ = [
    "MegatronReplayBatch",
    "megatron_layout",
    "megatron_rank_plan",
    "replay_batch_of",
]


@dataclass(frozen=True)
class MegatronReplayBatch:
    """What :func:`megatron_layout` returns for one micro-batch on one rank.

    ``per_layer``   one ``[local_tokens, K]`` int64 array (or tensor) per local MoE
                    layer, in ``layer_ids`` order: pass it to
                    ``RouterReplay.set_replay_data(batch.per_layer)``.
    ``layer_ids``   the absolute MoE layer ids of ``per_layer`` (ascending).
    ``cu_seqlens``  ``[n + 1]`` int32 cumulative *padded* sequence lengths of the
                    whole packed batch (before the CP/SP split), i.e. the
                    ``cu_seqlens_padded`` of Megatron's ``PackedSeqParams``.
    ``seqlens``     ``[n]`` int32 true token counts ``T_i`` (the trainer's, each
                    checked to equal the sample's routing rows + 1).
    ``positions``   ``[local_tokens]`` int64: for each local token, its index in
                    the padded packed batch (to slice other per-token tensors
                    the same way).
    ``rollout_ids`` the samples' rollout ids when the caller gave them (they name
                    a sample in the driver's errors), else ``None``.
    """

    per_layer: list[Any]
    layer_ids: tuple[int, ...]
    cu_seqlens: npt.NDArray[np.int32]
    seqlens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int64]
    rollout_ids: tuple[str, ...] | None = None

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see (``local_tokens``)."""
        return int(self.positions.shape[0])


def megatron_layout(
    routings: Sequence[RoutingLike],
    *,
    seqlens: Sequence[int] | npt.ArrayLike,
    layer_ids: Sequence[int] | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    sequence_parallel: bool = False,
    stage_layers: Sequence[int] | None = None,
    pad_to_multiple: int | None = None,
    missing: Missing = "raise",
    rollout_ids: Sequence[str] | None = None,
    as_torch: bool = False,
) -> MegatronReplayBatch:
    """Per-local-MoE-layer ``[local_tokens, K]`` int64 routing for ``RouterReplay``.

    Call it once per micro-batch on every rank, with that rank's TP / CP
    coordinates and its pipeline stage's MoE layers, right before the
    forward pass; then ``RouterReplayDriver.add_micro_batch(batch)``.
    ``layer_ids`` are the absolute MoE layer ids of the routing's ``L`` axis
    (required for plain arrays; taken from :class:`Routing` inputs).  The result
    equals slicing the one-rank layout (``tp_size = cp_size = 1``, every layer, the
    same ``pad_to_multiple``) at ``positions`` and ``layer_ids``, and only the rank's
    own rows are copied to build it.

    **Lengths.**  ``seqlens`` (required) are the trainer's own per-sample token
    counts ``T_i``, before padding (what it packs; numpy, list or torch).  Sample
    ``i`` must have exactly ``T_i - 1`` rows: a partial rollout with fewer rows
    would otherwise shift every later sample, and Megatron's gather accepts the
    shorter index without an error.

    **Rows nobody shipped** (all ``-1`` inside a sample's ``T_i - 1`` rows, where
    stored segments left a gap) raise by default: Megatron has no per-token
    fallback, so the driver would replay them as experts ``0..K-1``.
    ``missing="fill"`` keeps them ``-1`` and the driver does exactly that (miles'
    rule).  ``rollout_ids`` (one per sample) name the rollout in errors, here and
    in the driver's.

    **Packing (THD).**  Sample ``i`` has ``T_i`` tokens: its ``T_i - 1`` rows
    plus one ``-1`` row for its last token, then ``-1`` rows up to a multiple of
    ``pad_to_multiple`` (default ``2 * tp_size * cp_size`` when ``cp_size > 1``,
    else ``tp_size`` with ``sequence_parallel``, else 1; pass the multiple your
    trainer packs with if it differs -- verl pads to ``tp_size`` whenever
    ``cp_size == 1``, and :func:`~r3_client.layouts.verl_rank_slice` is verl's own
    slice).  Samples are concatenated; the padded lengths give ``cu_seqlens``.

    **Context parallel** (``cp_size > 1``).  Each padded sequence is cut into
    ``2 * cp_size`` equal chunks; CP rank ``r`` keeps chunks ``r`` and
    ``2*cp_size - 1 - r`` (Megatron's load-balanced zigzag), sequence by
    sequence.

    **Sequence parallel.**  The CP-local token axis is split into ``tp_size``
    equal contiguous parts; TP rank ``t`` keeps part ``t`` (without sequence
    parallel every TP rank's router sees all CP-local tokens).

    **Pipeline.**  ``stage_layers`` lists the absolute MoE layer ids this
    stage (all its virtual-pipeline chunks) owns, default all of
    ``layer_ids``; ``per_layer`` holds those layers in ascending order.

    Raises :class:`ShapeError` for inconsistent routing, a sample whose rows are
    not ``seqlens[i] - 1``, rows nobody shipped (unless ``missing="fill"``), a
    padded length not divisible by ``2 * cp_size``, a CP-local token count not
    divisible by ``tp_size`` under sequence parallel, or a stage layer that is not
    in ``layer_ids``.  ``as_torch=True`` returns CPU ``torch.int64`` tensors.
    Worked examples of each split: docs/layouts.md ("Megatron-Core: megatron_layout").
    """
    batch = collect(routings, "megatron_layout", rollout_ids)
    check_rank(tp_size, tp_rank, "tp")
    check_rank(cp_size, cp_rank, "cp")
    local_ids, layer_pos = stage_layer_positions(batch, layer_ids, stage_layers, "megatron_layout")
    tokens = lengths(seqlens, "seqlens", len(batch.arrays))
    check_rows_match_tokens(batch, tokens, "the trainer's seqlens")
    for i, arr in enumerate(batch.arrays):
        # fill=None: "fill" keeps -1 there; the driver replays 0..K-1 on the device.
        uncovered(arr, batch.routing_name(i), missing, None)
    plan = _plan(tokens, tp_size, tp_rank, cp_size, cp_rank, sequence_parallel, pad_to_multiple)
    # Still int16 (or int32) here: widen per layer, only the local tokens.
    local = gather_local(
        batch.arrays, plan.cu_seqlens, plan.positions, layer_pos, batch.topk, -1, batch.out_dtype
    )
    per_layer = [local[:, j].astype(np.int64) for j in range(local.shape[1])]
    return replay_batch_of(plan, per_layer, local_ids, batch.rollout_ids, as_torch)


def _plan(
    tokens: npt.NDArray[np.int64],
    tp_size: int,
    tp_rank: int,
    cp_size: int,
    cp_rank: int,
    sequence_parallel: bool,
    pad_to_multiple: int | None,
) -> RankPlan:
    """The packed batch and the rank's positions in it (:func:`megatron_layout`'s rules)."""
    if pad_to_multiple is None:
        multiple = 2 * tp_size * cp_size if cp_size > 1 else (tp_size if sequence_parallel else 1)
    else:
        multiple = int(pad_to_multiple)
        if multiple < 1:
            raise ShapeError(f"pad_to_multiple must be >= 1, got {multiple}")
    padded = -(-tokens // multiple) * multiple
    if cp_size > 1 and (padded % (2 * cp_size)).any():
        raise ShapeError(
            f"context parallel needs every padded sequence divisible by 2*cp_size={2 * cp_size}; "
            f"pad_to_multiple={multiple} gives lengths {padded.tolist()}"
        )
    cu = cumulative(padded)
    positions = zigzag_positions(cu, padded, cp_size, cp_rank)
    if sequence_parallel:
        positions = sp_part(positions, tp_size, tp_rank, "raise pad_to_multiple")
    return RankPlan(cu, tokens, positions, row_runs(cu, tokens, positions))


def megatron_rank_plan(
    seqlens: Sequence[int] | npt.ArrayLike,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    sequence_parallel: bool = False,
    pad_to_multiple: int | None = None,
) -> RankPlan:
    """The rows a Megatron rank needs for a micro-batch of samples with ``seqlens`` tokens
    (:class:`~r3_client.layouts.RankPlan`), packed and split as :func:`megatron_layout`
    packs and splits them; no routing needed."""
    check_rank(tp_size, tp_rank, "tp")
    check_rank(cp_size, cp_rank, "cp")
    n = len(as_numpy(seqlens))
    if n < 1:
        raise ShapeError("megatron_rank_plan needs at least one sample")
    tokens = lengths(seqlens, "seqlens", n)
    return _plan(tokens, tp_size, tp_rank, cp_size, cp_rank, sequence_parallel, pad_to_multiple)


def replay_batch_of(
    plan: RankPlan,
    per_layer: list[Any],
    layer_ids: tuple[int, ...],
    rollout_ids: tuple[str, ...] | None,
    as_torch: bool,
) -> MegatronReplayBatch:
    """The :class:`MegatronReplayBatch` of ``plan`` with its targets ``per_layer`` (one
    int64 ``[local_tokens, K]`` array per layer of ``layer_ids``, ``-1`` where the plan
    has no row)."""
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
    return MegatronReplayBatch(
        per_layer=per_layer,
        layer_ids=layer_ids,
        cu_seqlens=plan.cu_seqlens.astype(np.int32),
        seqlens=plan.seqlens.astype(np.int32),
        positions=plan.positions,
        rollout_ids=rollout_ids,
    )
