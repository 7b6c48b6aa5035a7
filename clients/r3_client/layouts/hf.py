"""HF transformers: routing aligned with ``input_ids`` / ``attention_mask`` (:func:`hf_layout`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from r3_client._exceptions import ShapeError
from r3_client.layouts._rows import RoutingLike, as_numpy, check_rows_match_tokens, collect

__all__ = ["hf_layout"]


def hf_layout(
    routings: Sequence[RoutingLike],
    attention_mask: Any,
    *,
    as_torch: bool = False,
    dtype: Any = None,
) -> Any:
    """Routing aligned with HF ``input_ids`` / ``attention_mask`` ``[B, T]``: ``[B, T, L, K]``.

    Use it with the HF transformers replay adapter.  ``attention_mask`` is a
    numpy array or torch tensor (nonzero = attended); padding may sit on
    either side or anywhere.  The k-th attended position of row ``b`` holds
    routing row ``k`` of sample ``b``; the last attended position and every
    masked position hold ``-1``.  Raises :class:`ShapeError` when sample ``b``
    attends to a number of positions other than its routing rows + 1::

        attention_mask[b] = 0 0 1 1 1 1      (left padding; 4 tokens, rows r0..r2)
        out[b]            = - - r0 r1 r2 -   ("-" = -1 in all L x K slots)

        attention_mask[b] = 1 1 1 0 0 0      (right padding; 3 tokens, rows r0, r1)
        out[b]            = r0 r1 - - - -

    Returns ``int16`` numpy (``int32`` for ids beyond int16), or with
    ``as_torch=True`` a CPU ``torch.Tensor``.  ``dtype`` overrides the result
    dtype (a numpy dtype, or a torch dtype with ``as_torch``, e.g.
    ``torch.int64``).
    """
    mask = as_numpy(attention_mask)
    if mask.ndim != 2:
        raise ShapeError(f"attention_mask must be [batch, seq_len], got shape {mask.shape}")
    batch = collect(routings, "hf_layout")
    n, seq = mask.shape
    if len(batch.arrays) != n:
        raise ShapeError(f"attention_mask has {n} rows but {len(batch.arrays)} routings were given")
    attended = mask != 0
    check_rows_match_tokens(batch, attended.sum(axis=1).astype(np.int64), "attended positions")
    out = np.full((n, seq, batch.num_layers, batch.topk), -1, dtype=batch.out_dtype)
    for b, arr in enumerate(batch.arrays):
        out[b, np.flatnonzero(attended[b])[:-1]] = arr
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        tensor = torch.from_numpy(out)
        return tensor if dtype is None else tensor.to(dtype)
    return out if dtype is None else out.astype(dtype)
