"""Small builders shared by the tests (importable thanks to pytest's ``pythonpath``)."""

from __future__ import annotations

import uuid

import numpy as np

from r3_client import Segment, encode_frame, token_digest
from r3_client.testing import synthetic_routing

E, K, LAYERS = 64, 4, (1, 3, 5)
TRAJ = synthetic_routing(300, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=7)


def rid() -> str:
    """A fresh rollout id."""
    return f"rollout-{uuid.uuid4().hex[:8]}"


def frame_for(
    idx: np.ndarray,
    start: int,
    *,
    codec: str = "auto",
    version: str = "v1",
    layers: tuple[int, ...] = LAYERS,
    e: int = E,
    digest: bool = True,
) -> bytes:
    """A segment frame for rows ``[start, start + len(idx))`` of a tiny-moe rollout."""
    end = start + idx.shape[0]
    seg = Segment(start, end, "tiny-moe", version, token_digest(range(end)) if digest else "")
    return encode_frame(idx, num_experts=e, layer_ids=layers, segment=seg, codec=codec)  # type: ignore[arg-type]


def same_sets(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as expert sets (row order ignored)."""
    return a.shape == b.shape and bool(np.array_equal(np.sort(a, -1), np.sort(b, -1)))
