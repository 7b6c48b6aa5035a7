"""Packed (THD) batches and one rank's part of them: what Megatron and verl slice alike.

A packed batch concatenates its samples, each padded to a multiple the trainer picks;
``cu`` are the cumulative padded lengths.  A rank keeps some *positions* of it:

* **context parallel, zigzag** (:func:`zigzag_positions`): each padded sequence cut into
  ``2 * cp_size`` equal chunks, CP rank ``r`` keeping chunks ``r`` and
  ``2*cp_size - 1 - r``, sequence by sequence (Megatron's load-balanced split, as
  Transformer Engine's ``thd_get_partitioned_indices`` and verl's ``preprocess_thd_engine``
  apply it);
* **context parallel, contiguous** (:func:`contiguous_positions`): CP rank ``r`` keeping
  the ``r``-th of ``cp_size`` equal runs of the whole padded batch (verl's layout for
  DeepSeek-V4's hybrid attention);
* **sequence parallel** (:func:`sp_part`): the CP-local positions cut into ``tp_size``
  equal contiguous parts, TP rank ``t`` keeping part ``t`` (Megatron's
  ``scatter_to_sequence_parallel_region``);
* **pipeline stage** (:func:`stage_layer_positions`): the MoE layers the stage's
  routers own.

:func:`gather_local` then copies only those positions' rows, so a rank's slice costs
its own tokens and layers, never the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import check_layer_ids
from r3_client.layouts._rows import Rows

__all__ = [
    "RankPlan",
    "check_rank",
    "contiguous_positions",
    "cumulative",
    "gather_local",
    "row_runs",
    "sample_offsets",
    "sp_part",
    "stage_layer_positions",
    "zigzag_positions",
]


@dataclass(frozen=True)
class RankPlan:
    """Which rows one rank needs for one micro-batch, known before anything is fetched.

    From the samples' lengths alone: the packed batch (``cu_seqlens``: cumulative padded
    lengths; ``seqlens``: token counts), the rank's ``positions`` in it, and ``runs``:
    ``(sample, start, end, local)``, rows ``[start, end)`` of sample ``sample`` landing at
    local tokens ``[local, local + end - start)`` (:func:`row_runs`).  The runs cover
    every row the rank holds once: only those need fetching
    (:mod:`r3_client.rank_local`); every other local token is a last token or padding.
    """

    cu_seqlens: npt.NDArray[np.int64]
    seqlens: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    runs: tuple[tuple[int, int, int, int], ...]

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see."""
        return int(self.positions.shape[0])

    @property
    def num_rows(self) -> int:
        """Rows the rank reads: the sum of its runs' lengths."""
        return sum(b - a for _, a, b, _ in self.runs)


def check_rank(size: int, rank: int, name: str) -> None:
    """``size >= 1`` and ``0 <= rank < size`` (``name``: ``"tp"`` or ``"cp"``)."""
    for what, value in ((f"{name}_size", size), (f"{name}_rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ShapeError(f"{what} must be an int, got {type(value).__name__}")
    if size < 1:
        raise ShapeError(f"{name}_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ShapeError(f"{name}_rank must be in [0, {size}), got {rank}")


def cumulative(padded: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``[0, p0, p0 + p1, ...]``: the packed batch's ``cu_seqlens_padded``."""
    return np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)


def zigzag_positions(
    cu: npt.NDArray[np.int64], padded: npt.NDArray[np.int64], cp_size: int, cp_rank: int
) -> npt.NDArray[np.int64]:
    """Packed-batch positions CP rank ``cp_rank`` keeps: per sequence, two zigzag chunks.

    Every ``padded`` length must divide by ``2 * cp_size`` (the caller checks, in its terms).
    """
    if cp_size == 1:
        return np.arange(int(cu[-1]), dtype=np.int64)
    chunk = padded // (2 * cp_size)
    firsts = (cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk)
    # Sequence i contributes [first_a, first_a + chunk) then [first_b, first_b + chunk).
    starts = np.stack(firsts, axis=1).reshape(-1)
    lens = np.repeat(chunk, 2)
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + offsets


def contiguous_positions(total: int, cp_size: int, cp_rank: int) -> npt.NDArray[np.int64]:
    """Packed-batch positions CP rank ``cp_rank`` keeps: the ``cp_rank``-th of ``cp_size`` runs."""
    if total % cp_size:
        raise ShapeError(
            f"the padded batch of {total} tokens does not split over cp_size={cp_size}"
        )
    part = total // cp_size
    return np.arange(cp_rank * part, (cp_rank + 1) * part, dtype=np.int64)


def sp_part(
    positions: npt.NDArray[np.int64], tp_size: int, tp_rank: int, hint: str
) -> npt.NDArray[np.int64]:
    """Sequence parallel: TP rank ``tp_rank``'s contiguous part of the CP-local positions.

    ``hint`` ends the error when the parts are unequal (what the caller can change).
    """
    n_cp = positions.shape[0]
    if n_cp % tp_size:
        raise ShapeError(
            f"sequence parallel splits the {n_cp} CP-local tokens over tp_size={tp_size} "
            f"ranks, which does not divide evenly; {hint}"
        )
    part = n_cp // tp_size
    return positions[tp_rank * part : (tp_rank + 1) * part]


def stage_layer_positions(
    batch: Rows,
    layer_ids: Sequence[int] | None,
    stage_layers: Sequence[int] | None,
    what: str,
    *,
    allow_empty: bool = False,
) -> tuple[tuple[int, ...], list[int]]:
    """This stage's MoE layer ids (ascending) and their positions on the routing's layer axis.

    ``layer_ids`` names the routing's ``L`` axis (required unless :class:`Routing` inputs
    carry it); ``stage_layers=None`` is every layer.  ``allow_empty``: a stage without MoE
    layers (a dense first stage) gets none instead of an error.
    """
    if layer_ids is None:
        if batch.layer_ids is None:
            raise ShapeError(f"{what} needs layer_ids= for plain-array routing")
        ids = batch.layer_ids
    else:
        ids = check_layer_ids(layer_ids)
        if batch.layer_ids is not None and batch.layer_ids != ids:
            raise ShapeError(
                f"layer_ids={list(ids)} but the routing covers MoE layers {list(batch.layer_ids)}"
            )
    if len(ids) != batch.num_layers:
        raise ShapeError(
            f"routing has {batch.num_layers} MoE layers but layer_ids names {len(ids)}: {list(ids)}"
        )
    if stage_layers is None:
        local_ids = ids
    else:
        wanted = [int(s) for s in stage_layers]
        missing = [s for s in wanted if s not in ids]
        if missing:
            raise ShapeError(f"stage layers {missing} are not among the MoE layer_ids {list(ids)}")
        if (not wanted and not allow_empty) or len(set(wanted)) != len(wanted):
            raise ShapeError(f"stage_layers must be non-empty without repeats, got {wanted}")
        local_ids = tuple(sorted(wanted))
    return local_ids, [ids.index(lid) for lid in local_ids]


def sample_offsets(
    cu: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """For each packed-batch position, its sample ``i`` (``cu[i] <= p < cu[i + 1]``) and
    its offset ``p - cu[i]`` in that sample."""
    sample = np.searchsorted(cu, positions, side="right") - 1
    return sample, positions - cu[sample]


def gather_local(
    arrays: Sequence[npt.NDArray[Any]],
    cu: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    layer_pos: Sequence[int],
    topk: int,
    fill: int,
    dtype: np.dtype[Any],
) -> npt.NDArray[Any]:
    """``[len(positions), len(layer_pos), topk]``: each position's row, ``fill`` where none.

    Position ``p`` of sample ``i`` (``cu[i] <= p < cu[i + 1]``) holds row ``p - cu[i]`` of
    ``arrays[i]`` at layers ``layer_pos``, or ``fill`` past its rows (the last token and
    padding).  ``positions`` ascend, as every split above leaves them.  Only those rows
    are read.
    """
    out = np.full((positions.shape[0], len(layer_pos), topk), fill, dtype=dtype)
    sample, offset = sample_offsets(cu, positions)
    # positions ascend, so each sample's local positions are one run [bounds[i], bounds[i+1]).
    bounds = np.searchsorted(sample, np.arange(len(arrays) + 1))
    layers = np.asarray(layer_pos, dtype=np.intp)
    for i, arr in enumerate(arrays):
        a, b = int(bounds[i]), int(bounds[i + 1])
        if a == b:
            continue
        off = offset[a:b]
        keep = off < arr.shape[0]
        out[a:b][keep] = arr[np.ix_(off[keep], layers)]
    return out


def row_runs(
    cu: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]
) -> tuple[tuple[int, int, int, int], ...]:
    """The rows a rank's ``positions`` hold, as runs ``(sample, start, end, local)``.

    Rows ``[start, end)`` of sample ``sample`` land at local tokens ``[local, local + end
    - start)``; sample ``i`` has rows ``0 .. tokens[i] - 2`` (none for its last token and
    padding).  What a rank reads (:mod:`r3_client.rank_local`), known from lengths alone.
    """
    sample, offset = sample_offsets(cu, positions)
    keep = np.flatnonzero(offset < tokens[sample] - 1)
    if not keep.shape[0]:
        return ()
    breaks = np.flatnonzero(
        (np.diff(keep) != 1) | (np.diff(sample[keep]) != 0) | (np.diff(offset[keep]) != 1)
    )
    firsts = np.concatenate([[0], breaks + 1])
    lasts = np.concatenate([breaks, [keep.shape[0] - 1]])
    return tuple(
        (int(sample[keep[f]]), int(offset[keep[f]]), int(offset[keep[t]]) + 1, int(keep[f]))
        for f, t in zip(firsts, lasts, strict=True)
    )
