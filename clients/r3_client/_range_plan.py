"""Where each row of a ranged read comes from, and the answer put together: no I/O.

:meth:`RoutingClient.get_ranges <r3_client.RoutingClient.get_ranges>` runs in the trainer
process (a training rank's fetch) in three stages: one batched stat names each rollout's
views; :func:`plan_range` turns a read and its rollout's stat into a :class:`RangePlan`
(which rows the segments answer, which a view answers, or the error the read answers
from nowhere); the client then streams the planned segment pieces and hands them here,
:func:`pieced` (a read that views and segments answer row by row) or :func:`in_state`
(a read the segments answer whole, its state's views written over it).  The view rows
those two need are read by the caller's function, one view at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from r3_client._answers import RolloutInfo, ViewInfo
from r3_client._exceptions import R3Error, ShapeError
from r3_client._routing import Routing, Segment, index_dtype, layer_positions
from r3_client._views import (
    ViewRows,
    applicable_views,
    apply_views,
    check_rows_size,
    overlapping,
    read_pieces,
    read_views,
    run_steps,
    write_rows,
)

__all__ = ["RangePlan", "in_state", "pieced", "plan_range"]

#: Reads rows ``[a, b)`` of a view (the caller's I/O).
ViewRange: TypeAlias = Callable[[ViewInfo, int, int], Routing]


@dataclass(frozen=True)
class RangePlan:
    """How :meth:`RoutingClient.get_ranges <r3_client.RoutingClient.get_ranges>` reads one
    range ``[start, end)``.

    ``spans``: the batch stream's items for it (a rollout may be named once per span).
    ``pieces`` None: the one span read as the segments hold it, and the views of its
    state applied over it after (:func:`in_state`): a range no applied view overlaps,
    and one the stat cannot cut (its stat failed, it reaches past the stored rows, it
    names a layer the rollout lacks: the service's answer is the read's).  Otherwise each
    row's source (:func:`~r3_client._views.read_pieces`): ``spans`` the pieces read from
    the segments (those with stored rows; the others are a gap, ``-1``), each other piece
    read from its view; ``like``, a routing of no rows with the answer's geometry;
    ``segments``, the stored segments the range overlaps.  ``error``: the read's answer,
    read from nowhere (its state refused, over ``max_bytes``).
    """

    start: int
    end: int
    spans: tuple[tuple[int, int], ...]
    pieces: tuple[tuple[ViewInfo | None, int, int], ...] | None = None
    like: Routing | None = None
    segments: tuple[Segment, ...] = ()
    error: R3Error | None = None
    #: No view applies to the range: the segments alone answer it (``decode=False`` then
    #: answers their frames undecoded).
    settled: bool = False


def plan_range(
    rollout_id: str,
    start: int,
    end: int,
    state: int | None,
    upto: int,
    info: RolloutInfo | R3Error | None,
    policy: str,
    layers: Sequence[int] | None,
    max_bytes: int,
) -> RangePlan:
    """Where rows ``[start, end)`` of ``rollout_id`` are read from (:class:`RangePlan`),
    from its stat ``info`` (None under ``generated``)."""
    whole = RangePlan(start, end, ((start, end),))
    if info is None or isinstance(info, R3Error) or end > info.num_rows:
        return whole
    try:
        kept = info.layer_ids
        if layers is not None:
            kept = tuple(kept[p] for p in layer_positions(kept, layers))
    except ShapeError:
        return whole
    try:
        applied = read_views(
            applicable_views(info), policy, state, start, end, info.num_rows, rollout_id, upto
        )
        views = overlapping(applied, start, end)
        if not views:
            return RangePlan(start, end, ((start, end),), settled=True)
        dtype = index_dtype(info.num_experts)
        row = dtype.itemsize * len(kept) * info.topk
        check_rows_size(row, start, end, views, [], max_bytes, rollout_id)
    except R3Error as exc:
        return RangePlan(start, end, (), error=exc)
    like = Routing(np.empty((0, len(kept), info.topk), dtype), info.num_experts, kept, start)
    pieces = tuple(read_pieces(views, start, end))
    stored = [s.segment for s in info.segments]
    spans = tuple(
        (a, b) for v, a, b in pieces if v is None and any(s.overlaps(a, b) for s in stored)
    )
    segments = tuple(s for s in stored if s.overlaps(start, end))
    return RangePlan(start, end, spans, pieces, like, segments)


def pieced(
    rollout_id: str,
    plan: RangePlan,
    parts: Sequence[Routing | R3Error],
    view_range: ViewRange,
) -> Routing | R3Error:
    """A planned read's answer: its segment pieces ``parts`` (the batch stream's answers
    to ``plan.spans``) and each view's pieces (read by ``view_range``, one at a time)
    written into one array, or the first error among them."""
    assert plan.pieces is not None and plan.like is not None
    like = plan.like
    for got in parts:
        if isinstance(got, R3Error):
            return got
    out = np.full((plan.end - plan.start, like.num_layers, like.topk), -1, like.indices.dtype)
    try:
        for got in parts:
            assert isinstance(got, Routing)
            write_rows(out, plan.start, got, like, None, rollout_id)
        for v, a, b in plan.pieces:
            if v is None:
                continue
            part = view_range(v, a, b)
            write_rows(out, plan.start, part, like, v, rollout_id)
            del part  # one view's rows held at a time
    except R3Error as exc:
        return exc
    out.setflags(write=False)
    return Routing(out, like.num_experts, like.layer_ids, plan.start, plan.segments)


def in_state(
    rollout_id: str,
    base: Routing,
    info: RolloutInfo | R3Error,
    policy: str,
    state: int | None,
    upto: int,
    max_bytes: int,
    view_rows: ViewRows,
) -> Routing | R3Error:
    """``base`` (a ranged read's first computations) with the views of its ``state``
    under ``policy`` written over it (each view's rows in ``base``'s range read by
    ``view_rows``), or the error that read answers."""
    if isinstance(info, R3Error):
        return info
    try:
        applied = read_views(
            applicable_views(info),
            policy,
            state,
            base.start,
            base.end,
            info.num_rows,
            rollout_id,
            upto,
        )
        steps = apply_views(
            base,
            overlapping(applied, base.start, base.end),
            max_bytes=max_bytes,
            rollout_id=rollout_id,
        )
        return run_steps(steps, view_rows)
    except R3Error as exc:
        return exc
