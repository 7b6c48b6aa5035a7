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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from r3_client._routing import check_rollout_id
from r3_client._views import ViewPolicy
from r3_client.integrations import _samples
from r3_client.layouts import Missing, miles_layout

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient
    from r3_client.rank_local import RangeSource, StatSource

SampleRank = _samples.SampleRank
RankReplay = _samples.RankReplay

__all__ = [
    "ATTEMPT_KEY",
    "RankReplay",
    "SampleRank",
    "check_samples",
    "check_stored",
    "fetch_rank_replay",
    "fill_routed_experts",
    "rank_keys",
    "rollout_key",
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
        raise ValueError("miles sample has no index: the data source numbers every sample")
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
        raise ValueError("miles sample has no index: the data source numbers every sample")
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
    view: ViewPolicy = "generated",
) -> None:
    """Set ``sample.rollout_routed_experts`` = :func:`~r3_client.layouts.miles_layout`
    (int32) of the rollout stored under ``sample.routing_key``, for one sample or a
    group (one ``get_many``); call it once a sample is ``COMPLETED`` or ``TRUNCATED``.

    ``num_layers``: miles' ``--num-layers`` (decoder layers, no MTP).  Raises
    :class:`~r3_client.RolloutNotFoundError` when a rollout is not stored and
    :class:`~r3_client.ShapeError` when its rows are not ``len(tokens) - 1`` or some
    were never shipped (``missing="fill"`` fills those instead).  ``view``: which
    computation of recomputed positions to read, ``"generated"`` (first computations) or
    ``"latest"`` (what the rollout's last call attended to); docs/integrations.md.
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
    view: ViewPolicy = "generated",
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
    samples: Any | Sequence[Any], client: AsyncRoutingClient, *, missing: Missing = "raise"
) -> None:
    """Rollout side of the rank-local path, for a generate function of your own: each
    sample's rollout holds ``len(tokens) - 1`` rows, no gap (unless ``missing="fill"``),
    from the sample's tokens where digests were recorded; one ``stat`` per sample.
    Raises :class:`~r3_client.RolloutNotFoundError` / :class:`~r3_client.ShapeError`."""
    await _samples.check_stored(_MILES, samples, client, missing=missing)


def check_samples(
    samples: Sequence[Any], source: StatSource, *, missing: Missing = "raise"
) -> None:
    """Before dispatch (the driver, e.g. in a ``--custom-convert-samples-to-train-data-path``
    function or a rollout function's end): every sample's rollout exists and holds
    ``len(tokens) - 1`` rows (:func:`~r3_client.rank_local.check_step`, one ``stat`` each);
    raises one error naming the failing samples and rollouts."""
    _samples.check_samples(_MILES, samples, source, missing=missing)


def fetch_rank_replay(
    source: RangeSource,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int],
    *,
    rank: SampleRank,
    num_layers: int,
    missing: Missing = "raise",
    as_torch: bool = False,
) -> RankReplay:
    """One micro-batch's replay targets on one miles Megatron rank, read for that rank alone.

    ``rollout_ids`` (:func:`rank_keys` of the micro-batch's ``sample_indices``) and
    ``num_tokens`` (``len(tokens)``), in the order the actor packs them; ``rank``: the
    rank's TP / CP / SP coordinates, ``args`` and router layers (:class:`SampleRank`);
    ``num_layers``: ``args.num_layers``.  miles pads with ``-1`` (``replay_data.py:63-71``),
    which its replay reads as experts ``0..K-1`` (``replay_base.py:102-109``).  Router
    ``j`` of the rank records ``per_layer[j]`` (:meth:`RankReplay.record`), equal to what
    miles' own fill records from whole ``miles_layout`` arrays; only the rank's rows of
    its routers' layers are fetched.  See :func:`r3_client.integrations._samples.fetch_rank_replay`.
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
    )
