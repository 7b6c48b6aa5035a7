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

Nothing here imports AReaL: its objects are used by the attributes named above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import Routing, check_rollout_id
from r3_client._views import ViewPolicy, one_routing_policy
from r3_client.integrations.tags import tag_generate
from r3_client.layouts import Missing, miles_layout

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient

__all__ = [
    "ROLLOUT_ID_KEY",
    "RoutedEngine",
    "TaggingBackend",
    "fill_routed_experts",
    "install",
    "rollout_id",
    "routed_experts",
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
    Raises TypeError when the engine holds no backend where AReaL 1.0.4 keeps it.
    """
    inner = getattr(engine, "_engine", engine)
    backend = getattr(inner, "backend", None)
    if not hasattr(backend, "build_generation_request"):
        raise TypeError(
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
    view: ViewPolicy = "generated",
) -> None:
    """Set ``response.routed_experts`` (a ``ModelResponse``) from the rollout stored
    under ``rollout_id``, once its ``agenerate`` has returned.

    ``num_layers``: the model's ``num_hidden_layers``.  ``view``: ``"generated"`` (each
    position's first computation: what AReaL's inline concatenation holds) or
    ``"latest"`` (what the last resume attended to); docs/integrations.md.  Raises
    :class:`~r3_client.RolloutNotFoundError` when the rollout is not stored and
    :class:`~r3_client.ShapeError` when it does not hold exactly one row per token but
    the last of ``input_tokens + output_tokens``.
    """
    num_tokens = len(response.input_tokens) + len(response.output_tokens)
    routing = await client.get(rollout_id, view=one_routing_policy(view, "AReaL"))
    try:
        response.routed_experts = routed_experts(
            routing, num_tokens, num_layers=num_layers, missing=missing
        )
    except ShapeError as exc:
        raise ShapeError(f"AReaL response of rollout {rollout_id!r}: {exc}") from exc


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
        view: ViewPolicy = "generated",
    ) -> None:
        self.engine = engine
        self.client = client
        self.num_layers = num_layers
        self.share_prompt = share_prompt
        self.missing: Missing = missing
        self.view: ViewPolicy = one_routing_policy(view, "AReaL")

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
