"""What every layout checks and does to a batch's rows before placing them.

Shared by the consumer modules of :mod:`r3_client.layouts`:

* **validation** -- :func:`collect` checks a batch of rollouts (each ``[T-1, L, K]``,
  all with the same ``L``, ``K`` and layer ids) into :class:`Rows`, which also names a
  sample in errors; :func:`lengths` and :func:`check_rows_match_tokens` check the
  trainer's lengths against the rows;
* **the layer axis** -- our format holds MoE layers only (``layer_ids``); verl, slime
  and miles index it by absolute transformer layer (``num_hidden_layers`` /
  ``args.num_layers``), so :func:`absolute_layers` scatters each MoE layer's rows to
  its id and fills dense layers with ``0``, which is what upstream SGLang returns for a
  dense layer (its rows are never read: a dense layer has no router);
* **uncovered rows** -- rows no segment covered decode as ``-1``.  No third-party
  consumer falls back to its own router on them (verl and slime crash on ``-1``,
  miles silently replays experts ``0..K-1``), so by default a layout refuses them
  (``missing="raise"``, :func:`uncovered`); ``missing="fill"`` fills them the way that
  consumer fills rows it has no route for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import Routing, check_layer_ids

__all__ = [
    "Missing",
    "RoutingLike",
    "Rows",
    "absolute_layers",
    "as_numpy",
    "check_rows_match_tokens",
    "collect",
    "consumer_rows",
    "lengths",
    "resolve_layer_ids",
    "uncovered",
]

#: One rollout's routing: a :class:`Routing` (``start == 0``) or an integer array ``[T-1, L, K]``.
RoutingLike: TypeAlias = "Routing | npt.NDArray[np.integer[Any]]"

#: What a layout does with rows nobody shipped (``-1`` rows inside a rollout).
Missing: TypeAlias = Literal["raise", "fill"]

_I16 = np.iinfo(np.int16)


@dataclass(frozen=True)
class Rows:
    """Validated rows of a batch of rollouts (all share ``L`` and ``K``)."""

    arrays: list[npt.NDArray[np.integer[Any]]]
    layer_ids: tuple[int, ...] | None  # from Routing inputs, when any were given
    num_layers: int
    topk: int
    max_id: int
    rollout_ids: tuple[str, ...] | None = None  # the caller's, for error messages only
    single: bool = False  # one sample (slime, miles): no batch index to name

    def _rid(self, i: int) -> str:
        return f" (rollout {self.rollout_ids[i]!r})" if self.rollout_ids is not None else ""

    def who(self, i: int) -> str:
        """Sample ``i`` in an error message: ``sample 2 (rollout 'r-7')``."""
        return ("the sample" if self.single else f"sample {i}") + self._rid(i)

    def routing_name(self, i: int) -> str:
        """Sample ``i``'s routing in an error message: ``sample 2's routing (rollout 'r-7')``."""
        return ("the routing" if self.single else f"sample {i}'s routing") + self._rid(i)

    @property
    def out_dtype(self) -> np.dtype[Any]:
        """int16 while every id fits, else int32."""
        return np.dtype(np.int16) if self.max_id <= _I16.max else np.dtype(np.int32)

    def lengths(self) -> npt.NDArray[np.int64]:
        """Each sample's row count."""
        return np.array([a.shape[0] for a in self.arrays], dtype=np.int64)


def as_numpy(x: Any) -> npt.NDArray[Any]:
    """A numpy view of a numpy array, array-like, or (CPU or GPU) torch tensor."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _one(routing: RoutingLike, name: str) -> tuple[npt.NDArray[Any], tuple[int, ...] | None]:
    """Validate one rollout's routing; return its ``[T-1, L, K]`` array and layer ids."""
    layer_ids: tuple[int, ...] | None = None
    if isinstance(routing, Routing):
        if routing.start != 0:
            raise ShapeError(
                f"{name} starts at token {routing.start}; layouts need the whole rollout's rows "
                "from token 0 (fetch it without start=, or select(start=0))"
            )
        arr = routing.indices
        layer_ids = routing.layer_ids
    else:
        arr = as_numpy(routing)
    if arr.ndim != 3:
        raise ShapeError(f"{name} must be [tokens-1, layers, topk], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.shape[1] < 1 or arr.shape[2] < 1:
        raise ShapeError(f"{name} has an empty layer or top-k axis: shape {arr.shape}")
    return arr, layer_ids


def _rollout_ids(ids: Sequence[str] | None, n: int) -> tuple[str, ...] | None:
    """The caller's rollout ids, one per sample (they only name samples in errors)."""
    if ids is None:
        return None
    if isinstance(ids, str):
        raise ShapeError("rollout_ids must list one id per sample, not be one string")
    out = tuple(ids)
    if len(out) != n:
        raise ShapeError(f"rollout_ids must name each sample ({n}), got {len(out)}")
    bad = [x for x in out if not isinstance(x, str)]
    if bad:
        raise ShapeError(f"rollout_ids must be strings, got {type(bad[0]).__name__}")
    return out


def collect(
    routings: Sequence[RoutingLike] | RoutingLike,
    what: str,
    rollout_ids: Sequence[str] | None = None,
    *,
    single: bool = False,
) -> Rows:
    """Validate a batch: each rollout well-formed, all with the same L, K (and layer ids).

    ``rollout_ids`` and ``single`` only change how errors name a sample (:class:`Rows`).
    """
    if isinstance(routings, Routing) or (isinstance(routings, np.ndarray) and routings.ndim == 3):
        raise ShapeError(f"{what} takes a list of rollouts (one per sample), not one routing")
    items = list(routings)
    if not items:
        raise ShapeError(f"{what} needs at least one sample")
    names = Rows([], None, 0, 0, 0, _rollout_ids(rollout_ids, len(items)), single)
    arrays: list[npt.NDArray[Any]] = []
    layer_ids: tuple[int, ...] | None = None
    lo, hi = 0, -1
    for i, item in enumerate(items):
        arr, ids = _one(item, names.routing_name(i))
        if arrays and arr.shape[1:] != arrays[0].shape[1:]:
            raise ShapeError(
                f"{names.routing_name(i)} has [layers, topk] = {list(arr.shape[1:])}, "
                f"but sample 0 has {list(arrays[0].shape[1:])}"
            )
        if ids is not None:
            if layer_ids is not None and ids != layer_ids:
                raise ShapeError(
                    f"{names.routing_name(i)} covers MoE layers {list(ids)}, "
                    f"an earlier sample covers {list(layer_ids)}"
                )
            layer_ids = ids
        if arr.size:
            lo, hi = min(lo, int(arr.min())), max(hi, int(arr.max()))
        arrays.append(arr)
    if lo < -1:
        raise ShapeError(f"routing holds expert id {lo}; ids are >= 0, and -1 marks 'no route'")
    if hi > np.iinfo(np.int32).max:
        raise ShapeError(f"routing holds expert id {hi}, which does not fit in int32")
    return dataclasses.replace(
        names,
        arrays=arrays,
        layer_ids=layer_ids,
        num_layers=arrays[0].shape[1],
        topk=arrays[0].shape[2],
        max_id=hi,
    )


def lengths(values: Sequence[int] | npt.ArrayLike, name: str, n: int) -> npt.NDArray[np.int64]:
    """A 1-D vector of ``n`` non-negative integer lengths (``name`` says whose, in errors)."""
    arr = as_numpy(values)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ShapeError(f"{name} must list one length per sample ({n}), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must be integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64)
    if (out < 0).any():
        raise ShapeError(f"{name} must be non-negative, got {out.tolist()}")
    return out


def check_rows_match_tokens(batch: Rows, tokens: npt.NDArray[np.int64], how: str) -> None:
    """Every sample must have exactly ``tokens - 1`` routing rows (``how`` names the count)."""
    rows = batch.lengths()
    bad = np.flatnonzero(rows != tokens - 1)
    if bad.size:
        i = int(bad[0])
        if tokens[i] < 1:
            raise ShapeError(f"{batch.who(i)} has no tokens ({how}); every sample needs >= 1 token")
        raise ShapeError(
            f"{batch.who(i)}: routing has {rows[i]} rows but the sample has {tokens[i]} tokens "
            f"({how}); expected {tokens[i] - 1} rows (one per token except the last)"
        )


def resolve_layer_ids(batch: Rows, layer_ids: Sequence[int] | None) -> tuple[int, ...] | None:
    """The routing's MoE layer ids: from its :class:`Routing` inputs or ``layer_ids``."""
    if layer_ids is None:
        return batch.layer_ids
    ids = check_layer_ids(layer_ids)
    if batch.layer_ids is not None and batch.layer_ids != ids:
        raise ShapeError(
            f"layer_ids={list(ids)} but the routing covers MoE layers {list(batch.layer_ids)}"
        )
    return ids


def _spans(mask: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``[a, b)`` runs of True in a 1-D mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def uncovered(
    arr: npt.NDArray[Any],
    name: str,
    missing: Missing,
    fill: npt.NDArray[Any] | None,
    *,
    first_row: int = 0,
) -> npt.NDArray[Any]:
    """``arr`` ``[rows, L, K]`` with its all-``-1`` (token, layer) rows handled per ``missing``.

    ``"raise"``: :class:`ShapeError` naming ``name`` and the token rows nobody shipped.
    ``"fill"``: a copy with each such row set to ``fill`` (``[K]``), or ``arr`` itself with
    ``fill=None`` (the consumer fills ``-1`` rows itself, as the Megatron driver does).  A
    row that mixes ``-1`` with expert ids is corrupt whatever the policy.  ``first_row``:
    the token row ``arr[0]`` is (errors name absolute rows).
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
        spans = [(a + first_row, b + first_row) for a, b in _spans(np.asarray(empty.any(axis=-1)))]
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


def consumer_rows(
    batch: Rows,
    layer_ids: Sequence[int] | None,
    num_layers: int | None,
    missing: Missing,
    fill: npt.NDArray[Any],
) -> tuple[list[npt.NDArray[Any]], int]:
    """Each sample's rows with uncovered rows handled and the layer axis made absolute."""
    ids = resolve_layer_ids(batch, layer_ids)
    out = []
    for i, arr in enumerate(batch.arrays):
        arr = uncovered(arr, batch.routing_name(i), missing, fill)
        out.append(absolute_layers(arr, ids, num_layers, batch.routing_name(i)))
    return out, out[0].shape[1]
