"""Which routing each token needs when the engine computed some positions more than once.

A rollout's segments hold each position's *first* computation.  When a later call of the
engine recomputed positions that already had rows (the radix cache was flushed by a
weight push, the prefix was evicted, the request was retracted and re-prefilled, a
partial rollout was resumed), the extension also stores what that call computed for
them as a **view** (:class:`~r3_client.ViewInfo`): rows ``[start, end)``, serving the
segment that starts at row ``serves`` (the call's own rows).  The tokens of that segment
and of every later one, until another view, attended to KV computed with the view's
routing; earlier tokens attended to the first computation.

Three read policies (docs/store.md, "Views"):

* ``generated``: each position's first computation (what was stored before views
  existed; what every token up to the first recompute attended to);
* ``latest``: every view applied in order: what the rollout's last call attended to;
* ``exact``: one routing per *state*: for each span of rows whose tokens attended to the
  same routing, the rows ``[0, span end)`` as those tokens saw them.  A trainer replays
  each state in its own forward and takes the log-probs of that span's tokens from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np

from r3_client._answers import RolloutInfo, ViewInfo
from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._routing import Routing

__all__ = ["ServedRouting", "ViewPolicy", "applicable_views", "overlay", "served_states"]

#: How a read resolves positions the engine computed more than once.
ViewPolicy: TypeAlias = Literal["generated", "latest", "exact"]
POLICIES: tuple[str, ...] = ("generated", "latest", "exact")


@dataclass(frozen=True, eq=False)
class ServedRouting:
    """The routing that the tokens after rows ``[serves_start, serves_end)`` attended to.

    ``routing`` covers rows ``[0, serves_end)`` (or the requested layers of them).  Row
    ``t``'s forward produced the log-prob of token ``t + 1``, so replay ``routing`` in a
    forward over tokens ``[0, serves_end]`` and keep the log-probs of tokens
    ``serves_start + 1 … serves_end`` from it.  ``views``: the views applied.
    """

    serves_start: int
    serves_end: int
    routing: Routing
    views: tuple[ViewInfo, ...]


def check_policy(view: object) -> str:
    """``view`` if it names a policy; :class:`InvalidRequestError` otherwise."""
    if not isinstance(view, str) or view not in POLICIES:
        raise InvalidRequestError(f"view must be one of {', '.join(POLICIES)}; got {view!r}")
    return view


def applicable_views(info: RolloutInfo) -> tuple[ViewInfo, ...]:
    """The rollout's views that serve a stored segment, in order of the row they serve.

    A view whose own call's segment was never stored (the write failed after the view's)
    served no token that a trainer can read, so it is left out.
    """
    starts = {s.segment.start for s in info.segments}
    return tuple(sorted((v for v in info.views if v.serves in starts), key=lambda v: v.serves))


def served_states(info: RolloutInfo) -> list[tuple[int, int, tuple[ViewInfo, ...]]]:
    """``(serves_start, serves_end, views applied)`` per state of the rollout, in order.

    A rollout without views has one state, ``(0, num_rows, ())``.
    """
    views = applicable_views(info)
    bounds = sorted({0, *(v.serves for v in views if v.serves < info.num_rows)})
    out = []
    for i, a in enumerate(bounds):
        b = bounds[i + 1] if i + 1 < len(bounds) else info.num_rows
        out.append((a, b, tuple(v for v in views if v.serves <= a)))
    return out


def overlay(base: Routing, parts: Sequence[Routing]) -> Routing:
    """``base`` with the rows of each of ``parts`` (in order, later wins) written over it.

    Every part must have ``base``'s geometry; rows outside ``base``'s range are ignored.
    """
    if not parts:
        return base
    out = np.array(base.indices, copy=True)
    for part in parts:
        if part.layer_ids != base.layer_ids or part.num_experts != base.num_experts:
            raise ShapeError(
                f"a view holds layers {list(part.layer_ids)} of {part.num_experts} experts; "
                f"the rollout holds {list(base.layer_ids)} of {base.num_experts}"
            )
        a, b = max(part.start, base.start), min(part.end, base.end)
        if a < b:
            out[a - base.start : b - base.start] = part.indices[a - part.start : b - part.start]
    out.setflags(write=False)
    return Routing(out, base.num_experts, base.layer_ids, base.start, base.segments)
