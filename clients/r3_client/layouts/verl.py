"""verl 0.9.1: the whole batch's ``routed_experts`` (:func:`verl_layout`) and one Megatron
rank's slice of it (:func:`verl_rank_slice`).

The slice is what verl's Megatron engine hands each router in its R3 branch
(``workers/engine/megatron/transformer_impl.py:1306-1327``), computed without the
whole batch: ``left_right_2_no_padding`` drops the padding (``workers/utils/padding.py:73-79``),
``align_r3_router_replay_data`` and ``build_r3_replay_mask`` pick the replayed rows
(``utils/megatron/router_replay_utils.py:380-431``), and ``set_router_replay_data``
(:434-567) packs them with ``preprocess_thd_engine`` (``models/mcore/util.py:335-564``:
padding, zigzag or contiguous CP split), splits them over the TP group with
``scatter_to_sequence_parallel_region`` and gives each router of the model chunk the
rows of its layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client.layouts._packing import (
    RankPlan,
    check_rank,
    contiguous_positions,
    cumulative,
    gather_local,
    row_runs,
    sample_offsets,
    sp_part,
    stage_layer_positions,
    zigzag_positions,
)
from r3_client.layouts._rows import (
    Missing,
    RoutingLike,
    Rows,
    as_numpy,
    check_rows_match_tokens,
    collect,
    consumer_rows,
    lengths,
    uncovered,
)

__all__ = [
    "VerlRank",
    "VerlRankPlan",
    "VerlRankSlice",
    "rank_slice_of",
    "verl_layout",
    "verl_rank_plan",
    "verl_rank_slice",
]


def _check_lengths(
    routings: Sequence[RoutingLike],
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    what: str,
    rollout_ids: Sequence[str] | None,
) -> tuple[Rows, npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The batch and its prompt / response lengths, each sample's rows checked against them."""
    batch = collect(routings, what, rollout_ids)
    n = len(batch.arrays)
    p = lengths(prompt_lens, "prompt_lens", n)
    r = lengths(response_lens, "response_lens", n)
    check_rows_match_tokens(batch, p + r, "prompt + response")
    return batch, p, r


def verl_layout(
    routings: Sequence[RoutingLike],
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    *,
    prompt_len: int | None = None,
    response_len: int | None = None,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_ids: Sequence[str] | None = None,
) -> npt.NDArray[np.integer[Any]]:
    """verl 0.9.1's ``batch["routed_experts"]``: ``[bs, prompt_len + response_len, L, K]``.

    Use it when building a verl ``DataProto`` whose ``prompts`` are left-padded
    to ``prompt_len`` and ``responses`` right-padded to ``response_len``.
    Sample ``i`` has ``P_i = prompt_lens[i]`` prompt and ``R_i = response_lens[i]``
    response tokens and ``P_i + R_i - 1`` routing rows.  Token ``t < P_i`` sits
    at column ``prompt_len - P_i + t``, token ``t >= P_i`` at
    ``prompt_len + t - P_i``.  ``prompt_len`` / ``response_len`` default to
    the batch maxima.  Every padding position and each sample's last token hold
    ``0``, as verl's own rollout fills them (verl never gathers there: it drops
    padding and leaves the last token to its router; a ``-1`` inside a sample's
    replayed rows crashes its gather, hence ``missing``).  One Megatron rank's part
    of it, without building it: :func:`verl_rank_slice`.

    ``num_layers``: the model's ``num_hidden_layers``; the layer axis becomes
    absolute (verl indexes it by ``layer_number - 1``), MoE rows at their layer ids
    (a :class:`Routing`'s, or ``layer_ids`` for plain arrays), dense layers ``0``.
    Required for models with dense layers (DeepSeek-V3, GLM-4.5, Kimi-K2, ...).
    ``missing``: rows nobody shipped raise (default) or, with ``"fill"``, become ``0``.
    ``rollout_ids``: one per sample, to name the rollout in errors (a :class:`Routing`
    does not carry its id).
    Raises :class:`ShapeError` when a sample's row count is not ``P_i + R_i - 1``
    or it does not fit the given lengths::

        P_i=3, R_i=2, prompt_len=5, response_len=4   (r_t = routing row t)

        column:  0   1   2   3   4 | 5   6   7   8
                 pad pad r0  r1  r2| r3  0   pad pad
                 <-- prompt, left- | response, right-padded -->
        every pad and the last token (0 after r3) hold 0 in all L x K slots
    """
    batch, p, r = _check_lengths(routings, prompt_lens, response_lens, "verl_layout", rollout_ids)
    n = len(batch.arrays)
    plen = int(p.max()) if prompt_len is None else int(prompt_len)
    rlen = int(r.max()) if response_len is None else int(response_len)
    for name, have, cap in (("prompt", p, plen), ("response", r, rlen)):
        over = np.flatnonzero(have > cap)
        if over.size:
            i = int(over[0])
            raise ShapeError(
                f"{batch.who(i)} has {have[i]} {name} tokens, more than {name}_len={cap}"
            )
    fill = np.zeros(batch.topk, dtype=np.int64)
    arrays, nl = consumer_rows(batch, layer_ids, num_layers, missing, fill)
    # np.zeros is calloc: pages are zeroed lazily, so the fill costs no extra pass.
    out = np.zeros((n, plen + rlen, nl, batch.topk), dtype=batch.out_dtype)
    for i, arr in enumerate(arrays):
        pi, rows = int(p[i]), arr.shape[0]
        in_prompt = min(pi, rows)
        out[i, plen - pi : plen - pi + in_prompt] = arr[:in_prompt]
        out[i, plen : plen + rows - in_prompt] = arr[in_prompt:]
    return out


CpLayout = Literal["zigzag", "contiguous"]


@dataclass(frozen=True)
class VerlRank:
    """Where one verl Megatron rank (one model chunk of it) sits, as its R3 branch slices routing.

    ``tp_size``, ``tp_rank``     the tensor-parallel group (``mpu.get_tensor_model_parallel_*``).
    ``cp_size``, ``cp_rank``     the context-parallel group; under verl's dynamic CP, the
                                 micro-batch's ``local_cp_size`` and the rank in that group.
    ``stage_layers``             the absolute MoE layer ids of the chunk's routers
                                 (``[n - 1 for n, _ in iter_model_routers(chunk)]``), default
                                 every MoE layer of the routing; may be empty (a stage of
                                 dense layers only).  With virtual pipeline stages, one chunk's
                                 layers (verl sets each chunk's routers per micro-batch) or all
                                 the rank's: the tokens are the same.
    ``sequence_parallel``        verl's ``sequence_parallel`` (its default with TP > 1).  verl's
                                 R3 branch splits routing over the TP group whatever it says, so
                                 ``False`` with ``tp_size > 1`` is refused: the routers would see
                                 ``tp_size`` times the rows verl gives them.
    ``fp8_padding``              ``tf_config.fp8 in ("e4m3", "hybrid")``: verl pads each sequence
                                 to ``lcm(16, align)`` and the batch to ``128 * align``.
    ``cp_layout``, ``min_local_rows``  verl's CP layout: ``"zigzag"`` (default), or
                                 ``"contiguous"`` with ``min_local_rows=tf_config.csa_window_size``
                                 for ``experimental_attention_variant="dsv4_hybrid"``.

    Raises :class:`ShapeError` for a rank outside its group or an inconsistent setting.
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    stage_layers: Sequence[int] | None = None
    sequence_parallel: bool = True
    fp8_padding: bool = False
    cp_layout: CpLayout = "zigzag"
    min_local_rows: int | None = None

    def __post_init__(self) -> None:
        check_rank(self.tp_size, self.tp_rank, "tp")
        check_rank(self.cp_size, self.cp_rank, "cp")
        if self.stage_layers is not None:
            if isinstance(self.stage_layers, str | bytes):
                raise ShapeError("stage_layers must list layer ids, not be a string")
            # A list is as welcome as a tuple; stored as a tuple so the rank stays hashable.
            object.__setattr__(self, "stage_layers", tuple(int(s) for s in self.stage_layers))
        if self.cp_layout not in ("zigzag", "contiguous"):
            raise ShapeError(f"cp_layout must be 'zigzag' or 'contiguous', got {self.cp_layout!r}")
        if self.tp_size > 1 and not self.sequence_parallel:
            raise ShapeError(
                f"verl 0.9.1's R3 branch splits routing over the TP group (tp_size={self.tp_size}) "
                "whatever sequence_parallel says, but without sequence parallel every TP rank's "
                "routers see all the tokens: verl refuses that micro-batch ('Router replay "
                "tensors are not aligned'). Turn sequence parallel on (verl's default with TP > 1)"
            )
        if self.min_local_rows is not None:
            if self.cp_layout != "contiguous":
                raise ShapeError(
                    "min_local_rows goes with cp_layout='contiguous' (verl sets it for "
                    "dsv4_hybrid attention only)"
                )
            if isinstance(self.min_local_rows, bool) or self.min_local_rows < 1:
                raise ShapeError(f"min_local_rows must be >= 1, got {self.min_local_rows!r}")

    def padded_lengths(self, tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Each sequence's length as verl packs it for this rank (``preprocess_thd_engine``)."""
        zigzag = self.cp_layout == "zigzag" and self.cp_size > 1
        align = self.tp_size * self.cp_size * (2 if zigzag else 1)
        per_seq = math.lcm(16, align) if self.fp8_padding else align
        padded = -(-tokens // per_seq) * per_seq
        if self.fp8_padding:  # the last sequence takes the batch to a multiple of 128 * align
            padded[-1] += -int(padded.sum()) % (128 * align)
        if self.min_local_rows is not None:
            padded[-1] += max(self.cp_size * self.min_local_rows - int(padded.sum()), 0)
        return padded

    def positions(self, padded: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The packed-batch positions this rank's routers see, in their order."""
        cu = cumulative(padded)
        if self.cp_layout == "contiguous":
            local = contiguous_positions(int(cu[-1]), self.cp_size, self.cp_rank)
        else:
            local = zigzag_positions(cu, padded, self.cp_size, self.cp_rank)
        hint = "verl's packing leaves them so with this min_local_rows (Megatron refuses it too)"
        return sp_part(local, self.tp_size, self.tp_rank, hint)


@dataclass(frozen=True)
class VerlRankSlice:
    """What :func:`verl_rank_slice` returns: one rank's R3 replay targets for one micro-batch.

    ``per_layer``    one ``[local_tokens, K]`` int64 array (tensor with ``as_torch``) per
                     MoE layer of ``layer_ids``: router ``l``'s ``target_topk_idx``.
    ``layer_ids``    the absolute MoE layer ids of ``per_layer``, ascending.
    ``replay_mask``  ``[local_tokens]`` bool: ``True`` where verl replays the row (every
                     token but each sample's last, of samples with a response), ``False``
                     where the router routes natively (the last token, padding).
    ``cu_seqlens``   ``[n + 1]`` int32 cumulative padded lengths of the micro-batch's packed
                     batch (verl's ``cu_seqlens_padded``, before the CP / TP split).
    ``seqlens``      ``[n]`` int32 token counts ``P_i + R_i``.
    ``positions``    ``[local_tokens]`` int64 index of each local token in the packed batch.
    ``rollout_ids``  the ``rollout_ids`` given, or ``None``.

    Hand it to the chunk's routers as verl's ``set_router_replay_data`` would::

        targets = dict(zip(s.layer_ids, s.per_layer, strict=True))
        for n, router in iter_model_routers(chunk):  # verl's; n is the 1-based layer_number
            router.set_target_indices(targets[n - 1], replay_mask=s.replay_mask)
    """

    per_layer: list[Any]
    layer_ids: tuple[int, ...]
    replay_mask: Any
    cu_seqlens: npt.NDArray[np.int32]
    seqlens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int64]
    rollout_ids: tuple[str, ...] | None = None

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see (``local_tokens``)."""
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class VerlRankPlan(RankPlan):
    """Which rows one verl rank needs for one micro-batch (:func:`verl_rank_plan`): a
    :class:`~r3_client.layouts.RankPlan` of verl's packing, plus the rank's
    ``replay_mask`` (``build_r3_replay_mask``'s, at its positions)."""

    replay_mask: npt.NDArray[np.bool_] = dataclasses.field(
        default_factory=lambda: np.zeros(0, bool)
    )


def _plan(rank: VerlRank, p: npt.NDArray[np.int64], r: npt.NDArray[np.int64]) -> VerlRankPlan:
    tokens = p + r
    padded = rank.padded_lengths(tokens)
    cu = cumulative(padded)
    positions = rank.positions(padded)
    sample, offset = sample_offsets(cu, positions)
    # build_r3_replay_mask: every token but the last, of samples with a response.
    replayed = np.where(r > 0, tokens - 1, 0)
    mask = offset < replayed[sample]
    runs = row_runs(cu, tokens, positions)  # every row, replayed or not, is placed
    return VerlRankPlan(
        cu_seqlens=cu, seqlens=tokens, positions=positions, runs=runs, replay_mask=mask
    )


def verl_rank_plan(
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    *,
    rank: VerlRank | None = None,
) -> VerlRankPlan:
    """The rows ``rank`` needs for a micro-batch of samples with these lengths, in the
    order verl packs them (:class:`VerlRankPlan`); no routing needed."""
    rank = VerlRank() if rank is None else rank
    if not isinstance(rank, VerlRank):
        raise ShapeError(f"rank must be a VerlRank, got {type(rank).__name__}")
    n = len(as_numpy(prompt_lens))
    if n < 1:
        raise ShapeError("verl_rank_plan needs at least one sample")
    return _plan(
        rank, lengths(prompt_lens, "prompt_lens", n), lengths(response_lens, "response_lens", n)
    )


def verl_rank_slice(
    routings: Sequence[RoutingLike],
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    *,
    rank: VerlRank | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_ids: Sequence[str] | None = None,
    as_torch: bool = False,
) -> VerlRankSlice:
    """One verl Megatron rank's R3 replay targets for one micro-batch, without the whole batch.

    Equal to what verl 0.9.1's Megatron engine derives from :func:`verl_layout`'s
    ``batch["routed_experts"]`` on that rank (``left_right_2_no_padding``,
    ``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data``):
    the same packing and padding, CP split (zigzag or contiguous), TP split, the rows of
    the stage's layers, the same replay mask; ``0`` wherever no row was recorded, as in
    verl's tensor.  Only the rank's own rows are copied (the checks read each sample's
    rows in place), so each rank lays out its part of a micro-batch from its rollouts
    without any process holding the whole batch.

    ``routings``, ``prompt_lens``, ``response_lens``: the micro-batch's samples *in the
    order verl packs them* (its micro-batch split, dynamic batch size included, reorders
    samples; the samples' ``r3_rollout_id`` travel with them), as for :func:`verl_layout`:
    sample ``i`` has ``P_i + R_i`` tokens and ``P_i + R_i - 1`` rows.  ``rank``: this
    rank's :class:`VerlRank` (default: one rank holding every layer).  ``layer_ids``: the
    absolute MoE layer ids of the routing's layer axis (required for plain arrays, taken
    from :class:`Routing` inputs).  ``missing``: rows nobody shipped raise (default) or,
    with ``"fill"``, become ``0`` (and are replayed, as verl replays :func:`verl_layout`'s
    fill).  ``as_torch=True`` returns CPU tensors (``int64`` targets, ``bool`` mask).

    Packing, as verl's ``preprocess_thd_engine``: each sample padded to a multiple of
    ``tp_size * cp_size * 2`` (zigzag with ``cp_size > 1``) or ``tp_size * cp_size``; then
    CP rank ``r`` keeps chunks ``r`` and ``2*cp_size - 1 - r`` of each sequence (zigzag) or
    the ``r``-th of ``cp_size`` runs of the batch (contiguous); then TP rank ``t`` keeps the
    ``t``-th of ``tp_size`` parts.  Worked example: docs/layouts.md ("verl: one rank's
    slice").  Raises :class:`ShapeError` as :func:`verl_layout` does, and for a stage layer
    that is not a MoE layer of the routing.
    """
    rank = VerlRank() if rank is None else rank
    if not isinstance(rank, VerlRank):
        raise ShapeError(f"rank must be a VerlRank, got {type(rank).__name__}")
    batch, p, r = _check_lengths(
        routings, prompt_lens, response_lens, "verl_rank_slice", rollout_ids
    )
    local_ids, layer_pos = stage_layer_positions(
        batch, layer_ids, rank.stage_layers, "verl_rank_slice", allow_empty=True
    )
    fill = np.zeros(batch.topk, dtype=np.int64)
    arrays = [
        uncovered(arr, batch.routing_name(i), missing, fill) for i, arr in enumerate(batch.arrays)
    ]
    plan = _plan(rank, p, r)
    local = gather_local(
        arrays, plan.cu_seqlens, plan.positions, layer_pos, batch.topk, 0, batch.out_dtype
    )
    per_layer = [local[:, j].astype(np.int64) for j in range(local.shape[1])]
    return rank_slice_of(plan, per_layer, local_ids, batch.rollout_ids, as_torch)


def rank_slice_of(
    plan: VerlRankPlan,
    per_layer: list[Any],
    layer_ids: tuple[int, ...],
    rollout_ids: tuple[str, ...] | None,
    as_torch: bool,
) -> VerlRankSlice:
    """The :class:`VerlRankSlice` of ``plan`` with its targets ``per_layer`` (one int64
    ``[local_tokens, K]`` array per layer of ``layer_ids``, ``0`` where the plan has no
    row), as verl's routers take them."""
    replay_mask: Any = plan.replay_mask
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
        replay_mask = torch.from_numpy(replay_mask)
    return VerlRankSlice(
        per_layer=per_layer,
        layer_ids=layer_ids,
        replay_mask=replay_mask,
        cu_seqlens=plan.cu_seqlens.astype(np.int32),
        seqlens=plan.seqlens.astype(np.int32),
        positions=plan.positions,
        rollout_ids=rollout_ids,
    )
