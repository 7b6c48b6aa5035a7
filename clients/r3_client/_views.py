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

import itertools
from collections.abc import Awaitable, Callable, Collection, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar, cast

import numpy as np
import numpy.typing as npt

from r3_client._answers import RolloutInfo, ViewInfo
from r3_client._exceptions import InvalidRequestError, LimitExceededError, StoreError
from r3_client._routing import Routing

__all__ = [
    "RangeRead",
    "ServedRouting",
    "Steps",
    "ViewPolicy",
    "ViewRows",
    "applicable_views",
    "apply_views",
    "arun_steps",
    "check_rows_size",
    "check_views_size",
    "off_state_tokens",
    "overlapping",
    "piece_sources",
    "ranged_reads",
    "read_pieces",
    "read_views",
    "run_steps",
    "served",
    "serving_views",
    "states_of",
    "write_rows",
]

T = TypeVar("T")

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


def check_policy(view: object) -> ViewPolicy:
    """``view`` if it names a policy; :class:`InvalidRequestError` otherwise."""
    if not isinstance(view, str) or view not in POLICIES:
        raise InvalidRequestError(f"view must be one of {', '.join(POLICIES)}; got {view!r}")
    return cast(ViewPolicy, view)


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


#: One ranged read: ``(rollout_id, start, end)``; with the first row of the state it is read
#: under (``exact``; :func:`read_views`) as a fourth element; and, fifth, the end of the rows
#: its sample spans (a rank reads part of a sample: ``exact`` refuses the read when the
#: *sample* reaches past its state, whichever part this rank reads).
RangeRead: TypeAlias = (
    tuple[str, int, int] | tuple[str, int, int, int | None] | tuple[str, int, int, int | None, int]
)


def ranged_reads(
    reads: Iterable[Sequence[Any]], policy: str
) -> list[tuple[str, int, int, int | None, int]]:
    """``reads`` as ``(rollout_id, start, end, state, upto)``: ``state`` None where not
    given, ``upto`` the end of the sample's rows (``end`` where not given, never below it).
    A state is a row of an ``exact`` read, so one given under another policy is refused
    (:class:`InvalidRequestError`: it would be ignored)."""
    out: list[tuple[str, int, int, int | None, int]] = []
    for n, item in enumerate(reads):
        if len(item) not in (3, 4, 5):
            raise InvalidRequestError(
                f"read {n} is {tuple(item)!r}: give (rollout_id, start, end), "
                "(rollout_id, start, end, state) or (rollout_id, start, end, state, sample_end)"
            )
        state = None if len(item) == 3 or item[3] is None else int(item[3])
        if state is not None and policy != "exact":
            raise InvalidRequestError(
                f'read {n} names state {state}, which only view="exact" reads under; '
                f"view={policy!r} answers one routing for every row"
            )
        if state is not None and state < 0:
            raise InvalidRequestError(f"read {n} names state {state}: a state is a row >= 0")
        end = int(item[2])
        upto = max(end, int(item[4])) if len(item) == 5 else end
        out.append((str(item[0]), int(item[1]), end, state, upto))
    return out


def read_views(
    views: Sequence[ViewInfo],
    policy: str,
    state: int | None,
    start: int,
    end: int,
    num_rows: int,
    rollout_id: str = "",
    upto: int | None = None,
) -> tuple[ViewInfo, ...]:
    """The views a read of rows ``[start, end)`` writes over the first computations under
    ``policy``; ``views``: the rollout's applicable views, ``num_rows`` its stored rows;
    ``upto``: where the rows of the read's sample end (a rank reads part of a sample; the
    check below is on the whole sample's rows, so no rank replays part of a sample that
    spans several states), ``end`` when not given.

    ``generated``: none; ``latest``: all.  ``exact``: those of the read's ``state`` (the
    first row it serves, :func:`states_of`; ``None`` is the first state, ``0``), and
    the read must lie within that state's rows ``[0, serves_end)``: rows past them were
    computed for tokens another state served, so a read reaching them is refused
    (:class:`InvalidRequestError`: the sample holds tokens of several states and must be
    expanded, one training sample per state, docs/integrations.md) rather than
    answered with a routing those tokens never attended to.  A ``state`` that does not
    start a state of the rollout is refused too (a plan made from another stat).
    """
    if policy == "generated":
        return ()
    if policy == "latest":
        return tuple(views)
    states = states_of(views, num_rows)
    at = 0 if state is None else int(state)
    who = f"rollout {rollout_id}" if rollout_id else "the rollout"
    for a, b, applied in states:
        if a != at:
            continue
        reach = end if upto is None else max(end, upto)
        if reach > b and len(states) > 1:
            what = f"rows [{start}, {end})" + (
                f" (of a sample of rows [0, {reach}))" if reach > end else ""
            )
            raise InvalidRequestError(
                f'view="exact": {what} of {who} under its state starting at '
                f"row {a} go past that state's rows [0, {b}): the tokens after row {b} "
                f"attended to another routing ({len(states)} states start at rows "
                f"{[s for s, _, _ in states]}); expand the sample into one training sample "
                "per state (r3_client.expand_states), or name the policy "
                '"generated"/"latest" to replay one routing for all of them'
            )
        return applied
    raise InvalidRequestError(
        f'view="exact": {who} has no state starting at row {at}; its states start at rows '
        f"{[s for s, _, _ in states]} (a plan made from another stat of the rollout?)"
    )


def overlapping(views: Iterable[ViewInfo], start: int, end: int) -> tuple[ViewInfo, ...]:
    """The ``views`` with rows in ``[start, end)`` (the others change none of its rows)."""
    return tuple(v for v in views if v.start < end and v.end > start)


def read_pieces(
    views: Sequence[ViewInfo], start: int, end: int
) -> list[tuple[ViewInfo | None, int, int]]:
    """Where each row of a read of rows ``[start, end)`` comes from when ``views`` (those
    the read applies, in the order they are applied: a later one wins) are written over
    the first computations: ``(source, a, b)`` pieces that tile ``[start, end)`` in
    order, ``source`` the last of ``views`` whose rows ``[v.start, v.end)`` hold rows
    ``[a, b)``, or None where no view does (the segments' rows).  Adjacent rows of the
    same source are one piece; no piece is empty; none at all when ``end <= start``.

    A reader that reads each piece from its source reads every row of the answer once:
    no row a view overwrites is read from the segments, nor from an earlier view.
    """
    if end <= start:
        return []
    cuts = sorted({start, end, *(x for v in views for x in (v.start, v.end) if start < x < end)})
    out: list[tuple[ViewInfo | None, int, int]] = []
    for a, b in itertools.pairwise(cuts):
        source: ViewInfo | None = None
        for v in views:
            if v.start <= a and b <= v.end:
                source = v
        if out and out[-1][0] is source:
            out[-1] = (source, out[-1][1], b)
        else:
            out.append((source, a, b))
    return out


def piece_sources(views: Sequence[ViewInfo], start: int, end: int) -> tuple[ViewInfo, ...]:
    """The ``views`` (in their order) that are the source of some row of ``[start, end)``
    (:func:`read_pieces`): those a later view does not wholly cover there.  Applying only
    these, in order, answers the same rows as applying every one of ``views``."""
    won = {id(v) for v, _, _ in read_pieces(views, start, end) if v is not None}
    return tuple(v for v in views if id(v) in won)


def off_state_tokens(views: Sequence[ViewInfo], num_rows: int, policy: str, num_tokens: int) -> int:
    """How many of a sample's tokens a one-routing ``policy`` (``generated``: no view
    applied; ``latest``: every view) replays with a routing other than the one they
    attended to: the sample has ``num_tokens`` tokens (so rows ``[0, num_tokens - 1)``),
    its rollout ``num_rows`` rows and applicable ``views``.  (``exact`` replays each state
    with its own routing, or refuses: none of its tokens are off.)

    Token ``t`` (``1 <= t < num_tokens``) belongs to the state whose rows ``(a, b]`` hold
    ``t``; it attended to rows ``[0, t)`` with that state's views applied.  It is off its
    state when a view that one applies and the replay does not (or the other way round)
    has a row below ``t``.  A view whose rows happen to equal the first computation still
    counts: which rows the engine recomputed is known, what they hold is not read here.
    """
    if policy not in ("generated", "latest"):
        raise InvalidRequestError(f"off_state_tokens counts a one-routing policy, not {policy!r}")
    rows = max(0, min(num_rows, num_tokens - 1))
    if rows == 0 or not views:
        return 0
    replayed = () if policy == "generated" else tuple(views)
    off = 0
    for a, b, applied in states_of(views, rows):  # tokens a + 1 .. b are in this state
        differ = [v for v in set(applied) ^ set(replayed) if v.end > v.start]
        if not differ:
            continue
        low = min(v.start for v in differ)  # token t is off once t > low
        off += max(0, b - max(a, low))
    return off


#: Reads one view's rows in the base read's range and layers (decoded; maybe no rows).
ViewRows: TypeAlias = Callable[[ViewInfo], Routing]
#: A resolution that asks for one view's rows at a time (it yields the view, and is sent
#: the view's rows in the base read's range and layers) and returns its answer: the one
#: logic behind the sync readers (:func:`run_steps`) and the async one (:func:`arun_steps`).
Steps: TypeAlias = Generator[ViewInfo, Routing, T]


def run_steps(steps: Steps[T], rows_of: ViewRows) -> T:
    """Drive ``steps``, reading each view it asks for with ``rows_of``; its answer.  A read
    that raises closes ``steps`` before the error goes on (the rows it holds let go then,
    not when a traceback that keeps it is freed)."""
    try:
        v = next(steps)
        while True:
            v = steps.send(rows_of(v))
    except StopIteration as done:
        return cast(T, done.value)
    finally:
        steps.close()


async def arun_steps(steps: Steps[T], rows_of: Callable[[ViewInfo], Awaitable[Routing]]) -> T:
    """:func:`run_steps` with an async reader of views."""
    try:
        v = next(steps)
        while True:
            v = steps.send(await rows_of(v))
    except StopIteration as done:
        return cast(T, done.value)
    finally:
        steps.close()


def served(
    base: Routing,
    views: Sequence[ViewInfo],
    num_rows: int,
    policy: str,
    *,
    max_bytes: int,
    rollout_id: str = "",
) -> Steps[list[ServedRouting]]:
    """What ``get_served`` answers under ``policy``, whoever reads the rows (as
    :data:`Steps`: it asks for each view's rows when it applies them).

    ``base``: every row of the rollout (first computations); ``views``: its applicable
    views (:func:`serving_views`).  ``exact``: one :class:`ServedRouting` per state, each
    with the views serving rows up to it applied; ``latest``: one, every view applied;
    ``generated``: one, none applied.

    Bounded (:func:`check_views_size`): the answer's declared size is checked against
    ``max_bytes`` before any view is read, and views are read and written one at a time,
    so at most one view's rows are held beside the answer.
    """
    if policy == "exact":
        states = states_of(views, num_rows)
    else:
        states = [(0, base.end, tuple(views) if policy == "latest" else ())]
    kept = [b for i, (_, b, applied) in enumerate(states) if applied and i < len(states) - 1]
    check_views_size(base, views if policy != "generated" else (), kept, max_bytes, rollout_id)
    out: list[ServedRouting] = []
    cur: npt.NDArray[Any] | None = None  # base's rows with the views so far written over
    done = 0
    for i, (a, b, applied) in enumerate(states):
        for v in applied[done:]:  # each state applies the views of the one before, and more
            part = yield v
            cur = _write_view(base, base.indices if cur is None else cur, part, v, rollout_id)
        done = len(applied)
        if cur is None:
            routing = base.select(start=0, end=b)
        else:
            last = i == len(states) - 1
            rows = cur[:b] if last else np.array(cur[:b], copy=True)  # cur changes after
            rows.setflags(write=False)
            routing = Routing(
                rows, base.num_experts, base.layer_ids, 0, base.select(end=b).segments
            )
        out.append(ServedRouting(a, b, routing, applied))
    return out


def apply_views(
    base: Routing,
    views: Sequence[ViewInfo],
    *,
    max_bytes: int,
    rollout_id: str = "",
) -> Steps[Routing]:
    """``base`` (any range and layers) with ``views`` written over it in order (later wins):
    the ``latest`` policy, as :data:`Steps`.  Bounded like :func:`served`: one view's rows
    held at a time."""
    if not views:
        return base
    check_views_size(base, views, [], max_bytes, rollout_id)
    cur = base.indices
    for v in views:
        part = yield v
        cur = _write_view(base, cur, part, v, rollout_id)
    cur.setflags(write=False)
    return Routing(cur, base.num_experts, base.layer_ids, base.start, base.segments)


def check_views_size(
    base: Routing,
    views: Sequence[ViewInfo],
    kept: Sequence[int],
    max_bytes: int,
    rollout_id: str,
) -> None:
    """Refuse (:class:`LimitExceededError`) an answer with views over ``max_bytes``, from the
    declared sizes alone (before any view is read): ``base``, one copy of it to write the
    views over, the rows ``[0, b)`` of each earlier state kept (``kept``: their ends), and
    the largest view's rows in ``base``'s range."""
    row = base.indices.itemsize * base.indices.shape[1] * base.indices.shape[2]
    check_rows_size(row, base.start, base.end, views, kept, max_bytes, rollout_id)


def check_rows_size(
    row: int,
    start: int,
    end: int,
    views: Sequence[ViewInfo],
    kept: Sequence[int],
    max_bytes: int,
    rollout_id: str,
) -> None:
    """:func:`check_views_size` of an answer of rows ``[start, end)``, ``row`` bytes each
    (decoded, in the layers read), before any of its rows are read."""
    if not views:
        return
    part = max(max(0, min(v.end, end) - max(v.start, start)) for v in views)
    need = row * (2 * (end - start) + sum(kept) + part)
    if need > max_bytes:
        who = f"rollout {rollout_id}" if rollout_id else "a rollout"
        raise LimitExceededError(
            f"{who} with {len(views)} views needs {need} bytes to answer with its views "
            f"applied ({len(kept) + 1} routings of up to {end - start} rows, one view at a "
            f"time); this reader's limit is {max_bytes} (max_bytes): read fewer layers or "
            "rows, or raise max_bytes"
        )


def _write_view(
    base: Routing, cur: npt.NDArray[Any], part: Routing, v: ViewInfo, rollout_id: str
) -> npt.NDArray[Any]:
    """``cur`` (``base``'s rows; copied on the first write) with view ``v``'s rows ``part``
    written over it, after checking the view's geometry is the rollout's."""
    _check_geometry(base, part, v, rollout_id)
    if cur is base.indices:
        cur = np.array(cur, copy=True)
    a, b = max(part.start, base.start), min(part.end, base.end)
    if a < b:
        cur[a - base.start : b - base.start] = part.indices[a - part.start : b - part.start]
    return cur


def write_rows(
    out: npt.NDArray[Any],
    start: int,
    part: Routing,
    like: Routing,
    source: ViewInfo | None,
    rollout_id: str = "",
) -> None:
    """Write ``part``'s rows into ``out`` (rows ``[start, start + len(out))``; those of
    ``part`` outside them are left out), after checking ``part`` has the geometry of
    ``like`` (the rollout's: experts, layers read, top-k; :class:`StoreError` otherwise).
    ``source``: the view ``part`` was read from, None for the segments (the message)."""
    _check_geometry(like, part, source, rollout_id)
    a, b = max(part.start, start), min(part.end, start + out.shape[0])
    if a < b:
        out[a - start : b - start] = part.indices[a - part.start : b - part.start]


def _check_geometry(base: Routing, part: Routing, v: ViewInfo | None, rollout_id: str) -> None:
    """:class:`StoreError` unless ``part`` (a view's rows, or with ``v`` None a segment's)
    holds ``base``'s experts, layers and top-k."""
    if (
        part.num_experts == base.num_experts
        and part.layer_ids == base.layer_ids
        and part.indices.shape[1:] == base.indices.shape[1:]
    ):
        return
    who = f"rollout {rollout_id}" if rollout_id else "the rollout"
    what = f"the view serving row {v.serves}" if v is not None else "a segment"
    stored = "its stored view" if v is not None else "the stored segment"
    raise StoreError(
        f"{what} of {who} holds layers {list(part.layer_ids)} "
        f"of {part.num_experts} experts, top-{part.indices.shape[-1]}; the rollout holds "
        f"layers {list(base.layer_ids)} of {base.num_experts}, top-{base.indices.shape[-1]}: "
        f"{stored} is not the rollout's (damaged at rest)"
    )
