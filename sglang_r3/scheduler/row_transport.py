"""Routing rows on their way from SGLang's scheduler to the extension, without base64.

Upstream collects a finished request's rows in the scheduler as an int32 tensor
``[rows, num_hidden_layers, K]``, base64-encodes it in the detokenizer and hands the
string to the HTTP process, which puts it in the response.  For a tagged request the
extension needs none of that:

1. scheduler (``_maybe_collect_routed_experts``, AROUND): the tensor upstream just
   gathered is wrapped in :class:`TaggedRows`.  Nothing else runs there: the
   scheduler's critical path gets one object allocation per finished request.
2. detokenizer (``handle_batch_token_id_out``, AROUND): a :class:`TaggedRows` is
   narrowed to the smallest unsigned dtype that holds its ids (uint8 up to 256
   experts) by :func:`compact_rows`, instead of being base64-encoded, and crosses to
   the HTTP process as an :class:`EngineRows` (4x fewer bytes than the int32, 5.3x
   fewer than the base64 string, so the HTTP process unpickles less on its loop).
3. HTTP process: :mod:`sglang_r3.http_server.shipping` takes the rows off the event loop.

All layers are kept (not only the MoE ones) so that the inline fallback can rebuild
upstream's base64 int32 exactly.  Everything here only applies to SGLang's default
pickle IPC; with ``SGLANG_USE_PICKLE_IPC=0`` (msgpack) the fields are typed, so the
hooks leave upstream's base64 in place and the shipper decodes it in a worker thread.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

#: Rows kept when a request was retracted: ``(rows computed so far, rows [0, that))``.
Snapshot = tuple[int, Any]


class TaggedRows:
    """The scheduler's int32 routing tensor of a tagged request, marked for the detokenizer.

    ``numpy()`` returns the int32 rows, so a detokenizer without the extension's hook
    (which the start-up check refuses) would still base64-encode it as upstream does.
    ``first``: the row the tensor starts at (below the request's
    ``routed_experts_start_len`` when a prefill recomputed stored positions);
    ``epochs``: where each prefill epoch (0, then one per retraction) started computing;
    ``snapshots``: the rows kept at each retraction (``row_hooks.around_release_req``);
    ``problem``: why the rows cannot be stored exactly (the HTTP process refuses the
    output with it), or ``None``.
    """

    __slots__ = ("epochs", "first", "problem", "snapshots", "tensor")

    def __init__(
        self,
        tensor: Any,
        first: int | None = None,
        epochs: tuple[int, ...] = (),
        snapshots: tuple[Snapshot, ...] = (),
        problem: str | None = None,
    ) -> None:
        self.tensor = tensor
        self.first = first
        self.epochs = epochs
        self.snapshots = snapshots
        self.problem = problem

    def numpy(self) -> npt.NDArray[np.int32]:
        """The rows as an int32 numpy array ``[rows, layers, K]`` (no copy)."""
        return self.tensor.numpy()  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.tensor, self.first, self.epochs, self.snapshots, self.problem)
        return (TaggedRows, args)


@dataclass(frozen=True, slots=True)
class EngineRows:
    """A tagged request's rows as the detokenizer hands them over.

    ``array``: ``[rows, num_hidden_layers, K]`` in uint8 or uint16 when every id fits
    (the exact int32 values otherwise, e.g. a negative id, which validation refuses).
    ``first``, ``epochs``, ``snapshots`` (compacted the same way), ``problem``: as on
    :class:`TaggedRows`.
    """

    array: npt.NDArray[Any]
    first: int | None = None
    epochs: tuple[int, ...] = ()
    snapshots: tuple[tuple[int, npt.NDArray[Any]], ...] = ()
    problem: str | None = None

    def to_base64(self) -> str:
        """Upstream's ``meta_info["routed_experts"]``: base64 of the int32 rows, exactly."""
        return base64.b64encode(self.array.astype(np.int32).tobytes()).decode("ascii")


def _compact(t: Any) -> npt.NDArray[Any]:
    import torch

    if t.numel() == 0:
        return np.zeros(tuple(t.shape), dtype=np.uint8)
    lo, hi = (int(x) for x in torch.aminmax(t))
    if lo >= 0 and hi < 256:
        return t.to(torch.uint8).numpy()  # type: ignore[no-any-return]
    if lo >= 0 and hi < 65536:
        # torch has no uint16 casts on every build; numpy does it in one pass.
        return t.numpy().astype(np.uint16)  # type: ignore[no-any-return]
    return t.numpy().copy()  # type: ignore[no-any-return]


def compact_rows(rows: TaggedRows) -> EngineRows:
    """Narrow the scheduler's int32 rows to uint8/uint16 when all ids fit (lossless)."""
    snaps = tuple((n, _compact(t)) for n, t in rows.snapshots)
    return EngineRows(_compact(rows.tensor), rows.first, rows.epochs, snaps, rows.problem)
