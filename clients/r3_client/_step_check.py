"""The pre-dispatch check of a step, and what it tells an operator about the step's replay.

:func:`check_step` holds a step's rollouts to the rules every rank's fetch holds them to
(one batched stat, no rows) and says what the replay will do with them, counted in the
process (:func:`off_state_totals`, :func:`checked_totals`, :func:`expansion_totals`) and
exported as the ``r3_client_*`` Prometheus series the monitoring reads:

* **off state** (``r3_client_off_state_*``): tokens replayed with a routing other than the
  one they attended to.  Only a named one-routing policy (``generated``, ``latest``) on a
  rollout with views does that; ``exact`` never does (it replays each sample in its state
  and refuses a sample reaching past it), so under ``exact`` these count 0;
* **expansion** (``r3_client_expansion_*``): under ``exact``, the samples whose tokens span
  several routing states, which the exact path cuts into one training sample per state
  (:mod:`r3_client.expansion`), and what that costs: the extra samples and the tokens
  forwarded more than once.  A step already expanded has none.

The whole-step fills under a named policy count their off-state tokens the same way
(:func:`count_replay`).  docs/integrations.md ("What the counters mean") and
docs/runbooks.md (``R3TrainerOffStateReplay``) say what each series means and when the
alert fires.  Lives apart from :mod:`r3_client.rank_local`, which re-exports it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from r3_client._answers import RolloutInfo
from r3_client._exceptions import InvalidRequestError, R3Error, RolloutNotFoundError, ShapeError
from r3_client._routing import check_rollout_id, token_digest
from r3_client._views import (
    ViewPolicy,
    applicable_views,
    check_policy,
    off_state_tokens,
    states_of,
)
from r3_client.layouts import Missing

__all__ = [
    "StatSource",
    "StatsInHand",
    "StepCheck",
    "check_step",
    "checked_totals",
    "count_replay",
    "expansion_totals",
    "off_state_totals",
    "sample_name",
]


def sample_name(i: int, rid: str) -> str:
    """How a refusal names sample ``i`` of a step and its rollout."""
    return f"sample {i} (rollout {rid!r})"


class StatSource(Protocol):
    """What :func:`check_step` asks: a rollout's stat."""

    def stat(self, rollout_id: str) -> RolloutInfo:
        """What is stored for the rollout."""
        ...


class StatsInHand:
    """A :class:`StatSource` answering from stats already read (``None`` or a
    :class:`~r3_client.RolloutNotFoundError`: not stored), so one batched stat serves
    several checks of a step (:func:`check_step`, :func:`r3_client.expand_states`)."""

    def __init__(self, infos: dict[str, RolloutInfo | R3Error | None]) -> None:
        self.infos = infos

    def stat(self, rollout_id: str) -> RolloutInfo:
        """The stat in hand, or the error its read answered."""
        info = self.infos[rollout_id]
        if info is None:
            raise RolloutNotFoundError(f"rollout {rollout_id!r} not found")
        if isinstance(info, R3Error):
            raise info
        return info

    def stat_many(self, rollout_ids: Sequence[str]) -> list[RolloutInfo | R3Error]:
        """Each stat in hand or its error, in order (no threads, no I/O)."""
        out: list[RolloutInfo | R3Error] = []
        for rid in rollout_ids:
            try:
                out.append(self.stat(rid))
            except R3Error as exc:
                out.append(exc)
        return out


# The logger keeps the name it had when this lived in rank_local: operators filter on it.
_log = logging.getLogger("r3_client.rank_local")


@dataclass(frozen=True)
class StepCheck:
    """What :func:`check_step` found in a step that can be replayed.

    ``samples``: the step's samples; ``samples_with_views``: those whose rollout has views
    (positions the engine computed more than once); ``off_state_samples`` /
    ``off_state_tokens``: the samples with tokens, and those tokens, that the replay under
    ``policy`` gives a routing other than the one they attended to
    (:func:`r3_client._views.off_state_tokens`; always 0 under ``exact``); ``tokens``: the
    step's tokens with a routing row (``num_tokens - 1`` per sample).

    ``expanded_samples`` / ``extra_samples`` / ``extra_tokens`` (``exact`` only): the
    samples whose tokens span several routing states, which the exact replay cuts into
    one training sample per state (:func:`r3_client.expand_states`; unexpanded, their
    fetch is refused), the training samples that adds and the tokens it forwards more than
    once (:attr:`r3_client.Expansion.extra_samples` / ``extra_tokens``).  0 on a step
    already expanded.
    """

    samples: int
    samples_with_views: int
    off_state_samples: int
    off_state_tokens: int
    tokens: int
    policy: str
    expanded_samples: int = 0
    extra_samples: int = 0
    extra_tokens: int = 0


_totals_lock = threading.Lock()
#: Process-wide off-state totals, by policy (:func:`off_state_totals`).
_off_state: dict[str, dict[str, int]] = {}
#: Process-wide totals of the steps checked, by policy (:func:`checked_totals`).
_steps: dict[str, dict[str, int]] = {}
#: Process-wide expansion totals of the steps checked under exact (:func:`expansion_totals`).
_expansion: dict[str, int] = {"samples": 0, "extra_samples": 0, "extra_tokens": 0}
#: The Prometheus collectors once made (one entry); None without prometheus_client.
_collectors: list[_Collectors | None] = []


@dataclass(frozen=True)
class _Collectors:
    """The trainer process's ``r3_client_*`` series, each labelled ``policy``."""

    off_samples: Any  # r3_client_off_state_samples_total
    off_tokens: Any  # r3_client_off_state_tokens_total
    steps: Any  # r3_client_steps_checked_total
    samples: Any  # r3_client_step_samples_total
    tokens: Any  # r3_client_step_tokens_total
    ratio: Any  # r3_client_step_off_state_ratio (gauge: the last step checked)
    expanded: Any  # r3_client_expansion_samples_total (no label: exact only)
    extra_samples: Any  # r3_client_expansion_extra_samples_total
    extra_tokens: Any  # r3_client_expansion_extra_tokens_total


def _prometheus() -> _Collectors | None:
    """The ``r3_client_*`` collectors in prometheus_client's default registry, made on
    first use; None where prometheus_client is not installed.  Call with ``_totals_lock``
    held."""
    if not _collectors:
        try:
            from prometheus_client import REGISTRY, Counter, Gauge
        except ImportError:
            _collectors.append(None)
            return None
        off = (
            "check_step found replayed with a routing other than the one they attended to "
            "(rollouts with views), by read policy"
        )
        made: list[Any] = []
        cut = "samples check_step found spanning several routing states under exact"
        by = ["policy"]
        for kind, name, doc, labels in (
            (Counter, "r3_client_off_state_samples", f"training samples {off}", by),
            (Counter, "r3_client_off_state_tokens", f"tokens {off}", by),
            (Counter, "r3_client_steps_checked", "steps check_step passed, by read policy", by),
            (Counter, "r3_client_step_samples", "samples of the steps check_step passed", by),
            (Counter, "r3_client_step_tokens", "tokens with a routing row of those steps", by),
            (
                Gauge,
                "r3_client_step_off_state_ratio",
                "off-state tokens / tokens of the last step check_step passed, by read policy",
                by,
            ),
            (Counter, "r3_client_expansion_samples", cut, []),
            (Counter, "r3_client_expansion_extra_samples", f"training samples added, {cut}", []),
            (Counter, "r3_client_expansion_extra_tokens", f"tokens forwarded again, {cut}", []),
        ):
            try:
                made.append(kind(name, doc, labels))
            except ValueError:  # already registered (the module was reloaded)
                made.append(getattr(REGISTRY, "_names_to_collectors", {}).get(name))
        _collectors.append(_Collectors(*made) if all(c is not None for c in made) else None)
    return _collectors[0]


def off_state_totals() -> dict[str, dict[str, int]]:
    """The samples and tokens :func:`check_step` has found replayed off their own state in
    this process, by policy: ``{policy: {"samples": n, "tokens": n}}`` (also exported as
    the Prometheus counters ``r3_client_off_state_samples_total`` and
    ``r3_client_off_state_tokens_total``, label ``policy``, where prometheus_client is
    installed)."""
    with _totals_lock:
        return {policy: dict(counts) for policy, counts in _off_state.items()}


def checked_totals() -> dict[str, dict[str, int]]:
    """The steps :func:`check_step` has passed in this process, their samples and their
    tokens with a routing row, by policy: ``{policy: {"steps": n, "samples": n, "tokens":
    n}}``, the denominators of :func:`off_state_totals` (also exported as the Prometheus
    counters ``r3_client_steps_checked_total``, ``r3_client_step_samples_total`` and
    ``r3_client_step_tokens_total``, label ``policy``, beside the gauge
    ``r3_client_step_off_state_ratio``, the last step's off-state tokens / tokens)."""
    with _totals_lock:
        return {policy: dict(counts) for policy, counts in _steps.items()}


def expansion_totals() -> dict[str, int]:
    """What :func:`check_step` has found the exact replay expands in this process:
    ``{"samples": n, "extra_samples": n, "extra_tokens": n}``, the samples spanning several
    routing states, the training samples their expansion adds and the tokens it forwards
    more than once (:class:`StepCheck`; also exported as the Prometheus counters
    ``r3_client_expansion_samples_total``, ``r3_client_expansion_extra_samples_total`` and
    ``r3_client_expansion_extra_tokens_total``).  Not off-state: those samples are replayed
    each state with its own routing."""
    with _totals_lock:
        return dict(_expansion)


def _report(found: StepCheck) -> None:
    """Count a checked step: warn about and count its off-state replay when it has one, and
    say (info) what the exact replay expands when it expands something."""
    off = found.off_state_tokens > 0
    if off:
        _log.warning(
            "%d of %d samples (%d of %d tokens) will be replayed off their own state under "
            "policy %r: those tokens attended to another routing than the one replayed; "
            'view="exact" with expansion (r3_client.expand_states) replays each state with '
            "its own",
            found.off_state_samples,
            found.samples,
            found.off_state_tokens,
            found.tokens,
            found.policy,
        )
    if found.expanded_samples:
        _log.info(
            "%d of %d samples span several routing states: the exact replay cuts them into "
            "one training sample per state (%d more samples, %d tokens forwarded again); "
            "unexpanded, their fetch is refused",
            found.expanded_samples,
            found.samples,
            found.extra_samples,
            found.extra_tokens,
        )
    with _totals_lock:
        step = _steps.setdefault(found.policy, {"steps": 0, "samples": 0, "tokens": 0})
        step["steps"] += 1
        step["samples"] += found.samples
        step["tokens"] += found.tokens
        if off:
            counts = _off_state.setdefault(found.policy, {"samples": 0, "tokens": 0})
            counts["samples"] += found.off_state_samples
            counts["tokens"] += found.off_state_tokens
        _expansion["samples"] += found.expanded_samples
        _expansion["extra_samples"] += found.extra_samples
        _expansion["extra_tokens"] += found.extra_tokens
        prom = _prometheus()
    if prom is None:
        return
    policy = found.policy
    prom.steps.labels(policy=policy).inc()
    prom.samples.labels(policy=policy).inc(found.samples)
    prom.tokens.labels(policy=policy).inc(found.tokens)
    ratio = found.off_state_tokens / found.tokens if found.tokens else 0.0
    prom.ratio.labels(policy=policy).set(ratio)
    if off:
        prom.off_samples.labels(policy=policy).inc(found.off_state_samples)
        prom.off_tokens.labels(policy=policy).inc(found.off_state_tokens)
    if found.expanded_samples:
        prom.expanded.inc(found.expanded_samples)
        prom.extra_samples.inc(found.extra_samples)
        prom.extra_tokens.inc(found.extra_tokens)


def check_step(
    source: StatSource,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int] | npt.ArrayLike,
    *,
    missing: Missing = "raise",
    tokens: Sequence[Sequence[int]] | None = None,
    longer: Sequence[bool] | bool = True,
    workers: int = 16,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
    count: bool = True,
) -> StepCheck:
    """Before dispatch: every rollout of the step exists and holds a row for each token
    of its sample but the last (``num_tokens[i] - 1`` rows, no gap unless
    ``missing="fill"``).  Metadata only, no rows: one batched request per 1,024 ids
    where ``source`` has ``stat_many`` (:class:`~r3_client.RoutingClient`), else one
    ``stat`` per rollout, ``workers`` at a time.

    ``tokens``: each sample's token ids; a stored segment that recorded a token digest
    and lies within them must have been computed from them (rows from other tokens: an
    earlier attempt's, another sample's).  ``longer``: whether a rollout may hold more
    rows than its sample needs (per sample, or for all): a trainer that cut a response
    allows it, one whose sample should be the whole rollout does not.

    ``view``: the policy the ranks replay under; ``states`` (``exact`` only): the state
    each sample replays (its first row; ``None`` is ``0``), which must start a state of its
    rollout (:func:`r3_client._views.states_of`) and, where given, hold all the sample's
    rows (an expanded sample reaching past its state is refused here, as every fetch
    refuses it).  Returns a :class:`StepCheck`: how many tokens the replay gives a routing
    other than the one they attended to (a sample of a rollout with views under
    ``generated`` / ``latest``; never under ``exact``), logged as a warning and counted
    when some are (:func:`off_state_totals`); under ``exact``, the samples spanning several
    states that the exact replay expands and what that costs, logged (info) and counted
    under their own name (:func:`expansion_totals`), never as off-state.  Every step that
    passes is counted too (:func:`checked_totals`); ``count=False`` counts nothing (a
    caller checking the same step again: ``ExactReplayTrainer`` expands a step three times).

    Raises one :class:`~r3_client.ShapeError` or :class:`~r3_client.RolloutNotFoundError`
    listing the first failing samples; any other error (auth, an unreachable service)
    raises as it is; :class:`~r3_client.InvalidRequestError` for a bad ``view`` or
    ``states`` given under another policy."""
    samples = _Samples.of(rollout_ids, num_tokens, tokens, longer, states, view, missing)
    ids = samples.ids
    many = getattr(source, "stat_many", None)
    infos: list[RolloutInfo | R3Error] | None = many(ids) if many is not None else None
    seen: list[RolloutInfo | None] = [None] * len(ids)

    def one(i: int) -> str | None:
        try:
            got = source.stat(ids[i]) if infos is None else infos[i]
            if isinstance(got, R3Error):
                raise got
        except RolloutNotFoundError:
            return f"{sample_name(i, ids[i])} is not in the cache"
        problem = samples.problem(i, got)
        if problem is None:
            seen[i] = got
        return problem

    if infos is not None:
        problems = [p for p in map(one, range(len(ids))) if p is not None]
    else:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="r3-check") as pool:
            problems = [p for p in pool.map(one, range(len(ids))) if p is not None]
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        cls = RolloutNotFoundError if all("not in the cache" in p for p in problems) else ShapeError
        raise cls(f"{len(problems)} of {len(ids)} samples cannot be replayed: {shown}")
    return _step_check(seen, samples.need, samples.policy, samples.state_of, count=count)


@dataclass(frozen=True)
class _Samples:
    """A step's samples as :func:`check_step` holds each to the rules, arguments checked:
    ``need`` each sample's rows (``num_tokens - 1``), ``state_of`` the state it replays."""

    ids: list[str]
    need: npt.NDArray[np.int64]
    tokens: Sequence[Sequence[int]] | None
    may_be_longer: list[bool]
    state_of: list[int | None]
    policy: ViewPolicy
    missing: Missing

    @classmethod
    def of(
        cls,
        rollout_ids: Sequence[str],
        num_tokens: Sequence[int] | npt.ArrayLike,
        tokens: Sequence[Sequence[int]] | None,
        longer: Sequence[bool] | bool,
        states: Sequence[int | None] | None,
        view: ViewPolicy,
        missing: Missing,
    ) -> _Samples:
        """:func:`check_step`'s arguments checked (before any I/O)."""
        policy = check_policy(view)
        ids = [check_rollout_id(r) for r in rollout_ids]
        need = np.asarray(num_tokens, dtype=np.int64).reshape(-1) - 1
        if need.shape[0] != len(ids):
            raise ShapeError(f"{len(ids)} rollout ids for {need.shape[0]} token counts")
        if tokens is not None and len(tokens) != len(ids):
            raise ShapeError(f"{len(ids)} rollout ids for {len(tokens)} token lists")
        may_be_longer = [bool(longer)] * len(ids) if isinstance(longer, bool) else list(longer)
        if len(may_be_longer) != len(ids):
            raise ShapeError(f"{len(ids)} rollout ids for {len(may_be_longer)} 'longer' flags")
        if states is not None and policy != "exact":
            raise InvalidRequestError(
                'states name the state each sample replays, which only view="exact" reads; '
                f"view={policy!r} replays one routing for every token"
            )
        if states is not None and len(states) != len(ids):
            raise ShapeError(f"{len(ids)} rollout ids for {len(states)} states")
        state_of: list[int | None] = [None] * len(ids)
        if states is not None:
            state_of = [None if s is None else int(s) for s in states]
        return cls(ids, need, tokens, may_be_longer, state_of, policy, missing)

    def problem(self, i: int, info: RolloutInfo) -> str | None:
        """Why sample ``i`` cannot be replayed from what its rollout stores (``info``), or
        None: its rows, their tokens, a gap nobody shipped, its state."""
        who, need = sample_name(i, self.ids[i]), self.need[i]
        if info.num_rows < need:
            return f"{who} holds {info.num_rows} rows, its sample needs {need}"
        if info.num_rows > need and not self.may_be_longer[i]:
            return (
                f"{who} holds {info.num_rows} rows, more than its sample's "
                f"{need}, and the sample was not cut short"
            )
        segments = [s.segment for s in info.segments]
        if self.tokens is not None:
            seq = [int(t) for t in self.tokens[i]]
            for seg in segments:
                checkable = seg.tokens_digest and seg.end <= len(seq)
                if checkable and token_digest(seq[: seg.end]) != seg.tokens_digest:
                    return (
                        f"{who}: stored rows [{seg.start}, {seg.end}) were computed from "
                        "other tokens than the sample's (token digest differs)"
                    )
        if self.missing == "raise":
            covered = 0
            for seg in sorted(segments, key=lambda s: s.start):
                if covered < seg.start and covered < need:
                    return f"{who} has no rows [{covered}, {seg.start}): nobody shipped them"
                covered = max(covered, seg.end)
        state = self.state_of[i]
        if self.policy != "exact" or state is None:
            return None
        ends = {a: b for a, b, _ in states_of(applicable_views(info), info.num_rows)}
        if state not in ends:
            return (
                f"{who} replays a state starting at row {state}; its "
                f"rollout's states start at rows {list(ends)}"
            )
        if need > ends[state]:
            return (
                f"{who} replays the state of rows [{state}, {ends[state]}) "
                f"but its tokens reach row {need}: one routing cannot replay them "
                "(expand the original sample, r3_client.expand_states)"
            )
        return None


def _step_check(
    infos: Sequence[RolloutInfo | None],
    need: npt.NDArray[np.int64],
    policy: str,
    state_of: Sequence[int | None],
    *,
    count: bool = True,
) -> StepCheck:
    """:func:`check_step`'s answer for a step that passed its checks (``need``: each
    sample's rows), counted (``count``): under ``generated`` / ``latest`` the tokens
    replayed off their own state, under ``exact`` what the expansion adds."""
    with_views = off_samples = off_tokens = expanded = extra_samples = extra_tokens = 0
    for i, info in enumerate(infos):
        views = () if info is None else applicable_views(info)
        if info is None or not views:
            continue
        with_views += 1
        if policy == "exact":
            # exact replays each state with its own routing (or refuses): nothing is off;
            # a sample spanning several states costs the copies its expansion adds
            rows = max(0, min(info.num_rows, int(need[i])))
            state = state_of[i]
            first = 0 if state is None else int(state)
            spans = [b for _, b, _ in states_of(views, rows) if b > first]
            if len(spans) > 1:
                expanded += 1
                extra_samples += len(spans) - 1
                extra_tokens += sum(b + 1 for b in spans[:-1])  # each copy: tokens 0 .. b
            continue
        off = off_state_tokens(views, info.num_rows, policy, int(need[i]) + 1)
        off_samples += off > 0
        off_tokens += off
    found = StepCheck(
        samples=len(infos),
        samples_with_views=with_views,
        off_state_samples=off_samples,
        off_state_tokens=off_tokens,
        tokens=int(np.maximum(need, 0).sum()),
        policy=policy,
        expanded_samples=expanded,
        extra_samples=extra_samples,
        extra_tokens=extra_tokens,
    )
    if count:
        _report(found)
    return found


def count_replay(
    infos: Sequence[RolloutInfo | R3Error | None],
    num_tokens: Sequence[int] | npt.ArrayLike,
    policy: ViewPolicy,
) -> StepCheck:
    """Count what a fill already made replays (its stats in hand: ``infos``, one per
    sample of ``num_tokens`` tokens; an error or ``None`` counts as a sample without
    views): the :class:`StepCheck` :func:`check_step` would answer for those samples
    under ``policy``, reported (warned and counted) as every checked step is.  The
    whole-step fills (verl's ``attach_routed_experts``, slime's and miles'
    ``fill_routed_experts``, AReaL's) call it under ``generated`` / ``latest``, so a
    named policy is counted where it is chosen, whether or not a pre-dispatch check
    runs too."""
    need = np.asarray(num_tokens, dtype=np.int64).reshape(-1) - 1
    if need.shape[0] != len(infos):
        raise ShapeError(f"{len(infos)} stats for {need.shape[0]} token counts")
    held = [info if isinstance(info, RolloutInfo) else None for info in infos]
    return _step_check(held, need, check_policy(policy), [None] * len(held))
