"""Train/inference mismatch metrics, named as the R3 paper and the field use them.

Log-probability mismatch, with ``D = logp_train - logp_infer`` over the tokens
where ``mask`` is true (normally the valid response tokens):

* ``k3_kl``          mean(exp(D) - 1 - D), the k3 estimator of KL(infer || train);
* ``logp_abs_diff``  mean |D|;
* ``extreme_frac``   F(tau) = share of tokens with |D| > ln(tau), i.e. whose
  probability ratio max(p_train/p_infer, p_infer/p_train) exceeds tau
  (the paper's Eq. 3; tau = 2 and 5 are the usual thresholds).

Routing disagreement between two recordings of the same tokens (e.g. SGLang
vs. a trainer's forward pass), rows compared as *sets*; see
:func:`routing_disagreement`.

Every function accepts numpy arrays or torch tensors (any device; tensors are
detached and copied to the CPU, no gradients flow) and returns plain Python
numbers.  An empty selection gives 0.0 with a count of 0, never NaN or a
warning.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._kernels.sortnet import sort_rows
from r3_client._routing import Routing

__all__ = [
    "extreme_frac",
    "k3_kl",
    "logp_abs_diff",
    "logprob_mismatch",
    "routing_disagreement",
]


def _numpy(x: Any, name: str) -> npt.NDArray[Any]:
    """``x`` as a numpy array; torch tensors are detached, moved to CPU, floats widened."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        t = x.detach().cpu()
        if t.is_floating_point():
            t = t.double()  # numpy has no bfloat16
        return np.asarray(t.numpy())
    arr = np.asarray(x)
    if arr.dtype == object:
        raise ShapeError(f"{name} must be a numeric array or tensor, got {type(x).__name__}")
    return arr


def _mask(mask: Any, shape: tuple[int, ...], name: str) -> npt.NDArray[np.bool_] | None:
    """A boolean mask of ``shape`` (nonzero = selected), or None for "everything"."""
    if mask is None:
        return None
    m = _numpy(mask, name)
    if m.shape != shape:
        raise ShapeError(f"{name} has shape {m.shape}, expected {shape}")
    selected: npt.NDArray[np.bool_] = m != 0
    return selected


def _delta(logp_train: Any, logp_infer: Any, mask: Any) -> npt.NDArray[np.float64]:
    """The selected ``logp_train - logp_infer`` as a 1-D float64 array."""
    train = _numpy(logp_train, "logp_train")
    infer = _numpy(logp_infer, "logp_infer")
    if train.shape != infer.shape:
        raise ShapeError(f"logp_train has shape {train.shape} but logp_infer has {infer.shape}")
    for name, arr in (("logp_train", train), ("logp_infer", infer)):
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise ShapeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    m = _mask(mask, train.shape, "mask")
    if m is None:
        return (train.astype(np.float64) - infer.astype(np.float64)).reshape(-1)
    return train[m].astype(np.float64) - infer[m].astype(np.float64)


def _k3(d: npt.NDArray[np.float64]) -> float:
    # expm1 keeps exp(D) - 1 - D accurate for the tiny D of a well-aligned run.
    return float(np.mean(np.expm1(d) - d)) if d.size else 0.0


def _abs(d: npt.NDArray[np.float64]) -> float:
    return float(np.mean(np.abs(d))) if d.size else 0.0


def _extreme(d: npt.NDArray[np.float64], tau: float) -> float:
    if not tau > 0:
        raise ValueError(f"tau must be a positive ratio threshold, got {tau}")
    return float(np.mean(np.abs(d) > math.log(tau))) if d.size else 0.0


def k3_kl(logp_train: Any, logp_infer: Any, mask: Any = None) -> float:
    """k3 KL estimate mean(exp(D) - 1 - D) over masked tokens (0.0 when none are).

    ``logp_*`` are per-token log-probabilities of the sampled tokens, any
    equal shape; ``mask`` (same shape, nonzero = use) defaults to all tokens.
    """
    return _k3(_delta(logp_train, logp_infer, mask))


def logp_abs_diff(logp_train: Any, logp_infer: Any, mask: Any = None) -> float:
    """Mean |logp_train - logp_infer| over masked tokens (0.0 when none are)."""
    return _abs(_delta(logp_train, logp_infer, mask))


def extreme_frac(logp_train: Any, logp_infer: Any, mask: Any = None, *, tau: float = 2.0) -> float:
    """F(tau): share of masked tokens with |logp_train - logp_infer| > ln(tau) (strict).

    A token exactly at the ratio ``tau`` is not counted, as in the paper's Eq. 3.
    """
    return _extreme(_delta(logp_train, logp_infer, mask), tau)


def logprob_mismatch(logp_train: Any, logp_infer: Any, mask: Any = None) -> dict[str, float]:
    """All log-prob mismatch metrics at once, ready to log.

    Keys: ``k3_kl``, ``logp_abs_diff``, ``extreme_frac_tau2``,
    ``extreme_frac_tau5``, ``n_tokens`` (the number of masked tokens, an int).
    """
    d = _delta(logp_train, logp_infer, mask)
    return {
        "k3_kl": _k3(d),
        "logp_abs_diff": _abs(d),
        "extreme_frac_tau2": _extreme(d, 2.0),
        "extreme_frac_tau5": _extreme(d, 5.0),
        "n_tokens": int(d.size),
    }


def _routing(x: Any, name: str) -> npt.NDArray[Any]:
    arr = x.indices if isinstance(x, Routing) else _numpy(x, name)
    if arr.ndim < 3:
        raise ShapeError(
            f"{name} must be [tokens, layers, topk] (or [..., layers, topk]), got {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    return arr


def routing_disagreement(a: Any, b: Any, mask: Any = None) -> dict[str, float]:
    """How often two routing recordings of the same tokens pick different expert sets.

    ``a`` and ``b`` are :class:`Routing` objects, or integer arrays / tensors
    ``[T, L, K]`` (any leading token axes ``[..., L, K]`` work, e.g. a padded
    ``[B, S, L, K]`` batch).  Rows are compared as sets.  A router (one token,
    one layer) is *compared* only where neither row is ``-1``, and, with
    ``mask`` (shape of the token axes, nonzero = use), only on masked tokens.
    Returns:

    * ``router_disagreement`` -- share of compared routers whose sets differ;
    * ``token_disagreement`` -- share of tokens with >= 1 differing router,
      among tokens with >= 1 compared router;
    * ``differing_routers_per_token`` -- mean number of differing routers per
      such token (the R3 paper's Fig. 3 sequence-level statistic);
    * ``n_routers``, ``n_tokens`` -- the compared routers and tokens (ints).
    """
    ra, rb = _routing(a, "a"), _routing(b, "b")
    if ra.shape != rb.shape:
        raise ShapeError(f"recordings differ in shape: a is {ra.shape}, b is {rb.shape}")
    if isinstance(a, Routing) and isinstance(b, Routing):
        if a.layer_ids != b.layer_ids:
            raise ShapeError(f"a covers MoE layers {list(a.layer_ids)}, b {list(b.layer_ids)}")
        if a.start != b.start:
            raise ShapeError(f"a starts at token {a.start}, b at token {b.start}")
    compared = (ra != -1).any(axis=-1) & (rb != -1).any(axis=-1)  # [..., L]
    m = _mask(mask, ra.shape[:-2], "mask")
    if m is not None:
        compared &= m[..., None]
    differ = compared & (sort_rows(ra) != sort_rows(rb)).any(axis=-1)
    n_routers = int(compared.sum())
    n_tokens = int(compared.any(axis=-1).sum())
    n_differ = int(differ.sum())
    return {
        "router_disagreement": n_differ / n_routers if n_routers else 0.0,
        "token_disagreement": int(differ.any(axis=-1).sum()) / n_tokens if n_tokens else 0.0,
        "differing_routers_per_token": n_differ / n_tokens if n_tokens else 0.0,
        "n_routers": n_routers,
        "n_tokens": n_tokens,
    }
