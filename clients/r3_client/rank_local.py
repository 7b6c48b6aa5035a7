"""Rank-local fetch: each training rank reads and decodes only its own slice of a step's routing.

The driver (or rollout process) hands the ranks rollout ids and lengths, which the
trainer carries anyway; no process ever holds a step's decoded routing.  Each rank,
for each micro-batch it runs:

1. plans which rows it needs from the lengths alone (:func:`~r3_client.layouts.verl_rank_plan`:
   its CP / TP(SP) slice of the packed micro-batch, its pipeline stage's layers);
2. reads exactly those rows of those layers (one batch request per micro-batch:
   :meth:`RoutingClient.get_ranges <r3_client.RoutingClient.get_ranges>` through the
   service, which cuts each item to the stored blocks and layer groups covering it, or
   :meth:`DirectReader.get_ranges <r3_client.DirectReader.get_ranges>` from Redis);
3. decodes them straight into its replay targets (:class:`~r3_client.layouts.VerlRankSlice`,
   ``int64`` as ``RouterReplay`` takes them), checking every row against its packing:
   a rollout that is missing, shorter than its sample or holds rows nobody shipped is
   refused naming the sample and rollout.

:func:`prefetched` overlaps the next micro-batch's fetch with the current one's
compute.  Before dispatch, the driver checks the whole step once
(:func:`check_step`), so a missing rollout fails the step before any rank starts.
docs/integrations.md ("Rank-local fetch") gives the recipe per framework.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import InvalidRequestError, R3Error, RolloutNotFoundError, ShapeError
from r3_client._fetched import FetchedRange
from r3_client._kernels import native as _native
from r3_client._routing import Routing, check_rollout_id
from r3_client._step_check import (
    StatsInHand,
    StatSource,
    StepCheck,
    check_step,
    checked_totals,
    count_replay,
    expansion_totals,
    off_state_totals,
    sample_name,
)
from r3_client._views import (
    RangeRead,
    ViewPolicy,
    check_policy,
)
from r3_client.codec.into import IntoPlan
from r3_client.layouts import (
    MegatronReplayBatch,
    Missing,
    RankPlan,
    VerlRank,
    VerlRankSlice,
    megatron_rank_plan,
    verl_rank_plan,
)
from r3_client.layouts._rows import uncovered
from r3_client.layouts.megatron import replay_batch_of
from r3_client.layouts.verl import rank_slice_of

__all__ = [
    "RangeSource",
    "StatSource",
    "StatsInHand",
    "StepCheck",
    "check_step",
    "checked_totals",
    "count_replay",
    "expansion_totals",
    "fetch_megatron_rank_batch",
    "fetch_plan_rows",
    "fetch_verl_rank_slice",
    "off_state_totals",
    "prefetched",
]

T = TypeVar("T")
U = TypeVar("U")


class RangeSource(Protocol):
    """Where a rank reads rows from: a :class:`~r3_client.RoutingClient` (through the
    service) or a :class:`~r3_client.DirectReader` (Redis directly)."""

    def get_ranges(
        self,
        reads: Sequence[RangeRead],
        *,
        layers: Sequence[int] | None = None,
        view: ViewPolicy = "exact",
        return_errors: bool = False,
    ) -> Iterator[tuple[str, Routing | R3Error]]:
        """``(rollout_id, Routing)`` per ``(rollout_id, start, end[, state])`` read, in
        order, under ``view`` (:meth:`RoutingClient.get_ranges
        <r3_client.RoutingClient.get_ranges>`)."""
        ...


def fetch_verl_rank_slice(
    source: RangeSource,
    rollout_ids: Sequence[str],
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    *,
    rank: VerlRank | None = None,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
    pin_memory: bool = False,
) -> VerlRankSlice:
    """One verl Megatron rank's R3 replay targets for one micro-batch, read for that rank alone.

    Equal to :func:`~r3_client.layouts.verl_rank_slice` of the micro-batch's whole
    rollouts (so to verl 0.9.1's own R3 branch on the whole batch), but only the rank's
    rows of its stage's layers (``rank.stage_layers``, absolute MoE layer ids; default
    every layer the rollouts hold) are fetched and decoded: one ``get_ranges`` call,
    one read per contiguous run of rows (at most two per sample under zigzag CP, plus
    one where the SP split cuts a sample).  ``rollout_ids``, ``prompt_lens``,
    ``response_lens``: the micro-batch's samples in the order verl packs them.
    A stage without MoE layers (``stage_layers=()``) fetches nothing.

    Raises :class:`~r3_client.RolloutNotFoundError` for a rollout the cache does not
    hold and :class:`~r3_client.ShapeError` for one shorter than its sample (fewer
    than ``P_i + R_i - 1`` rows), one holding other layers or rows nobody shipped
    (unless ``missing="fill"``: ``0``, as verl fills), each naming the sample and
    rollout.

    ``pin_memory=True``: the targets are written into page-locked host memory (a CUDA
    process only), so the replay's copy to the GPU is asynchronous with no staging copy.
    """
    rank = VerlRank() if rank is None else rank
    ids = [check_rollout_id(r) for r in rollout_ids]
    plan = verl_rank_plan(prompt_lens, response_lens, rank=rank)
    stage = rank.stage_layers
    layers = None if stage is None else tuple(sorted(stage))
    local, layer_ids = fetch_plan_rows(
        source, ids, plan, layers, missing, 0, view, states, pin_memory=pin_memory
    )
    return rank_slice_of(plan, list(local), layer_ids, tuple(ids), as_torch)


def fetch_megatron_rank_batch(
    source: RangeSource,
    rollout_ids: Sequence[str],
    *,
    seqlens: Sequence[int] | npt.ArrayLike,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    sequence_parallel: bool = False,
    stage_layers: Sequence[int] | None = None,
    pad_to_multiple: int | None = None,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
    pin_memory: bool = False,
) -> MegatronReplayBatch:
    """One Megatron rank's :class:`~r3_client.layouts.MegatronReplayBatch` for one
    micro-batch, read for that rank alone (for ``RouterReplayDriver.add_micro_batch``).

    Equal to :func:`~r3_client.layouts.megatron_layout` of the micro-batch's whole
    rollouts with the same arguments (``-1`` on last tokens and padding), but only the
    rank's rows of ``stage_layers`` (absolute MoE layer ids; default every layer the
    rollouts hold) are fetched and decoded, as :func:`fetch_verl_rank_slice` reads.
    ``seqlens``: the trainer's token counts, in its packing order.  Raises as
    :func:`fetch_verl_rank_slice` does; ``missing="fill"`` keeps rows nobody shipped
    ``-1`` (the driver replays experts ``0..K-1`` there, miles' rule).  ``view`` and
    ``states``, ``pin_memory``: as :func:`fetch_verl_rank_slice` takes them.
    """
    ids = [check_rollout_id(r) for r in rollout_ids]
    plan = megatron_rank_plan(
        seqlens,
        tp_size=tp_size,
        tp_rank=tp_rank,
        cp_size=cp_size,
        cp_rank=cp_rank,
        sequence_parallel=sequence_parallel,
        pad_to_multiple=pad_to_multiple,
    )
    layers = None if stage_layers is None else tuple(sorted(int(x) for x in stage_layers))
    if layers == ():
        raise ShapeError("stage_layers is empty: a stage without MoE layers has no routers")
    local, layer_ids = fetch_plan_rows(
        source, ids, plan, layers, missing, -1, view, states, pin_memory=pin_memory
    )
    return replay_batch_of(plan, list(local), layer_ids, tuple(ids), as_torch)


def fetch_plan_rows(
    source: RangeSource,
    ids: list[str],
    plan: RankPlan,
    layers: tuple[int, ...] | None,
    missing: Missing,
    fill: int,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
    *,
    pin_memory: bool = False,
) -> tuple[npt.NDArray[np.int64], tuple[int, ...]]:
    """``[L, local_tokens, K]`` int64 rows of ``plan`` (``fill`` where it has none) and
    their layer ids: one ``get_ranges`` call, every run checked against the plan.  Layer
    major, so each layer's targets are a contiguous view (no copy per layer).

    The fetch every rank-local layout shares (verl's, Megatron's, and the glue's for
    trainers that pack their own way): ``layers`` are absolute MoE layer ids (``None``:
    every stored layer; ``()``: none, nothing read); ``fill`` ``>= 0`` also replaces rows
    nobody shipped under ``missing="fill"``, a negative one keeps them ``-1``.
    ``view`` / ``states``: the policy every read is made under and, under ``exact``,
    each sample's state (:func:`fetch_verl_rank_slice`); ``pin_memory``: the rows in
    page-locked host memory (:func:`pinned_targets`).
    """
    policy = _check_fetch(ids, plan, view, states)
    if layers == ():  # a stage of dense layers: its routers are none, nothing to read
        return np.full((0, plan.num_local_tokens, 0), fill, np.int64), ()
    runs, reads = _plan_reads(ids, plan, policy, states)
    targets = _Targets(ids, plan, missing, fill, pin_memory)
    # Reads answered undecoded (a source taking decode=False) go straight into the targets
    # by one compiled call for the whole micro-batch, the GIL released throughout; any read
    # that call does not take is decoded by the reference and copied, as before.
    kw: dict[str, Any] = {"decode": False} if _takes_decode(type(source)) else {}
    answers = source.get_ranges(reads, layers=layers, view=policy, return_errors=True, **kw)
    planned: list[tuple[int, int, int, int, FetchedRange, IntoPlan]] = []
    with _released(answers):
        for (i, a, b, at), (_, got) in zip(runs, answers, strict=True):
            if isinstance(got, FetchedRange):
                into = got.plan()
                if into is not None:
                    targets.array(i, into.layer_ids, into.topk)
                    if at >= 0:  # (a run that only says the layers and K places no row)
                        planned.append((i, a, b, at, got, into))
                    continue
                got = got.routing()
            targets.place(i, a, b, at, _checked(got, i, ids[i], a, b, plan))
    if planned:
        _decode_planned(targets, planned)
    return targets.result()


def _check_fetch(
    ids: list[str], plan: RankPlan, view: ViewPolicy, states: Sequence[int | None] | None
) -> ViewPolicy:
    """:func:`fetch_plan_rows`' arguments checked (before any I/O); the read policy."""
    if len(ids) != plan.seqlens.shape[0]:
        raise ShapeError(
            f"{len(ids)} rollout ids for a micro-batch of {plan.seqlens.shape[0]} samples"
        )
    policy = check_policy(view)
    if states is not None:
        if policy != "exact":
            raise InvalidRequestError(
                f'states name the state each sample replays, which only view="exact" reads; '
                f"view={policy!r} replays one routing for every token"
            )
        if len(states) != len(ids):
            raise ShapeError(f"{len(ids)} rollout ids for {len(states)} states")
    return policy


def _plan_reads(
    ids: list[str], plan: RankPlan, policy: ViewPolicy, states: Sequence[int | None] | None
) -> tuple[list[tuple[int, int, int, int]], list[RangeRead]]:
    """The runs of rows a rank reads (``(sample, start, end, at)``: ``at`` where they go in
    its targets, ``-1`` for none) and the ``get_ranges`` read of each."""
    runs = list(plan.runs)
    if not runs:  # only last tokens and padding: one row says the layers and K
        first = int(np.argmax(plan.seqlens > 1))
        if plan.seqlens[first] < 2:
            raise ShapeError("no sample of the micro-batch has a routing row (all one token)")
        runs = [(first, 0, 1, -1)]
    # Under exact every read names its sample's rows' end, so a rank that reads only an
    # early part of a sample spanning several states refuses it as the others do.
    rows_of = plan.seqlens.astype(np.int64) - 1
    reads: list[RangeRead] = [
        (ids[i], a, b)
        if policy != "exact"
        else (ids[i], a, b, None if states is None else states[i], int(rows_of[i]))
        for i, a, b, _ in runs
    ]
    return runs, reads


class _Targets:
    """A micro-batch's ``[L, local_tokens, K]`` int64 targets, made when the first answer
    says the layers and K (every later one must agree), and the rows placed in them."""

    def __init__(
        self, ids: list[str], plan: RankPlan, missing: Missing, fill: int, pin_memory: bool
    ) -> None:
        self.ids = ids
        self.plan = plan
        self.missing: Missing = missing
        self.fill = fill
        self.pin_memory = pin_memory
        # verl fills rows nobody shipped with 0 (its own fill); Megatron keeps them -1.
        self.gap_fill = np.full(1, fill, np.int64) if fill >= 0 else None
        self.local: npt.NDArray[np.int64] | None = None
        self.layer_ids: tuple[int, ...] = ()

    def array(self, i: int, got_layers: tuple[int, ...], topk: int) -> npt.NDArray[np.int64]:
        """The targets, made on sample ``i``'s answer (its layers and K) if none are yet."""
        if self.local is None:
            self.layer_ids = got_layers
            shape = (len(got_layers), self.plan.num_local_tokens, topk)
            self.local = (
                pinned_targets(shape, self.fill)
                if self.pin_memory
                else np.full(shape, self.fill, np.int64)
            )
        elif got_layers != self.layer_ids or topk != self.local.shape[2]:
            raise ShapeError(
                f"{sample_name(i, self.ids[i])} holds MoE layers {list(got_layers)} with "
                f"top-{topk}, an earlier sample {list(self.layer_ids)} with "
                f"top-{self.local.shape[2]}"
            )
        return self.local

    def place(self, i: int, a: int, b: int, at: int, rows: Routing) -> None:
        """Rows ``[a, b)`` of sample ``i`` at local token ``at`` (none where ``at < 0``)."""
        out = self.array(i, rows.layer_ids, rows.topk)
        if at >= 0:
            arr = uncovered(rows.indices, self.name(i), self.missing, self.gap_fill, first_row=a)
            out[:, at : at + b - a] = arr.transpose(1, 0, 2)

    def name(self, i: int) -> str:
        """How a refusal names sample ``i``'s rows."""
        return f"{sample_name(i, self.ids[i])}'s routing"

    def result(self) -> tuple[npt.NDArray[np.int64], tuple[int, ...]]:
        """The targets and their layer ids."""
        assert self.local is not None  # (every fetch reads at least one run)
        return self.local, self.layer_ids


def pinned_targets(shape: tuple[int, int, int], fill: int) -> npt.NDArray[np.int64]:
    """An int64 array of ``shape`` filled with ``fill``, in page-locked (pinned) host memory
    (a torch tensor's, which the array keeps alive): a replay's copy of it to the GPU runs
    asynchronously and needs no staging copy (``Tensor.pin_memory()`` returns a pinned
    tensor as it is).  Needs torch with a CUDA device: page-locked memory is CUDA's
    (:class:`InvalidRequestError` otherwise, rather than memory that is not pinned)."""
    import torch  # lazy: only a caller asking for pinned memory needs torch

    if not torch.cuda.is_available():
        raise InvalidRequestError(
            "pin_memory=True needs a CUDA device (page-locked host memory is CUDA's); this "
            "process has none: fetch without pin_memory"
        )
    pinned = torch.full(shape, fill, dtype=torch.int64, pin_memory=True)
    out: npt.NDArray[np.int64] = pinned.numpy()
    return out


def _decode_planned(
    targets: _Targets, planned: list[tuple[int, int, int, int, FetchedRange, IntoPlan]]
) -> None:
    """The planned reads of a micro-batch (each placing rows: ``at >= 0``) decoded into
    their windows of the targets by one compiled call; each window's rows nobody shipped
    handled as the reference path handles them (:func:`~r3_client.layouts._rows.uncovered`).
    A refusal (a damaged chunk) decodes every planned read by the reference instead, which
    raises the exact error; a refusal the reference does not share is counted
    (``native.disagreed``)."""
    local, ids, plan = targets.local, targets.ids, targets.plan
    assert local is not None
    windows = [local[:, at : at + b - a].transpose(1, 0, 2) for _, a, b, at, _, _ in planned]
    jobs = [job for (*_, into), win in zip(planned, windows, strict=True) for job in into.jobs(win)]
    code, _ = _native.decode_into(jobs)
    if code != 0:
        for i, a, b, at, fetched, _ in planned:
            targets.place(i, a, b, at, _checked(fetched.routing(), i, ids[i], a, b, plan))
        _native.disagreed("a micro-batch's frames decoded into its targets")
        return
    for (i, a, *_), win in zip(planned, windows, strict=True):
        arr = uncovered(win, targets.name(i), targets.missing, targets.gap_fill, first_row=a)
        if arr is not win:
            win[...] = arr


@contextmanager
def _released(answers: Iterator[Any]) -> Iterator[None]:
    """Close ``answers`` (a source's ``get_ranges`` generator) on leaving, error or not.

    A refused run raises with the rest of the read still unconsumed: the generator is
    suspended inside its batch stream (an open HTTP response, a gRPC call, Redis reads in
    flight).  Closed here, that is released before the error reaches the caller; left to
    whatever frees the generator, a traceback cycle kept the stream open until the garbage
    collector ran, and a finalizer closing it inside httpcore's pool lock waited on that
    lock for good (issue 53).  A caller's own source may answer a plain iterator."""
    try:
        yield
    finally:
        close = getattr(answers, "close", None)
        if close is not None:
            close()


@functools.cache
def _takes_decode(kind: type) -> bool:
    """Whether a source type's ``get_ranges`` takes ``decode=`` (RoutingClient and
    DirectReader do; a caller's own source may not)."""
    try:
        params = inspect.signature(getattr(kind, "get_ranges")).parameters  # noqa: B009
    except (AttributeError, TypeError, ValueError):
        return False
    return "decode" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _checked(got: Routing | R3Error, i: int, rid: str, a: int, b: int, plan: RankPlan) -> Routing:
    """A run's rows, or the error naming the sample: not found, or short of its tokens."""
    who = sample_name(i, rid)
    if isinstance(got, RolloutNotFoundError):
        raise RolloutNotFoundError(f"{who}: {got}") from got
    if isinstance(got, R3Error):
        if "outside rollout" in str(got):
            raise ShapeError(
                f"{who} has {plan.seqlens[i]} tokens, so {plan.seqlens[i] - 1} routing "
                f"rows, but the cache does not hold rows [{a}, {b}) of it ({got}): a partial "
                "rollout, or tokens the engine never saw"
            ) from got
        raise got
    if got.start != a or got.num_rows != b - a:
        raise ShapeError(f"{who}: asked rows [{a}, {b}), got [{got.start}, {got.end})")
    return got


def prefetched(
    items: Iterable[T], fetch: Callable[[T], U], *, depth: int = 1
) -> Iterator[tuple[T, U]]:
    """``(item, fetch(item))`` in order, fetching up to ``depth`` items ahead in a thread.

    The next micro-batch's routing is read and decoded while the caller computes
    on the current one (the decode releases the GIL in zstd and numpy); an error
    raises when its item is reached.
    """
    it = iter(items)
    with ThreadPoolExecutor(1, thread_name_prefix="r3-prefetch") as pool:
        window: list[tuple[T, Any]] = []
        for item in it:
            window.append((item, pool.submit(fetch, item)))
            if len(window) > depth:
                head, fut = window.pop(0)
                yield head, fut.result()
        for head, fut in window:
            yield head, fut.result()
