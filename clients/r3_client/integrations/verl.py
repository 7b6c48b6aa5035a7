"""verl 0.9.1: agent-loop trajectories tagged by rollout id, ``routed_experts`` from the cache.

Rollout side.  verl's agent loops call SGLang in-process, never over HTTP: an agent
loop's ``self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
(``LLMServerClient``, ``workers/rollout/llm_server.py:99-163``) reaches
``SGLangHttpServer.generate`` (``workers/rollout/sglang_rollout/async_sglang_server.py:546``),
which puts the ``sampling_params`` it was given into a ``GenerateReqInput`` and calls
``tokenizer_manager.generate_request`` (:625-657), where the plugin reads the tag.  So
the tag travels in ``sampling_params["custom_params"]["r3"]``; the ``X-SMG-Routing-Key``
header has no HTTP request to ride on.  :class:`RoutedAgentLoop` gives each ``run`` of
an agent loop (one trajectory: verl builds one agent loop per sample,
``agent_loop.py:682-694``) a fresh rollout id and tags every ``generate`` it makes with
it, so a multi-turn trajectory's turns, and the resumes of
``FullyAsyncLLMServerClient`` (``llm_server.py:289-345``), continue one rollout.  The id
is ``f"{prefix}.{uuid4().hex}"``: unique per trajectory whatever verl's own request ids
are (``det-{priority}`` under ``full_determinism``).  It comes back in the trajectory's
``extra_fields``, which verl turns into ``non_tensor_batch["r3_rollout_id"]``
(``agent_loop.py:1129-1135``), so it follows its sample through ``union``, balancing
and slicing.  Install it by verl's agent-loop config file (:func:`routed_agent_loop`)::

    # actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: r3_single_turn_agent
      _target_: r3_client.integrations.verl.routed_agent_loop
      agent_loop: verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop

or as the first base of an agent loop class of your own.  Inline routing stays off:
``rollout.enable_rollout_routing_replay=False`` (checked on each ``run``).

Trainer side, :func:`attach_routed_experts` fetches the batch's rollouts (one streamed
``get_many``) into ``data.batch["routed_experts"]``, laid out by
:func:`~r3_client.layouts.verl_layout`; :class:`RoutedRolloutManager` does it to every
training batch the trainer's ``async_rollout_manager`` returns.  Nothing here imports
verl; torch is imported when a batch is attached.
"""

from __future__ import annotations

import importlib
import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from r3_client._exceptions import ShapeError
from r3_client._routing import Routing, check_rollout_id, token_digest
from r3_client._views import ViewPolicy, one_routing_policy
from r3_client.integrations.tags import tag_sampling_params
from r3_client.layouts import Missing, verl_layout

if TYPE_CHECKING:
    from r3_client._client import RoutingClient

__all__ = [
    "ROLLOUT_ID_KEY",
    "RoutedAgentLoop",
    "RoutedRolloutManager",
    "TaggingServerClient",
    "attach_routed_experts",
    "new_rollout_id",
    "routed_agent_loop",
]

#: The ``extra_fields`` key (so ``non_tensor_batch`` key) holding each sample's rollout id.
ROLLOUT_ID_KEY = "r3_rollout_id"


def new_rollout_id(prefix: str = "verl") -> str:
    """A fresh rollout id, ``f"{prefix}.{uuid4().hex}"``; the prefix names the run in the
    cache (InvalidRequestError when it makes an id the cache would refuse)."""
    return check_rollout_id(f"{prefix}.{uuid.uuid4().hex}")


class TaggingServerClient:
    """verl's ``LLMServerClient`` with every ``generate`` tagged with one rollout id.

    Wraps the agent loop's ``server_manager`` for one trajectory; every other attribute
    is the wrapped one's.
    """

    def __init__(self, wrapped: Any, rollout_id: str, *, share_prompt: bool | None = None) -> None:
        self.wrapped = wrapped
        self.rollout_id = check_rollout_id(rollout_id)
        self.share_prompt = share_prompt

    async def generate(
        self, request_id: Any, *, sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        """The wrapped ``generate`` with ``sampling_params["custom_params"]["r3"]`` set (a
        copy: verl reuses the caller's dict across turns)."""
        params = tag_sampling_params(
            sampling_params, self.rollout_id, share_prompt=self.share_prompt
        )
        return await self.wrapped.generate(request_id, sampling_params=params, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def _check_rollout_config(rollout: Any) -> None:
    """Refuse a rollout config under which tagged requests would not store routing or
    verl would misread the answer."""
    name = getattr(rollout, "name", None)
    if name != "sglang":
        raise ValueError(
            f"r3 tags SGLang requests; actor_rollout_ref.rollout.name is {name!r}, not 'sglang'"
        )
    if getattr(rollout, "enable_rollout_routing_replay", False):
        raise ValueError(
            "set actor_rollout_ref.rollout.enable_rollout_routing_replay=False: the engine "
            "ships a tagged request's routing to the cache and answers without the inline "
            "routing verl would then read (async_sglang_server.py:641, 682-698); "
            "r3_client.integrations.verl.attach_routed_experts fills the field instead"
        )


class RoutedAgentLoop:
    """Mixin for a verl ``AgentLoopBase`` subclass: each ``run`` is one rollout.

    Put it first among the bases (``class R3ToolAgentLoop(RoutedAgentLoop,
    ToolAgentLoop)``).  ``run`` makes a rollout id (:func:`new_rollout_id` with
    ``r3_prefix``), tags every ``self.server_manager.generate`` of the trajectory with
    it (:class:`TaggingServerClient`, ``share_prompt`` from ``r3_share_prompt``) and
    returns it in ``output.extra_fields["r3_rollout_id"]``.
    """

    r3_prefix: str = "verl"
    r3_share_prompt: bool | None = None
    server_manager: Any
    rollout_config: Any

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        """The agent loop's own ``run``, its requests tagged with a new rollout id."""
        _check_rollout_config(self.rollout_config)
        rollout_id = new_rollout_id(self.r3_prefix)
        inner = self.server_manager
        self.server_manager = TaggingServerClient(
            inner, rollout_id, share_prompt=self.r3_share_prompt
        )
        try:
            output = await super().run(sampling_params, **kwargs)  # type: ignore[misc]
        finally:
            self.server_manager = inner
        output.extra_fields[ROLLOUT_ID_KEY] = rollout_id
        return output


_ROUTED: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """``cls`` with :class:`RoutedAgentLoop` first among its bases (made once per class)."""
    if issubclass(cls, RoutedAgentLoop):
        return cls
    if cls not in _ROUTED:
        _ROUTED[cls] = type(
            f"Routed{cls.__name__}", (RoutedAgentLoop, cls), {"__module__": __name__}
        )
    return _ROUTED[cls]


def _locate(path: str) -> type:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImportError(
            f"agent_loop={path!r}: cannot import {name!r} from {module!r} ({exc})"
        ) from exc
    if not isinstance(cls, type):
        raise TypeError(f"agent_loop={path!r} is not a class")
    return cls


def routed_agent_loop(
    agent_loop: str,
    *,
    prefix: str = "verl",
    share_prompt: bool | None = None,
    **kwargs: Any,
) -> Any:
    """An instance of ``agent_loop`` (a dotted class path) made a :class:`RoutedAgentLoop`.

    The ``_target_`` of an entry in verl's agent-loop config file: verl's worker
    instantiates the entry per sample with hydra, passing the entry's other keys
    (``agent_loop``, ``prefix``, ``share_prompt``) and its own constructor arguments
    (``agent_loop.py:682-692``), which go to the class.
    """
    check_rollout_id(f"{prefix}.0")  # a bad prefix fails here, not on the first request
    obj = _routed_class(_locate(agent_loop))(**kwargs)
    obj.r3_prefix = prefix
    obj.r3_share_prompt = share_prompt
    return obj


# ------------------------------------------------------------------ trainer side


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


class RoutedRolloutManager:
    """A verl ``AgentLoopManager`` whose training batches carry ``routed_experts``.

    Replace the trainer's after ``init_workers()``::

        trainer.async_rollout_manager = RoutedRolloutManager(
            trainer.async_rollout_manager, client, num_layers=hf_config.num_hidden_layers)

    ``generate_sequences`` (called synchronously by ``RayPPOTrainer.fit``,
    ``ray_trainer.py:1513``) returns the wrapped one's batch with
    :func:`attach_routed_experts` applied, except for validation batches
    (``meta_info["validate"]``), which verl does not train on.  ``view``: the policy
    of the fetch (:func:`attach_routed_experts`).  Every other attribute is the wrapped
    manager's.
    """

    def __init__(
        self,
        manager: Any,
        client: RoutingClient,
        *,
        num_layers: int,
        missing: Missing = "raise",
        view: ViewPolicy = "generated",
    ) -> None:
        self.wrapped = manager
        self.client = client
        self.num_layers = num_layers
        self.missing: Missing = missing
        self.view: ViewPolicy = one_routing_policy(view, "verl")

    def generate_sequences(self, prompts: Any) -> Any:
        """The wrapped manager's batch, with ``routed_experts`` for training batches."""
        out = self.wrapped.generate_sequences(prompts)
        if prompts.meta_info.get("validate", False):
            return out
        return attach_routed_experts(
            out, self.client, num_layers=self.num_layers, missing=self.missing, view=self.view
        )

    def __getattr__(self, name: str) -> Any:
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)
