"""Synthetic routing for tests, benchmarks and demos (no model needed).

``synthetic_routing`` draws router scores and takes their top-k, so rows are
genuine top-k sets in the engine's order (descending score):

* ``skew`` — per-layer Zipf expert popularity: expert of popularity rank ``r``
  gets a score bias ``-skew * ln(r + 1)`` (0 = uniform);
* ``rho`` — correlation between consecutive tokens: scores follow an AR(1)
  process ``z_t = rho * z_{t-1} + sqrt(1 - rho^2) * eps_t`` per layer;
* ``empty`` — share of (token, layer) rows replaced by ``-1``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["synthetic_routing"]

_CHUNK_TOKENS = 1024


def synthetic_routing(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    topk: int,
    *,
    skew: float = 0.0,
    rho: float = 0.0,
    empty: float = 0.0,
    seed: int = 0,
) -> npt.NDArray[np.int32]:
    """``[num_tokens, num_layers, topk]`` int32 routing drawn as described above."""
    rng = np.random.default_rng(seed)
    t, nl, e, k = num_tokens, num_layers, num_experts, topk
    ranks = np.argsort(rng.random((nl, e)), axis=1).astype(np.float32)
    bias = (-skew * np.log1p(ranks)).astype(np.float32)
    a = np.float32(math.sqrt(max(0.0, 1.0 - rho * rho)))
    z = rng.standard_normal((nl, e), dtype=np.float32)
    out = np.empty((t, nl, k), dtype=np.int32)
    buf: npt.NDArray[Any] = np.empty((_CHUNK_TOKENS, nl, e), dtype=np.float32)
    for c0 in range(0, t, _CHUNK_TOKENS):
        n = min(_CHUNK_TOKENS, t - c0)
        eps = rng.standard_normal((n, nl, e), dtype=np.float32)
        if rho:
            for i in range(n):  # the AR(1) recurrence is sequential in time
                z = np.float32(rho) * z + a * eps[i]
                buf[i] = z
            scores = buf[:n] + bias
        else:
            scores = eps + bias
        top = np.argpartition(scores, -k, axis=-1)[..., -k:]
        order = np.argsort(-np.take_along_axis(scores, top, axis=-1), axis=-1)
        out[c0 : c0 + n] = np.take_along_axis(top, order, axis=-1)
    if empty:
        out[rng.random((t, nl)) < empty] = -1
    return out
