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

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import numpy as np

from r3_client._answers import RolloutInfo, ViewInfo
from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._routing import Routing

__all__ = [
    "ServedRouting",
    "ViewPolicy",
    "applicable_views",
    "overlay",
    "served",
    "serving_views",
    "states_of",
]

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


def one_routing_policy(view: object, who: str | None = None) -> ViewPolicy:
    """``view`` if it answers one routing per rollout (``generated``, ``latest``);
    otherwise :class:`InvalidRequestError` (``exact`` needs a forward per state).

    ``who``: the trainer that replays one routing per sample in one forward (the glue's
    refusal names it); None for a read that answers one routing (``get``, ``get_many``).
    """
    if check_policy(view) == "exact":
        if who is None:
            raise InvalidRequestError(
                'view="exact" is one routing per state of a rollout: call get_served()'
            )
        raise InvalidRequestError(
            f'{who} replays one routing per sample in one forward; view="exact" is one '
            "routing per state of a rollout (get_served), each replayed in its own forward: "
            'use "latest" or "generated" (docs/integrations.md, "Which view policy each '
            'framework can use")'
        )
    return cast(ViewPolicy, view)


def applicable_views(info: RolloutInfo) -> tuple[ViewInfo, ...]:
    """The rollout's views that serve a stored segment, in order of the row they serve.

    A view whose own call's segment was never stored (the write failed after the view's)
    served no token that a trainer can read, so it is left out.
    """
    return serving_views(info.views, {s.segment.start for s in info.segments})


def serving_views(
    views: Iterable[ViewInfo], segment_starts: Collection[int]
) -> tuple[ViewInfo, ...]:
    """:func:`applicable_views` from the parts of a stat: ``views`` that serve a segment
    starting in ``segment_starts``, by the row they serve (a reader that sees the rollout
    hash itself, :class:`~r3_client.DirectReader`, has no :class:`RolloutInfo`)."""
    return tuple(sorted((v for v in views if v.serves in segment_starts), key=lambda v: v.serves))


def states_of(
    views: Sequence[ViewInfo], num_rows: int
) -> list[tuple[int, int, tuple[ViewInfo, ...]]]:
    """``(serves_start, serves_end, views applied)`` per state of a rollout of ``num_rows``
    rows whose applicable views (:func:`serving_views`) are ``views``, in order; a rollout
    without views has one state, ``(0, num_rows, ())``."""
    bounds = sorted({0, *(v.serves for v in views if v.serves < num_rows)})
    out = []
    for i, a in enumerate(bounds):
        b = bounds[i + 1] if i + 1 < len(bounds) else num_rows
        out.append((a, b, tuple(v for v in views if v.serves <= a)))
    return out


def served(
    base: Routing,
    views: Sequence[ViewInfo],
    num_rows: int,
    rows: Mapping[int, Routing],
    policy: str,
) -> list[ServedRouting]:
    """What ``get_served`` answers under ``policy``, whoever read the rows.

    ``base``: every row of the rollout (first computations); ``views``: its applicable
    views (:func:`serving_views`); ``rows``: each view's rows, by ``serves``, in
    ``base``'s range and layers.  ``exact``: one :class:`ServedRouting` per state, each
    with the views serving rows up to it applied; ``latest``: one, every view applied;
    ``generated``: one, none applied.
    """
    if policy == "exact":
        states = states_of(views, num_rows)
    else:
        states = [(0, base.end, tuple(views) if policy == "latest" else ())]
    out = []
    for a, b, applied in states:
        routing = overlay(base, [rows[v.serves] for v in applied]).select(start=0, end=b)
        out.append(ServedRouting(a, b, routing, applied))
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
