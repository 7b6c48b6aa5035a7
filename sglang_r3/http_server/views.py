"""One output's rows split into first computations and views (HTTP process, worker thread).

A request computes each position in some *epoch*: epoch 0 is its first prefill and
decode; each retraction ends an epoch, and the re-prefill after it starts the next.  The
scheduler hooks (:mod:`sglang_r3.scheduler.row_hooks`) report, per epoch, the row its prefill
started computing at (its radix-cache hit), and at each retraction the rows computed so
far.  From those:

* the **first computation** of every row past the stored end is kept as the rollout's
  segments (the rows the tokens sampled right after them attended to first);
* every epoch whose prefill recomputed rows that already had a computation (below the
  stored end, or below the retraction point) yields a **view**: those rows as that epoch
  computed them, serving the tokens from the row where the epoch's own rows start.

Nothing here runs when no prefill recomputed a stored row (the usual multi-turn turn, a
full radix-cache hit): the output is its rows from the stored end, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Computations", "ViewRows", "split_computations"]


@dataclass(frozen=True, slots=True)
class ViewRows:
    """Rows ``[start, end)`` recomputed by the epoch whose tokens start at row ``serves``."""

    start: int
    end: int
    serves: int
    rows: npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class Computations:
    """An output's rows ``[start, end)`` as first computed, where they split, and its views."""

    rows: npt.NDArray[Any]
    cuts: tuple[int, ...]  # rows where an epoch's own rows start (segment boundaries)
    views: tuple[ViewRows, ...]


def split_computations(
    final: npt.NDArray[Any],
    first: int,
    start: int,
    epochs: tuple[int, ...],
    snapshots: tuple[tuple[int, npt.NDArray[Any]], ...],
) -> Computations:
    """Split what the engine handed over for one output.

    ``final``: the rows ``[first, end)`` as the request's KV held them when it finished
    (each row's last computation); ``start``: the stored end (rows below it are stored);
    ``epochs[e]``: the row epoch ``e``'s prefill started computing at; ``snapshots[i]``:
    ``(n, rows [0, n))`` kept at retraction ``i + 1`` (the end of epoch ``i``).
    """
    end = first + final.shape[0]
    epochs = epochs or (start,)
    # Epoch e's own rows start at bound[e]: the stored end, then each retraction's rows.
    bounds = [start, *(min(max(n, start), end) for n, _ in snapshots)]

    def computed_in(e: int, a: int, b: int) -> npt.NDArray[Any]:
        if e < len(snapshots):
            return snapshots[e][1][a:b]
        return final[a - first : b - first]

    rows = final[start - first :]
    if snapshots:
        rows = np.array(rows, copy=True)
        for e in range(len(snapshots)):
            a, b = bounds[e], bounds[e + 1]
            if a < b:
                rows[a - start : b - start] = computed_in(e, a, b)
    views = []
    for e, h in enumerate(epochs[: len(bounds)]):
        lo, hi = max(h, first), bounds[e]
        if lo < hi:
            views.append(ViewRows(lo, hi, hi, computed_in(e, lo, hi)))
    cuts = {*bounds[1:], *(v.serves for v in views)}
    return Computations(rows, tuple(sorted(c for c in cuts if start < c < end)), tuple(views))
