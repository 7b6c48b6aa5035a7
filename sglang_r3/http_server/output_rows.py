"""What the engine hands over for a tagged output, read as rows, with the guards on it.

Three forms reach the HTTP process (:data:`EngineOutput`): the detokenizer's compact
rows, the scheduler's tensor, or upstream's base64 int32.  These helpers count,
read and re-encode them without caring which, and refuse misaligned routing.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import numpy.typing as npt

from sglang_r3.errors import R3RequestError
from sglang_r3.http_server import metrics
from sglang_r3.layers import MoeShape
from sglang_r3.scheduler.row_transport import EngineRows, TaggedRows

#: What the engine hands over for a finished tagged output: the detokenizer's
#: compact rows (default), the scheduler's tensor (``--skip-tokenizer-init``) or
#: upstream's base64 int32 (msgpack IPC).
EngineOutput = EngineRows | TaggedRows | str
FORMS = {EngineRows: "compact", TaggedRows: "tensor", str: "base64"}


def decode_rows(b64: str, shape: MoeShape) -> npt.NDArray[np.int32]:
    """Upstream's base64 int32 ``[rows, all layers, K]`` as an array."""
    raw = base64.b64decode(b64)
    width = shape.num_layers * shape.topk * 4
    if len(raw) % width:
        raise R3RequestError(
            500,
            f"r3: engine routing has {len(raw)} bytes, not a whole number of "
            f"[{shape.num_layers} layers x {shape.topk}] int32 rows",
        )
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, shape.num_layers, shape.topk)


def engine_rows_of(routing: EngineOutput, shape: MoeShape) -> npt.NDArray[Any]:
    """The rows ``[rows, all layers, K]`` of what the engine handed over (no copy when
    they are compact already)."""
    if isinstance(routing, EngineRows):
        rows = routing.array
    elif isinstance(routing, TaggedRows):
        rows = routing.numpy()
    elif isinstance(routing, str):
        return decode_rows(routing, shape)
    else:
        raise R3RequestError(500, f"r3: unexpected routing from the engine: {type(routing)}")
    if rows.ndim != 3 or rows.shape[1:] != (shape.num_layers, shape.topk):
        raise R3RequestError(
            500,
            f"r3: engine routing has shape {rows.shape}, not [rows, {shape.num_layers} layers, "
            f"{shape.topk}]",
        )
    return rows


def count_rows(routing: EngineOutput, shape: MoeShape) -> int:
    """Rows in ``routing`` without decoding it."""
    if isinstance(routing, str):
        return (len(routing) * 3 // 4) // (shape.num_layers * shape.topk * 4)
    if isinstance(routing, EngineRows):
        return int(routing.array.shape[0])
    return int(routing.tensor.shape[0])


def to_base64(routing: EngineOutput, shape: MoeShape, skip: int = 0) -> str:
    """Upstream's ``meta_info["routed_experts"]`` for ``routing`` without its first
    ``skip`` rows (inline answers; run it in a worker thread)."""
    if isinstance(routing, str) and not skip:
        return routing
    return EngineRows(engine_rows_of(routing, shape)[skip:]).to_base64()


def check_engine_rows(rows: npt.NDArray[Any], expected: int) -> None:
    """Guards on what the engine returned, before anything is stored.

    The row count must match the tokens (upstream only logs a warning).  All-zero
    rows, which is how a never-written slot reads, are refused later by the format's
    validation as a repeated expert id when ``K > 1``; with ``K = 1`` expert 0 is a
    legal row and cannot be told apart.
    """
    check_row_count(int(rows.shape[0]), expected)


def check_row_count(got: int, expected: int) -> None:
    """500 unless the engine returned ``expected`` rows (see :func:`check_engine_rows`)."""
    if got != expected:
        metrics.GUARD_TRIPS.labels("row_count").inc()
        raise R3RequestError(
            500,
            f"r3: engine returned {got} routing rows for {expected} token positions; "
            "refusing to store misaligned routing",
        )
