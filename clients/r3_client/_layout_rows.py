"""What every third-party layout does to a rollout's rows before placing them.

Two decisions each consumer's contract fixes (docs/integrations.md):

* **the layer axis** -- our format holds MoE layers only (``layer_ids``); verl,
  slime and miles index it by absolute transformer layer (``num_hidden_layers`` /
  ``args.num_layers``), so their layouts scatter each MoE layer's rows to its id
  and fill dense layers with ``0``, which is what upstream SGLang returns for a
  dense layer (its rows are never read: a dense layer has no router);
* **uncovered rows** -- rows no segment covered decode as ``-1``.  No third-party
  consumer falls back to its own router on them (verl and slime crash on ``-1``,
  miles silently replays experts ``0..K-1``), so by default a layout refuses them
  (``missing="raise"``); ``missing="fill"`` fills them the way that consumer fills
  rows it has no route for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import check_layer_ids

__all__ = ["Missing", "absolute_layers", "uncovered"]

#: What a layout does with rows nobody shipped (``-1`` rows inside a rollout).
Missing: TypeAlias = Literal["raise", "fill"]


def _spans(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``[a, b)`` runs of True in a 1-D mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def uncovered(
    arr: npt.NDArray[Any], name: str, missing: Missing, fill: npt.NDArray[Any] | None
) -> npt.NDArray[Any]:
    """``arr`` ``[rows, L, K]`` with its all-``-1`` (token, layer) rows handled per ``missing``.

    ``"raise"``: :class:`ShapeError` naming ``name`` and the token rows nobody shipped.
    ``"fill"``: a copy with each such row set to ``fill`` (``[K]``), or ``arr`` itself with
    ``fill=None`` (the consumer fills ``-1`` rows itself, as the Megatron driver does).  A
    row that mixes ``-1`` with expert ids is corrupt whatever the policy.
    """
    if missing not in ("raise", "fill"):
        raise ShapeError(f"missing must be 'raise' or 'fill', got {missing!r}")
    neg = arr < 0
    if not neg.any():
        return arr
    empty = neg.all(axis=-1)
    if (neg.any(axis=-1) & ~empty).any():
        raise ShapeError(f"{name} has a row mixing -1 with expert ids: the routing is corrupt")
    if missing == "raise":
        spans = _spans(np.asarray(empty.any(axis=-1)))
        shown = ", ".join(f"[{a}, {b})" for a, b in spans[:4]) + (" …" if len(spans) > 4 else "")
        raise ShapeError(
            f"{name} has no recorded route for token rows {shown}: nobody shipped them "
            "(a gap between segments). Refusing, because this trainer does not fall back to "
            "its router there; re-generate the rollout, or pass missing='fill' to fill them "
            "as this trainer fills rows it has no route for"
        )
    if fill is None:
        return arr
    out = arr.copy()
    out[empty] = fill.astype(arr.dtype)
    return out


def absolute_layers(
    arr: npt.NDArray[Any],
    layer_ids: Sequence[int] | None,
    num_layers: int | None,
    name: str,
) -> npt.NDArray[Any]:
    """``arr`` ``[rows, L, K]`` on the absolute layer axis ``[rows, num_layers, K]``.

    MoE layer ``layer_ids[j]`` gets ``arr[:, j]``; every other (dense) layer holds ``0``.
    ``num_layers=None`` returns ``arr`` (the MoE-only axis).
    """
    if num_layers is None:
        return arr
    if layer_ids is None:
        raise ShapeError(
            f"{name}: num_layers= needs the MoE layer ids (a Routing carries them; pass "
            "layer_ids= with plain arrays)"
        )
    ids = check_layer_ids(layer_ids)
    if len(ids) != arr.shape[1]:
        raise ShapeError(f"{name} has {arr.shape[1]} MoE layers but layer_ids names {len(ids)}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int | np.integer):
        raise ShapeError(f"num_layers must be an int, got {type(num_layers).__name__}")
    if ids[-1] >= num_layers:
        raise ShapeError(
            f"MoE layer id {ids[-1]} is not below num_layers={num_layers} (the model's "
            "num_hidden_layers, MTP layers excluded)"
        )
    out = np.zeros((arr.shape[0], int(num_layers), arr.shape[2]), dtype=arr.dtype)
    out[:, list(ids)] = arr
    return out
