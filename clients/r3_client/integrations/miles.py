"""miles (radixark/miles @ 31f1ca9): rollouts keyed per attempt, routing fetched into ``Sample``.

Use :func:`wrap_generate` as miles' ``--custom-generate-function-path`` (a legacy
``(args, sample, sampling_params, evaluation)`` function; miles sends
``sample.routing_key`` as ``X-SMG-Routing-Key`` whenever it is set), or, in a generate
function of your own, :func:`rollout_key` before the call and
:func:`fill_routed_experts` after it.

The key is ``f"{run}.{sample.index}.{attempt}"``.  miles' ``reset_for_retry`` clears a
sample's tokens but keeps its ``index`` and ``routing_key``: regenerating from the
prompt under the old key would not extend the stored rollout (the engine refuses it,
409).  So the attempt, kept in ``sample.metadata["r3_attempt"]``, moves on whenever a
generation starts from no tokens, and stays when a partial rollout resumes (tokens
kept: the engine continues the stored rollout).  See docs/integrations.md.  Nothing
here imports miles; its ``generate`` is imported on the first call that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from r3_client._exceptions import IntegrationError, InvalidRequestError, ShapeError
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.integrations import _samples
from r3_client.layouts import Missing, miles_layout

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient
    from r3_client.rank_local import RangeSource, StatSource, StepCheck

SampleRank = _samples.SampleRank
RankReplay = _samples.RankReplay

__all__ = [
    "ATTEMPT_KEY",
    "RankReplay",
    "SampleRank",
    "check_miles_hooks",
    "check_samples",
    "check_stored",
    "expand_samples",
    "fetch_rank_replay",
    "fill_routed_experts",
    "install_rank_local",
    "rank_keys",
    "rank_local_fill_replay_data",
    "rollout_key",
    "sample_rank",
    "wrap_generate",
]

#: Where the attempt counter lives in ``Sample.metadata``.
ATTEMPT_KEY = "r3_attempt"


def rollout_key(run: str, sample: Any) -> str:
    """The key of the generation about to start: ``f"{run}.{sample.index}.{attempt}"``.

    Call it once per generate call, before it: a sample with no tokens starts a new
    attempt (counted in ``sample.metadata``), one with tokens (a partial rollout
    resuming) keeps its attempt.
    """
    if sample.index is None:
        raise InvalidRequestError("miles sample has no index: the data source numbers every sample")
    meta = sample.metadata
    if ATTEMPT_KEY not in meta or not sample.tokens:
        meta[ATTEMPT_KEY] = int(meta.get(ATTEMPT_KEY, -1)) + 1
    return check_rollout_id(f"{run}.{sample.index}.{meta[ATTEMPT_KEY]}")


def _assign_key(run: str, sample: Any) -> str:
    sample.routing_key = rollout_key(run, sample)
    return str(sample.routing_key)


def _assign_rank_key(run: str, sample: Any) -> tuple[str, bool]:
    """Rank-local mode: ``f"{run}.{sample.index}.0"`` for every attempt, since a training
    rank sees ``sample_indices`` but not ``Sample.metadata`` (not among the fields miles
    ships per DP rank, ``train_data_conversion.py:349-381``).  A generation that starts
    from no tokens after an earlier attempt (``reset_for_retry``) is ``restarted``: the
    earlier attempt's rows are dropped before it runs."""
    if sample.index is None:
        raise InvalidRequestError("miles sample has no index: the data source numbers every sample")
    meta = sample.metadata
    restarted = ATTEMPT_KEY in meta and not sample.tokens
    meta[ATTEMPT_KEY] = 0
    sample.routing_key = _index_key(run, int(sample.index))
    return str(sample.routing_key), restarted


def _index_key(run: str, index: int) -> str:
    return check_rollout_id(f"{run}.{index}.0")


def _check_args(args: Any) -> None:
    """Nothing to refuse: miles sends a set routing_key under every router policy
    (miles/rollout/generate_utils/generate_endpoint_utils.py:42-49)."""


_MILES = _samples.Framework(
    name="miles",
    key_field="routing_key",
    generate_path="miles.rollout.sglang_rollout:generate",
    layout=miles_layout,
    assign_key=_assign_key,
    check_args=_check_args,
    assign_rank_key=_assign_rank_key,
    index_key=_index_key,
)


async def fill_routed_experts(
    samples: Any | Sequence[Any],
    client: AsyncRoutingClient,
    *,
    num_layers: int,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> None:
    """Set ``sample.rollout_routed_experts`` = :func:`~r3_client.layouts.miles_layout`
    (int32) of the rollout stored under ``sample.routing_key``, for one sample, a
    group, or the copies ``expand_samples`` made (each in its own state); call it once a
    sample is ``COMPLETED`` or ``TRUNCATED``.

    ``num_layers``: miles' ``--num-layers`` (decoder layers, no MTP).  Raises
    :class:`~r3_client.RolloutNotFoundError` when a rollout is not stored and
    :class:`~r3_client.ShapeError` when its rows are not ``len(tokens) - 1`` or some
    were never shipped (``missing="fill"`` fills those instead).  ``view``: ``"exact"``
    (the default: each sample in its routing state; a sample spanning several is refused),
    or by name ``"generated"`` (first computations) or ``"latest"`` (what the rollout's
    last call attended to), counted as a pre-dispatch check counts them (one batched stat:
    the tokens replayed off their own state, warned about); the reads and refusals of
    :func:`r3_client.integrations._samples.fill_samples`; docs/integrations.md.
    """
    await _samples.fill_samples(
        _MILES, samples, client, num_layers=num_layers, missing=missing, view=view
    )


def wrap_generate(
    *,
    run: str,
    client: AsyncRoutingClient,
    num_layers: int,
    generate: _samples.GenerateFn | None = None,
    share_prompt: bool | None = None,
    missing: Missing = "raise",
    view: ViewPolicy | None = None,
    fill: bool = True,
) -> _samples.GenerateFn:
    """miles' ``generate`` (or ``generate``) as a legacy custom generate function
    ``(args, sample, sampling_params, evaluation=False)`` that keys each generation
    (``sample.routing_key = rollout_key(run, sample)``) and fills the sample's
    ``rollout_routed_experts`` when it finishes.

    Evaluation samples pass through untouched (miles keys them itself, a fresh uuid4).
    miles' ``--use-rollout-routing-replay`` still adds ``return_routed_experts`` to its
    payload; the engine answers tagged requests without inline routing.  ``view``: the
    policy of the fetch (:func:`fill_routed_experts`).

    ``fill=False``: the rank-local path.  The sample is only keyed (the key a training
    rank rebuilds with :func:`rank_keys`) and, once finished, its rollout checked
    (:func:`check_stored`, one ``stat``); ``rollout_routed_experts`` stays ``None`` and
    each training rank reads its own slice (:func:`fetch_rank_replay`).
    """
    return _samples.wrap_generate(
        _MILES,
        run=run,
        client=client,
        num_layers=num_layers,
        generate=generate,
        share_prompt=share_prompt,
        missing=missing,
        view=view,
        fill=fill,
    )


# ------------------------------------------------------------------ rank-local path


def rank_keys(run: str, sample_indices: Sequence[int]) -> list[str]:
    """The rollout keys of a training rank's samples, from the ``sample_indices`` the
    trainer carries (what ``wrap_generate(..., fill=False)`` keyed them with)."""
    return _samples.index_keys(_MILES, run, sample_indices)


async def check_stored(
    samples: Any | Sequence[Any],
    client: AsyncRoutingClient,
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> StepCheck:
    """Rollout side of the rank-local path, for a generate function of your own: each
    sample's rollout holds ``len(tokens) - 1`` rows, no gap (unless ``missing="fill"``),
    from the sample's tokens where digests were recorded; one batched stat.
    Raises :class:`~r3_client.RolloutNotFoundError` / :class:`~r3_client.ShapeError`.
    Returns the :class:`~r3_client.rank_local.StepCheck` (tokens a replay under ``view``
    gives another routing than the one they attended to)."""
    return await _samples.check_stored(_MILES, samples, client, missing=missing, view=view)


def check_samples(
    samples: Sequence[Any],
    source: StatSource,
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> StepCheck:
    """Before dispatch (the driver, e.g. in a ``--custom-convert-samples-to-train-data-path``
    function or a rollout function's end): every sample's rollout exists and holds
    ``len(tokens) - 1`` rows (:func:`~r3_client.rank_local.check_step`, one batched stat);
    raises one error naming the failing samples and rollouts.  ``view`` / ``states``: the
    policy the ranks replay under and, under ``exact``, each sample's state; returns the
    :class:`~r3_client.rank_local.StepCheck` (tokens replayed off their own state)."""
    return _samples.check_samples(
        _MILES, samples, source, missing=missing, view=view, states=states
    )


def expand_samples(samples: Sequence[Any], source: Any, *, args: Any = None) -> list[Any]:
    """One ``Sample`` per routing state of each sample, for ``view="exact"`` on the ranks
    (:func:`r3_client.integrations._samples.expand_samples`: tokens, ``response_length``,
    ``loss_mask``, ``rollout_log_probs``, ``teacher_log_probs``, ``opd_reverse_kl``,
    ``metadata["opd_student_top_logprobs"]`` and the per-row arrays cut to the state, as
    ``strip_last_output_tokens`` cuts them, ``utils/types.py:221-244``;
    ``metadata["r3_state"]``; ``rollout_id`` shared, the original's ``index`` when unset).
    ``source``: a :class:`~r3_client.RoutingClient` (one batched stat).

    Run it on the rollout side once the rewards are set, before miles converts the samples
    to train data.  miles' own reward normalization already counts each rollout once
    (one shared reward per ``rollout_id`` / ``index`` in each ``group_index`` group,
    ``ray/rollout/train_data_conversion.py:172-254``; ``group_index`` set, as miles' data
    source sets it, else it falls back to counting samples, ``:196-204``), and its loss
    divides by per-rollout mask sums (``:101, 162-169``;
    ``backends/training_utils/loss_hub/losses.py:264-272``), so the copies train what the
    original did.  Not with multi-LoRA's ``prompt_group_sizes``, which count samples
    (``:174-186``).  ``args``
    (miles'): refuses the settings the cut would change (``ppo`` /
    ``reinforce_plus_plus`` returns, ``gspo`` / ``use_opsm`` sequence ratios).
    """
    return _samples.expand_samples(_MILES, samples, source, args=args)


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

    ``rollout_ids`` (:func:`rank_keys` of the micro-batch's ``sample_indices``) and
    ``num_tokens`` (``len(tokens)``), in the order the actor packs them; ``rank``: the
    rank's TP / CP / SP coordinates, ``args`` and router layers (:class:`SampleRank`);
    ``num_layers``: ``args.num_layers``.  miles pads with ``-1`` (``replay_data.py:63-71``),
    which its replay reads as experts ``0..K-1`` (``replay_base.py:102-109``).  Router
    ``j`` of the rank records ``per_layer[j]`` (:meth:`RankReplay.record`), equal to what
    miles' own fill records from whole ``miles_layout`` arrays; only the rank's rows of
    its routers' layers are fetched.  ``view`` (default ``"exact"``) / ``states``: the read
    policy and, under ``exact``, each sample's state (:func:`expand_samples` records it); a
    sample spanning several states is refused ("expand the sample").  See
    :func:`r3_client.integrations._samples.fetch_rank_replay`.
    """
    return _samples.fetch_rank_replay(
        _MILES,
        source,
        rollout_ids,
        num_tokens,
        rank=rank,
        num_layers=num_layers,
        missing=missing,
        as_torch=as_torch,
        view=view,
        states=states,
    )


# ------------------------------------------------------------------ rank-local hook (training side)

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
        router_layers=_samples.model_router_layers(models),
    )


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
    ``j`` of ``replay_list`` records ``per_layer[j]``, as ``register_replay_list_moe`` has it
    (``replay_utils.py:22-24``; a list shorter than the rank's routers is refused); a
    shipped ``rollout_data["rollout_routed_experts"]`` is dropped unread (``:131``); every
    iterator reset again (``:133-134``).  thd only: ``args.qkv_format == "bshd"``
    (``:88-99``) is refused, as are token-position indices.

    ``view``: the read policy (default ``"exact"``: each sample in its state, a sample
    spanning several states refused; :func:`expand_samples` cuts them).  The rank tells an
    expanded sample's state from its shipped ``loss_masks`` / ``response_lengths`` and one
    batched stat per call (:func:`r3_client.integrations._samples.trained_states`; a
    source without stats, a :class:`~r3_client.DirectReader`, reads every sample in its
    first state).
    """
    check_rollout_id(f"{run}.0")
    get_source = _samples.source_getter(source)

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
        if data_key != _samples.ROUTED_EXPERTS:
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
        if getattr(args, "qkv_format", "thd") != "thd":
            raise InvalidRequestError(
                f"miles rank-local routing covers qkv_format 'thd', not {args.qkv_format!r} "
                "(replay_data.py:88-99)"
            )
        if indices_are_token_positions:
            raise InvalidRequestError(
                "miles rank-local routing replays experts, not token positions"
            )

        def record(replay: RankReplay) -> None:
            n = len(replay.per_layer)
            if len(replay_list) < n:
                raise ShapeError(
                    f"the rank has {len(replay_list)} routing replays but {n} MoE layers "
                    f"{list(replay.layer_ids)}"
                )
            replay.record(replay_list[:n])

        _samples.fill_micro_batches(
            _MILES,
            get_source(),
            run,
            data_iterator,
            num_microbatches,
            rank=sample_rank(args, models, if_sp_region=if_sp_region),
            num_layers=int(args.num_layers),
            num_experts=None,
            missing=missing,
            record=record,
            view=view,
        )
        rollout_data.pop(_samples.ROUTED_EXPERTS, None)

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
        elif bad := _samples.check_params(
            fill, _FILL_PARAMS, f"{_ACTOR}.fill_replay_data", _PINNED
        ):
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
    if source is None or run is None:
        url, key, env_run = _samples.hook_env("miles")
        source = _samples.client_factory(url, key) if source is None else source
        run = env_run if run is None else run
    own = _samples.unwrapped(actor.fill_replay_data)
    fill = rank_local_fill_replay_data(source, run, original=own, missing=missing, view=view)
    fill._r3_original = own  # type: ignore[attr-defined]
    actor.fill_replay_data = fill
    return fill
