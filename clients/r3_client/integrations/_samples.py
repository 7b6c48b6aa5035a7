"""The core slime and miles share: a ``Sample``'s key, its fetch and its custom generate.

Both frameworks hold ``Sample.rollout_routed_experts`` as ``[len(tokens) - 1,
num_layers, K]``, send a per-sample header key, and call a legacy custom generate
function ``(args, sample, sampling_params, evaluation=False)`` once per sample (it
may return several samples).  They differ in the key's field, the layout's dtype,
how the key is derived and where their ``generate`` lives: a :class:`Framework`.
Samples are duck-typed; nothing here imports either framework.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._answers import RolloutInfo
from r3_client._exceptions import (
    FrameworkImportError,
    IntegrationError,
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    ShapeError,
    UsageError,
)
from r3_client._routing import Routing, check_rollout_id
from r3_client._views import ViewPolicy, applicable_views, check_policy
from r3_client.expansion import Expansion, expand_states, rollout_states
from r3_client.integrations.tags import tag_sampling_params
from r3_client.layouts import Missing
from r3_client.layouts._packing import (
    RankPlan,
    check_rank,
    contiguous_positions,
    cumulative,
    row_runs,
    sp_part,
    zigzag_positions,
)
from r3_client.rank_local import (
    RangeSource,
    StatsInHand,
    StatSource,
    StepCheck,
    check_step,
    count_replay,
    fetch_plan_rows,
)

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient

#: Statuses whose sample is trained on, so whose routing is fetched.
FINISHED = ("COMPLETED", "TRUNCATED")

GenerateFn = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Framework:
    """What differs between slime and miles."""

    name: str
    key_field: str  # the Sample attribute sent as X-SMG-Routing-Key
    generate_path: str  # module:function of the framework's own generate
    layout: Callable[..., npt.NDArray[np.integer[Any]]]
    assign_key: Callable[[str, Any], str]  # (run, sample) -> key, set on the sample
    check_args: Callable[[Any], None]  # refuses args under which the key is not sent
    # rank-local mode: (run, sample) -> (key, restarted), the key rebuildable on a training
    # rank from (run, Sample.index) (index_key); restarted: a generation from no tokens
    # under a key that may hold an earlier attempt's rows, dropped before generating
    assign_rank_key: Callable[[str, Any], tuple[str, bool]]
    index_key: Callable[[str, int], str]  # (run, Sample.index) -> the rank-local key


def sample_key(fw: Framework, sample: Any) -> str:
    """The rollout key ``sample`` was generated under; InvalidRequestError when it has none."""
    key = getattr(sample, fw.key_field, None)
    if not key:
        raise InvalidRequestError(
            f"{fw.name} sample (index={getattr(sample, 'index', '?')}) has no {fw.key_field}: "
            f"it was not generated under a rollout key (r3_client.integrations.{fw.name}."
            "wrap_generate sets it)"
        )
    return check_rollout_id(key)


def finished(sample: Any) -> bool:
    """True when the sample's status is one its framework trains on (``FINISHED``)."""
    return getattr(sample.status, "name", sample.status) in FINISHED


def _layout(
    fw: Framework, sample: Any, key: str, routing: Routing, num_layers: int, missing: Missing
) -> npt.NDArray[np.integer[Any]]:
    try:
        return fw.layout(routing, len(sample.tokens), num_layers=num_layers, missing=missing)
    except ShapeError as exc:
        raise ShapeError(
            f"{fw.name} sample (index={getattr(sample, 'index', '?')}), rollout {key!r}: {exc}"
        ) from exc


def _state_routing(
    served: Sequence[Any], key: str, num_tokens: int, state: int | None, who: str
) -> Routing:
    """The rows ``[0, serves_end)`` of the routing state a sample of ``num_tokens`` tokens
    replays under ``exact``, from its rollout's states (``get_served``): its ``state`` (the
    state's first row; ``None`` is the first), refused (:class:`~r3_client.
    InvalidRequestError`) when the sample's tokens reach past that state, which one routing
    cannot replay: the sample is expanded first (:func:`expand_samples`), or ``"latest"`` /
    ``"generated"`` named.  ``who`` names the sample in errors.  A rollout without views
    has one state: its rows."""
    at = 0 if state is None else int(state)
    for n, st in enumerate(served):
        if st.serves_start != at:
            continue
        if num_tokens - 1 > st.serves_end and n + 1 < len(served):
            raise InvalidRequestError(
                f'{who}: view="exact": its {num_tokens} tokens span {len(served) - n} routing '
                f"states of rollout {key!r} (states start at rows "
                f"{[x.serves_start for x in served]}); expand the sample into one training "
                'sample per state (expand_samples), or name view="latest" or "generated" to '
                "replay one routing for all its tokens"
            )
        routing: Routing = st.routing
        return routing
    raise InvalidRequestError(
        f'{who}: view="exact": rollout {key!r} has no state starting at row {at}; its states '
        f"start at rows {[x.serves_start for x in served]}"
    )


async def exact_routing(
    client: AsyncRoutingClient, key: str, num_tokens: int, state: int | None, who: str
) -> Routing:
    """:func:`_state_routing` of one sample, its rollout's states read (``get_served``)."""
    return _state_routing(await client.get_served(key), key, num_tokens, state, who)


def _fill_keys(fw: Framework, group: Sequence[Any], policy: str) -> list[tuple[str, int | None]]:
    """Each sample's ``(rollout key, state)``: the key it was generated under and, for an
    expanded copy (:func:`expand_samples`), the state it replays.  Two samples with the
    same key and state are refused, as are expanded copies under a one-routing policy."""
    keys = [sample_key(fw, s) for s in group]
    states = sample_states(group)
    if policy != "exact" and any(x is not None for x in states):
        raise InvalidRequestError(
            f"{fw.name} samples expanded into routing states (metadata[{STATE_KEY!r}]) replay "
            f'each its own state: fill them with view="exact", not {policy!r}'
        )
    first: dict[tuple[str, int], int] = {}
    for i, (key, state) in enumerate(zip(keys, states, strict=True)):
        at = (key, 0 if state is None else state)
        if at in first:
            raise InvalidRequestError(
                f"{fw.name} samples {first[at]} and {i} share rollout key {key!r}"
                + (f" and state {at[1]}" if state is not None else "")
                + ": each conversation needs its own key (rollout_key(..., conversation=k))"
            )
        first[at] = i
    return list(zip(keys, states, strict=True))


async def fill_samples(
    fw: Framework,
    samples: Any,
    client: AsyncRoutingClient,
    *,
    num_layers: int,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> None:
    """Set each sample's ``rollout_routed_experts`` from the rollout stored under its key.

    ``samples``: one ``Sample`` or a sequence: a group, or the copies :func:`expand_samples`
    made of several samples (each keyed by its rollout and state, ``metadata["r3_state"]``).
    ``view`` (docs/store.md, "Views"): ``"exact"`` (the default: each sample's rows in its
    routing state; one batched stat, rollouts without views in one ``get_many``, each other
    rollout's states read once, ``get_served``, concurrently; a sample whose tokens span
    several states is refused, :func:`_state_routing`, never filled with one of them), or
    by name ``"generated"`` (one ``get`` / ``get_many``) or ``"latest"`` (one
    ``get(view="latest")`` per sample, concurrent), each counted as a pre-dispatch check
    counts it (one batched stat, :func:`r3_client.rank_local.count_replay`: the tokens it
    replays off their own state, warned about).  Raises
    :class:`~r3_client.RolloutNotFoundError` for a rollout the cache does not hold and
    :class:`~r3_client.ShapeError` (naming the sample and rollout) for one whose rows are
    not ``len(tokens) - 1`` or include rows nobody shipped; no sample is changed then.
    Samples sharing a key and a state are refused (:class:`~r3_client.InvalidRequestError`),
    as are expanded copies under a named policy.
    """
    policy = check_policy(view)
    group = list(samples) if isinstance(samples, Sequence) else [samples]
    keyed = _fill_keys(fw, group, policy)
    keys = [k for k, _ in keyed]
    routings: list[Routing]
    if policy == "exact":
        routings = await _exact_fill(fw, group, keyed, client)
    elif len(keys) == 1:
        routings = [await client.get(keys[0], view=policy)]
    elif policy == "latest":  # the batch stream answers first computations only
        routings = list(await asyncio.gather(*(client.get(k, view="latest") for k in keys)))
    else:
        got: dict[str, Routing] = {}
        async with aclosing(client.get_many(keys)) as answers:
            async for key, routing in answers:
                assert isinstance(routing, Routing)  # errors raise: return_errors is off
                got[key] = routing
        routings = [got[k] for k in keys]
    arrays = [
        _layout(fw, s, key, routing, num_layers, missing)
        for s, key, routing in zip(group, keys, routings, strict=True)
    ]
    if policy != "exact":  # a named policy is counted where it is chosen
        count_replay(await client.stat_many(keys), [len(s.tokens) for s in group], policy)
    for s, arr in zip(group, arrays, strict=True):
        s.rollout_routed_experts = arr


async def _exact_fill(
    fw: Framework,
    group: Sequence[Any],
    keyed: Sequence[tuple[str, int | None]],
    client: AsyncRoutingClient,
) -> list[Routing]:
    """Each sample's rows in its state (:func:`fill_samples` under ``exact``)."""
    keys = list(dict.fromkeys(k for k, _ in keyed))
    # rollouts without views (one state: their rows) in one get_many
    plain = [
        k
        for k, info in zip(keys, await client.stat_many(keys), strict=True)
        if isinstance(info, RolloutInfo) and not applicable_views(info)
    ]
    whole: dict[str, Routing] = {}
    if plain:
        async with aclosing(client.get_many(plain)) as answers:
            async for key, routing in answers:
                assert isinstance(routing, Routing)  # errors raise: return_errors is off
                whole[key] = routing
    rest = [k for k in keys if k not in whole]
    served = dict(
        zip(rest, await asyncio.gather(*(client.get_served(k) for k in rest)), strict=True)
    )
    return [
        whole[k]
        if k in whole
        else _state_routing(served[k], k, len(s.tokens), state, f"{fw.name} sample {i} ({k!r})")
        for i, (s, (k, state)) in enumerate(zip(group, keyed, strict=True))
    ]


def _named(fw: Framework, exc: R3Error) -> R3Error:
    """``exc`` said of the framework's samples (each key names its ``Sample.index``)."""
    return type(exc)(f"{fw.name} rank-local routing: {exc}")


def _check_infos(
    fw: Framework,
    group: Sequence[Any],
    keys: Sequence[str],
    infos: dict[str, RolloutInfo | None],
    missing: Missing,
    view: ViewPolicy = "exact",
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on ``infos``, each stored segment's token
    digest included (rows computed from other tokens: an earlier attempt's, or another
    sample's); its :class:`~r3_client.rank_local.StepCheck`."""
    tokens = [[int(t) for t in s.tokens] for s in group]
    try:
        return check_step(
            StatsInHand(dict(infos)),
            keys,
            [len(t) for t in tokens],
            missing=missing,
            tokens=tokens,
            workers=1,
            view=view,
        )
    except (RolloutNotFoundError, ShapeError) as exc:
        raise _named(fw, exc) from exc


async def check_stored(
    fw: Framework,
    samples: Any,
    client: AsyncRoutingClient,
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> StepCheck:
    """Rollout side of the rank-local path: each finished sample's rollout is stored with a
    row for every token but the last, no gap (unless ``missing="fill"``) and, where the
    engine recorded token digests, from the sample's own tokens.  One batched stat
    (metadata only); raises naming the sample and rollout.  Returns the
    :class:`~r3_client.rank_local.StepCheck`: the tokens a replay under ``view`` gives a
    routing other than the one they attended to (a warning is logged when some are)."""
    group = list(samples) if isinstance(samples, Sequence) else [samples]
    keys = [sample_key(fw, s) for s in group]
    infos: dict[str, RolloutInfo | None] = {}
    for key, got in zip(keys, await client.stat_many(keys), strict=True):
        if isinstance(got, R3Error) and not isinstance(got, RolloutNotFoundError):
            raise got
        infos[key] = got if isinstance(got, RolloutInfo) else None
    return _check_infos(fw, group, keys, infos, missing, view)


def check_samples(
    fw: Framework,
    samples: Sequence[Any],
    source: StatSource,
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> StepCheck:
    """Driver side, before dispatch: :func:`~r3_client.rank_local.check_step` over a step's
    samples (their keys and ``len(tokens)``), a missing or short rollout refused naming
    the sample's position and framework index.  ``view`` / ``states``: the policy the
    ranks replay under and, under ``exact``, each sample's state (default: the state an
    expanded sample records, :func:`sample_states`); returns the
    :class:`~r3_client.rank_local.StepCheck` (tokens replayed off their own state)."""
    keys = [sample_key(fw, s) for s in samples]
    if states is None and view == "exact":
        recorded = sample_states(samples)
        states = recorded if any(x is not None for x in recorded) else None
    try:
        return check_step(
            source,
            keys,
            [len(s.tokens) for s in samples],
            missing=missing,
            view=view,
            states=states,
        )
    except (RolloutNotFoundError, ShapeError) as exc:
        raise _named(fw, exc) from exc


# ------------------------------------------------------------------ exact: state expansion

#: Where an expanded sample records the state it replays (``Sample.metadata``, a dict in
#: both: slime ``utils/types.py:142``, miles ``utils/types.py:69``).
STATE_KEY = "r3_state"

#: Per-response-token lists of slime's / miles' ``Sample``, cut with the response (slime
#: ``utils/types.py:119-128``, checked against ``response_length`` at ``:418-426``; miles
#: ``utils/types.py:44-55``, cut together by ``strip_last_output_tokens``, ``:221-244``).
_PER_RESPONSE = ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl")
#: Per-row arrays (``[len(tokens) - 1, ...]``), cut with the tokens.
_PER_ROW = ("rollout_routed_experts", "rollout_indexer_topk")
#: miles keeps one more per-response-token list in ``metadata`` (``types.py:236-237``).
_PER_RESPONSE_META = ("opd_student_top_logprobs",)

#: Advantage estimators whose per-token values run to the sample's end (GAE, discounted
#: returns: slime ``backends/megatron_utils/loss.py:769-794``, miles
#: ``training_utils/loss_hub/advantages.py:59-91``) or whose ratio is one per sequence
#: (GSPO, ``loss.py:1021-1028``): a sample cut at a state's end would change them.
_CUT_CHANGES = ("ppo", "reinforce_plus_plus", "gspo")
#: Estimators under which slime normalizes rewards per group (``ray/rollout.py:612-631``).
NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")


def sample_states(samples: Sequence[Any]) -> list[int | None]:
    """The state each sample records (``metadata[STATE_KEY]``, set by :func:`expand_samples`;
    ``None`` for a sample that was not cut)."""
    out: list[int | None] = []
    for s in samples:
        meta = getattr(s, "metadata", None)
        state = meta.get(STATE_KEY) if isinstance(meta, dict) else None
        out.append(None if state is None else int(state))
    return out


def _check_expand_args(fw: Framework, args: Any) -> None:
    """Refuse trainer settings under which the expanded samples would not train what the
    originals do."""
    estimator = getattr(args, "advantage_estimator", None)
    if estimator in _CUT_CHANGES or getattr(args, "use_opsm", False):
        what = "use_opsm" if estimator not in _CUT_CHANGES else f"advantage_estimator={estimator!r}"
        raise InvalidRequestError(
            f"{fw.name} state expansion cuts a sample at each state's end, which changes "
            f"{what}: its values run over the whole sample (token-level returns, or one "
            "ratio per sequence).  Use grpo / cispo / reinforce_plus_plus_baseline, or "
            'replay one routing per sample (view="latest" or "generated")'
        )
    if (
        fw.name == "slime"
        and estimator in NORMALIZED
        and getattr(args, "rewards_normalization", False)
        and getattr(args, "custom_reward_post_process_path", None) is None
    ):
        raise InvalidRequestError(
            "slime normalizes rewards by reshaping them into groups of n_samples_per_prompt "
            "(slime/ray/rollout.py:618-623): expanded samples break that count and it falls "
            "back to one group of every copy.  Pass --custom-reward-post-process-path "
            "r3_client.integrations.slime.normalize_rewards (each original counted once)"
        )


def _cut(value: Any, n: int) -> Any:
    return None if value is None else value[:n]


def _copy_state(
    sample: Any, state: int, num_tokens: int, first_token: int, prompt: int
) -> Any | None:
    """``sample`` cut to its first ``num_tokens`` tokens, training tokens ``first_token ..``
    only; ``None`` when that trains nothing."""
    response = num_tokens - prompt
    if response <= 0:
        return None  # all prompt
    mask = [1] * sample.response_length if sample.loss_mask is None else list(sample.loss_mask)
    mask = [0 if prompt + j < first_token else int(m) for j, m in enumerate(mask[:response])]
    if not any(mask):
        return None
    out = copy.copy(sample)
    out.tokens = list(sample.tokens[:num_tokens])
    out.response_length = response
    for name in _PER_RESPONSE[1:]:
        if hasattr(sample, name):
            setattr(out, name, _cut(getattr(sample, name), response))
    out.loss_mask = mask
    for name in _PER_ROW:
        if hasattr(sample, name):
            setattr(out, name, _cut(getattr(sample, name), num_tokens - 1))
    offsets = getattr(sample, "rollout_top_p_token_offsets", None)
    if offsets is not None:  # slime's ragged top-p ids: response token i owns ids[o[i]:o[i+1]]
        out.rollout_top_p_token_offsets = offsets[: response + 1]
        out.rollout_top_p_token_ids = sample.rollout_top_p_token_ids[: int(offsets[response])]
    meta = dict(getattr(sample, "metadata", None) or {})
    for name in _PER_RESPONSE_META:
        if meta.get(name) is not None:
            meta[name] = meta[name][:response]
    meta[STATE_KEY] = int(state)
    out.metadata = meta
    if getattr(sample, "rollout_id", None) is None and hasattr(sample, "rollout_id"):
        out.rollout_id = sample.index  # siblings share it: the rollout is counted once
    return out


def expand_sample_states(fw: Framework, samples: Sequence[Any], exp: Expansion) -> list[Any]:
    """:func:`expand_samples` from an :class:`~r3_client.expansion.Expansion` of ``samples``
    already made (e.g. by :func:`r3_client.expansion.expand_infos` from stats read
    asynchronously)."""
    if exp.num_samples != len(samples):
        raise ShapeError(f"an expansion of {exp.num_samples} samples for {len(samples)} samples")
    by_origin: dict[int, list[Any]] = {}
    for st in exp.states:
        by_origin.setdefault(st.origin, []).append(st)
    out: list[Any] = []
    for i, sample in enumerate(samples):
        own = by_origin.get(i, [])
        if len(own) <= 1:
            out.append(sample)  # one state: replayed as it is
            continue
        if getattr(sample, "reward", None) is None:
            raise InvalidRequestError(
                f"{fw.name} sample {i} (index={getattr(sample, 'index', '?')}) has no reward "
                "yet: expand after the reward model ran, since each expanded sample copies "
                "the original's reward (scored on a cut copy it would be another)"
            )
        prompt = len(sample.tokens) - int(sample.response_length)
        copies = [_copy_state(sample, s.state, s.num_tokens, s.first_token, prompt) for s in own]
        kept = [c for c in copies if c is not None]
        if not kept:  # trains nothing at all (e.g. remove_sample): one copy keeps its place,
            whole = copy.copy(sample)  # in its last state (where a rank reads it, too)
            whole.metadata = {**(getattr(sample, "metadata", None) or {}), STATE_KEY: own[-1].state}
            kept = [whole]
        out.extend(kept)
    return out


def expand_samples(
    fw: Framework, samples: Sequence[Any], source: Any, *, args: Any = None
) -> list[Any]:
    """One ``Sample`` per routing state of each sample (``view="exact"``, docs/integrations.md
    "Exact replay by state expansion"): :func:`r3_client.expand_states` of the samples'
    keys and ``len(tokens)`` (one batched stat through ``source``, metadata only), then
    per state ``s`` (rows ``[s, end)``) a shallow copy of the sample with

    * ``tokens`` cut to the state's ``num_tokens`` (``end + 1``; the last state: all),
      ``response_length`` to ``num_tokens - prompt`` (the prompt: ``len(tokens) -
      response_length`` of the original);
    * ``loss_mask`` (``None``: all ones) cut to that and zeroed on the response tokens
      before ``s + 1``, so each trained token of the original is trained by exactly one
      copy; the other per-response-token lists (``rollout_log_probs``,
      ``teacher_log_probs``, ``opd_reverse_kl``, slime's top-p ids and offsets, miles'
      ``metadata["opd_student_top_logprobs"]``) and per-row arrays
      (``rollout_routed_experts``, ``rollout_indexer_topk``) cut with them;
    * ``metadata[STATE_KEY] = s``; ``rollout_id`` (``None``: the original's ``index``)
      shared by the copies, so slime / miles count the rollout once (per-rollout loss
      denominators, step split, reward groups); ``index``, key, ``reward``, ``status``,
      ``group_index`` and the rest copied (``response``, the text, is the original's).

    A state that trains no token (all prompt, or loss mask zero there) is dropped; a sample
    of one state is returned as it is.  Samples without a reward are refused when cut
    (expand after the reward model).  ``args`` (the trainer's): refuses settings the cut
    would change (token-level returns, GSPO / OPSM sequence ratios; slime's
    count-reshaping reward normalization without
    ``--custom-reward-post-process-path r3_client.integrations.slime.normalize_rewards``).
    """
    if args is not None:
        _check_expand_args(fw, args)
    keys = [sample_key(fw, s) for s in samples]
    try:
        exp = expand_states(source, keys, [len(s.tokens) for s in samples])
    except (RolloutNotFoundError, ShapeError) as exc:
        raise _named(fw, exc) from exc
    return expand_sample_states(fw, samples, exp)


def index_keys(fw: Framework, run: str, sample_indices: Sequence[int]) -> list[str]:
    """Training side: the rank-local keys of a rank's samples from ``sample_indices``, which
    slime and miles ship to every DP rank (slime ``ray/rollout.py:665,786-807``; miles
    ``ray/rollout/train_data_conversion.py:81,349-381``)."""
    return [fw.index_key(run, int(i)) for i in sample_indices]


def _framework_generate(fw: Framework) -> GenerateFn:
    """The framework's own ``generate``, imported on first use."""
    module, _, name = fw.generate_path.partition(":")
    try:
        fn: GenerateFn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise FrameworkImportError(
            f"r3_client.integrations.{fw.name} wraps {module}.{name} by default, which could "
            f"not be imported ({exc}); install {fw.name} or pass generate= to wrap another "
            "function"
        ) from exc
    return fn


async def _call(
    fn: GenerateFn, args: Any, sample: Any, sampling_params: Any, evaluation: bool
) -> Any:
    """Call a generate function the way slime and miles do: ``evaluation=`` only if it
    takes it (slime sglang_rollout.py:252-260, miles compatibility.py:51-65)."""
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


def wrap_generate(
    fw: Framework,
    *,
    run: str,
    client: AsyncRoutingClient,
    num_layers: int,
    generate: GenerateFn | None = None,
    share_prompt: bool | None = None,
    missing: Missing = "raise",
    view: ViewPolicy | None = None,
    fill: bool = True,
) -> GenerateFn:
    """A legacy custom generate function around ``generate`` (default: the framework's own).

    Per call: evaluation samples pass through untagged; otherwise the sample gets its
    rollout key (``fw.assign_key``), which the framework sends as
    ``X-SMG-Routing-Key``, and the sampling params carry the same tag in
    ``custom_params`` (with ``share_prompt``; sglang-router drops it, an engine reached
    directly reads it).  After the call, every returned sample whose status is
    ``COMPLETED`` or ``TRUNCATED`` gets ``rollout_routed_experts`` from the cache (one
    ``get_many`` when the call returns several); aborted samples get nothing until
    their resumed call finishes.  ``view``: the policy of that fetch (:func:`fill_samples`;
    ``None``: ``"exact"``).

    ``fill=False`` (rank-local training): the sample is keyed by ``fw.assign_rank_key``
    (rebuildable on a training rank from ``Sample.index``) and nothing is fetched into
    it; a finished sample's rollout is only checked (:func:`check_stored`: one ``stat``,
    no rows), so a missing, short, gapped or foreign-token rollout fails here, naming the
    sample, before slime / miles ship it to the trainer.  Nothing is fetched here, so
    ``view`` is not given: the training ranks choose their policy where they read (the
    rank-local fetches' ``view``, ``exact`` by default); a policy given here is refused
    (:class:`~r3_client.InvalidRequestError`) rather than ignored.
    """
    check_rollout_id(f"{run}.0")  # the run must make valid keys before any generation
    policy = check_policy("exact" if view is None else view)  # before any generation, too
    if not fill and view is not None:
        raise InvalidRequestError(
            f"{fw.name} wrap_generate(fill=False) fetches nothing, so view={view!r} would be "
            "ignored: the rank-local fetch chooses its policy on the training side (each "
            "rank's fetch takes view=...)"
        )
    inner: list[GenerateFn] = [generate] if generate is not None else []

    async def generate_r3(
        args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
    ) -> Any:
        if not inner:
            inner.append(_framework_generate(fw))
        if evaluation:
            return await _call(inner[0], args, sample, sampling_params, evaluation)
        fw.check_args(args)
        if fill:
            key = fw.assign_key(run, sample)
        else:
            key, restarted = fw.assign_rank_key(run, sample)
            if restarted:  # an earlier attempt's rows, from tokens this one will not repeat
                await client.delete(key)
        params = tag_sampling_params(sampling_params, key, share_prompt=share_prompt)
        out = await _call(inner[0], args, sample, params, evaluation)
        done = [s for s in (out if isinstance(out, list) else [out]) if finished(s)]
        if done and fill:
            await fill_samples(
                fw, done, client, num_layers=num_layers, missing=missing, view=policy
            )
        elif done:
            await check_stored(fw, done, client, missing=missing)
        return out

    generate_r3.__doc__ = f"{fw.name}'s generate with rollouts keyed, routing fetched by key."
    return generate_r3


# ------------------------------------------------------------------ rank-local (training side)


@dataclass(frozen=True)
class SampleRank:
    """One Megatron training rank, as slime's and miles' replay fill sees it.

    ``tp_size``/``tp_rank``, ``cp_size``/``cp_rank``: the rank's tensor- and context-parallel
    coordinates (``mpu`` in slime, ``get_parallel_state()`` in miles).
    ``sequence_parallel``, ``allgather_cp``, ``data_pad_size_multiplier``: the trainer's
    ``args`` of those names.  ``router_layers``: the absolute decoder layer ids of the
    rank's MoE routers, in the order their replay objects were created (virtual stages in
    order, layers ascending, dense layers skipped: what the actor's loop walks);
    ``None`` is every layer the rollouts hold, ``()`` a stage without MoE layers.
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False
    allgather_cp: bool = False
    data_pad_size_multiplier: int = 128
    router_layers: Sequence[int] | None = None


@dataclass(frozen=True)
class RankReplay:
    """One micro-batch's replay targets on one rank: what the actor records per router.

    ``per_layer[j]`` (``[num_local_tokens, K]``, ``int32``) is what the framework's fill
    hands the router of absolute layer ``layer_ids[j]``: ``prepared[:, layer_id]`` after
    its own last-token row, CP split, padding and SP split.  :meth:`record` feeds them
    to the rank's replay objects in order.
    """

    layer_ids: tuple[int, ...]
    per_layer: list[Any]
    rollout_ids: tuple[str, ...]
    num_local_tokens: int
    num_rows: int  # rows read from the cache (the rank's share)

    def record(self, replays: Sequence[Any]) -> None:
        """``replays[j].record(per_layer[j])``, refusing a count that differs (as slime's
        ``assert routing_replay_offset == len(RoutingReplay.all_routing_replays)``)."""
        if len(replays) != len(self.per_layer):
            raise ShapeError(
                f"the rank has {len(replays)} routers but this replay holds "
                f"{len(self.per_layer)} layers {list(self.layer_ids)}"
            )
        for replay, rows in zip(replays, self.per_layer, strict=True):
            replay.record(rows)


def _rank_plan(
    num_tokens: npt.NDArray[np.int64], rank: SampleRank
) -> tuple[RankPlan, npt.NDArray[np.int64]]:
    """The rank's local positions in slime's / miles' thd pack, from token counts alone.

    Per sample: its ``T - 1`` rows plus the trainer's last-token row (``T``); zigzag CP
    pads it to ``2 * cp * ceil(T / 2cp)`` and keeps chunks ``r`` and ``2cp - 1 - r``; the
    CP-local pack is padded to ``tp * data_pad_size_multiplier``; sequence parallel keeps
    TP rank ``t``'s part.  With ``allgather_cp`` the unsplit pack is padded to ``cp`` times
    that and cut into ``cp`` runs.  Positions past the pack's samples (``>= cu[-1]``) are
    pack padding.  Also returns each local position's *fill index*: the row it takes in the
    padding call that made it (``-1`` for a routing row).
    """
    for name, size, r in (("tp", rank.tp_size, rank.tp_rank), ("cp", rank.cp_size, rank.cp_rank)):
        check_rank(size, r, name)
    if rank.data_pad_size_multiplier < 1:
        raise ShapeError(
            f"data_pad_size_multiplier must be >= 1, got {rank.data_pad_size_multiplier}"
        )
    if num_tokens.ndim != 1 or (num_tokens < 1).any():
        raise ShapeError("num_tokens must be one count >= 1 per sample")
    cp = rank.cp_size
    pad_size = rank.tp_size * rank.data_pad_size_multiplier
    if rank.allgather_cp or cp == 1:
        padded = num_tokens.copy()
        cu = cumulative(padded)
        total = int(cu[-1])
        unit = pad_size * (cp if rank.allgather_cp else 1)
        full = total + (unit - total % unit) % unit
        if rank.allgather_cp:
            local = contiguous_positions(full, cp, rank.cp_rank)
        else:
            local = np.arange(full, dtype=np.int64)
    else:
        padded = 2 * cp * ((num_tokens + 2 * cp - 1) // (2 * cp))
        cu = cumulative(padded)
        pos = zigzag_positions(cu, padded, cp, rank.cp_rank)
        extra = (pad_size - pos.shape[0] % pad_size) % pad_size
        local = np.concatenate([pos, int(cu[-1]) + np.arange(extra, dtype=np.int64)])
    if rank.sequence_parallel:
        local = sp_part(local, rank.tp_size, rank.tp_rank, "the pack is padded to tp * multiplier")
    inside = local < cu[-1]
    sample = np.searchsorted(cu, np.minimum(local, cu[-1] - 1), side="right") - 1
    offset = local - cu[sample]
    # A routing row: -1.  The last-token row is its own padding call (row 0); a sample's
    # CP padding starts again at 0 after it; pack padding counts from the pack's end.
    in_sample = np.where(
        offset < num_tokens[sample] - 1, -1, np.maximum(offset - num_tokens[sample], 0)
    )
    fill_index = np.where(inside, in_sample, local - cu[-1])
    n_inside = int(inside.sum())  # positions ascend: the samples' part is a prefix
    runs = row_runs(cu, num_tokens, local[:n_inside])
    plan = RankPlan(cu_seqlens=cu, seqlens=num_tokens, positions=local, runs=runs)
    return plan, fill_index.astype(np.int64)


def _pad_values(
    fill_index: npt.NDArray[np.int64],
    layer_ids: Sequence[int],
    num_layers: int,
    topk: int,
    num_experts: int,
    dtype: np.dtype[Any],
) -> npt.NDArray[np.int64]:
    """slime's padding rows (``cp_utils.py:239-251``): row ``j`` of a padding call over a
    ``[*, num_layers, K]`` tensor holds ``arange(pad * L * K) % E`` at ``(j, l, k)``,
    computed in the per-sample tensor's ``dtype`` (int16 wraps, as torch's arange does)."""
    j = fill_index[None, :, None]
    lk = (np.asarray(layer_ids, dtype=np.int64)[:, None] * topk + np.arange(topk))[:, None]
    flat = (j * num_layers * topk + lk).astype(dtype)  # wraps like torch.arange(dtype=)
    return flat.astype(np.int64) % num_experts  # [L, len(fill_index), K]


def fetch_rank_replay(
    fw: Framework,
    source: RangeSource,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int] | npt.ArrayLike,
    *,
    rank: SampleRank,
    num_layers: int,
    num_experts: int | None = None,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> RankReplay:
    """One micro-batch's replay targets for one slime or miles Megatron rank, read for it alone.

    Equal, router by router, to what the framework's fill hands its replay objects when
    every sample carries the whole ``fw.layout`` of its rollout (slime
    ``actor.py:333-350`` after ``cp_utils.py:254-297``; miles ``replay_utils.py:5-24``
    after ``replay_data.py:73-127``), but only the rank's rows (its CP / SP slice) of its
    routers' layers are fetched (one ``get_ranges`` call).  ``rollout_ids`` and
    ``num_tokens`` (``len(tokens)``): the micro-batch's samples in the order the actor
    packs them.  Padding rows are the framework's own: slime's ``arange % num_experts``
    (``num_experts``: ``args.num_experts``), miles' ``-1``.  Raises
    :class:`~r3_client.RolloutNotFoundError` / :class:`~r3_client.ShapeError` naming the
    sample (``missing="fill"`` replays experts ``0..K-1`` on rows nobody shipped, as the
    layouts fill them).

    ``view``: the policy every read is made under (docs/store.md, "Views"); under
    ``"exact"`` (the default) ``states`` names each sample's state (its first row;
    ``None``: ``0``), as :func:`expand_samples` records it, and a sample whose rows span
    several states is refused (:class:`~r3_client.InvalidRequestError`, "expand the
    sample") rather than replayed with one of them.
    """
    ids = [check_rollout_id(r) for r in rollout_ids]
    counts = np.asarray(num_tokens, dtype=np.int64).reshape(-1)
    if fw.name == "slime" and num_experts is None:
        raise ShapeError("slime pads with arange % num_experts: pass num_experts=args.num_experts")
    routers = None if rank.router_layers is None else [int(x) for x in rank.router_layers]
    if routers is not None:
        bad = [x for x in routers if not 0 <= x < num_layers]
        if bad or len(set(routers)) != len(routers):
            raise ShapeError(
                f"router_layers {routers} must be distinct decoder layers in [0, {num_layers})"
            )
    plan, fill_index = _rank_plan(counts, rank)
    layers = None if routers is None else tuple(sorted(routers))
    local, got_ids = fetch_plan_rows(source, ids, plan, layers, missing, -1, view, states)
    if routers is None:
        routers = list(got_ids)
    if any(x >= num_layers for x in got_ids):
        raise ShapeError(
            f"the rollouts hold layers {list(got_ids)}, beyond num_layers={num_layers}"
        )
    # local: [L, local tokens, K], layer major (each router's targets one contiguous view)
    is_row = fill_index < 0
    if missing == "fill" and local.shape[0]:  # rows nobody shipped: experts 0..K-1
        gap = is_row[None, :] & (local < 0).all(axis=-1)
        local[gap] = np.arange(local.shape[2])
    if local.shape[0]:
        pad = ~is_row
        if fw.name == "slime":
            assert num_experts is not None
            dtype = np.dtype(np.int16) if num_experts <= 1 << 15 else np.dtype(np.int32)
            local[:, pad] = _pad_values(
                fill_index[pad], got_ids, num_layers, local.shape[2], num_experts, dtype
            )
        else:
            local[:, pad] = -1
    order = [got_ids.index(x) for x in routers]
    per_layer: list[Any] = [np.ascontiguousarray(local[j], dtype=np.int32) for j in order]
    if as_torch:
        import torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
    return RankReplay(
        layer_ids=tuple(routers),
        per_layer=per_layer,
        rollout_ids=tuple(ids),
        num_local_tokens=plan.num_local_tokens,
        num_rows=plan.num_rows,
    )


# ------------------------------------------------------------------ rank-local fill (the hook)

#: The field slime's and miles' own fill reads (and deletes once filled).
ROUTED_EXPERTS = "rollout_routed_experts"

#: What a rank-local fill asks of the actor's data iterator per micro-batch: the keys
#: slime and miles ship to every DP rank anyway (slime ray/rollout.py:786-807; miles
#: ray/rollout/train_data_conversion.py:357-381).  The first two are needed; the loss
#: masks and response lengths tell each sample's state under ``exact``
#: (:func:`trained_states`).
FILL_KEYS = ("sample_indices", "tokens", "loss_masks", "response_lengths")


def _as_array(x: Any) -> npt.NDArray[Any]:
    if hasattr(x, "detach"):  # torch (the actor moves loss masks to the GPU)
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def trained_states(
    source: Any,
    rollout_ids: Sequence[str],
    num_tokens: Sequence[int],
    response_lengths: Sequence[int],
    loss_masks: Sequence[Any],
) -> list[int | None] | None:
    """Each sample's state as a training rank can tell it: the state holding its first
    trained token (the first response token whose loss mask is set; a sample training none:
    its last token's), from one batched stat of the rollouts (``source.stat_many``, else one
    ``stat`` each).  slime and miles ship no per-sample metadata to the ranks, but they do
    ship ``loss_masks`` and ``response_lengths``, and :func:`expand_samples` zeroes each
    copy's mask before its state's first token, so this is the state it recorded.  A sample
    whose trained tokens run past that state's rows is then refused by the read ("expand
    the sample"); one whose earlier states are masked out (a resumed partial rollout under
    ``mask_offpolicy_in_partial_rollout``) replays its last state, as it should.  ``None``
    when ``source`` answers no stats (a :class:`~r3_client.DirectReader`): every sample is
    then read in its first state.  A rollout the cache does not hold gets ``None`` (the
    read names it)."""
    many = getattr(source, "stat_many", None)
    one = getattr(source, "stat", None)
    if many is None and one is None:
        return None
    ids = list(rollout_ids)
    distinct = list(dict.fromkeys(ids))
    if many is not None:
        got = list(many(distinct))
    else:
        got = []
        for rid in distinct:
            try:
                got.append(one(rid))  # type: ignore[misc]
            except RolloutNotFoundError as exc:
                got.append(exc)
    infos = dict(zip(distinct, got, strict=True))
    out: list[int | None] = []
    for rid, n, r, mask in zip(ids, num_tokens, response_lengths, loss_masks, strict=True):
        info = infos[rid]
        if isinstance(info, R3Error):
            if not isinstance(info, RolloutNotFoundError):
                raise info
            out.append(None)
            continue
        states = rollout_states(info, int(n))
        trained = np.flatnonzero(_as_array(mask).reshape(-1)[: int(r)])
        first = int(n) - int(r) + int(trained[0]) if trained.size else int(n) - 1
        row = max(0, first - 1)  # token t attended to rows [0, t): it trains in t - 1's state
        out.append(max(a for a, _, _ in states if a <= row))
    return out


def source_getter(source: Any) -> Callable[[], RangeSource]:
    """``source``: a :class:`~r3_client.rank_local.RangeSource` (has ``get_ranges``), or a
    callable making one, called once, on the first fill (in the training process)."""
    if hasattr(source, "get_ranges"):
        made: list[RangeSource] = [source]
    elif callable(source):
        made = []
    else:
        raise UsageError("source must have get_ranges, or make such an object when called")

    def get() -> RangeSource:
        if not made:
            made.append(source())
            if not hasattr(made[0], "get_ranges"):
                raise UsageError(f"the source factory made {type(made[0]).__name__}, no get_ranges")
        return made[0]

    return get


def model_router_layers(models: Sequence[Any]) -> tuple[int, ...]:
    """The absolute decoder layers of a rank's MoE routers, in replay order, walked the way
    slime's actor (``actor.py:334-349``) and miles' ``register_replay_list_moe``
    (``megatron_utils/replay_utils.py:8-20``) walk them: per virtual stage ``vp_stage``
    (each model chunk's ``.module.config``), layers ``get_transformer_layer_offset`` to
    ``+ get_num_layers_to_build`` (Megatron's, answering from its parallel state), dense
    layers skipped by ``moe_layer_freq`` (an int: ``layer_id % freq != 0``; a list: ``0``).
    Imports megatron.core."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out: list[int] = []
    for vp_stage, model in enumerate(models):
        config = model.module.config
        num_layers_to_build = get_num_layers_to_build(config, vp_stage=vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        freq = config.moe_layer_freq
        for layer_id in range(offset, offset + num_layers_to_build):
            if isinstance(freq, int):
                if layer_id % freq != 0:
                    continue
            elif isinstance(freq, list):
                if len(freq) != config.num_layers:
                    raise ShapeError(
                        f"moe_layer_freq has {len(freq)} entries for {config.num_layers} layers"
                    )
                if freq[layer_id] == 0:
                    continue
            out.append(int(layer_id))
    return tuple(out)


def fill_micro_batches(
    fw: Framework,
    source: RangeSource,
    run: str,
    data_iterator: Sequence[Any],
    num_microbatches: Sequence[int],
    *,
    rank: SampleRank,
    num_layers: int,
    num_experts: int | None,
    missing: Missing,
    record: Callable[[RankReplay], None],
    view: ViewPolicy = "exact",
) -> int:
    """The loop of slime's ``fill_routing_replay`` (``actor.py:319-323, 354-355``) and miles'
    ``fill_replay_data`` (``replay_data.py:55-56, 73-74, 133-134``), reading
    ``sample_indices`` and ``tokens`` (and the loss masks and response lengths) instead of
    the routing: every iterator reset, then ``sum(num_microbatches)`` times
    ``data_iterator[0].get_next(FILL_KEYS)``, each micro-batch's :func:`fetch_rank_replay`
    (keys :func:`index_keys`, ``len(tokens)`` per sample, under ``view``) handed to
    ``record``, in order, then every iterator reset again.  Under ``exact`` each sample's
    state is :func:`trained_states` of the whole call's samples (one batched stat per call,
    where ``source`` answers stats).  Returns the count."""
    for iterator in data_iterator:
        iterator.reset()
    batches: list[tuple[list[str], list[int], list[Any] | None, list[Any] | None]] = []
    for done in range(sum(int(n) for n in num_microbatches)):
        batch = data_iterator[0].get_next(list(FILL_KEYS))
        indices, tokens = batch.get("sample_indices"), batch.get("tokens")
        if indices is None or tokens is None:
            raise InvalidRequestError(
                f"{fw.name} rank-local routing: micro-batch {done} carries no "
                f"{'sample_indices' if indices is None else 'tokens'}; the rollout keys are "
                "rebuilt from sample_indices, which the trainer ships to every DP rank"
            )
        if len(indices) != len(tokens):
            raise ShapeError(
                f"{fw.name} micro-batch {done}: {len(indices)} sample_indices for "
                f"{len(tokens)} samples"
            )
        if any(i is None for i in indices):
            raise InvalidRequestError(f"{fw.name} micro-batch {done}: a sample has no index")
        batches.append(
            (
                index_keys(fw, run, indices),
                [len(t) for t in tokens],
                batch.get("loss_masks"),
                batch.get("response_lengths"),
            )
        )
    states: list[list[int | None] | None] = [None] * len(batches)
    if view == "exact" and batches and all(m is not None and r is not None for *_, m, r in batches):
        flat = trained_states(
            source,
            [k for keys, *_ in batches for k in keys],
            [n for _, counts, *_ in batches for n in counts],
            [int(x) for *_, r in batches for x in r],  # type: ignore[union-attr]
            [m for *_, masks, _ in batches for m in masks],  # type: ignore[union-attr]
        )
        if flat is not None:
            at = 0
            for j, (keys, *_) in enumerate(batches):
                states[j] = flat[at : at + len(keys)]
                at += len(keys)
    for (keys, counts, _, _), mb_states in zip(batches, states, strict=True):
        replay = fetch_rank_replay(
            fw,
            source,
            keys,
            counts,
            rank=rank,
            num_layers=num_layers,
            num_experts=num_experts,
            missing=missing,
            as_torch=True,
            view=view,
            states=mb_states,
        )
        record(replay)
    for iterator in data_iterator:
        iterator.reset()
    return len(batches)


def hook_env(framework: str) -> tuple[str, str | None, str]:
    """``(R3_URL, R3_KEY, R3_RUN)`` from the training process's environment; a clear error
    naming what is unset."""
    import os

    unset = [v for v in ("R3_URL", "R3_RUN") if not os.environ.get(v)]
    if unset:
        raise IntegrationError(
            f"r3_client.integrations.{framework}.install_rank_local reads the cache's URL and "
            f"the run from R3_URL and R3_RUN (R3_KEY: its API key), unset here: "
            f"{', '.join(unset)}.  Set them in every training process's environment, or "
            "pass source= and run="
        )
    return os.environ["R3_URL"], os.environ.get("R3_KEY") or None, os.environ["R3_RUN"]


def client_factory(url: str, api_key: str | None) -> Callable[[], RangeSource]:
    """A :class:`~r3_client.RoutingClient` made on first use (in the process that fills)."""

    def make() -> RangeSource:
        from r3_client._client import RoutingClient

        return RoutingClient(url, api_key=api_key)

    return make


def unwrapped(fn: Any) -> Any:
    """The framework's own function under an installed hook (``_r3_original``)."""
    return getattr(fn, "_r3_original", fn)


def check_params(fn: Any, want: Sequence[str], where: str, pinned: str) -> str | None:
    """A problem when ``fn``'s parameters (unwrapped) are not ``want``, else ``None``."""
    try:
        params = list(inspect.signature(unwrapped(fn)).parameters)
    except (TypeError, ValueError):
        return f"{where} has no signature"
    if params != list(want):
        return f"{where} takes {params}, not {list(want)} ({pinned})"
    return None
