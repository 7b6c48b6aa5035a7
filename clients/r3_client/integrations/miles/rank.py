"""miles' training ranks: each Megatron rank reads its own slice of the routing replay.

Runs in every miles training process.  :func:`install_rank_local` (miles'
``--custom-megatron-init-path``, called with ``args`` in every training process,
``miles/backends/megatron_utils/initialize.py:129-133``, from the actor's ``init``,
``actor.py:109``) replaces the ``fill_replay_data`` that miles' Megatron actor calls
(``actor.py:49, 482-495``) with :func:`rank_local_fill_replay_data`, which reads the
routing replay of each micro-batch for this rank alone (:func:`fetch_rank_replay`: the
rank's CP / SP rows of its routers' layers, miles' ``-1`` padding) from the keys
:func:`rank_keys` rebuilds from ``sample_indices``, and hands every other data key (the
indexer replay) to miles' own.  Imports miles and megatron.core only when a hook is
installed or a fill runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from r3_client._exceptions import IntegrationError, InvalidRequestError, ShapeError
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.integrations.miles._keys import MILES
from r3_client.integrations.samples.rank import (
    ROUTED_EXPERTS,
    RankReplay,
    SampleRank,
    check_params,
    fill_micro_batches,
    hook_source,
    model_router_layers,
    plan_replay,
    source_getter,
    unwrapped,
)
from r3_client.layouts import Missing
from r3_client.rank_local import RangeSource, fetch_plan_rows

__all__ = [
    "RankReplay",
    "SampleRank",
    "check_miles_hooks",
    "fetch_rank_replay",
    "install_rank_local",
    "rank_keys",
    "rank_local_fill_replay_data",
    "sample_rank",
]

#: miles' fill's keywords (miles/backends/training_utils/replay_data.py:30-42).
_FILL_PARAMS = (
    "args",
    "models",
    "data_iterator",
    "num_microbatches",
    "rollout_data",
    "data_key",
    "replay_list",
    "register_replay_list_func",
    "if_sp_region",
    "indices_are_token_positions",
)
_PINNED = "miles 31f1ca9, miles/backends/training_utils/replay_data.py:30-134"
_ACTOR = "miles.backends.megatron_utils.actor"
_PARALLEL = "miles.backends.training_utils.parallel"
_REPLAY_DATA = "miles.backends.training_utils.replay_data"


rank_keys = MILES.rank_keys


def fetch_rank_replay(
    source: RangeSource,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int],
    *,
    rank: SampleRank,
    num_layers: int,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> RankReplay:
    """One micro-batch's replay targets on one miles Megatron rank, read for that rank alone.

    Equal, router by router, to what miles' fill records (``replay_utils.py:5-24`` after
    ``replay_data.py:73-127``) from whole ``miles_layout`` arrays, but only the rank's
    rows (its CP / SP slice) of its routers' layers are fetched (one ``get_ranges``
    call).  ``rollout_ids`` (:func:`rank_keys` of the micro-batch's ``sample_indices``)
    and ``num_tokens`` (``len(tokens)``), in the order the actor packs them; ``rank``: the
    rank's TP / CP / SP coordinates, ``args`` and router layers (:class:`SampleRank`);
    ``num_layers``: ``args.num_layers``.  miles pads with ``-1`` (``replay_data.py:63-71``),
    which its replay reads as experts ``0..K-1`` (``replay_base.py:102-109``).  Router
    ``j`` of the rank records ``per_layer[j]`` (:meth:`RankReplay.record`).  Raises
    :class:`~r3_client.RolloutNotFoundError` / :class:`~r3_client.ShapeError` naming the
    sample (``missing="fill"`` replays experts ``0..K-1`` on rows nobody shipped).
    ``view`` (default ``"exact"``) / ``states``: the read policy and, under ``exact``,
    each sample's state (``expand_samples`` records it); a sample spanning several states
    is refused ("expand the sample").
    """
    plan = plan_replay(rollout_ids, num_tokens, rank=rank, num_layers=num_layers)
    local, got = fetch_plan_rows(
        source, plan.rollout_ids, plan.rows, plan.layers, missing, -1, view, states
    )
    return plan.replay(local, got, missing=missing, num_experts=None, as_torch=as_torch)


def sample_rank(args: Any, models: Sequence[Any], *, if_sp_region: bool = True) -> SampleRank:
    """This rank's :class:`SampleRank`, read where miles' fill reads it: TP / CP from miles'
    ``get_parallel_state()`` (``replay_data.py:58-60, 86-87``), the pack multiplier and the
    SP / CP modes from ``args`` (``:101-102, 123``; SP only in an SP region), the routers
    from the model chunks as ``register_replay_list_moe`` walks them
    (``megatron_utils/replay_utils.py:8-20``).  Imports miles and megatron.core."""
    state = importlib.import_module(_PARALLEL).get_parallel_state()
    cp_size = int(state.cp.size)
    return SampleRank(
        tp_size=int(state.tp.size),
        tp_rank=int(state.tp.rank),
        cp_size=cp_size,
        cp_rank=int(state.cp.rank),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and bool(if_sp_region),
        allgather_cp=bool(args.allgather_cp) and cp_size > 1,
        data_pad_size_multiplier=int(args.data_pad_size_multiplier),
        router_layers=model_router_layers(models),
    )


def _check_thd(args: Any, indices_are_token_positions: bool) -> None:
    """Refuse what the rank-local fill does not cover: bshd (``replay_data.py:88-99``) and
    token-position indices."""
    if getattr(args, "qkv_format", "thd") != "thd":
        raise InvalidRequestError(
            f"miles rank-local routing covers qkv_format 'thd', not {args.qkv_format!r} "
            "(replay_data.py:88-99)"
        )
    if indices_are_token_positions:
        raise InvalidRequestError("miles rank-local routing replays experts, not token positions")


def _recorder(replay_list: list[Any]) -> Callable[[RankReplay], None]:
    """Replay ``j`` of ``replay_list`` records ``per_layer[j]``, as
    ``register_replay_list_moe`` has it (``replay_utils.py:22-24``); a list shorter than
    the rank's routers is refused."""

    def record(replay: RankReplay) -> None:
        n = len(replay.per_layer)
        if len(replay_list) < n:
            raise ShapeError(
                f"the rank has {len(replay_list)} routing replays but {n} MoE layers "
                f"{list(replay.layer_ids)}"
            )
        replay.record(replay_list[:n])

    return record


def rank_local_fill_replay_data(
    source: Any,
    run: str,
    *,
    original: Callable[..., Any] | None = None,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> Callable[..., None]:
    """A replacement for miles' ``fill_replay_data(*, args, models, data_iterator,
    num_microbatches, rollout_data, data_key, replay_list, register_replay_list_func,
    if_sp_region=True, indices_are_token_positions=False)`` (``replay_data.py:30-134``)
    that reads the routing replay (``data_key == "rollout_routed_experts"``) of each
    micro-batch for this rank alone from the cache.  Other data keys (the indexer replay)
    go to ``original`` (default: miles' own, imported when first needed).

    ``source``: a :class:`~r3_client.RoutingClient` / :class:`~r3_client.DirectReader`, or a
    callable making one on the first fill.  ``run``: the run the rollout side keyed with.

    Per call, as miles' own: every iterator reset (``:55-56``); per micro-batch
    (``sum(num_microbatches)``, ``:73``) ``data_iterator[0].get_next(["sample_indices",
    "tokens"])`` (``:74`` reads the routing); the rank (:func:`sample_rank`);
    :func:`fetch_rank_replay` of :func:`rank_keys` (``num_layers=args.num_layers``); replay
    ``j`` of ``replay_list`` records ``per_layer[j]`` (a list shorter than the rank's
    routers is refused); a shipped ``rollout_data["rollout_routed_experts"]`` is dropped
    unread (``:131``); every iterator reset again (``:133-134``).  thd only:
    ``args.qkv_format == "bshd"`` (``:88-99``) is refused, as are token-position indices.

    ``view``: the read policy (default ``"exact"``: each sample in its state, a sample
    spanning several states refused; ``expand_samples`` cuts them).  The rank tells an
    expanded sample's state from its shipped ``loss_masks`` / ``response_lengths`` and one
    batched stat per call (:func:`r3_client.integrations.samples.rank.trained_states`; a
    source without stats, a :class:`~r3_client.DirectReader`, reads every sample in its
    first state).
    """
    check_rollout_id(f"{run}.0")
    get_source: Callable[[], RangeSource] = source_getter(source)

    def fill_replay_data(
        *,
        args: Any,
        models: Any,
        data_iterator: Any,
        num_microbatches: Any,
        rollout_data: Any,
        data_key: str,
        replay_list: list[Any],
        register_replay_list_func: Any,
        if_sp_region: bool = True,
        indices_are_token_positions: bool = False,
    ) -> None:
        if data_key != ROUTED_EXPERTS:
            own = original
            if own is None:
                own = importlib.import_module(_REPLAY_DATA).fill_replay_data
            own(
                args=args,
                models=models,
                data_iterator=data_iterator,
                num_microbatches=num_microbatches,
                rollout_data=rollout_data,
                data_key=data_key,
                replay_list=replay_list,
                register_replay_list_func=register_replay_list_func,
                if_sp_region=if_sp_region,
                indices_are_token_positions=indices_are_token_positions,
            )
            return
        _check_thd(args, indices_are_token_positions)
        reads = get_source()
        fetch = functools.partial(
            fetch_rank_replay,
            rank=sample_rank(args, models, if_sp_region=if_sp_region),
            num_layers=int(args.num_layers),
            missing=missing,
        )
        fill_micro_batches(
            MILES, reads, run, data_iterator, num_microbatches, fetch, _recorder(replay_list), view
        )
        rollout_data.pop(ROUTED_EXPERTS, None)

    fill_replay_data.__doc__ = (
        f"miles' fill_replay_data, the routing replay read rank-locally from run {run!r}."
    )
    return fill_replay_data


def check_miles_hooks() -> Any:
    """The canary of :func:`install_rank_local`: returns the module
    ``miles.backends.megatron_utils.actor``, or raises :class:`~r3_client.IntegrationError`
    naming what moved unless it still binds ``fill_replay_data`` (imported at
    ``actor.py:49``, called at ``:482-495``) with miles 31f1ca9's keywords and
    ``get_parallel_state`` is where the fill reads TP / CP.  Imports miles."""
    problems: list[str] = []
    actor: Any = None
    try:
        actor = importlib.import_module(_ACTOR)
    except ImportError as exc:
        problems.append(f"{_ACTOR} cannot be imported ({exc})")
    if actor is not None:
        fill = getattr(actor, "fill_replay_data", None)
        if fill is None:
            problems.append(f"{_ACTOR} has no fill_replay_data")
        elif bad := check_params(fill, _FILL_PARAMS, f"{_ACTOR}.fill_replay_data", _PINNED):
            problems.append(bad)
    try:
        if not callable(getattr(importlib.import_module(_PARALLEL), "get_parallel_state", None)):
            problems.append(f"{_PARALLEL} has no get_parallel_state")
    except ImportError as exc:
        problems.append(f"{_PARALLEL} cannot be imported ({exc})")
    if problems:
        raise IntegrationError(
            f"miles is not the code r3_client's rank-local fill replaces ({_PINNED}): "
            + "; ".join(problems)
        )
    return actor


def install_rank_local(
    args: Any = None,
    *,
    source: Any = None,
    run: str | None = None,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> Callable[..., None]:
    """Make miles' Megatron actor of this process fill its routing replay rank-locally:
    ``miles.backends.megatron_utils.actor.fill_replay_data`` (the name ``train_actor``
    calls, ``actor.py:49, 482-495``) becomes :func:`rank_local_fill_replay_data` around
    miles' own (installing again replaces the hook, never wraps it).  Returns it.

    Usable as miles' ``--custom-megatron-init-path
    r3_client.integrations.miles.install_rank_local``: miles calls it with ``args`` in every
    training process (``miles/backends/megatron_utils/initialize.py:129-133``, from the
    actor's ``init``, ``actor.py:109``).  Without ``source`` / ``run`` it reads ``R3_URL``,
    ``R3_KEY`` (optional) and ``R3_RUN`` from the environment.  Refuses
    (:class:`~r3_client.InvalidRequestError`) ``args`` without
    ``use_rollout_routing_replay`` (``actor.py:460-461``: the fill is not called) and
    (:class:`~r3_client.IntegrationError`, :func:`check_miles_hooks`) a miles whose fill
    moved. ``view``: the ranks' read policy (:func:`rank_local_fill_replay_data`).
    """
    if args is not None and not getattr(args, "use_rollout_routing_replay", False):
        raise InvalidRequestError(
            "miles fills the routing replay only with --use-rollout-routing-replay "
            "(miles/backends/megatron_utils/actor.py:460-461, 482-484): without it nothing "
            "is replayed"
        )
    actor = check_miles_hooks()
    from r3_client._sync_client import RoutingClient

    source, run = hook_source("miles", source, run, RoutingClient)
    own = unwrapped(actor.fill_replay_data)
    fill = rank_local_fill_replay_data(source, run, original=own, missing=missing, view=view)
    fill._r3_original = own  # type: ignore[attr-defined]
    actor.fill_replay_data = fill
    return fill
