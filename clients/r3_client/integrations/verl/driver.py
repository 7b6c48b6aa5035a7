"""verl driver side (the trainer process): the step's routing attached to the batch, or, in the
rank-local mode, the step checked and only its rollout ids dispatched.

:func:`attach_routed_experts` fetches the step's rollouts into ``batch["routed_experts"]``
(the whole step, in the driver); :func:`check_rank_local_batch` only checks them (one
batched stat) and leaves each rank to fetch its slice; :class:`RoutedRolloutManager` does
one or the other to every training batch.  The exact path's state expansion, also inside
verl's own ``RayPPOTrainer.fit``, is :mod:`~r3_client.integrations.verl.exact` (its names are
served from here too); what both read of a batch is :mod:`~r3_client.integrations.verl._batch`.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any

import numpy as np

from r3_client._answers import RolloutInfo
from r3_client._exceptions import InvalidRequestError, R3Error, ShapeError, UsageError
from r3_client._routing import Routing, token_digest
from r3_client._step_check import StatSource, count_replay
from r3_client._views import ViewPolicy, applicable_views, check_policy
from r3_client.integrations.verl._batch import (
    ORIGIN_KEY,
    batch_lengths,
    batch_rollout_ids,
    check_batch,
)
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY, STATE_KEY
from r3_client.integrations.verl.exact import (
    FULL_MASK_KEY,
    ExactReplayTrainer,
    advantages_by_origin,
    arrange_mini_batches,
    check_expansion_modes,
    expand_verl_batch,
    gather_by_state,
)
from r3_client.layouts import Missing, verl_layout

if TYPE_CHECKING:
    from r3_client._sync_client import RoutingClient

__all__ = [
    "FULL_MASK_KEY",
    "ORIGIN_KEY",
    "ExactReplayTrainer",
    "RoutedRolloutManager",
    "advantages_by_origin",
    "arrange_mini_batches",
    "attach_routed_experts",
    "check_expansion_modes",
    "check_rank_local_batch",
    "expand_verl_batch",
    "gather_by_state",
]


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
    ids = batch_rollout_ids(data, rollout_ids)
    mask = data.batch["attention_mask"]
    lengths = batch_lengths(data)
    tokens = data.batch["input_ids"].cpu().numpy()
    routings: list[Routing] = []
    fetched: Generator[tuple[str, Routing | R3Error, int | None], None, None]
    if policy == "exact":
        fetched = _exact_rows(data, client, ids, lengths.counts)
    elif policy == "generated":
        fetched = ((key, got, None) for key, got in client.get_many(ids))
    else:  # the stream has no views
        fetched = ((key, client.get(key, view=policy), None) for key in ids)
    with closing(fetched):
        for i, (key, routing, stored) in enumerate(fetched):
            assert isinstance(routing, Routing)  # errors raise: return_errors is off
            sample = lengths.tokens(tokens, i)
            r = lengths.responses[i]
            routings.append(_fit(routing, sample, r, lengths.response_len, i, key, stored))
    try:
        routed = verl_layout(
            routings,
            lengths.prompts,
            lengths.responses,
            prompt_len=lengths.prompt_len,
            response_len=lengths.response_len,
            num_layers=num_layers,
            missing=missing,
        )
    except ShapeError as exc:
        m = re.match(r"sample (\d+)", str(exc))
        if m is None:
            raise
        raise ShapeError(f"verl {exc} (rollout {ids[int(m.group(1))]!r})") from exc
    if policy != "exact":  # a named policy is counted where it is chosen
        count_replay(client.stat_many(ids), lengths.counts, policy)
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
    ids = batch_rollout_ids(data, rollout_ids)
    if "routed_experts" in data.batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        raise InvalidRequestError(
            "the batch carries batch['routed_experts'] (inline routing replay?): in the "
            "rank-local mode verl's workers replay the cache's rows, not this tensor; "
            "drop it or use attach_routed_experts"
        )
    found = check_batch(data, source, ids, missing, view)
    if rollout_ids is not None:
        data.non_tensor_batch[ROLLOUT_ID_KEY] = np.array(ids, dtype=object)
    meta = getattr(data, "meta_info", None)
    if isinstance(meta, dict):
        meta["r3_step_check"] = found
    return data


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
