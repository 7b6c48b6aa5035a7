"""slime (THUDM/slime @ 624b824): rollouts keyed per ``Sample``, routing fetched into it.

Use :func:`wrap_generate` as slime's ``--custom-generate-function-path`` (with
``--router-policy consistent_hashing``, under which slime sends ``sample.session_id``
as ``X-SMG-Routing-Key``)::

    # my_r3.py
    generate_r3 = wrap_generate(run="grpo-0412-r2", client=AsyncRoutingClient(url),
                                num_layers=args_num_layers)

or, in a generate function of your own, :func:`rollout_key` before the call and
:func:`fill_routed_experts` after it.  The key is ``f"{run}.{sample.index}"``: slime
numbers every copy of a prompt (group siblings differ) and resubmits the same
``Sample`` when a partial rollout resumes (the key is kept, the engine continues the
stored rollout).  ``run`` must be unique per training run *and* per restart, since
slime restores its index counter from the last checkpoint.  See docs/integrations.md.
Nothing here imports slime; its ``generate`` is imported on the first call that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from r3_client._exceptions import IntegrationError, InvalidRequestError
from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.integrations import _samples
from r3_client.layouts import Missing, slime_layout

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient
    from r3_client.rank_local import RangeSource, StatSource, StepCheck

SampleRank = _samples.SampleRank
RankReplay = _samples.RankReplay

__all__ = [
    "RankReplay",
    "SampleRank",
    "check_samples",
    "check_slime_hooks",
    "check_stored",
    "expand_samples",
    "fetch_rank_replay",
    "fill_routed_experts",
    "install_rank_local",
    "normalize_rewards",
    "rank_keys",
    "rank_local_fill_routing_replay",
    "rollout_key",
    "sample_rank",
    "wrap_generate",
]


def rollout_key(run: str, sample: Any, conversation: int | None = None) -> str:
    """``f"{run}.{sample.index}"``, plus ``f".{conversation}"`` for a generate function
    that runs several conversations for one ``Sample``."""
    if sample.index is None:
        raise InvalidRequestError("slime sample has no index: the data source numbers every sample")
    key = f"{run}.{sample.index}" + ("" if conversation is None else f".{conversation}")
    return check_rollout_id(key)


def _assign_key(run: str, sample: Any) -> str:
    sample.session_id = rollout_key(run, sample)
    return str(sample.session_id)


def _assign_rank_key(run: str, sample: Any) -> tuple[str, bool]:
    """Rank-local mode: the same key (a training rank rebuilds it from ``sample_indices``);
    slime resubmits the same ``Sample`` to resume, never restarts it from the prompt."""
    return _assign_key(run, sample), False


def _index_key(run: str, index: int) -> str:
    return check_rollout_id(f"{run}.{index}")


def _check_args(args: Any) -> None:
    policy = getattr(args, "router_policy", None)
    if policy != "consistent_hashing":
        raise InvalidRequestError(
            "slime sends sample.session_id as X-SMG-Routing-Key only with --router-policy "
            f"consistent_hashing (slime/rollout/sglang_rollout.py:196-200), got {policy!r}: "
            "without it the rollout key never reaches the engine and nothing is stored"
        )


_SLIME = _samples.Framework(
    name="slime",
    key_field="session_id",
    generate_path="slime.rollout.sglang_rollout:generate",
    layout=slime_layout,
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
    """Set ``sample.rollout_routed_experts`` = :func:`~r3_client.layouts.slime_layout` of
    the rollout stored under ``sample.session_id``, for one sample, a group, or the copies
    ``expand_samples`` made (each in its own state); call it once a sample is
    ``COMPLETED`` or ``TRUNCATED``.

    ``num_layers``: slime's ``--num-layers`` (decoder layers, no MTP).  Raises
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
        _SLIME, samples, client, num_layers=num_layers, missing=missing, view=view
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
    """slime's ``generate`` (or ``generate``) as a custom generate function
    ``(args, sample, sampling_params, evaluation=False)`` that keys each sample's rollout
    (``sample.session_id = rollout_key(run, sample)``) and fills its
    ``rollout_routed_experts`` when it finishes.

    Evaluation samples (renumbered from 0 by slime) pass through untagged.  Each call
    refuses ``args.router_policy`` other than ``consistent_hashing``
    (:class:`~r3_client.InvalidRequestError`), under which the key would not be sent.
    slime's ``--use-rollout-routing-replay`` still adds ``return_routed_experts`` to its
    payload; the engine answers tagged requests without inline routing.  ``view``: the
    policy of the fetch (:func:`fill_routed_experts`).
    """
    return _samples.wrap_generate(
        _SLIME,
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
    return _samples.index_keys(_SLIME, run, sample_indices)


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
    return await _samples.check_stored(_SLIME, samples, client, missing=missing, view=view)


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
        _SLIME, samples, source, missing=missing, view=view, states=states
    )


def expand_samples(samples: Sequence[Any], source: Any, *, args: Any = None) -> list[Any]:
    """One ``Sample`` per routing state of each sample, for ``view="exact"`` on the ranks
    (:func:`r3_client.integrations._samples.expand_samples`: tokens, ``response_length``,
    ``loss_mask``, ``rollout_log_probs``, ``teacher_log_probs`` and the top-p ids cut to the
    state; ``metadata["r3_state"]``; ``rollout_id`` shared, the original's ``index`` when
    unset).  ``source``: a :class:`~r3_client.RoutingClient` (one batched stat).

    Run it on the rollout side once the rewards are set and before slime converts the
    samples to train data: e.g. at the end of a ``--rollout-function-path`` function,
    returning each group as ``[[copies of sample 0], [copies of sample 1], ...]`` (slime
    flattens nested groups and checks that siblings share ``rollout_id``,
    ``ray/rollout.py:595-604``).  slime's own reward normalization reshapes by count
    (``ray/rollout.py:618-623``) and would weigh the copies: pass
    ``--custom-reward-post-process-path r3_client.integrations.slime.normalize_rewards``.
    ``args`` (slime's): refuses the settings the cut would change (``ppo`` /
    ``reinforce_plus_plus`` returns, ``gspo`` / ``use_opsm`` sequence ratios, the
    count-reshaping normalization).
    """
    return _samples.expand_samples(_SLIME, samples, source, args=args)


def normalize_rewards(args: Any, samples: Sequence[Any]) -> tuple[list[Any], list[float]]:
    """slime's ``_post_process_rewards`` (``ray/rollout.py:608-633``) counting each rollout
    once: usable as ``--custom-reward-post-process-path
    r3_client.integrations.slime.normalize_rewards`` (called as ``f(args, samples)``,
    ``:609-610``).  Returns ``(raw_rewards, rewards)``, one each per sample.

    Under ``rewards_normalization`` with ``advantage_estimator`` in ``grpo``, ``gspo``,
    ``cispo``, ``reinforce_plus_plus_baseline``, slime's grouping applied to rollouts
    instead of samples: each rollout (``rollout_id``, else ``index``) counts once with its
    reward (its samples must share it); ``n_samples_per_prompt`` consecutive rollouts form
    a group when there are ``n_samples_per_prompt * rollout_batch_size`` of them, else
    all form one (``:619-623``); centred on the group's mean and, for ``grpo`` / ``gspo`` /
    ``cispo`` with ``grpo_std_normalization``, divided by ``std + 1e-6`` (unbiased, as
    ``torch.std``, ``:624-629``); every sample of a rollout gets its rollout's value.  On
    samples that were not expanded this is slime's own result.  Otherwise the raw
    rewards, as slime.
    """
    key = getattr(args, "reward_key", None)
    raw = [s.reward if not key else s.reward[key] for s in samples]
    estimator = getattr(args, "advantage_estimator", None)
    if estimator not in _samples.NORMALIZED or not getattr(args, "rewards_normalization", False):
        return raw, list(raw)
    rollouts: dict[Any, list[int]] = {}
    for i, s in enumerate(samples):
        rid = s.rollout_id if getattr(s, "rollout_id", None) is not None else s.index
        rollouts.setdefault(("row", i) if rid is None else rid, []).append(i)
    order = list(rollouts)  # in order of their first sample
    n = int(args.n_samples_per_prompt)
    if len(order) != n * int(args.rollout_batch_size):
        n = len(order)  # slime: "when samples count are not equal in each group", one group
    grouped = [order[i : i + n] for i in range(0, len(order), n)]
    out = [0.0] * len(samples)
    use_std = estimator in ("grpo", "gspo", "cispo") and getattr(
        args, "grpo_std_normalization", False
    )
    for group in grouped:
        shared = []
        for rid in group:
            values = [raw[i] for i in rollouts[rid]]
            if any(v != values[0] for v in values[1:]):
                raise InvalidRequestError(
                    f"slime rollout {rid!r}: its samples {rollouts[rid]} must share one reward, "
                    f"got {values}"
                )
            shared.append(values[0])
        r = np.asarray(shared, dtype=np.float32)
        r = r - r.mean(dtype=np.float32)
        if use_std:
            std = r.std(ddof=1, dtype=np.float32) if r.size > 1 else np.float32(np.nan)
            r = r / (std + np.float32(1e-6))
        for rid, value in zip(group, r.tolist(), strict=True):
            for i in rollouts[rid]:
                out[i] = float(value)
    return raw, out


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

    ``rollout_ids`` (:func:`rank_keys` of the micro-batch's ``sample_indices``) and
    ``num_tokens`` (``len(tokens)``), in the order the actor packs them; ``rank``: the
    rank's TP / CP / SP coordinates, ``args`` and router layers (:class:`SampleRank`);
    ``num_layers``: ``args.num_layers``.  ``num_experts``: ``args.num_experts`` (slime
    pads with ``arange % num_experts``, ``cp_utils.py:239-251``).  Router ``j`` of the rank records
    ``per_layer[j]`` (:meth:`RankReplay.record`), equal to what slime's own fill records
    from whole ``slime_layout`` arrays; only the rank's rows of its routers' layers are
    fetched.  ``view`` (default ``"exact"``) / ``states``: the read policy and, under
    ``exact``, each sample's state (:func:`expand_samples` records it); a sample spanning
    several states is refused ("expand the sample").  See
    :func:`r3_client.integrations._samples.fetch_rank_replay`.
    """
    return _samples.fetch_rank_replay(
        _SLIME,
        source,
        rollout_ids,
        num_tokens,
        rank=rank,
        num_layers=num_layers,
        num_experts=num_experts,
        missing=missing,
        as_torch=as_torch,
        view=view,
        states=states,
    )


# ------------------------------------------------------------------ rank-local hook (training side)

#: slime's fill, hooked by :func:`install_rank_local` (slime/backends/megatron_utils/actor.py:308).
_FILL_PARAMS = ("self", "data_iterator", "num_microbatches", "rollout_data")
_PINNED = "slime 624b824, slime/backends/megatron_utils/actor.py:308-355"
_REPLAY = "slime.utils.routing_replay"


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
        router_layers=_samples.model_router_layers(models),
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
    spanning several states refused; :func:`expand_samples` cuts them).  The rank tells an
    expanded sample's state from its shipped ``loss_masks`` / ``response_lengths`` and one
    batched stat per call (:func:`r3_client.integrations._samples.trained_states`; a
    source without stats, a :class:`~r3_client.DirectReader`, reads every sample in its
    first state).
    """
    check_rollout_id(f"{run}.0")
    get_source = _samples.source_getter(source)

    def fill_routing_replay(
        self: Any, data_iterator: Any, num_microbatches: Any, rollout_data: Any
    ) -> None:
        args = self.args
        replays = importlib.import_module(_REPLAY).RoutingReplay.all_routing_replays
        _samples.fill_micro_batches(
            _SLIME,
            get_source(),
            run,
            data_iterator,
            num_microbatches,
            rank=sample_rank(args, self.model),
            num_layers=int(args.num_layers),
            num_experts=int(args.num_experts),
            missing=missing,
            record=lambda replay: replay.record(replays),
            view=view,
        )
        rollout_data.pop(_samples.ROUTED_EXPERTS, None)

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
        elif bad := _samples.check_params(
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
    if source is None or run is None:
        url, key, env_run = _samples.hook_env("slime")
        source = _samples.client_factory(url, key) if source is None else source
        run = env_run if run is None else run
    fill = rank_local_fill_routing_replay(source, run, missing=missing, view=view)
    fill._r3_original = _samples.unwrapped(cls.fill_routing_replay)  # type: ignore[attr-defined]
    cls.fill_routing_replay = fill  # type: ignore[attr-defined]
    return fill
