"""Each slime / miles Megatron rank: its replay targets planned and finished, its fill's loop.

Runs in every training process, inside the fill the framework calls before a step's
forwards (slime's ``MegatronTrainRayActor.fill_routing_replay``, miles'
``fill_replay_data``), which the framework's ``install_rank_local`` replaced.  No I/O of
its own: :func:`plan_replay` says which rows of a micro-batch the rank reads (its CP /
SP slice of the framework's thd pack, from token counts alone) and
:meth:`ReplayPlan.replay` turns the rows read into what the framework's fill hands its
routers (padding rows its own); the framework's ``fetch_rank_replay`` reads between the
two (:func:`r3_client.rank_local.fetch_plan_rows`).  :func:`fill_micro_batches` is the
fill's loop over the actor's data iterator; :func:`trained_states` tells an expanded
sample's state from what the ranks are shipped.  The rest is the hook's environment.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import (
    IntegrationError,
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    ShapeError,
    UsageError,
)
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.expansion import rollout_states, stat_each
from r3_client.integrations.samples.framework import Framework
from r3_client.layouts import Missing
from r3_client.layouts._packing import (
    RankPlan,
    check_rank,
    contiguous_positions,
    cumulative,
    row_runs,
    sp_part,
    zigzag_positions,
)

#: The field slime's and miles' own fill reads (and deletes once filled).
ROUTED_EXPERTS = "rollout_routed_experts"

#: What a rank-local fill asks of the actor's data iterator per micro-batch: the keys
#: slime and miles ship to every DP rank anyway (slime ray/rollout.py:786-807; miles
#: ray/rollout/train_data_conversion.py:357-381).  The first two are needed; the loss
#: masks and response lengths tell each sample's state under ``exact``
#: (:func:`trained_states`).
FILL_KEYS = ("sample_indices", "tokens", "loss_masks", "response_lengths")


@dataclass(frozen=True)
class SampleRank:
    """One Megatron training rank, as slime's and miles' replay fill sees it.

    ``tp_size``/``tp_rank``, ``cp_size``/``cp_rank``: the rank's tensor- and context-parallel
    coordinates (``mpu`` in slime, ``get_parallel_state()`` in miles).
    ``sequence_parallel``, ``allgather_cp``, ``data_pad_size_multiplier``: the trainer's
    ``args`` of those names.  ``router_layers``: the absolute decoder layer ids of the
    rank's MoE routers, in the order their replay objects were created (virtual stages in
    order, layers ascending, dense layers skipped: what the actor's loop walks);
    ``None`` is every layer the rollouts hold, ``()`` a stage without MoE layers.
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False
    allgather_cp: bool = False
    data_pad_size_multiplier: int = 128
    router_layers: Sequence[int] | None = None


@dataclass(frozen=True)
class RankReplay:
    """One micro-batch's replay targets on one rank: what the actor records per router.

    ``per_layer[j]`` (``[num_local_tokens, K]``, ``int32``) is what the framework's fill
    hands the router of absolute layer ``layer_ids[j]``: ``prepared[:, layer_id]`` after
    its own last-token row, CP split, padding and SP split.  :meth:`record` feeds them
    to the rank's replay objects in order.
    """

    layer_ids: tuple[int, ...]
    per_layer: list[Any]
    rollout_ids: tuple[str, ...]
    num_local_tokens: int
    num_rows: int  # rows read from the cache (the rank's share)

    def record(self, replays: Sequence[Any]) -> None:
        """``replays[j].record(per_layer[j])``, refusing a count that differs (as slime's
        ``assert routing_replay_offset == len(RoutingReplay.all_routing_replays)``)."""
        if len(replays) != len(self.per_layer):
            raise ShapeError(
                f"the rank has {len(replays)} routers but this replay holds "
                f"{len(self.per_layer)} layers {list(self.layer_ids)}"
            )
        for replay, rows in zip(replays, self.per_layer, strict=True):
            replay.record(rows)


def _rank_plan(
    num_tokens: npt.NDArray[np.int64], rank: SampleRank
) -> tuple[RankPlan, npt.NDArray[np.int64]]:
    """The rank's local positions in slime's / miles' thd pack, from token counts alone.

    Per sample: its ``T - 1`` rows plus the trainer's last-token row (``T``); zigzag CP
    pads it to ``2 * cp * ceil(T / 2cp)`` and keeps chunks ``r`` and ``2cp - 1 - r``; the
    CP-local pack is padded to ``tp * data_pad_size_multiplier``; sequence parallel keeps
    TP rank ``t``'s part.  With ``allgather_cp`` the unsplit pack is padded to ``cp`` times
    that and cut into ``cp`` runs.  Positions past the pack's samples (``>= cu[-1]``) are
    pack padding.  Also returns each local position's *fill index*: the row it takes in the
    padding call that made it (``-1`` for a routing row).
    """
    for name, size, r in (("tp", rank.tp_size, rank.tp_rank), ("cp", rank.cp_size, rank.cp_rank)):
        check_rank(size, r, name)
    if rank.data_pad_size_multiplier < 1:
        raise ShapeError(
            f"data_pad_size_multiplier must be >= 1, got {rank.data_pad_size_multiplier}"
        )
    if num_tokens.ndim != 1 or (num_tokens < 1).any():
        raise ShapeError("num_tokens must be one count >= 1 per sample")
    cp = rank.cp_size
    pad_size = rank.tp_size * rank.data_pad_size_multiplier
    if rank.allgather_cp or cp == 1:
        padded = num_tokens.copy()
        cu = cumulative(padded)
        total = int(cu[-1])
        unit = pad_size * (cp if rank.allgather_cp else 1)
        full = total + (unit - total % unit) % unit
        if rank.allgather_cp:
            local = contiguous_positions(full, cp, rank.cp_rank)
        else:
            local = np.arange(full, dtype=np.int64)
    else:
        padded = 2 * cp * ((num_tokens + 2 * cp - 1) // (2 * cp))
        cu = cumulative(padded)
        pos = zigzag_positions(cu, padded, cp, rank.cp_rank)
        extra = (pad_size - pos.shape[0] % pad_size) % pad_size
        local = np.concatenate([pos, int(cu[-1]) + np.arange(extra, dtype=np.int64)])
    if rank.sequence_parallel:
        local = sp_part(local, rank.tp_size, rank.tp_rank, "the pack is padded to tp * multiplier")
    inside = local < cu[-1]
    sample = np.searchsorted(cu, np.minimum(local, cu[-1] - 1), side="right") - 1
    offset = local - cu[sample]
    # A routing row: -1.  The last-token row is its own padding call (row 0); a sample's
    # CP padding starts again at 0 after it; pack padding counts from the pack's end.
    in_sample = np.where(
        offset < num_tokens[sample] - 1, -1, np.maximum(offset - num_tokens[sample], 0)
    )
    fill_index = np.where(inside, in_sample, local - cu[-1])
    n_inside = int(inside.sum())  # positions ascend: the samples' part is a prefix
    runs = row_runs(cu, num_tokens, local[:n_inside])
    plan = RankPlan(cu_seqlens=cu, seqlens=num_tokens, positions=local, runs=runs)
    return plan, fill_index.astype(np.int64)


def _pad_values(
    fill_index: npt.NDArray[np.int64],
    layer_ids: Sequence[int],
    num_layers: int,
    topk: int,
    num_experts: int,
    dtype: np.dtype[Any],
) -> npt.NDArray[np.int64]:
    """slime's padding rows (``cp_utils.py:239-251``): row ``j`` of a padding call over a
    ``[*, num_layers, K]`` tensor holds ``arange(pad * L * K) % E`` at ``(j, l, k)``,
    computed in the per-sample tensor's ``dtype`` (int16 wraps, as torch's arange does)."""
    j = fill_index[None, :, None]
    lk = (np.asarray(layer_ids, dtype=np.int64)[:, None] * topk + np.arange(topk))[:, None]
    flat = (j * num_layers * topk + lk).astype(dtype)  # wraps like torch.arange(dtype=)
    return flat.astype(np.int64) % num_experts  # [L, len(fill_index), K]


@dataclass(frozen=True)
class ReplayPlan:
    """One micro-batch's rank-local read, planned from its token counts: read ``rows``
    (:class:`~r3_client.layouts.RankPlan`) of ``rollout_ids``, for ``layers`` (the rank's
    routers, sorted; ``None``: every layer the rollouts hold), fill ``-1`` where nothing
    was read; then :meth:`replay`."""

    rollout_ids: list[str]
    rows: RankPlan
    fill_index: npt.NDArray[np.int64]  # per local position: its padding row, -1 a routing row
    layers: tuple[int, ...] | None
    routers: tuple[int, ...] | None  # in replay order
    num_layers: int

    def replay(
        self,
        local: npt.NDArray[np.int64],
        got_ids: tuple[int, ...],
        *,
        missing: Missing,
        num_experts: int | None,
        as_torch: bool,
    ) -> RankReplay:
        """The rows read (``local``: ``[L, local tokens, K]``, layer major, of layers
        ``got_ids``) as the framework's fill hands them to the routers: rows nobody shipped
        replay experts ``0..K-1`` under ``missing="fill"``, padding rows are slime's
        ``arange % num_experts`` when ``num_experts`` is given, else miles' ``-1``."""
        routers = list(got_ids) if self.routers is None else list(self.routers)
        if any(x >= self.num_layers for x in got_ids):
            raise ShapeError(
                f"the rollouts hold layers {list(got_ids)}, beyond num_layers={self.num_layers}"
            )
        fill_index = self.fill_index
        is_row = fill_index < 0
        if missing == "fill" and local.shape[0]:  # rows nobody shipped: experts 0..K-1
            gap = is_row[None, :] & (local < 0).all(axis=-1)
            local[gap] = np.arange(local.shape[2])
        if local.shape[0]:
            pad = ~is_row
            if num_experts is not None:
                dtype = np.dtype(np.int16) if num_experts <= 1 << 15 else np.dtype(np.int32)
                local[:, pad] = _pad_values(
                    fill_index[pad], got_ids, self.num_layers, local.shape[2], num_experts, dtype
                )
            else:
                local[:, pad] = -1
        order = [got_ids.index(x) for x in routers]
        per_layer: list[Any] = [np.ascontiguousarray(local[j], dtype=np.int32) for j in order]
        if as_torch:
            import torch

            per_layer = [torch.from_numpy(a) for a in per_layer]
        return RankReplay(
            layer_ids=tuple(routers),
            per_layer=per_layer,
            rollout_ids=tuple(self.rollout_ids),
            num_local_tokens=self.rows.num_local_tokens,
            num_rows=self.rows.num_rows,
        )


def plan_replay(
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int] | npt.ArrayLike,
    *,
    rank: SampleRank,
    num_layers: int,
) -> ReplayPlan:
    """The :class:`ReplayPlan` of a micro-batch of ``rollout_ids`` of ``num_tokens``
    (``len(tokens)``) tokens each, in the order the actor packs them, on ``rank``
    (refused, :class:`~r3_client.ShapeError`, when its routers are not distinct decoder
    layers in ``[0, num_layers)``)."""
    ids = [check_rollout_id(r) for r in rollout_ids]
    counts = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    routers = None if rank.router_layers is None else tuple(int(x) for x in rank.router_layers)
    if routers is not None:
        bad = [x for x in routers if not 0 <= x < num_layers]
        if bad or len(set(routers)) != len(routers):
            raise ShapeError(
                f"router_layers {list(routers)} must be distinct decoder layers in "
                f"[0, {num_layers})"
            )
    rows, fill_index = _rank_plan(counts, rank)
    layers = None if routers is None else tuple(sorted(routers))
    return ReplayPlan(ids, rows, fill_index, layers, routers, num_layers)


def _as_array(x: Any) -> npt.NDArray[Any]:
    if hasattr(x, "detach"):  # torch (the actor moves loss masks to the GPU)
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def trained_states(
    source: Any,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Any],
) -> list[int | None] | None:
    """Each sample's state as a training rank can tell it: the state holding its first
    trained token (the first response token whose loss mask is set; a sample training none:
    its last token's), from one batched stat of the rollouts (``source.stat_many``, else one
    ``stat`` each: :func:`r3_client.expansion.stat_each`).  slime and miles ship no
    per-sample metadata to the ranks, but they do ship ``loss_masks`` and
    ``response_lengths``, and ``expand_samples`` zeroes each copy's mask before its
    state's first token, so this is the state it recorded.  A sample whose trained tokens
    run past that state's rows is then refused by the read ("expand the sample"); one
    whose earlier states are masked out (a resumed partial rollout under
    ``mask_offpolicy_in_partial_rollout``) replays its last state, as it should.  ``None``
    when ``source`` answers no stats (a :class:`~r3_client.DirectReader`): every sample is
    then read in its first state.  A rollout the cache does not hold gets ``None`` (the
    read names it)."""
    if getattr(source, "stat_many", None) is None and getattr(source, "stat", None) is None:
        return None
    ids = list(rollout_ids)
    distinct = list(dict.fromkeys(ids))
    infos = dict(zip(distinct, stat_each(source, distinct), strict=True))
    out: list[int | None] = []
    for rid, n, r, mask in zip(ids, num_tokens, response_lengths, loss_masks, strict=True):
        info = infos[rid]
        if isinstance(info, R3Error):
            if not isinstance(info, RolloutNotFoundError):
                raise info
            out.append(None)
            continue
        states = rollout_states(info, int(n))
        trained = np.flatnonzero(_as_array(mask).reshape(-1)[: int(r)])
        first = int(n) - int(r) + int(trained[0]) if trained.size else int(n) - 1
        row = max(0, first - 1)  # token t attended to rows [0, t): it trains in t - 1's state
        out.append(max(a for a, _, _ in states if a <= row))
    return out


def model_router_layers(models: Sequence[Any]) -> tuple[int, ...]:
    """The absolute decoder layers of a rank's MoE routers, in replay order, walked the way
    slime's actor (``actor.py:334-349``) and miles' ``register_replay_list_moe``
    (``megatron_utils/replay_utils.py:8-20``) walk them: per virtual stage ``vp_stage``
    (each model chunk's ``.module.config``), layers ``get_transformer_layer_offset`` to
    ``+ get_num_layers_to_build`` (Megatron's, answering from its parallel state), dense
    layers skipped by ``moe_layer_freq`` (an int: ``layer_id % freq != 0``; a list: ``0``).
    Imports megatron.core."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out: list[int] = []
    for vp_stage, model in enumerate(models):
        config = model.module.config
        num_layers_to_build = get_num_layers_to_build(config, vp_stage=vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        freq = config.moe_layer_freq
        for layer_id in range(offset, offset + num_layers_to_build):
            if isinstance(freq, int):
                if layer_id % freq != 0:
                    continue
            elif isinstance(freq, list):
                if len(freq) != config.num_layers:
                    raise ShapeError(
                        f"moe_layer_freq has {len(freq)} entries for {config.num_layers} layers"
                    )
                if freq[layer_id] == 0:
                    continue
            out.append(int(layer_id))
    return tuple(out)


# ------------------------------------------------------------------ the fill's loop

#: One micro-batch as the fill reads it: its keys, ``len(tokens)`` per sample, and the loss
#: masks and response lengths when the iterator ships them.
MicroBatch = tuple[list[str], list[int], list[Any] | None, list[Any] | None]


def _micro_batches(
    fw: Framework, run: str, data_iterator: Sequence[Any], count: int
) -> list[MicroBatch]:
    """``count`` micro-batches of ``data_iterator[0].get_next(FILL_KEYS)``, each sample's
    key rebuilt from its ``sample_indices`` (:meth:`Framework.rank_keys
    <r3_client.integrations.samples.framework.Framework.rank_keys>`)."""
    batches: list[MicroBatch] = []
    for done in range(count):
        batch = data_iterator[0].get_next(list(FILL_KEYS))
        indices, tokens = batch.get("sample_indices"), batch.get("tokens")
        if indices is None or tokens is None:
            raise InvalidRequestError(
                f"{fw.name} rank-local routing: micro-batch {done} carries no "
                f"{'sample_indices' if indices is None else 'tokens'}; the rollout keys are "
                "rebuilt from sample_indices, which the trainer ships to every DP rank"
            )
        if len(indices) != len(tokens):
            raise ShapeError(
                f"{fw.name} micro-batch {done}: {len(indices)} sample_indices for "
                f"{len(tokens)} samples"
            )
        if any(i is None for i in indices):
            raise InvalidRequestError(f"{fw.name} micro-batch {done}: a sample has no index")
        batches.append(
            (
                fw.rank_keys(run, indices),
                [len(t) for t in tokens],
                batch.get("loss_masks"),
                batch.get("response_lengths"),
            )
        )
    return batches


def _batch_states(
    source: Any, batches: Sequence[MicroBatch], view: ViewPolicy
) -> list[list[int | None] | None]:
    """Each micro-batch's samples' states under ``exact``: :func:`trained_states` of the
    whole call's samples (one batched stat, where ``source`` answers stats and every
    micro-batch ships its loss masks and response lengths); ``None`` otherwise."""
    states: list[list[int | None] | None] = [None] * len(batches)
    if view == "exact" and batches and all(m is not None and r is not None for *_, m, r in batches):
        flat = trained_states(
            source,
            [k for keys, *_ in batches for k in keys],
            [n for _, counts, *_ in batches for n in counts],
            [int(x) for *_, r in batches for x in r],  # type: ignore[union-attr]
            [m for *_, masks, _ in batches for m in masks],  # type: ignore[union-attr]
        )
        if flat is not None:
            at = 0
            for j, (keys, *_) in enumerate(batches):
                states[j] = flat[at : at + len(keys)]
                at += len(keys)
    return states


def fill_micro_batches(
    fw: Framework,
    source: Any,
    run: str,
    data_iterator: Sequence[Any],
    num_microbatches: Sequence[int],
    fetch: Callable[..., RankReplay],
    record: Callable[[RankReplay], None],
    view: ViewPolicy = "exact",
) -> int:
    """The loop of slime's ``fill_routing_replay`` (``actor.py:319-323, 354-355``) and miles'
    ``fill_replay_data`` (``replay_data.py:55-56, 73-74, 133-134``), reading
    ``sample_indices`` and ``tokens`` (and the loss masks and response lengths) instead of
    the routing: every iterator reset, then ``sum(num_microbatches)`` times
    ``data_iterator[0].get_next(FILL_KEYS)``, each micro-batch's replay read from ``source``
    under ``view`` (``fetch``: the framework's ``fetch_rank_replay`` with the rank's
    keywords bound; keys rebuilt from ``sample_indices``, ``len(tokens)`` per sample, torch
    tensors) handed to ``record``, in order, then every iterator reset again.  Under
    ``exact`` each sample's state is :func:`trained_states` of the whole call's samples
    (one batched stat per call, where ``source`` answers stats).  Returns the count."""
    for iterator in data_iterator:
        iterator.reset()
    batches = _micro_batches(fw, run, data_iterator, sum(int(n) for n in num_microbatches))
    for (keys, counts, _, _), states in zip(
        batches, _batch_states(source, batches, view), strict=True
    ):
        record(fetch(source, keys, counts, as_torch=True, view=view, states=states))
    for iterator in data_iterator:
        iterator.reset()
    return len(batches)


# ------------------------------------------------------------------ the hook's environment


def source_getter(source: Any) -> Callable[[], Any]:
    """``source``: a :class:`~r3_client.rank_local.RangeSource` (has ``get_ranges``), or a
    callable making one, called once, on the first fill (in the training process)."""
    if hasattr(source, "get_ranges"):
        made: list[Any] = [source]
    elif callable(source):
        made = []
    else:
        raise UsageError("source must have get_ranges, or make such an object when called")

    def get() -> Any:
        if not made:
            made.append(source())
            if not hasattr(made[0], "get_ranges"):
                raise UsageError(f"the source factory made {type(made[0]).__name__}, no get_ranges")
        return made[0]

    return get


def hook_source(
    framework: str, source: Any, run: str | None, client: Callable[..., Any]
) -> tuple[Any, str]:
    """An installed hook's ``(source, run)``: those given, else read from the training
    process's environment: ``R3_URL``, ``R3_KEY`` (optional: the API key) and ``R3_RUN``,
    the source then ``client(R3_URL, api_key=R3_KEY)`` made on the first fill (in the
    process that fills); a clear error naming what is unset."""
    if source is not None and run is not None:
        return source, run
    unset = [v for v in ("R3_URL", "R3_RUN") if not os.environ.get(v)]
    if unset:
        raise IntegrationError(
            f"r3_client.integrations.{framework}.install_rank_local reads the cache's URL and "
            f"the run from R3_URL and R3_RUN (R3_KEY: its API key), unset here: "
            f"{', '.join(unset)}.  Set them in every training process's environment, or "
            "pass source= and run="
        )
    if source is None:
        source = functools.partial(
            client, os.environ["R3_URL"], api_key=os.environ.get("R3_KEY") or None
        )
    return source, os.environ["R3_RUN"] if run is None else run


def unwrapped(fn: Any) -> Any:
    """The framework's own function under an installed hook (``_r3_original``)."""
    return getattr(fn, "_r3_original", fn)


def check_params(fn: Any, want: Sequence[str], where: str, pinned: str) -> str | None:
    """A problem when ``fn``'s parameters (unwrapped) are not ``want``, else ``None``."""
    try:
        params = list(inspect.signature(unwrapped(fn)).parameters)
    except (TypeError, ValueError):
        return f"{where} has no signature"
    if params != list(want):
        return f"{where} takes {params}, not {list(want)} ({pinned})"
    return None
