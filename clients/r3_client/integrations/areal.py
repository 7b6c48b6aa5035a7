"""AReaL 1.0.4: requests tagged by rollout id, ``ModelResponse.routed_experts`` from the cache.

AReaL builds each SGLang request in ``SGLangBackend.build_generation_request``
(``areal/engine/sglang_remote.py:44-90``), which ``RemoteSGLangEngine`` holds as
``engine._engine.backend``.  :func:`install` wraps that backend (once; installing
again is harmless) so every request carries ``custom_params.r3`` with its rollout id
and AReaL's weight version, and no ``return_routed_experts``.  AReaL resumes a request
aborted for a weight update with the same ``ModelRequest`` (``input_ids`` += output so
far), so the resumed call carries the same id and the engine stores only the new
rows, under the new version.  The id is :func:`rollout_id`: ``req.metadata[
"r3_rollout_id"]`` where set (one id for a multi-turn episode's turns), else
``req.rid`` (the built-in workflows make one per sample).

Trainer side, :func:`fill_routed_experts` sets ``ModelResponse.routed_experts`` as
AReaL's remote engine fills it from inline routing today, ``int32 [prompt + completion
- 1, num_layers * K]`` over all of SGLang's ``num_hidden_layers`` (dense layers ``0``),
which its Megatron replay (PR #1207) consumes -- one row per token, also after a
resume.  :class:`RoutedEngine` does both around ``agenerate``, so an unchanged
workflow gets filled responses::

    class R3RLVRWorkflow(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            engine = RoutedEngine(engine, client, num_layers=hf_config.num_hidden_layers)
            return await super().arun_episode(engine, data)

**Rank-local mode** (AReaL's Megatron R3, PR inclusionAI/AReaL#1207, read at commit
``a9f0b0400e8937242e0994e6a10ec271b75dba06``): the rollout carries a key per sample instead
of routing (:class:`KeyedEngine`, :func:`with_rollout_keys`: a per-token ``int64`` column
``r3_key`` that AReaL's batching splits, reorders, packs and pads like ``input_ids``), the
trainer checks the step once (:func:`check_areal_step`), and each training rank, for each
micro-batch, reads only its rows of its stage's layers and gets exactly what the PR's
``set_router_replay_data`` sets on that rank (:func:`fetch_areal_rank_targets`,
:func:`areal_micro_batch`, :func:`set_router_targets`); docs/integrations.md.

Nothing here imports AReaL: its objects are used by the attributes named above.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import InvalidRequestError, ShapeError, UsageError
from r3_client._routing import Routing, check_rollout_id
from r3_client._views import ViewPolicy, check_policy
from r3_client.expansion import Expansion, expand_states
from r3_client.integrations._samples import exact_routing
from r3_client.integrations.tags import tag_generate
from r3_client.layouts import Missing, RankPlan, miles_layout
from r3_client.layouts._packing import check_rank, row_runs, sp_part, zigzag_positions
from r3_client.rank_local import (
    RangeSource,
    StatSource,
    StepCheck,
    check_step,
    count_replay,
    fetch_plan_rows,
)

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient

__all__ = [
    "KEY_FIELD",
    "ORIGIN_FIELD",
    "ROLLOUT_ID_KEY",
    "STATE_FIELD",
    "ArealMicroBatch",
    "ArealReplayTargets",
    "ExactPPOActor",
    "KeyedEngine",
    "RoutedEngine",
    "TaggingBackend",
    "areal_micro_batch",
    "areal_rank_plan",
    "check_areal_expansion_modes",
    "check_areal_step",
    "expand_areal_batch",
    "fetch_areal_rank_targets",
    "fill_routed_experts",
    "gather_by_state",
    "install",
    "key_rollout_id",
    "new_rollout_key",
    "rollout_id",
    "routed_experts",
    "set_router_targets",
    "stage_moe_layers",
    "step_rollouts",
    "with_rollout_keys",
]

#: ``ModelRequest.metadata`` key naming the rollout when ``rid`` should not.
ROLLOUT_ID_KEY = "r3_rollout_id"


def rollout_id(req: Any) -> str:
    """The rollout a ``ModelRequest`` belongs to: ``req.metadata["r3_rollout_id"]`` if
    set, else ``req.rid``."""
    metadata = getattr(req, "metadata", None) or {}
    return check_rollout_id(metadata.get(ROLLOUT_ID_KEY) or req.rid)


class TaggingBackend:
    """An AReaL SGLang backend whose generation requests are tagged by rollout id.

    Wraps the engine's backend; every other method is the wrapped one's.
    """

    def __init__(self, backend: Any, *, share_prompt: bool | None = None) -> None:
        self.wrapped = backend
        self.share_prompt = share_prompt

    def build_generation_request(self, req: Any, with_lora: bool, version: int) -> Any:
        """The wrapped backend's request, tagged with :func:`rollout_id` and ``version``
        as the weight version, without inline routing.

        Also removes ``req.metadata["return_routed_experts"]`` (``req`` is
        ``agenerate``'s own copy), which AReaL's loop reads to require inline routing
        in every answer (``remote_inf_engine.py:886-894``).
        """
        http_req = self.wrapped.build_generation_request(req, with_lora, version)
        req.metadata.pop("return_routed_experts", None)
        http_req.payload = tag_generate(
            http_req.payload,
            rollout_id(req),
            weight_version=str(version),
            share_prompt=self.share_prompt,
        )
        return http_req

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def install(engine: Any, *, share_prompt: bool | None = None) -> None:
    """Tag every generation request of ``engine`` (a ``RemoteSGLangEngine`` or the
    ``RemoteInfEngine`` it composes) by rollout id, from now on.

    Call it where the engine is used, e.g. at the top of a workflow's ``arun_episode``
    (rollout workers build their own engines).  Installing again replaces the options.
    Raises :class:`~r3_client.UsageError` when the engine holds no backend where AReaL 1.0.4
    keeps it.
    """
    inner = getattr(engine, "_engine", engine)
    backend = getattr(inner, "backend", None)
    if not hasattr(backend, "build_generation_request"):
        raise UsageError(
            f"{type(engine).__name__} has no backend with build_generation_request where "
            "AReaL 1.0.4 keeps it (RemoteSGLangEngine._engine.backend, "
            "RemoteInfEngine.backend)"
        )
    if isinstance(backend, TaggingBackend):
        backend.share_prompt = share_prompt
    else:
        inner.backend = TaggingBackend(backend, share_prompt=share_prompt)


def routed_experts(
    routing: Routing, num_tokens: int, *, num_layers: int, missing: Missing = "raise"
) -> npt.NDArray[np.int32]:
    """AReaL's ``routed_experts`` for a sequence of ``num_tokens`` tokens:
    ``int32 [num_tokens - 1, num_layers * K]``, MoE layers at their ids, dense ``0``.

    Raises :class:`~r3_client.ShapeError` when the routing's rows are not
    ``num_tokens - 1`` or some were never shipped (unless ``missing="fill"``).
    """
    rows = miles_layout(routing, num_tokens, num_layers=num_layers, missing=missing)
    return rows.reshape(rows.shape[0], rows.shape[1] * rows.shape[2])


async def fill_routed_experts(
    response: Any,
    client: AsyncRoutingClient,
    rollout_id: str,
    *,
    num_layers: int,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
) -> None:
    """Set ``response.routed_experts`` (a ``ModelResponse``) from the rollout stored
    under ``rollout_id``, once its ``agenerate`` has returned.

    ``num_layers``: the model's ``num_hidden_layers``.  ``view``: ``"exact"`` (the
    default: the rows its tokens attended to; a response whose tokens span several routing
    states, a resume after a push, is refused rather than filled with one of them), or by
    name ``"generated"`` (each position's first computation: what AReaL's inline
    concatenation holds) or ``"latest"`` (what the last resume attended to);
    docs/integrations.md.  Raises
    :class:`~r3_client.RolloutNotFoundError` when the rollout is not stored and
    :class:`~r3_client.ShapeError` when it does not hold exactly one row per token but
    the last of ``input_tokens + output_tokens``.  Under a named policy the fill is
    counted as a step of one sample (:func:`r3_client.rank_local.count_replay`, one stat):
    the tokens it replays off their own state, warned about.
    """
    num_tokens = len(response.input_tokens) + len(response.output_tokens)
    policy = check_policy(view)
    if policy == "exact":
        who = f"AReaL response of rollout {rollout_id!r}"
        routing = await exact_routing(client, rollout_id, num_tokens, None, who)
    else:
        routing = await client.get(rollout_id, view=policy)
    try:
        rows = routed_experts(routing, num_tokens, num_layers=num_layers, missing=missing)
    except ShapeError as exc:
        raise ShapeError(f"AReaL response of rollout {rollout_id!r}: {exc}") from exc
    if policy != "exact":  # a named policy is counted where it is chosen
        count_replay(await client.stat_many([rollout_id]), [num_tokens], policy)
    response.routed_experts = rows


class RoutedEngine:
    """An AReaL engine whose ``agenerate`` tags requests and fills ``routed_experts``.

    Wraps a ``RemoteSGLangEngine`` (every other attribute is the engine's); pass it
    where a workflow takes its engine.  Each ``agenerate`` calls :func:`install` first.
    ``view``: the policy of the fetch (:func:`fill_routed_experts`).
    """

    def __init__(
        self,
        engine: Any,
        client: AsyncRoutingClient,
        *,
        num_layers: int,
        share_prompt: bool | None = None,
        missing: Missing = "raise",
        view: ViewPolicy = "exact",
    ) -> None:
        self.engine = engine
        self.client = client
        self.num_layers = num_layers
        self.share_prompt = share_prompt
        self.missing: Missing = missing
        self.view: ViewPolicy = check_policy(view)

    async def agenerate(self, req: Any) -> Any:
        """``engine.agenerate(req)`` with ``req`` tagged (resumes included) and the
        response's ``routed_experts`` fetched once, after the last resume."""
        install(self.engine, share_prompt=self.share_prompt)
        key = rollout_id(req)
        response = await self.engine.agenerate(req)
        await fill_routed_experts(
            response,
            self.client,
            key,
            num_layers=self.num_layers,
            missing=self.missing,
            view=self.view,
        )
        return response

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


# --------------------------------------------------------------------------------------------
# Rank-local mode for AReaL's Megatron R3 (PR inclusionAI/AReaL#1207, commit a9f0b0400e89).
# Paths and lines below are that commit's.
# --------------------------------------------------------------------------------------------

#: The per-token batch column carrying each sample's rollout key (:func:`with_rollout_keys`).
KEY_FIELD = "r3_key"
#: The per-token column :func:`expand_areal_batch` adds: each expanded sample's state (its
#: first row), which :func:`areal_micro_batch` reads back on the ranks.
STATE_FIELD = "r3_state"
#: The ``[B]`` column :func:`expand_areal_batch` adds: the original each sample was cut from.
ORIGIN_FIELD = "r3_origin"

_KEY_LIMIT = 1 << 63


def new_rollout_key() -> int:
    """A fresh random rollout key: an int in ``[1, 2**63)`` (``0`` is AReaL's padding)."""
    return secrets.randbelow(_KEY_LIMIT - 1) + 1


def key_rollout_id(key: int | np.integer[Any]) -> str:
    """The rollout id stored under ``key``: ``"areal-"`` and 16 hex digits."""
    if isinstance(key, bool) or not isinstance(key, int | np.integer) or not 0 < key < _KEY_LIMIT:
        raise ShapeError(
            f"rollout key {key!r} is not an int in [1, 2**63): a sample without a key "
            f"(no {KEY_FIELD!r} column from with_rollout_keys, or a padding row)"
        )
    return f"areal-{int(key):016x}"


class KeyedEngine:
    """Rollout side of the rank-local mode: each ``agenerate`` gets a fresh key, is tagged
    with its rollout id (:func:`key_rollout_id`) and carries no routing back.

    Wraps a ``RemoteSGLangEngine`` for one episode; ``keys`` lists the keys in call order,
    for :func:`with_rollout_keys`.  AReaL resumes an aborted request with the same request
    (``remote_inf_engine.py`` copies it once, metadata included), so a resume keeps its id.
    """

    def __init__(self, engine: Any, *, share_prompt: bool | None = None) -> None:
        self.engine = engine
        self.share_prompt = share_prompt
        self.keys: list[int] = []

    async def agenerate(self, req: Any) -> Any:
        """``engine.agenerate(req)`` tagged with a fresh key's rollout id."""
        install(self.engine, share_prompt=self.share_prompt)
        key = new_rollout_key()
        if req.metadata is None:
            req.metadata = {}
        req.metadata[ROLLOUT_ID_KEY] = key_rollout_id(key)
        self.keys.append(key)
        return await self.engine.agenerate(req)

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


def with_rollout_keys(result: dict[str, Any], keys: Sequence[int]) -> dict[str, Any]:
    """``result`` (a workflow's ``[B, S]`` tensor dict) with ``result["r3_key"]``: ``int64
    [B, S]``, row ``b`` all ``keys[b]``.

    A per-token column, so AReaL moves it with the sample wherever it moves ``input_ids``:
    concatenation (right padding with ``0``), the DP split, the mini- and micro-batch
    splits and their reordering (``split_padded_tensor_dict_into_mb_list`` splits every
    tensor of ``B * S`` elements, ``areal/utils/data.py``), packing and padding.  One key
    per row: the workflow must issue one ``agenerate`` per row (RLVR does).
    """
    import torch  # lazy: AReaL's batches are torch tensors

    ids = result["input_ids"]
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    if len(keys) != rows:
        raise ShapeError(f"{len(keys)} rollout keys for a result of {rows} rows")
    for k in keys:
        key_rollout_id(k)
    col = torch.tensor([int(k) for k in keys], dtype=torch.int64)
    out = dict(result)
    out[KEY_FIELD] = col[:, None].expand(rows, width).contiguous()
    return out


def _np(x: Any) -> npt.NDArray[Any]:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def step_rollouts(batch: dict[str, Any]) -> tuple[list[str], npt.NDArray[np.int64]]:
    """A step's (or mini-batch's) rollout ids and token counts, from its ``[B, S]`` batch:
    ``r3_key[:, 0]`` (samples are right-padded) and ``attention_mask.sum(1)``."""
    keys = _np(batch[KEY_FIELD])
    mask = _np(batch["attention_mask"])
    if keys.ndim != 2 or keys.shape != mask.shape:
        raise ShapeError(
            f"{KEY_FIELD!r} has shape {keys.shape}, attention_mask {mask.shape}: expected "
            "the same [B, S] (a batch before packing)"
        )
    return [key_rollout_id(k) for k in keys[:, 0]], mask.sum(axis=1).astype(np.int64)


def check_areal_step(
    source: StatSource,
    batch: dict[str, Any],
    *,
    missing: Missing = "raise",
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on an AReaL batch (:func:`step_rollouts`):
    call it on the trainer before ``compute_logp`` / ``ppo_update`` dispatch the batch.
    ``view`` / ``states``: the policy the ranks replay under and, under ``exact``, each
    sample's state; returns the :class:`~r3_client.rank_local.StepCheck` (tokens replayed
    off their own state)."""
    ids, num_tokens = step_rollouts(batch)
    return check_step(source, ids, num_tokens, missing=missing, view=view, states=states)


def check_areal_expansion_modes(config: Any) -> None:
    """Refuse an AReaL ``PPOActorConfig`` whose loss changes when a sample is cut into its
    states (:func:`expand_areal_batch`); call it once, before the first step.

    AReaL 1.0.4's actor loss is token-level (``grpo_loss_fn``: per-token ratios under
    ``loss_mask``, each micro-batch weighted by ``loss_mask.count_nonzero()``,
    ``areal/trainer/ppo/actor.py:340-363``), so a partition of each sample's trained tokens
    leaves it unchanged.  Refused, naming the setting: ``importance_sampling_level=
    "sequence"`` (GSPO: one geometric-mean ratio per sequence, ``functional.py:501``; an
    expanded sample would get its own) and ``rejection_sampling.level="sequence"`` (one
    filter decision per sequence).  The alternative: ``"token"``, or replay one state by
    naming ``view="latest"``/``"generated"`` (counted by :func:`check_areal_step`).
    """
    level = getattr(config, "importance_sampling_level", "token")
    if level != "token":
        raise InvalidRequestError(
            f"AReaL importance_sampling_level={level!r} takes one ratio per sequence, which "
            "an expanded sample would take over its own tokens only: use 'token', or replay "
            "one routing per sample with view='latest' / 'generated' (counted, not exact)"
        )
    rs = getattr(config, "rejection_sampling", None)
    rs_level = getattr(rs, "level", "token") if rs is not None else "token"
    if rs_level != "token":
        raise InvalidRequestError(
            f"AReaL rejection_sampling.level={rs_level!r} filters whole sequences, which an "
            "expanded sample would filter by its own tokens only: use level='token', or "
            "replay one routing per sample with view='latest' / 'generated'"
        )


def _rows(value: Any, count: int) -> bool:
    return (
        getattr(value, "shape", None) is not None
        and len(value.shape) >= 1
        and (int(value.shape[0]) == count)
    )


def expand_areal_batch(
    source: StatSource,
    batch: dict[str, Any],
    *,
    expansion: Expansion | None = None,
    rolled: bool = False,
) -> tuple[dict[str, Any], Expansion]:
    """AReaL's padded ``[B, S]`` batch with each sample cut into one sample per routing state
    (:mod:`r3_client.expansion`), and the :class:`~r3_client.Expansion`.

    The samples are named by ``r3_key`` (:func:`step_rollouts`).  Every ``[B, ...]`` value
    is copied to each of its sample's states (``rewards``, ``versions``, ``logprobs``,
    ``advantages``, the keys); ``attention_mask`` keeps each
    state's first ``num_tokens`` tokens; ``loss_mask`` keeps only the tokens the state
    served (``rolled``: the mask is AReaL's after ``compute_advantages``, where position
    ``t`` stands for token ``t + 1``).  Adds ``r3_state`` (per token, the state's first
    row: :func:`areal_micro_batch` reads it on the ranks) and ``r3_origin`` (``[B']``).
    ``expansion``: reuse the one the first call returned (no stat).  One batched stat
    otherwise.

    Where in AReaL's step (``PPOTrainer``: ``compute_logp``, ``compute_advantages``,
    ``ppo_update``), docs/integrations.md: expand before ``compute_logp`` (each state's
    forward), bring its log-probs back to the originals (:func:`gather_by_state`), run
    ``compute_advantages`` on the originals (group statistics count each sample once),
    and expand that with ``expansion=..., rolled=True`` for ``ppo_update``.
    """
    if STATE_FIELD in batch:
        raise ShapeError(
            f"the batch is already expanded (it has {STATE_FIELD!r}): expand the originals"
        )
    ids, num_tokens = step_rollouts(batch)
    if expansion is None:
        expansion = expand_states(source, ids, num_tokens)
    elif expansion.num_samples != len(ids) or any(
        s.rollout_id != ids[s.origin] for s in expansion.states
    ):
        raise ShapeError(
            f"the expansion was made for {expansion.num_samples} other samples than this "
            f"batch's {len(ids)}: expand this batch itself"
        )
    b = len(ids)
    mask = batch["attention_mask"]
    width = int(mask.shape[1])
    out: dict[str, Any] = {k: expansion.take(v) if _rows(v, b) else v for k, v in batch.items()}
    keep = np.arange(width)[None, :] < expansion.num_tokens[:, None]
    served = expansion.token_masks(width, offset=1 if rolled else 0)
    state = np.repeat(np.asarray(expansion.state_rows, np.int64)[:, None], width, axis=1)
    origin = expansion.origin
    if hasattr(mask, "index_select"):
        import torch  # the batch is torch: so is what is added to it

        def like(a: npt.NDArray[Any], ref: Any) -> Any:
            return torch.as_tensor(a, device=ref.device)

        out["attention_mask"] = out["attention_mask"] * like(keep, mask).to(mask.dtype)
        if "loss_mask" in out:
            lm = out["loss_mask"]
            out["loss_mask"] = lm * like(served, lm).to(lm.dtype)
        out[STATE_FIELD] = like(state, mask)
        out[ORIGIN_FIELD] = like(origin, mask)
    else:
        out["attention_mask"] = np.asarray(out["attention_mask"]) * keep.astype(mask.dtype)
        if "loss_mask" in out:
            lm = np.asarray(out["loss_mask"])
            out["loss_mask"] = lm * served.astype(lm.dtype)
        out[STATE_FIELD] = state
        out[ORIGIN_FIELD] = origin
    return out, expansion


def gather_by_state(values: Any, expansion: Expansion, *, rolled: bool = True) -> Any:
    """Per-token ``values`` of an expanded batch (``[B', S]``: ``prox_logp`` from
    ``compute_logp``, entropies) back on the originals (``[B, S]``): each token's value from
    the state that served it, the rest from the original's last state (all its tokens).
    ``rolled``: position ``t`` holds token ``t + 1``'s value (AReaL's ``compute_logp``
    output); ``False``: token ``t``'s."""
    width = int(values.shape[1])
    served = expansion.token_masks(width, offset=1 if rolled else 0)
    last: dict[int, int] = {}
    for j, s in enumerate(expansion.states):
        last[s.origin] = j
    rows = [last[i] for i in range(expansion.num_samples)]
    if hasattr(values, "index_select"):
        import torch

        out = values[torch.as_tensor(rows, device=values.device)].clone()
        for j, s in enumerate(expansion.states):
            m = torch.as_tensor(served[j], device=values.device)
            out[s.origin][m] = values[j][m]
        return out
    arr = np.asarray(values)
    res = arr[rows].copy()
    for j, s in enumerate(expansion.states):
        res[s.origin][served[j]] = arr[j][served[j]]
    return res


class ExactPPOActor:
    """Mixin for AReaL 1.0.4's ``PPOActor`` (put it first) that replays every token in its
    routing state inside AReaL's own ``compute_logp`` and ``ppo_update``::

        class Actor(ExactPPOActor, PPOActor): ...
        actor = Actor(config.actor, engine)
        actor.r3_source = RoutingClient(cache_url, api_key=key)  # stats only

    ``compute_logp`` forwards the expanded batch (:func:`expand_areal_batch`) and returns
    each token's log-prob from the state that served it (:func:`gather_by_state`), so the
    trainer's ``compute_advantages`` runs on the original samples (group normalisation
    counts each once); ``ppo_update`` expands its (advantaged, rolled) batch again and
    trains that, after :func:`check_areal_expansion_modes`.  The ranks read each sample's
    state from ``r3_state`` (:func:`areal_micro_batch`).  AReaL cuts the update into
    ``ppo_n_minibatches`` token-balanced mini-batches (``split_padded_tensor_dict_into_mb_
    list``): with more than one, the optimizer steps group the expanded samples as AReaL
    balances them, each token still trained once, with its own routing.
    """

    r3_source: StatSource | None = None

    def _r3(self) -> StatSource:
        if self.r3_source is None:
            raise InvalidRequestError(
                "ExactPPOActor needs actor.r3_source (a RoutingClient) before the first step"
            )
        return self.r3_source

    def _compute_logp(self, data: dict[str, Any]) -> Any:
        """AReaL's, on the expanded batch; each token's log-prob from its own state."""
        expanded, expansion = expand_areal_batch(self._r3(), data)
        out = super()._compute_logp(expanded)  # type: ignore[misc]
        return None if out is None else gather_by_state(out, expansion)

    def _ppo_update(self, data: dict[str, Any]) -> None:
        """AReaL's, on the batch expanded after ``compute_advantages`` (rolled masks)."""
        check_areal_expansion_modes(self.config)  # type: ignore[attr-defined]
        expanded, _ = expand_areal_batch(self._r3(), data, rolled=True)
        super()._ppo_update(expanded)  # type: ignore[misc]


@dataclass(frozen=True)
class ArealMicroBatch:
    """One AReaL micro-batch as a rank sees it: its samples' rollout ids and token counts in
    packing order, the padded ``cu_seqlens`` the model runs on (with the batch-padding
    sequence when AReaL appended one), and each sample's state when the batch was expanded
    (:func:`expand_areal_batch`; ``None``: not expanded)."""

    rollout_ids: tuple[str, ...]
    seqlens: npt.NDArray[np.int64]
    cu_seqlens: npt.NDArray[np.int64]
    states: tuple[int, ...] | None = None


def areal_micro_batch(mb_item: Any, *, key_field: str = KEY_FIELD) -> ArealMicroBatch:
    """The :class:`ArealMicroBatch` of a ``MicroBatchItem`` (what ``iter(mb_list)`` yields in
    ``MegatronEngine.forward_backward_batch``, ``areal/utils/data.py:586-602``).

    Token counts from ``mb_item.old_cu_seqlens`` (the packed ``cu_seqlens`` before the
    per-sequence alignment, ``pad_packed_tensor_dict``, data.py:843), else
    ``orig_mb["cu_seqlens"]``; the padded ``cu_seqlens`` from ``padded_mb`` (what
    ``megatron_engine_r3_patch.py:218-250`` passes on); each sample's key at its first
    token of ``padded_mb[key_field]``; each sample's state from ``r3_state`` when the batch
    was expanded (pass ``mb.states`` to :func:`fetch_areal_rank_targets`).
    """
    padded = mb_item.padded_mb
    cu = _np(padded["cu_seqlens"]).astype(np.int64).reshape(-1)
    old = getattr(mb_item, "old_cu_seqlens", None)
    if old is None:
        old = mb_item.orig_mb["cu_seqlens"]
    seqlens = np.diff(_np(old).astype(np.int64).reshape(-1))
    n = int(seqlens.shape[0])
    if key_field not in padded:
        raise ShapeError(
            f"the micro-batch has no {key_field!r} column: the workflow did not add rollout "
            "keys (with_rollout_keys)"
        )
    keys = _np(padded[key_field]).reshape(-1)
    if cu.shape[0] not in (n + 1, n + 2) or int(cu[-1]) != keys.shape[0]:
        raise ShapeError(
            f"padded cu_seqlens {cu.tolist()} do not fit {n} samples and "
            f"{keys.shape[0]} packed tokens"
        )
    ids = []
    for i in range(n):
        try:
            ids.append(key_rollout_id(keys[cu[i]]))
        except ShapeError as exc:
            raise ShapeError(f"micro-batch sample {i}: {exc}") from exc
    states = None
    if STATE_FIELD in padded:
        column = _np(padded[STATE_FIELD]).reshape(-1)
        if column.shape[0] != keys.shape[0]:
            raise ShapeError(
                f"{STATE_FIELD!r} has {column.shape[0]} packed tokens, {key_field!r} "
                f"{keys.shape[0]}"
            )
        states = tuple(int(column[cu[i]]) for i in range(n))
    return ArealMicroBatch(tuple(ids), seqlens, cu, states)


def areal_rank_plan(
    seqlens: Sequence[int] | npt.ArrayLike,
    cu_seqlens: Sequence[int] | npt.ArrayLike,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> RankPlan:
    """The rows one rank's routers replay for an AReaL micro-batch, from lengths alone.

    ``cu_seqlens``: the padded micro-batch's (``padded_mb["cu_seqlens"]``: each sample padded
    to a multiple of ``tp*cp*2`` when ``cp > 1`` else ``tp``, then possibly one
    batch-padding sequence); ``seqlens``: the samples' token counts.  As
    ``router_replay_utils.set_router_replay_data`` lays them out: sample ``i``'s token ``t``
    at ``cu[i] + t`` (:246-315), the CP split of ``split_packed_seqs_for_context_parallel``
    (Megatron's zigzag: chunks ``r`` and ``2cp-1-r`` of ``2cp`` per sequence,
    ``packed_context_parallel.py:91-114``; router_replay_utils.py:355-366), then, whenever
    ``tp > 1``, ``scatter_to_sequence_parallel_region`` (``tp`` equal contiguous parts,
    :369-381).  Row ``t`` of the rollout replays token ``t`` for ``t < seqlens[i] - 1``.
    """
    check_rank(tp_size, tp_rank, "tp")
    check_rank(cp_size, cp_rank, "cp")
    tokens = _np(seqlens).astype(np.int64).reshape(-1)
    cu = _np(cu_seqlens).astype(np.int64).reshape(-1)
    n = int(tokens.shape[0])
    if n < 1 or cu.shape[0] not in (n + 1, n + 2) or cu[0] != 0:
        raise ShapeError(
            f"cu_seqlens {cu.tolist()} are not the padded cu_seqlens of {n} samples "
            "(n + 1 entries, or n + 2 with AReaL's batch-padding sequence, from 0)"
        )
    padded = np.diff(cu)
    if (padded[:n] < tokens).any() or (tokens < 0).any() or (padded < 0).any():
        raise ShapeError(f"seqlens {tokens.tolist()} do not fit in cu_seqlens {cu.tolist()}")
    align = tp_size * cp_size * 2 if cp_size > 1 else tp_size  # megatron_engine_r3_patch.py:333
    if (padded % align).any():
        # AReaL refuses such a batch itself (packed_context_parallel.py:31-37).
        raise ShapeError(
            f"padded lengths {padded.tolist()} are not multiples of {align} "
            f"(tp_size={tp_size}, cp_size={cp_size}), as AReaL's _prepare_mb_list pads them"
        )
    # The batch-padding sequence (if any) has no tokens of a sample: no rows.
    rows_of = np.concatenate([tokens, np.zeros(padded.shape[0] - n, np.int64)])
    positions = zigzag_positions(cu, padded, cp_size, cp_rank)
    if tp_size > 1:
        positions = sp_part(positions, tp_size, tp_rank, "pad as AReaL does")
    return RankPlan(cu, tokens, positions, row_runs(cu, rows_of, positions))


@dataclass(frozen=True)
class ArealReplayTargets:
    """What AReaL's ``set_router_replay_data`` hands each of a rank's routers, for one micro-batch.

    ``per_layer``   one ``int64 [local_tokens, K]`` array (or tensor) per local MoE layer,
                    ascending (the order of ``RouterReplay`` instances on the stage):
                    the recorded experts, ``0`` where there is none (router_replay_utils.py:440).
    ``valid_mask``  one ``bool [local_tokens]`` per layer: ``True`` where the rollout has a
                    row (replayed), ``False`` on each sample's last token, alignment and
                    batch padding, and rows nobody shipped under ``missing="fill"``: the
                    patched router routes those live (router_replay_patch.py:262-272).
    ``layer_ids``   the absolute MoE layer ids of ``per_layer``.
    ``cu_seqlens``  the padded micro-batch's ``cu_seqlens``; ``seqlens``: token counts;
    ``positions``   each local token's index in the padded micro-batch.
    """

    per_layer: list[Any]
    valid_mask: list[Any]
    layer_ids: tuple[int, ...]
    cu_seqlens: npt.NDArray[np.int64]
    seqlens: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    rollout_ids: tuple[str, ...]

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see."""
        return int(self.positions.shape[0])


def fetch_areal_rank_targets(
    source: RangeSource,
    rollout_ids: Sequence[str],
    *,
    seqlens: Sequence[int] | npt.ArrayLike,
    cu_seqlens: Sequence[int] | npt.ArrayLike,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    stage_layers: Sequence[int] | None = None,
    missing: Missing = "raise",
    as_torch: bool = False,
    view: ViewPolicy = "exact",
    states: Sequence[int | None] | None = None,
) -> ArealReplayTargets:
    """One rank's :class:`ArealReplayTargets` for one AReaL micro-batch, read for that rank alone.

    Equal, router by router, to what ``set_router_replay_data`` (router_replay_utils.py:206-443)
    sets from AReaL's inline ``routed_experts`` of the same rollouts: the rank's rows
    (:func:`areal_rank_plan`) of ``stage_layers`` (absolute MoE layer ids the rank's routers
    own, :func:`stage_moe_layers`; default every layer the rollouts hold; ``()``: a stage of
    dense layers, nothing fetched) are read through ``source`` and decoded, nothing else.
    ``rollout_ids``, ``seqlens``: the micro-batch's samples in packing order
    (:func:`areal_micro_batch`).  Raises as :func:`~r3_client.rank_local.fetch_megatron_rank_batch`
    does; ``missing="fill"`` marks rows nobody shipped invalid (routed live, as AReaL treats
    rows it has no routing for).  ``as_torch``: CPU torch tensors.

    ``view``: the policy every read is made under (docs/store.md, "Views"); under
    ``"exact"`` (the default) ``states`` names each sample's state (its first row; ``None``:
    ``0``; :func:`r3_client.expand_states` gives them, ``Expansion.state_rows``), and a
    sample whose rows span several states is refused
    (:class:`~r3_client.InvalidRequestError`, "expand the sample") rather than replayed
    with one of them.
    """
    ids = tuple(check_rollout_id(r) for r in rollout_ids)
    plan = areal_rank_plan(
        seqlens, cu_seqlens, tp_size=tp_size, tp_rank=tp_rank, cp_size=cp_size, cp_rank=cp_rank
    )
    layers = None if stage_layers is None else tuple(sorted(int(x) for x in stage_layers))
    local, layer_ids = fetch_plan_rows(source, list(ids), plan, layers, missing, -1, view, states)
    valid: npt.NDArray[np.bool_] = np.asarray((local >= 0).all(axis=2))  # [L, local_tokens]
    local[local < 0] = 0
    per_layer: list[Any] = [local[j] for j in range(local.shape[0])]
    masks: list[Any] = [valid[j] for j in range(valid.shape[0])]
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
        masks = [torch.from_numpy(np.ascontiguousarray(m)) for m in masks]
    return ArealReplayTargets(
        per_layer=per_layer,
        valid_mask=masks,
        layer_ids=layer_ids,
        cu_seqlens=plan.cu_seqlens,
        seqlens=plan.seqlens,
        positions=plan.positions,
        rollout_ids=ids,
    )


def stage_moe_layers(
    start: int, end: int, moe_layer_freq: int | Sequence[int] | None = None
) -> tuple[int, ...]:
    """The MoE layers among decoder layers ``[start, end)``, by AReaL's ``is_moe_layer``
    (router_replay_utils.py:109-122: every layer when ``moe_layer_freq`` is ``None``,
    ``i % freq == 0`` for an int, ``freq[i] == 1`` for a list).  ``start``/``end``: the
    rank's layer range, ``get_current_rank_layer_info(tf_config)`` (:146-161)."""
    if moe_layer_freq is None:
        return tuple(range(start, end))
    if isinstance(moe_layer_freq, int):
        return tuple(i for i in range(start, end) if i % moe_layer_freq == 0)
    return tuple(i for i in range(start, end) if moe_layer_freq[i] == 1)


def set_router_targets(
    routers: Sequence[Any], targets: ArealReplayTargets, *, device: Any = None
) -> None:
    """Hand each of a rank's ``RouterReplay`` instances (ascending layers, e.g.
    ``RouterReplayHelper.get_micro_batch_router_list(tf_config)``) its targets and mask, as
    ``router.set_target_indices(slab, valid_mask=mask)`` (router_replay_utils.py:441).

    Raises :class:`~r3_client.ShapeError` when the counts differ (AReaL warns and skips).
    """
    import torch  # lazy

    if len(routers) != len(targets.per_layer):
        raise ShapeError(
            f"{len(routers)} routers on this rank but targets for {len(targets.per_layer)} MoE "
            f"layers {list(targets.layer_ids)}: pass stage_layers= the rank's MoE layers"
        )
    for router, slab, mask in zip(routers, targets.per_layer, targets.valid_mask, strict=True):
        t = torch.as_tensor(slab, dtype=torch.int64)
        m = torch.as_tensor(mask, dtype=torch.bool)
        router.set_target_indices(t.to(device), valid_mask=m.to(device))
