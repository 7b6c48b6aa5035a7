"""slime's training ranks: each Megatron rank reads its own slice of the routing replay.

Runs in every slime training process.  :func:`install_rank_local` (slime's
``--custom-megatron-init-path``, called with ``args`` in each training process,
``slime/backends/megatron_utils/initialize.py:100-104``) replaces
``MegatronTrainRayActor.fill_routing_replay`` (``actor.py:308-355``) with
:func:`rank_local_fill_routing_replay`, which reads each micro-batch's routing for this
rank alone (:func:`fetch_rank_replay`: the rank's CP / SP rows of its routers' layers,
slime's own padding) from the keys :func:`rank_keys` rebuilds from ``sample_indices``.
Imports megatron.core and slime only when a hook is installed or a fill runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from r3_client._exceptions import IntegrationError, InvalidRequestError, ShapeError
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
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
from r3_client.integrations.slime._keys import SLIME
from r3_client.layouts import Missing
from r3_client.rank_local import RangeSource, fetch_plan_rows

__all__ = [
    "RankReplay",
    "SampleRank",
    "check_slime_hooks",
    "fetch_rank_replay",
    "install_rank_local",
    "rank_keys",
    "rank_local_fill_routing_replay",
    "sample_rank",
]

#: slime's fill, hooked by :func:`install_rank_local` (slime/backends/megatron_utils/actor.py:308).
_FILL_PARAMS = ("self", "data_iterator", "num_microbatches", "rollout_data")
_PINNED = "slime 624b824, slime/backends/megatron_utils/actor.py:308-355"
_REPLAY = "slime.utils.routing_replay"


rank_keys = SLIME.rank_keys


def fetch_rank_replay(
    source: RangeSource,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int],
    *,
    rank: SampleRank,
    num_layers: int,
    num_experts: int,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> RankReplay:
    """One micro-batch's replay targets on one slime Megatron rank, read for that rank alone.

    Equal, router by router, to what slime's fill hands its replay objects
    (``actor.py:333-350`` after ``cp_utils.py:254-297``) from whole ``slime_layout``
    arrays, but only the rank's rows (its CP / SP slice) of its routers' layers are
    fetched (one ``get_ranges`` call).  ``rollout_ids`` (:func:`rank_keys` of the
    micro-batch's ``sample_indices``) and ``num_tokens`` (``len(tokens)``), in the order
    the actor packs them; ``rank``: the rank's TP / CP / SP coordinates, ``args`` and
    router layers (:class:`SampleRank`); ``num_layers``: ``args.num_layers``.
    ``num_experts``: ``args.num_experts`` (slime pads with ``arange % num_experts``,
    ``cp_utils.py:239-251``).  Router ``j`` of the rank records ``per_layer[j]``
    (:meth:`RankReplay.record`).  Raises :class:`~r3_client.RolloutNotFoundError` /
    :class:`~r3_client.ShapeError` naming the sample (``missing="fill"`` replays experts
    ``0..K-1`` on rows nobody shipped, as the layouts fill them).  ``view`` (default
    ``"exact"``) / ``states``: the read policy and, under ``exact``, each sample's state
    (its first row; ``None``: ``0``; ``expand_samples`` records it); a sample spanning
    several states is refused (:class:`~r3_client.InvalidRequestError`, "expand the
    sample") rather than replayed with one of them.
    """
    if num_experts is None:
        raise ShapeError("slime pads with arange % num_experts: pass num_experts=args.num_experts")
    plan = plan_replay(rollout_ids, num_tokens, rank=rank, num_layers=num_layers)
    local, got = fetch_plan_rows(
        source, plan.rollout_ids, plan.rows, plan.layers, missing, -1, view, states
    )
    return plan.replay(local, got, missing=missing, num_experts=num_experts, as_torch=as_torch)


def sample_rank(args: Any, models: Sequence[Any]) -> SampleRank:
    """This rank's :class:`SampleRank`, read where slime's fill reads it: TP / CP from
    ``megatron.core.mpu`` (``cp_utils.py:183-184, 269, 273-274, 289-290``), the SP / CP
    mode and pack multiplier from ``args`` (``actor.py:327-330``), the routers from the
    model chunks (``actor.py:334-349``).  Imports megatron.core."""
    from megatron.core import mpu

    return SampleRank(
        tp_size=int(mpu.get_tensor_model_parallel_world_size()),
        tp_rank=int(mpu.get_tensor_model_parallel_rank()),
        cp_size=int(mpu.get_context_parallel_world_size()),
        cp_rank=int(mpu.get_context_parallel_rank()),
        sequence_parallel=bool(args.sequence_parallel),
        allgather_cp=bool(args.allgather_cp),
        data_pad_size_multiplier=int(args.data_pad_size_multiplier),
        router_layers=model_router_layers(models),
    )


def rank_local_fill_routing_replay(
    source: Any, run: str, *, missing: Missing = "raise", view: ViewPolicy = "exact"
) -> Callable[[Any, Any, Any, Any], None]:
    """A replacement for slime's ``MegatronTrainRayActor.fill_routing_replay(self,
    data_iterator, num_microbatches, rollout_data)`` (``actor.py:308-355``) that reads each
    micro-batch's routing for this rank alone from the cache.

    ``source``: a :class:`~r3_client.RoutingClient` / :class:`~r3_client.DirectReader`, or a
    callable making one on the first fill (in the training process).  ``run``: the run the
    rollout side keyed with (``wrap_generate(run=..., fill=False)``).

    Per call, as slime's own: every iterator reset (``:319-320``); per micro-batch
    (``sum(num_microbatches)``, ``:322``) ``data_iterator[0].get_next(["sample_indices",
    "tokens"])`` in place of ``["rollout_routed_experts", "tokens"]`` (``:323``); the rank
    (:func:`sample_rank`, from ``self.args`` and ``self.model``); :func:`fetch_rank_replay`
    of :func:`rank_keys` (``num_layers=args.num_layers``, ``num_experts=args.num_experts``);
    router ``j`` = ``RoutingReplay.all_routing_replays[j]`` records ``per_layer[j]``,
    refused unless the counts match (``:333-350``); a shipped
    ``rollout_data["rollout_routed_experts"]`` is dropped unread (``:352``); every iterator
    reset again (``:354-355``).  Imports megatron.core and slime when called.

    ``view``: the read policy (default ``"exact"``: each sample in its state, a sample
    spanning several states refused; ``expand_samples`` cuts them).  The rank tells an
    expanded sample's state from its shipped ``loss_masks`` / ``response_lengths`` and one
    batched stat per call (:func:`r3_client.integrations.samples.rank.trained_states`; a
    source without stats, a :class:`~r3_client.DirectReader`, reads every sample in its
    first state).
    """
    check_rollout_id(f"{run}.0")
    get_source: Callable[[], RangeSource] = source_getter(source)

    def fill_routing_replay(
        self: Any, data_iterator: Any, num_microbatches: Any, rollout_data: Any
    ) -> None:
        args = self.args
        replays = importlib.import_module(_REPLAY).RoutingReplay.all_routing_replays
        reads = get_source()
        fetch = functools.partial(
            fetch_rank_replay,
            rank=sample_rank(args, self.model),
            num_layers=int(args.num_layers),
            num_experts=int(args.num_experts),
            missing=missing,
        )
        fill_micro_batches(
            SLIME,
            reads,
            run,
            data_iterator,
            num_microbatches,
            fetch,
            lambda replay: replay.record(replays),
            view,
        )
        rollout_data.pop(ROUTED_EXPERTS, None)

    fill_routing_replay.__doc__ = (
        f"slime's fill_routing_replay, each rank reading its own slice of run {run!r}."
    )
    return fill_routing_replay


def check_slime_hooks() -> type:
    """The canary of :func:`install_rank_local`: returns slime's ``MegatronTrainRayActor``,
    or raises :class:`~r3_client.IntegrationError` naming what moved unless
    ``fill_routing_replay(self, data_iterator, num_microbatches, rollout_data)`` and
    ``RoutingReplay.all_routing_replays`` are where slime 624b824 has them.  Imports slime."""
    problems: list[str] = []
    cls: Any = None
    try:
        actor = importlib.import_module("slime.backends.megatron_utils.actor")
        cls = getattr(actor, "MegatronTrainRayActor", None)
    except ImportError as exc:
        problems.append(f"slime.backends.megatron_utils.actor cannot be imported ({exc})")
    if cls is None and not problems:
        problems.append("slime.backends.megatron_utils.actor has no MegatronTrainRayActor")
    elif cls is not None:
        fill = getattr(cls, "fill_routing_replay", None)
        if fill is None:
            problems.append("MegatronTrainRayActor has no fill_routing_replay")
        elif bad := check_params(
            fill, _FILL_PARAMS, "MegatronTrainRayActor.fill_routing_replay", _PINNED
        ):
            problems.append(bad)
    try:
        replay = importlib.import_module(_REPLAY)
        replays = getattr(getattr(replay, "RoutingReplay", None), "all_routing_replays", None)
        if not isinstance(replays, list):
            problems.append("slime.utils.routing_replay has no RoutingReplay.all_routing_replays")
    except ImportError as exc:
        problems.append(f"slime.utils.routing_replay cannot be imported ({exc})")
    if problems:
        raise IntegrationError(
            "slime is not the code r3_client's rank-local fill replaces "
            f"({_PINNED}): " + "; ".join(problems)
        )
    assert isinstance(cls, type)
    return cls


def install_rank_local(
    args: Any = None,
    *,
    source: Any = None,
    run: str | None = None,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> Callable[[Any, Any, Any, Any], None]:
    """Make every slime Megatron actor of this process fill its routing replay rank-locally:
    ``MegatronTrainRayActor.fill_routing_replay`` becomes
    :func:`rank_local_fill_routing_replay` (class-wide; installing again replaces the hook,
    never wraps it).  Returns the installed function.

    Usable as slime's ``--custom-megatron-init-path
    r3_client.integrations.slime.install_rank_local``: slime calls it with ``args`` in every
    training process (``slime/backends/megatron_utils/initialize.py:100-104``).  Without
    ``source`` / ``run`` it reads ``R3_URL``, ``R3_KEY`` (optional) and ``R3_RUN`` from the
    environment and makes a :class:`~r3_client.RoutingClient` on the first fill.  Refuses
    (:class:`~r3_client.InvalidRequestError`) ``args`` without
    ``use_rollout_routing_replay``, under which slime never calls the fill
    (``actor.py:430-431``), and (:class:`~r3_client.IntegrationError`,
    :func:`check_slime_hooks`) a slime whose fill moved.  ``view``: the ranks' read policy
    (:func:`rank_local_fill_routing_replay`).
    """
    if args is not None and not getattr(args, "use_rollout_routing_replay", False):
        raise InvalidRequestError(
            "slime calls fill_routing_replay only with --use-rollout-routing-replay "
            "(slime/backends/megatron_utils/actor.py:430-431): without it nothing is replayed"
        )
    cls = check_slime_hooks()
    from r3_client._sync_client import RoutingClient

    source, run = hook_source("slime", source, run, RoutingClient)
    fill = rank_local_fill_routing_replay(source, run, missing=missing, view=view)
    fill._r3_original = unwrapped(cls.fill_routing_replay)  # type: ignore[attr-defined]
    cls.fill_routing_replay = fill  # type: ignore[attr-defined]
    return fill
