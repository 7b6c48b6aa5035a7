"""verl driver side (the trainer process): the step's routing attached to the batch, or, in the
rank-local mode, the step checked and only its rollout ids dispatched; state expansion."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._routing import Routing, check_rollout_id, token_digest
from r3_client._views import ViewPolicy, one_routing_policy
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY
from r3_client.layouts import Missing, verl_layout
from r3_client.rank_local import StatSource, check_step

if TYPE_CHECKING:
    from r3_client._client import RoutingClient


def _rollout_ids(data: Any, rollout_ids: Sequence[str] | None) -> list[str]:
    n = len(data.batch["attention_mask"])
    if rollout_ids is None:
        stored = data.non_tensor_batch.get(ROLLOUT_ID_KEY)
        if stored is None:
            raise ValueError(
                f"the batch has no non_tensor_batch[{ROLLOUT_ID_KEY!r}]: its agent loops are "
                "not routed (r3_client.integrations.verl.routed_agent_loop); pass rollout_ids"
            )
        rollout_ids = list(stored)
    ids = list(rollout_ids)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} rollout ids for a batch of {n} samples")
    first: dict[str, int] = {}
    for i, key in enumerate(ids):
        if not key:
            raise ValueError(
                f"verl sample {i} has no rollout id: its agent loop is not routed "
                "(r3_client.integrations.verl.routed_agent_loop)"
            )
        check_rollout_id(key)
        if key in first:
            raise ValueError(f"verl samples {first[key]} and {i} share rollout id {key!r}")
        first[key] = i
    return ids


def _fit(
    routing: Routing, tokens: Any, response: int, response_len: int, i: int, key: str
) -> Routing:
    """The rollout's rows for sample ``i`` (``tokens``: its prompt and response ids).

    A rollout with more rows is cut only where verl cut the response at
    ``response_len`` (``tool_agent_loop.py:195, 205-209``); a segment whose tokens are the
    sample's is checked against its digest.
    """
    want = len(tokens) - 1
    have = routing.num_rows
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
    if have == want:
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
    view: ViewPolicy = "generated",
) -> Any:
    """Set ``data.batch["routed_experts"]`` (a verl ``DataProto``) from the cache; return ``data``.

    Call it on the rollout's ``DataProto`` before ``compute_log_prob`` (or use
    :class:`RoutedRolloutManager`).  ``rollout_ids``: one per sample in batch order
    (default: ``data.non_tensor_batch["r3_rollout_id"]``, set by
    :class:`RoutedAgentLoop`).  ``num_layers``: the model's ``num_hidden_layers``.
    The tensor is :func:`~r3_client.layouts.verl_layout` of the rollouts, int16 ``[bs,
    prompt_len + response_len, num_layers, K]`` on ``attention_mask``'s device, with
    each sample's prompt and response lengths from ``attention_mask``.  ``view``:
    ``"generated"`` (each position's first computation; one streamed ``get_many``) or
    ``"latest"`` (what each rollout's last call attended to, verl#6054's answer; one
    ``get(view="latest")`` per sample); docs/integrations.md.

    Raises :class:`~r3_client.RolloutNotFoundError` for a rollout the cache does not
    hold and :class:`~r3_client.ShapeError` (naming the sample and rollout) for one that
    does not hold a row per token but the last, holds rows nobody shipped (unless
    ``missing="fill"``) or rows computed from other tokens; ``data`` is unchanged then.
    """
    import torch

    policy = one_routing_policy(view, "verl")
    ids = _rollout_ids(data, rollout_ids)
    mask = data.batch["attention_mask"]
    input_ids = data.batch["input_ids"]
    plen = int(data.batch["prompts"].shape[1])
    rlen = int(data.batch["responses"].shape[1])
    prompt_lens = mask[:, :plen].sum(dim=1).tolist()
    response_lens = mask[:, plen:].sum(dim=1).tolist()
    tokens = input_ids.cpu().numpy()
    routings: list[Routing] = []
    fetched = (
        client.get_many(ids)
        if policy == "generated"
        else ((key, client.get(key, view=policy)) for key in ids)  # the stream has no views
    )
    for i, (key, routing) in enumerate(fetched):
        assert isinstance(routing, Routing)  # errors raise: return_errors is off
        p, r = prompt_lens[i], response_lens[i]
        routings.append(_fit(routing, tokens[i, plen - p : plen + r], r, rlen, i, key))
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
    data.batch["routed_experts"] = torch.from_numpy(routed).to(mask.device)
    return data


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
        raise ValueError(
            "the batch carries batch['routed_experts'] (inline routing replay?): in the "
            "rank-local mode verl's workers replay the cache's rows, not this tensor; "
            "drop it or use attach_routed_experts"
        )
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
    # As attach_routed_experts' _fit: more rows only where verl cut the response.
    found = check_step(
        source,
        ids,
        [len(t) for t in tokens],
        missing=missing,
        tokens=tokens,
        longer=[int(r) >= rlen for r in response_lens],
        view=view,
    )
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
    of the fetch (:func:`attach_routed_experts`).  With ``rank_local=True`` it applies
    :func:`check_rank_local_batch` instead (``num_layers`` unused, ``view`` left at its
    default: the driver fetches nothing, each rank chooses its policy where it reads,
    :func:`~r3_client.rank_local.fetch_verl_rank_slice`'s ``view``; another one is
    refused, :class:`~r3_client.InvalidRequestError`) and the workers replay through
    :class:`RankLocalReplay`.  Every other attribute is the wrapped manager's.
    """

    def __init__(
        self,
        manager: Any,
        client: RoutingClient,
        *,
        num_layers: int | None = None,
        missing: Missing = "raise",
        view: ViewPolicy = "generated",
        rank_local: bool = False,
    ) -> None:
        self.wrapped = manager
        self.client = client
        self.num_layers = num_layers
        self.missing: Missing = missing
        self.view: ViewPolicy = one_routing_policy(view, "verl")
        self.rank_local = rank_local
        if rank_local and self.view != "generated":
            raise InvalidRequestError(
                f"rank_local=True: view={view!r} is the policy of the driver's fetch, which "
                "the rank-local mode does not make; each rank chooses its policy where it "
                "reads its slice (RankLocalReplay, fetch_verl_rank_slice(view=...))"
            )
        if not rank_local and num_layers is None:
            raise TypeError("num_layers (the model's num_hidden_layers) is required")

    def generate_sequences(self, prompts: Any) -> Any:
        """The wrapped manager's batch, with ``routed_experts`` (or checked ids) for
        training batches."""
        out = self.wrapped.generate_sequences(prompts)
        if prompts.meta_info.get("validate", False):
            return out
        if self.rank_local:
            return check_rank_local_batch(out, self.client, missing=self.missing)
        assert self.num_layers is not None
        return attach_routed_experts(
            out, self.client, num_layers=self.num_layers, missing=self.missing, view=self.view
        )

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)
