"""Judging an engine's routing rows against a reference engine's, for test_parallel.py and
test_speculative.py.

Rows are compared as sets per (token, layer).  Where they differ, a ``transformers``
forward of the same tokens (bf16, as the engine) judges each router:

- a *near-tie*: its 2nd and 3rd expert logits (for top-2) are less than :data:`NEAR_TIE`
  apart, so the two experts are interchangeable up to bf16 rounding;
- *after a near-tie*: a deeper layer of a token whose routing already differed at a
  near-tie (its input differs from there on);
- *real*: any other difference.

The two files' rules differ in one place, kept as ``after_tie_ok`` of :func:`judge_rows`:
test_speculative accepts differences after a near-tie (``True``), test_parallel counts
them as real (``False``: a tensor-parallel or recomputed-prefix engine may differ from the
reference only at near-ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.support.engine_requests import as_sets, generate, inline_rows

NEAR_TIE = 0.01  # a router's 2nd-3rd logit gap under this is a near-tie (median ~0.07)


def reference_rows(url: str, tokens: list[int], layers: int, topk: int) -> npt.NDArray[np.int32]:
    """The rows the engine at ``url`` computes over ``tokens`` in one untagged prefill
    (KV recomputed), one per token but the last."""
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_routed_experts": True,
    }
    status, out = generate(url, body)
    assert status == 200, out
    return inline_rows(out, layers, topk)[: len(tokens) - 1]


def router_gaps(model: Path, tokens: list[int], layers: int, topk: int) -> npt.NDArray[np.float32]:
    """``[len(tokens) - 1, layers]``: the gap between each router's ``topk``-th and next
    expert logit in a ``transformers`` forward of ``tokens`` (bf16, as the engine)."""
    import torch
    import transformers

    tf: Any = transformers
    hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_router_logits=True)
    logits = torch.stack([x.float() for x in out.router_logits], 1).numpy()
    ranked = -np.sort(-logits.reshape(len(tokens) - 1, layers, -1), axis=-1)
    return ranked[..., topk - 1] - ranked[..., topk]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Judgement:
    """The routers where two row sets differ, judged."""

    near_ties: int
    after_tie: int  # always 0 unless after_tie_ok
    real: list[tuple[int, int, float]]  # (token, layer, 2nd-3rd logit gap)


def judge_rows(
    got: npt.NDArray[Any],
    want: npt.NDArray[Any],
    model: Path,
    tokens: list[int],
    layers: int,
    topk: int,
    *,
    after_tie_ok: bool,
) -> Judgement:
    """Judge the (token, layer) routers where ``got`` and ``want`` (rows over ``tokens``)
    differ as sets.  The ``transformers`` forward runs only if some router differs.  With
    ``after_tie_ok`` a difference in a deeper layer of a token that already differed at a
    near-tie is counted under ``after_tie``; without it, it is real."""
    differ = (as_sets(got) != as_sets(want)).any(-1)  # [tokens, layers]
    if not differ.any():
        return Judgement(0, 0, [])
    gaps = router_gaps(model, tokens, layers, topk)
    tie = gaps < NEAR_TIE
    near = differ & tie
    tie_above = np.cumsum(near, axis=1) - near > 0
    after = differ & ~tie & tie_above if after_tie_ok else np.zeros_like(differ)
    real = differ & ~tie & ~after
    return Judgement(
        int(near.sum()),
        int(after.sum()),
        [(int(t), int(layer), float(gaps[t, layer])) for t, layer in np.argwhere(real)],
    )
