"""AReaL rollout side (the workflows on AReaL's rollout workers): each request tagged by
rollout id on its way to SGLang, and either the response's ``routed_experts`` filled from
the cache once ``agenerate`` returns (:class:`RoutedEngine`) or, in the rank-local mode, a
key per sample carried in the batch instead of routing (:class:`KeyedEngine`,
:func:`with_rollout_keys`).  The package docstring says how.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError, UsageError
from r3_client._routing import Routing, check_rollout_id
from r3_client._views import ViewPolicy, check_policy
from r3_client.integrations.areal._keys import KEY_FIELD, key_rollout_id, new_rollout_key
from r3_client.integrations.samples.rollout import exact_routing
from r3_client.integrations.tags import tag_generate
from r3_client.layouts import Missing, miles_layout
from r3_client.rank_local import count_replay

if TYPE_CHECKING:
    from r3_client._async_client import AsyncRoutingClient

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


# Rank-local mode for AReaL's Megatron R3 (PR inclusionAI/AReaL#1207, commit a9f0b0400e89):
# the rollout carries a key per sample, no routing.


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
