"""verl driver side (the trainer process): the step's routing attached to the batch, or, in the
rank-local mode, the step checked and only its rollout ids dispatched; state expansion, also
inside verl's own ``RayPPOTrainer.fit`` (:class:`ExactReplayTrainer`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Generator, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from r3_client._answers import RolloutInfo
from r3_client._exceptions import InvalidRequestError, R3Error, ShapeError, UsageError
from r3_client._routing import Routing, check_rollout_id, token_digest
from r3_client._views import ViewPolicy, applicable_views, check_policy
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY, STATE_KEY
from r3_client.layouts import Missing, verl_layout
from r3_client.rank_local import StatsInHand, StatSource, StepCheck, check_step, count_replay

if TYPE_CHECKING:
    from r3_client._client import RoutingClient

_log = logging.getLogger(__name__)

#: The ``non_tensor_batch`` key of an expanded batch's rows' original samples (``-1`` for
#: the rows added to keep the batch divisible); each row's state is under ``STATE_KEY``.
ORIGIN_KEY = "r3_origin"


def _rollout_ids(data: Any, rollout_ids: Sequence[str] | None) -> list[str]:
    n = len(data.batch["attention_mask"])
    if rollout_ids is None:
        stored = data.non_tensor_batch.get(ROLLOUT_ID_KEY)
        if stored is None:
            raise InvalidRequestError(
                f"the batch has no non_tensor_batch[{ROLLOUT_ID_KEY!r}]: its agent loops are "
                "not routed (r3_client.integrations.verl.routed_agent_loop); pass rollout_ids"
            )
        rollout_ids = list(stored)
    ids = list(rollout_ids)
    if len(ids) != n:
        raise ShapeError(f"{len(ids)} rollout ids for a batch of {n} samples")
    # An expanded batch (expand_verl_batch) holds a rollout once per state, and its padding
    # rows (origin -1) repeat one: a rollout id and state name one row.
    states = data.non_tensor_batch.get(STATE_KEY)
    origins = data.non_tensor_batch.get(ORIGIN_KEY)
    first: dict[tuple[str, int], int] = {}
    for i, key in enumerate(ids):
        if not key:
            raise InvalidRequestError(
                f"verl sample {i} has no rollout id: its agent loop is not routed "
                "(r3_client.integrations.verl.routed_agent_loop)"
            )
        check_rollout_id(key)
        if origins is not None and int(origins[i]) < 0:
            continue
        tag = (key, 0 if states is None else int(states[i]))
        if tag in first:
            raise InvalidRequestError(f"verl samples {first[tag]} and {i} share rollout id {key!r}")
        first[tag] = i
    return ids


def _fit(
    routing: Routing,
    tokens: Any,
    response: int,
    response_len: int,
    i: int,
    key: str,
    stored: int | None = None,
) -> Routing:
    """The rollout's rows for sample ``i`` (``tokens``: its prompt and response ids).

    A rollout with more rows is cut only where verl cut the response at
    ``response_len`` (``tool_agent_loop.py:195, 205-209``); a segment whose tokens are the
    sample's is checked against its digest.
    """
    want = len(tokens) - 1
    have = routing.num_rows if stored is None else stored  # stored: a ranged read's rollout
    where = f"verl sample {i}, rollout {key!r}"
    if have < want:
        raise ShapeError(
            f"{where}: the cache holds {have} rows, the sample has {len(tokens)} tokens "
            f"(expected {want} rows): a partial rollout, or tokens the engine never saw"
        )
    if have > want and response < response_len:
        raise ShapeError(
            f"{where}: the cache holds {have} rows, more than the sample's {len(tokens)} "
            f"tokens - 1, and its response ({response} tokens) was not cut at "
            f"response_length={response_len}"
        )
    for seg in routing.segments:
        checkable = seg.tokens_digest and seg.end <= len(tokens)
        if checkable and token_digest(tokens[: seg.end]) != seg.tokens_digest:
            raise ShapeError(
                f"{where}: stored rows [{seg.start}, {seg.end}) were computed from other "
                "tokens than the sample's (token digest differs)"
            )
    if routing.num_rows == want:
        return routing
    return Routing(
        routing.indices[:want], routing.num_experts, routing.layer_ids, 0, routing.segments
    )


def attach_routed_experts(
    data: Any,
    client: RoutingClient,
    rollout_ids: Sequence[str] | None = None,
    *,
    num_layers: int,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> Any:
    """Set ``data.batch["routed_experts"]`` (a verl ``DataProto``) from the cache; return ``data``.

    Call it on the rollout's ``DataProto`` before ``compute_log_prob`` (or use
    :class:`RoutedRolloutManager`).  ``rollout_ids``: one per sample in batch order
    (default: ``data.non_tensor_batch["r3_rollout_id"]``, set by
    :class:`RoutedAgentLoop`).  ``num_layers``: the model's ``num_hidden_layers``.
    The tensor is :func:`~r3_client.layouts.verl_layout` of the rollouts, int16 ``[bs,
    prompt_len + response_len, num_layers, K]`` on ``attention_mask``'s device, with
    each sample's prompt and response lengths from ``attention_mask``.  ``view``:
    ``"exact"`` (the default: each row replays the routing its tokens attended to; one
    batched stat, then rollouts without views read as under ``generated`` and each
    sample with views read by range in its state, ``non_tensor_batch["r3_state"]`` of a
    batch expanded by :func:`expand_verl_batch`, else its first: a sample spanning
    several states is refused, ``InvalidRequestError``, never attached with one of them),
    ``"generated"`` (each position's first computation; one streamed ``get_many``) or
    ``"latest"`` (what each rollout's last call attended to, verl#6054's answer; one
    ``get(view="latest")`` per sample), the last two chosen by name and counted as a
    pre-dispatch check counts them (one batched stat,
    :func:`r3_client.rank_local.count_replay`: the tokens replayed off their own state,
    warned about); docs/integrations.md.

    Raises :class:`~r3_client.RolloutNotFoundError` for a rollout the cache does not
    hold and :class:`~r3_client.ShapeError` (naming the sample and rollout) for one that
    does not hold a row per token but the last, holds rows nobody shipped (unless
    ``missing="fill"``) or rows computed from other tokens; ``data`` is unchanged then.
    """
    import torch

    policy = check_policy(view)
    ids = _rollout_ids(data, rollout_ids)
    mask = data.batch["attention_mask"]
    input_ids = data.batch["input_ids"]
    plen = int(data.batch["prompts"].shape[1])
    rlen = int(data.batch["responses"].shape[1])
    prompt_lens = mask[:, :plen].sum(dim=1).tolist()
    response_lens = mask[:, plen:].sum(dim=1).tolist()
    tokens = input_ids.cpu().numpy()
    routings: list[Routing] = []
    fetched: Generator[tuple[str, Routing | R3Error, int | None], None, None]
    if policy == "exact":
        fetched = _exact_rows(
            data, client, ids, [p + r for p, r in zip(prompt_lens, response_lens, strict=True)]
        )
    elif policy == "generated":
        fetched = ((key, got, None) for key, got in client.get_many(ids))
    else:  # the stream has no views
        fetched = ((key, client.get(key, view=policy), None) for key in ids)
    with closing(fetched):
        for i, (key, routing, stored) in enumerate(fetched):
            assert isinstance(routing, Routing)  # errors raise: return_errors is off
            p, r = prompt_lens[i], response_lens[i]
            routings.append(_fit(routing, tokens[i, plen - p : plen + r], r, rlen, i, key, stored))
    try:
        routed = verl_layout(
            routings,
            prompt_lens,
            response_lens,
            prompt_len=plen,
            response_len=rlen,
            num_layers=num_layers,
            missing=missing,
        )
    except ShapeError as exc:
        m = re.match(r"sample (\d+)", str(exc))
        if m is None:
            raise
        raise ShapeError(f"verl {exc} (rollout {ids[int(m.group(1))]!r})") from exc
    if policy != "exact":  # a named policy is counted where it is chosen
        count_replay(
            client.stat_many(ids),
            [p + r for p, r in zip(prompt_lens, response_lens, strict=True)],
            policy,
        )
    data.batch["routed_experts"] = torch.from_numpy(routed).to(mask.device)
    return data


def _exact_rows(
    data: Any, client: RoutingClient, ids: list[str], counts: list[int]
) -> Generator[tuple[str, Routing | R3Error, int | None], None, None]:
    """Each sample's rollout under ``exact``: rollouts without views whole (the streamed
    ``get_many``, as ``generated`` reads them: their one state), a sample with views its
    rows ``[0, T - 1)`` in its state (``r3_state``, else the first), read by range, which
    refuses a sample reaching past its state (:func:`attach_routed_experts` checks what it
    gets as for every policy)."""
    states = data.non_tensor_batch.get(STATE_KEY)
    infos = client.stat_many(ids)
    one_state = [isinstance(info, R3Error) or not applicable_views(info) for info in infos]
    whole = client.get_many([key for key, one in zip(ids, one_state, strict=True) if one])
    # the samples with views that are read by range: one get_ranges call for all of them,
    # each answer (or error) taken at its sample's turn
    ranged = [
        (i, (key, 0, counts[i] - 1, None if states is None else int(states[i]), counts[i] - 1))
        for i, (key, info) in enumerate(zip(ids, infos, strict=True))
        if not one_state[i] and isinstance(info, RolloutInfo) and 0 < counts[i] - 1 <= info.num_rows
    ]
    by_sample: dict[int, Routing | R3Error] = {}
    if ranged:
        answers = client.get_ranges([r for _, r in ranged], view="exact", return_errors=True)
        with closing(answers):
            by_sample = {i: got for (i, _), (_, got) in zip(ranged, answers, strict=True)}
    with closing(whole):
        for i, (key, info) in enumerate(zip(ids, infos, strict=True)):
            if one_state[i] or isinstance(info, R3Error):  # a missing rollout raises in the read
                got_key, routing = next(whole)
                assert got_key == key
                yield key, routing, None
                continue
            if i not in by_sample:  # _fit refuses a short rollout; a one-token sample has no rows
                yield key, client.get(key), None
                continue
            routing = by_sample[i]
            if isinstance(routing, R3Error):
                raise routing
            # an expanded row is a prefix of its sample by construction (expand_verl_batch
            # checked the sample's length); an original row is held to the length rules
            yield key, routing, info.num_rows if states is None else None


def check_rank_local_batch(
    data: Any,
    source: StatSource,
    rollout_ids: Sequence[str] | None = None,
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> Any:
    """Driver side of the rank-local mode: check the step's rollouts, attach nothing.

    Returns ``data``; where it has a ``meta_info`` dict, the check's
    :class:`~r3_client.rank_local.StepCheck` goes in ``meta_info["r3_step_check"]`` (how
    many tokens the ranks, replaying under ``view``, give a routing other than the one
    they attended to; a warning is logged when some are).

    Every sample's rollout (``rollout_ids``, default ``non_tensor_batch["r3_rollout_id"]``;
    given ids are written there) must be in the cache with a row for each of its tokens
    but the last (``attention_mask.sum(1) - 1``; no gap unless ``missing="fill"``),
    computed from the sample's tokens where the engine recorded their digest, and no
    more rows unless verl cut the response at ``response_length`` (the checks
    :func:`attach_routed_experts` makes): one batched stat
    (:func:`r3_client.rank_local.check_step`), so such a rollout fails the step naming
    its sample before anything is dispatched.  The ids
    are then the batch's only routing: verl carries ``non_tensor_batch`` into the
    workers' micro-batches (``protocol.py:1119-1121``, ``tensordict_utils.index_select``)
    and :class:`RankLocalReplay` reads each rank's slice there.  A batch that already
    carries ``routed_experts`` is refused: verl's own R3 branch would replay that
    instead.
    """
    ids = _rollout_ids(data, rollout_ids)
    if "routed_experts" in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        raise InvalidRequestError(
            "the batch carries batch['routed_experts'] (inline routing replay?): in the "
            "rank-local mode verl's workers replay the cache's rows, not this tensor; "
            "drop it or use attach_routed_experts"
        )
    found = _check_batch(data, source, ids, missing, view)
    if rollout_ids is not None:
        data.non_tensor_batch[ROLLOUT_ID_KEY] = np.array(ids, dtype=object)
    meta = getattr(data, "meta_info", None)
    if isinstance(meta, dict):
        meta["r3_step_check"] = found
    return data


def _check_batch(
    data: Any,
    source: StatSource,
    ids: list[str],
    missing: Missing,
    view: ViewPolicy,
    *,
    count: bool = True,
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on a verl batch: its samples' token counts
    and tokens from ``attention_mask`` and ``input_ids``, more rows allowed only where verl
    cut the response (as :func:`attach_routed_experts`' ``_fit``)."""
    mask = data.batch["attention_mask"]
    plen = int(data.batch["prompts"].shape[1])
    rlen = int(data.batch["responses"].shape[1])
    prompt_lens = mask[:, :plen].sum(dim=1).tolist()
    response_lens = mask[:, plen:].sum(dim=1).tolist()
    input_ids = data.batch["input_ids"].cpu().numpy()
    tokens = [
        input_ids[i, plen - int(p) : plen + int(r)]
        for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True))
    ]
    return check_step(
        source,
        ids,
        [len(t) for t in tokens],
        missing=missing,
        tokens=tokens,
        longer=[int(r) >= rlen for r in response_lens],
        view=view,
        count=count,
    )


class RoutedRolloutManager:
    """A verl ``AgentLoopManager`` whose training batches carry ``routed_experts``, or
    (``rank_local=True``) only their checked rollout ids.

    Replace the trainer's after ``init_workers()``::

        trainer.async_rollout_manager = RoutedRolloutManager(
            trainer.async_rollout_manager, client, num_layers=hf_config.num_hidden_layers)

    ``generate_sequences`` (called synchronously by ``RayPPOTrainer.fit``,
    ``ray_trainer.py:1513``) returns the wrapped one's batch with
    :func:`attach_routed_experts` applied, except for validation batches
    (``meta_info["validate"]``), which verl does not train on.  ``view``: the policy
    of the fetch (:func:`attach_routed_experts`; ``"exact"`` by default, which refuses a
    sample spanning several routing states rather than attach one of them: name
    ``"latest"`` or ``"generated"`` to replay one routing per sample, or expand the batch,
    :func:`expand_verl_batch`, where the trainer's loop allows it, docs/integrations.md).
    With ``rank_local=True`` it applies :func:`check_rank_local_batch` instead
    (``num_layers`` unused; ``view`` is the policy the pre-dispatch check reports for:
    give :class:`RankLocalReplay` the same, the driver fetches nothing) and the workers
    replay through :class:`RankLocalReplay`.  Every other attribute is the wrapped
    manager's.
    """

    def __init__(
        self,
        manager: Any,
        client: RoutingClient,
        *,
        num_layers: int | None = None,
        missing: Missing = "raise",
        view: ViewPolicy = "exact",
        rank_local: bool = False,
    ) -> None:
        self.wrapped = manager
        self.client = client
        self.num_layers = num_layers
        self.missing: Missing = missing
        self.view: ViewPolicy = check_policy(view)
        self.rank_local = rank_local
        if not rank_local and num_layers is None:
            raise UsageError("num_layers (the model's num_hidden_layers) is required")

    def generate_sequences(self, prompts: Any) -> Any:
        """The wrapped manager's batch, with ``routed_experts`` (or checked ids) for
        training batches."""
        out = self.wrapped.generate_sequences(prompts)
        if prompts.meta_info.get("validate", False):
            return out
        if self.rank_local:
            return check_rank_local_batch(out, self.client, missing=self.missing, view=self.view)
        assert self.num_layers is not None
        return attach_routed_experts(
            out, self.client, num_layers=self.num_layers, missing=self.missing, view=self.view
        )

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


# ------------------------------------------------------------------ exact: state expansion

#: The batch key holding each row's original ``response_mask`` (before the state's cut),
#: which :func:`advantages_by_origin` computes advantages with.
FULL_MASK_KEY = "r3_full_response_mask"

# verl 0.9.1's loss aggregations and policy losses that are sums of per-token terms (each
# token trained once in an expanded batch: the same loss) and those that are not.
_TOKEN_AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_SEQUENCE_LOSSES = {
    "gspo": "a sequence-level importance ratio (core_algos.py:1545, the mean log-ratio of the "
    "sequence's tokens)",
    "sapo": "its loss aggregated seq-mean-token-mean whatever loss_agg_mode says "
    "(core_algos.py:1622)",
    "geo_mean": "a sequence-level geometric-mean ratio and advantage (core_algos.py:1928)",
}


def check_expansion_modes(loss_agg_mode: str, policy_loss_mode: str = "vanilla") -> None:
    """Refuse (:class:`~r3_client.InvalidRequestError`) verl loss settings under which an
    expanded batch does not train the loss of the original one.

    An expanded batch trains each token once, in the sample of its own routing state, so
    a loss that adds per-token terms is unchanged: ``token-mean`` and ``token-sum``, and
    ``seq-mean-token-sum(-norm)`` under verl's trainer, which divides by the mini-batch's
    configured size (``global_batch_size=ppo_mini_batch_size``, ``ray_trainer.py:1362``)
    rather than by the rows it holds.  ``seq-mean-token-mean`` averages within each
    sequence first, so a sample cut into states would weigh each part as a sequence; the
    ``gspo``, ``sapo`` and ``geo_mean`` policy losses take sequence-level statistics of
    the tokens trained together.  Those are refused under ``exact``: name ``view="latest"``
    (or ``"generated"``) to replay one routing per sample (the pre-dispatch check counts
    the tokens replayed off their own state), or use a token-level aggregation.
    """
    if loss_agg_mode not in _TOKEN_AGG:
        raise InvalidRequestError(
            f"verl loss_agg_mode={loss_agg_mode!r} is not a sum of per-token terms: a sample "
            "expanded into one training sample per routing state (view='exact') would be "
            f"weighed as several sequences. Use one of {', '.join(_TOKEN_AGG)}, or replay one "
            "routing per sample with view='latest' or 'generated' (its off-state tokens are "
            "counted by the pre-dispatch check)"
        )
    why = _SEQUENCE_LOSSES.get(policy_loss_mode)
    if why is not None:
        raise InvalidRequestError(
            f"verl policy_loss.loss_mode={policy_loss_mode!r} takes {why}: a sample expanded "
            "into one training sample per routing state (view='exact') would change it. Use a "
            "token-level policy loss (vanilla, dppo_tv, dppo_kl, gpg, clip_cov, kl_cov, dro, "
            "cispo), or replay one routing per sample with view='latest' or 'generated'"
        )


def expand_verl_batch(
    data: Any,
    source: StatSource,
    rollout_ids: Sequence[str] | None = None,
    *,
    loss_agg_mode: str = "token-mean",
    policy_loss_mode: str = "vanilla",
    divisor: int = 1,
    count: bool = True,
) -> Any:
    """A verl ``DataProto`` with one row per routing state of each sample (``exact``).

    Call it on the driver where the training batch is complete (its rewards computed, the
    rollout's per-sample fields set) and before ``compute_log_prob``: every later stage
    (old and reference log-probs, values, advantages through :func:`advantages_by_origin`,
    the update) then runs on the expanded batch, and each rank reads each row under its
    state (:class:`~r3_client.integrations.verl.RankLocalReplay` reads
    ``non_tensor_batch["r3_state"]``; or :func:`attach_routed_experts` on the expanded
    batch).  One batched stat (:func:`r3_client.expand_states`), no rows.

    Row ``j``, state ``s`` of sample ``i`` (rows ``[a, b)``), is sample ``i`` with its
    ``attention_mask`` cut after token ``b`` (tokens past it are padding: they were
    sampled after another routing) and its ``response_mask`` kept only on tokens
    ``a + 1 .. b`` (AND-ed with the sample's own: tool tokens stay masked); every other
    field is sample ``i``'s (old / reference / rollout log-probs, rewards, uids: per-token
    fields are masked by ``response_mask`` where verl's losses read them).  A state whose
    tokens are all prompt trains nothing and is left out.  The original mask is kept in
    ``batch["r3_full_response_mask"]``; ``non_tensor_batch["r3_state"]`` and
    ``["r3_origin"]`` say where each row comes from; ``meta_info["r3_expansion"]`` holds
    the counts (samples, rows, extra rows, extra tokens).  ``divisor``: the row count is
    padded to a multiple of it (verl's dispatch splits the batch evenly over its data-
    parallel ranks) with copies of the last row that train nothing (``response_mask`` 0,
    ``r3_origin`` -1).  A batch without views comes back with the same rows (and the keys).

    The check of the originals counts the step (:func:`r3_client.rank_local.check_step`):
    no off-state token (the exact replay has none), the samples it expands and their cost
    under ``r3_client_expansion_*``; ``count=False`` counts nothing (the same step expanded
    again).  Refuses (:class:`~r3_client.InvalidRequestError`, before any stat) the loss
    settings of :func:`check_expansion_modes`.
    """
    import torch

    from r3_client.expansion import expand_states

    check_expansion_modes(loss_agg_mode, policy_loss_mode)
    if STATE_KEY in data.non_tensor_batch:
        raise InvalidRequestError("the batch is expanded already (it carries r3_state)")
    ids = _rollout_ids(data, rollout_ids)
    if "routed_experts" in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        raise InvalidRequestError(
            "the batch carries batch['routed_experts']: each row of an expanded batch needs "
            "its own state's rows; expand first, then attach_routed_experts (or rank-local)"
        )
    # one batched stat (where the source has one) serves the check and the expansion
    many = getattr(source, "stat_many", None)
    if many is not None:
        source = StatsInHand(dict(zip(ids, many(ids), strict=True)))
    # the originals held to every rule of the rank-local check (rows for each token, the
    # sample's own tokens, longer only where verl cut the response), before any row is cut
    _check_batch(data, source, ids, "raise", "exact", count=count)
    mask = data.batch["attention_mask"]
    plen = int(data.batch["prompts"].shape[1])
    prompt_lens = mask[:, :plen].sum(dim=1).tolist()
    counts = mask.sum(dim=1).tolist()
    exp = expand_states(source, ids, counts)
    keep = [
        j
        for j, s in enumerate(exp.states)
        if s.num_tokens > prompt_lens[s.origin] or s.end >= counts[s.origin] - 1
    ]
    states = [exp.states[j] for j in keep]
    pad = (-len(states)) % max(1, divisor)
    rows = [s.origin for s in states] + [states[-1].origin] * pad
    out = data.select_idxs(np.asarray(rows, dtype=np.int64))
    full = out.batch["response_mask"] if "response_mask" in out.batch.keys() else None  # noqa: SIM118
    attention = out.batch["attention_mask"].clone()
    if full is None:
        full = attention[:, plen:].clone()
    response = full.clone()
    width = attention.shape[1]
    for j, s in enumerate(states):
        p = prompt_lens[s.origin]
        start = plen - p  # the sample's token 0 (verl left-pads prompts)
        attention[j, start + s.num_tokens :] = 0
        state_mask = torch.as_tensor(s.token_mask(width - plen, offset=p), device=response.device)
        response[j] = response[j] * state_mask.to(response.dtype)
    if pad:
        response[len(states) :] = 0
    out.batch["attention_mask"] = attention
    out.batch["response_mask"] = response
    out.batch[FULL_MASK_KEY] = full
    out.non_tensor_batch[STATE_KEY] = np.asarray(
        [s.state for s in states] + [states[-1].state] * pad, dtype=np.int64
    )
    out.non_tensor_batch[ORIGIN_KEY] = np.asarray(
        [s.origin for s in states] + [-1] * pad, dtype=np.int64
    )
    out.non_tensor_batch[ROLLOUT_ID_KEY] = np.asarray([ids[i] for i in rows], dtype=object)
    meta = dict(out.meta_info) if isinstance(out.meta_info, dict) else {}
    meta["r3_expansion"] = {
        "samples": len(ids),
        "rows": len(rows),
        "extra_rows": len(rows) - len(ids),
        "extra_tokens": int(sum(s.num_tokens for s in states) - sum(counts)),
        "padding_rows": pad,
    }
    out.meta_info = meta
    return out


def _origins(expanded: Any) -> np.ndarray:
    return np.asarray(expanded.non_tensor_batch[ORIGIN_KEY], dtype=np.int64)


def _last_rows(origin: np.ndarray) -> dict[int, int]:
    """Each original's last row in an expanded batch (its last state: its whole response);
    padding rows (origin -1) are none's."""
    last: dict[int, int] = {}
    for j, i in enumerate(origin.tolist()):
        if i >= 0:
            last[i] = j  # a sample's states are consecutive, its last state last
    return last


def advantages_by_origin(data: Any, compute: Any, **kwargs: Any) -> Any:
    """Run verl's advantage estimator over an expanded batch's original samples, once each,
    and give every row its original's advantages and returns; return ``data``.

    ``compute(originals, **kwargs)``: verl's ``compute_advantage`` (``ray_trainer.py``) or
    any function that sets ``batch["advantages"]`` / ``["returns"]`` on the ``DataProto``
    it is given and returns it.  The originals are each sample's last state's row (its
    whole response) with its original ``response_mask``, so group statistics (GRPO's by
    ``uid``, RLOO's baseline) and rewards count each sample once, as without expansion.
    """
    origin = _origins(data)
    last = _last_rows(origin)
    order = sorted(last)
    originals = data.select_idxs(np.asarray([last[i] for i in order], dtype=np.int64))
    originals.batch["response_mask"] = originals.batch[FULL_MASK_KEY].clone()
    originals = compute(originals, **kwargs)
    where = {i: n for n, i in enumerate(order)}
    take = np.asarray([where[i] if i >= 0 else 0 for i in origin.tolist()], dtype=np.int64)
    import torch

    index = torch.as_tensor(take, device=data.batch["response_mask"].device)
    for key in ("advantages", "returns"):
        if key in originals.batch.keys():  # noqa: SIM118
            data.batch[key] = originals.batch[key].index_select(0, index) * data.batch[
                "response_mask"
            ].to(originals.batch[key].dtype)
    return data


# ------------------------------------------------------------------ inside verl's own fit
#
# verl's own ``RayPPOTrainer.fit`` replaying every token in its routing state (``exact``).
#
# ``fit`` builds, scores and trains its batch in one method (``ray_trainer.py:1405-1720``):
# balance, reward, ``_compute_old_log_prob``, ``_compute_ref_log_prob``, the module-level
# ``compute_advantage``, ``_update_actor``.  There is no hook between the reward and the
# first forward, but the forwards and the update are methods, so :class:`ExactReplayTrainer`
# (a mixin put before ``RayPPOTrainer``) expands the batch inside them and nowhere else:
#
# * ``_compute_old_log_prob`` / ``_compute_ref_log_prob``: the batch is expanded (one row per
#   routing state, :func:`~r3_client.integrations.verl.expand_verl_batch`), verl's own method
#   forwards it (each row replays its state on the ranks: :class:`RankLocalReplay` reads
#   ``r3_state``), and each token's log-prob (and entropy) comes back to the original row
#   from the state that served it (:func:`gather_by_state`).  ``fit`` goes on with the
#   original batch: its rewards, its metrics and verl's ``compute_advantage`` (GRPO's ``uid``
#   groups, RLOO's baselines) see every sample once;
# * ``_update_actor``: the batch, now holding advantages and the per-token log-probs of each
#   token's own state, is expanded again and arranged so that every optimizer step trains
#   the states of exactly the samples verl would have put in that step on each data-parallel
#   rank (:func:`arrange_mini_batches`); verl's own method trains it.
#
# So every token is trained once, with the routing it was sampled under, in the same
# optimizer step as without expansion; the cost is the extra rows' forwards.  Accepted:
# ``loss_agg_mode`` ``token-mean`` (verl's default) and ``token-sum``; refused
# (:class:`~r3_client.InvalidRequestError`): the sequence-level aggregations and losses of
# :func:`~r3_client.integrations.verl.check_expansion_modes`, and ``seq-mean-token-sum(-norm)``
# here (verl divides it by the mini-batch's row count, which the arrangement changes).  The
# critic (``_compute_values``, ``_update_critic``) is left as verl runs it.

#: ``loss_agg_mode``\\ s whose per-step loss the arrangement leaves unchanged.
_STEP_EXACT = ("token-mean", "token-sum")


def gather_by_state(values: Any, expanded: Any, num_samples: int) -> Any:
    """A ``DataProto`` of per-response-token values computed on an expanded batch
    (``old_log_probs``, ``entropys``, ``ref_log_prob``: ``[rows, response_len]``) brought
    back to the ``num_samples`` originals: each token's value from the row of the state that
    trained it (``expanded.batch["response_mask"]``), the other tokens' (prompt-side,
    masked, padding) from the original's last state.  Values of another shape are refused
    (:class:`~r3_client.ShapeError`): an expanded row's value is not the original's."""
    import torch
    from verl.protocol import DataProto

    origin = _origins(expanded)
    rows = int(origin.shape[0])
    last = _last_rows(origin)
    if sorted(last) != list(range(num_samples)):
        raise ShapeError(f"the expanded batch covers samples {sorted(last)}, not {num_samples}")
    mask = expanded.batch["response_mask"].bool()
    index = torch.as_tensor([last[i] for i in range(num_samples)], device=mask.device)
    out: dict[str, Any] = {}
    for key in values.batch.keys():  # noqa: SIM118 (a TensorDict)
        value = values.batch[key]
        if value.dim() != 2 or tuple(value.shape) != (rows, mask.shape[1]):
            raise ShapeError(
                f"{key!r} has shape {tuple(value.shape)}, not the expanded batch's "
                f"[{rows}, {mask.shape[1]}] response tokens: it cannot be brought back per token"
            )
        merged = value.index_select(0, index).clone()
        for j, i in enumerate(origin.tolist()):
            if i >= 0:
                merged[i][mask[j]] = value[j][mask[j]]
        out[key] = merged
    return DataProto.from_dict(tensors=out, meta_info=dict(values.meta_info or {}))


def arrange_mini_batches(
    expanded: Any, num_samples: int, *, dp_size: int, mini_batch_size: int, row_multiple: int = 1
) -> tuple[Any, int]:
    """An expanded batch reordered and padded so that verl's update trains, in each optimizer
    step and on each data-parallel rank, the states of exactly the original samples it would
    have trained there; and the rows of one step (the ``global_batch_size`` to give verl).

    verl dispatches a batch to its ``dp_size`` ranks in equal contiguous chunks and each rank
    cuts its chunk into mini-batches of ``mini_batch_size / dp_size`` rows
    (``engine_workers.py:243-289``, unshuffled): original samples ``r * B/dp + g * G ..
    + G`` (``G = mini_batch_size / dp_size``) form rank ``r``'s part of step ``g``.  Here each
    such cell's states are placed at rank ``r``'s step ``g`` and padded to ``c`` rows (the
    largest cell, rounded up so that ``c * dp_size`` is a multiple of ``row_multiple``) with
    copies of the cell's last row that train nothing (``response_mask`` 0, ``r3_origin``
    -1).  Returns ``(batch, c * dp_size)``.
    """
    if mini_batch_size % dp_size or num_samples % mini_batch_size:
        raise ShapeError(
            f"{num_samples} samples in mini-batches of {mini_batch_size} over {dp_size} "
            "data-parallel ranks: verl needs both to divide"
        )
    origin = _origins(expanded)
    per_rank, cell = num_samples // dp_size, mini_batch_size // dp_size
    steps = per_rank // cell
    by_cell: dict[tuple[int, int], list[int]] = {}
    for j, i in enumerate(origin.tolist()):
        if i >= 0:
            by_cell.setdefault((i // per_rank, (i % per_rank) // cell), []).append(j)
    width = max(len(v) for v in by_cell.values())
    step = row_multiple // math.gcd(row_multiple, dp_size)  # c * dp_size % row_multiple == 0
    width = -(-width // step) * step
    order: list[int] = []
    pads: list[int] = []
    for r in range(dp_size):
        for g in range(steps):
            rows = by_cell[(r, g)]
            order.extend(rows)
            pads.extend(range(len(order), len(order) + width - len(rows)))
            order.extend([rows[-1]] * (width - len(rows)))
    out = expanded.select_idxs(np.asarray(order, dtype=np.int64))
    if pads:
        at = np.asarray(pads, dtype=np.int64)
        out.batch["response_mask"][at] = 0
        out.non_tensor_batch[ORIGIN_KEY][at] = -1
    return out, width * dp_size


class ExactReplayTrainer:
    """Mixin for verl's ``RayPPOTrainer`` (put it first) that trains every token with the
    routing state it was sampled under (the section comment above)::

        class Trainer(ExactReplayTrainer, RayPPOTrainer): ...
        trainer = Trainer(config, ...)
        trainer.r3_source = RoutingClient(cache_url, api_key=key)  # stats only
        trainer.fit()

    with the rank-local replay on the workers (:class:`RankLocalReplay`, ``view="exact"``).
    One batched stat per step (cached for the step's methods), no rows on the driver.
    """

    r3_source: StatSource | None = None
    #: Once the actor update has trained on a step, delete the step's rollouts from the
    #: cache (``r3_source.delete_many``, one request per 1,024 ids).  A source without it
    #: (a ``DirectReader``: read-only) leaves them to their TTL; set False where something
    #: after the update still reads them.  A failed delete is logged, never the step's.
    r3_release_step: bool = True
    _r3_stats: tuple[tuple[str, ...], StatsInHand] | None = None
    #: The step whose check was counted: verl's step expands its batch three times (old
    #: log-probs, reference log-probs, update), the metrics count it once.
    _r3_counted: tuple[str, ...] | None = None

    def _r3_stat_source(self, batch: Any) -> StatsInHand:
        if self.r3_source is None:
            raise InvalidRequestError(
                "ExactReplayTrainer needs trainer.r3_source (a RoutingClient) before fit()"
            )
        ids = tuple(str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY])
        if self._r3_stats is None or self._r3_stats[0] != ids:
            many = getattr(self.r3_source, "stat_many", None)
            if many is None:
                raise InvalidRequestError("r3_source answers no batched stat (stat_many)")
            self._r3_stats = (ids, StatsInHand(dict(zip(ids, many(list(ids)), strict=True))))
        return self._r3_stats[1]

    def _r3_expand(self, batch: Any, divisor: int = 1) -> Any:
        actor = self.config.actor_rollout_ref.actor  # type: ignore[attr-defined]
        if actor.loss_agg_mode not in _STEP_EXACT:  # before any forward is spent
            raise InvalidRequestError(
                f"ExactReplayTrainer: loss_agg_mode={actor.loss_agg_mode!r} is not kept by "
                "expansion inside fit (verl divides the sequence-level modes by the "
                "mini-batch's row count, which the expansion changes): use token-mean or "
                "token-sum, or expand in your own loop (expand_verl_batch) with one "
                "mini-batch per step"
            )
        source = self._r3_stat_source(batch)
        ids = tuple(str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY])
        count, self._r3_counted = self._r3_counted != ids, ids
        return expand_verl_batch(
            batch,
            source,
            loss_agg_mode=actor.loss_agg_mode,
            policy_loss_mode=actor.policy_loss.loss_mode,
            divisor=divisor,
            count=count,
        )

    def _r3_dp_size(self) -> int:
        return int(self._get_dp_size(self.actor_rollout_wg, "actor"))  # type: ignore[attr-defined]

    def _compute_old_log_prob(self, batch: Any) -> Any:
        """verl's, on the expanded batch; each token's log-prob and entropy from its state."""
        expanded = self._r3_expand(batch, self._r3_dp_size())
        out, mfu = super()._compute_old_log_prob(expanded)  # type: ignore[misc]
        if "routed_experts" in out.batch.keys():  # noqa: SIM118
            raise InvalidRequestError(
                "router_replay.mode='R2' records routing in compute_log_prob: R3's exact "
                "replay replays the rollout's routing instead; use one of them"
            )
        return gather_by_state(out, expanded, len(batch)), mfu

    def _compute_ref_log_prob(self, batch: Any) -> Any:
        """verl's, on the expanded batch; each token's reference log-prob from its state."""
        expanded = self._r3_expand(batch, self._r3_dp_size())
        out = super()._compute_ref_log_prob(expanded)  # type: ignore[misc]
        return gather_by_state(out, expanded, len(batch))

    def _update_actor(self, batch: Any) -> Any:
        """verl's, on the expanded batch arranged step by step (:func:`arrange_mini_batches`)."""
        config = self.config.actor_rollout_ref  # type: ignore[attr-defined]
        n = int(config.rollout.n)
        expanded = self._r3_expand(batch)
        arranged, rows = arrange_mini_batches(
            expanded,
            len(batch),
            dp_size=self._r3_dp_size(),
            mini_batch_size=int(config.actor.ppo_mini_batch_size) * n,
            row_multiple=n,
        )
        before = config.actor.ppo_mini_batch_size
        config.actor.ppo_mini_batch_size = rows // n  # verl multiplies it by n again
        try:
            out = super()._update_actor(arranged)  # type: ignore[misc]
        finally:
            config.actor.ppo_mini_batch_size = before
        self._r3_release(batch)
        return out

    def _r3_release(self, batch: Any) -> None:
        """The step's rollouts leave the cache (``r3_release_step``), after its last read."""
        source = self.r3_source
        if not self.r3_release_step or not callable(getattr(source, "delete_many", None)):
            return
        ids = [str(x) for x in batch.non_tensor_batch[ROLLOUT_ID_KEY]]
        try:
            cast("RoutingClient", source).delete_many(list(dict.fromkeys(ids)))
        except R3Error as exc:  # the rollouts expire with their TTL: training goes on
            _log.warning("r3: the step's %d rollouts were not deleted: %s", len(ids), exc)
        self._r3_stats = None
