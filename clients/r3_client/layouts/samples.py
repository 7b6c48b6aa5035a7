"""slime and miles: one sample's ``Sample.rollout_routed_experts`` (:func:`slime_layout`,
:func:`miles_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client.layouts._rows import Missing, RoutingLike, collect, consumer_rows

__all__ = ["miles_layout", "slime_layout"]


def _sample_layout(
    routing: RoutingLike,
    num_tokens: int,
    what: str,
    dtype: np.dtype[Any] | None,
    num_layers: int | None,
    layer_ids: Sequence[int] | None,
    missing: Missing,
    rollout_id: str | None,
) -> npt.NDArray[np.integer[Any]]:
    """One sample's ``[num_tokens - 1, L or num_layers, K]`` rows (slime and miles)."""
    # One sample: errors say "the routing" (a "sample 0" would not be the trainer's index).
    batch = collect([routing], what, None if rollout_id is None else [rollout_id], single=True)
    arr = batch.arrays[0]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
        raise ShapeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 1 or arr.shape[0] != num_tokens - 1:
        where = "" if rollout_id is None else f"{batch.who(0)}: "
        raise ShapeError(
            f"{where}routing has {arr.shape[0]} rows but the sample has {num_tokens} tokens; "
            f"expected {max(num_tokens - 1, 0)} rows (one per token except the last)"
        )
    fill = np.arange(batch.topk, dtype=np.int64)
    (rows,), _ = consumer_rows(batch, layer_ids, num_layers, missing, fill)
    return rows.astype(dtype or batch.out_dtype, copy=rows is arr)


def slime_layout(
    routing: RoutingLike,
    num_tokens: int,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_id: str | None = None,
) -> npt.NDArray[np.integer[Any]]:
    """slime's ``Sample.rollout_routed_experts`` for one sample of ``num_tokens`` tokens.

    ``[num_tokens - 1, L, K]``: one row per token but the last, which slime's
    trainer adds itself (it asserts ``len(tokens) - 1`` rows).  ``num_layers`` (slime's
    ``args.num_layers``) makes the layer axis absolute: MoE rows at their layer ids,
    dense layers ``0``.  ``missing="fill"`` fills rows nobody shipped with experts
    ``0..K-1`` instead of raising.  ``rollout_id`` names the rollout in errors (which
    otherwise say "the routing").  ``int16`` (``int32`` for ids beyond int16)::

        num_tokens = 4  ->  [r0, r1, r2]   shape [3, L, K]
        token index:         0   1   2     (token 3: slime's trainer adds its row)
    """
    return _sample_layout(
        routing, num_tokens, "slime_layout", None, num_layers, layer_ids, missing, rollout_id
    )


def miles_layout(
    routing: RoutingLike,
    num_tokens: int,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_id: str | None = None,
) -> npt.NDArray[np.int32]:
    """miles' ``Sample.rollout_routed_experts``: :func:`slime_layout`'s rows as ``int32``.

    miles asserts the same ``[len(tokens) - 1, num_layers, K]`` shape and adds the
    last row itself, but its replay gathers with the array's own dtype, which must
    be ``int32`` or ``int64``.
    """
    out = _sample_layout(
        routing,
        num_tokens,
        "miles_layout",
        np.dtype(np.int32),
        num_layers,
        layer_ids,
        missing,
        rollout_id,
    )
    return out.astype(np.int32, copy=False)
