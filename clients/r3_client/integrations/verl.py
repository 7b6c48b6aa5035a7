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
training batch the trainer's ``async_rollout_manager`` returns.

Rank-local (nothing but ids crosses Ray): ``RoutedRolloutManager(..., rank_local=True)``
only checks the step's rollouts (:func:`check_rank_local_batch`) and leaves
``non_tensor_batch["r3_rollout_id"]`` as the batch's only routing; on each training
worker, :class:`RankLocalReplay` makes verl's Megatron engine replay every micro-batch
from the rank's own slice (:func:`r3_client.rank_local.fetch_verl_rank_slice`) in place
of the ``routed_experts`` its R3 branch would read.  Nothing here imports verl at module
level; torch and verl are imported when a batch is attached or an engine hooked.
"""

from __future__ import annotations

import importlib
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import InvalidRequestError, ShapeError
from r3_client._routing import Routing, check_rollout_id, token_digest
from r3_client._views import ViewPolicy, one_routing_policy
from r3_client.integrations.tags import tag_sampling_params
from r3_client.layouts import Missing, VerlRank, VerlRankSlice, verl_layout
from r3_client.rank_local import RangeSource, StatSource, check_step, fetch_verl_rank_slice

if TYPE_CHECKING:
    from r3_client._client import RoutingClient

__all__ = [
    "ROLLOUT_ID_KEY",
    "RankLocalReplay",
    "RoutedAgentLoop",
    "RoutedRolloutManager",
    "TaggingServerClient",
    "attach_routed_experts",
    "check_rank_local_batch",
    "check_verl_hooks",
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


# ------------------------------------------------------------------ worker side (rank-local)

# The names of verl's Megatron engine module (workers/engine/megatron/transformer_impl.py)
# that RankLocalReplay replaces for the duration of one ``forward_backward_batch``, and the
# module each is verl's own from (transformer_impl.py:46-57).
_PATCHED = {
    "align_r3_router_replay_data": "verl.utils.megatron.router_replay_utils",
    "set_router_replay_data": "verl.utils.megatron.router_replay_utils",
    "make_batch_generator": "verl.utils.megatron.pipeline_parallel",
}

# Statements of verl 0.9.1 the hook relies on (whitespace removed before comparing).
_EXPECTED_SOURCE = {
    "MegatronEngineWithLMHead.forward_step": (
        # transformer_impl.py:1279: the micro-batch's inputs come from prepare_model_inputs
        "model_inputs=self.prepare_model_inputs(batch)",
        # :1283: the dynamic-CP group size of the micro-batch
        'local_cp_size=tu.get_non_tensor_data(data=batch,key="local_cp_size",default=None)',
        # :1306-1327: the R3 branch
        'layers_topk_idx=model_inputs["routed_experts"]',
        'ifself.engine_config.router_replay.mode=="R3":'
        "layers_topk_idx=align_r3_router_replay_data(layers_topk_idx,input_ids)",
        "set_router_replay_data(layers_topk_idx,attention_mask,self.tf_config,vp_rank,"
        "replay_mask=replay_mask,local_cp_size=local_cp_size,model=unwrapped_model,)",
    ),
    "MegatronEngineWithLMHead.prepare_model_inputs": (
        'routed_experts=batch.get("routed_experts",None)',  # :1178
    ),
    "MegatronEngine.forward_backward_batch": (
        # :961: the step's micro-batches, in the order the schedule consumes them
        "batch_generator=make_batch_generator(micro_batches,vpp_size=len(self.module))",
        "forward_step=partial(self.forward_step,",  # :947
    ),
    "router_replay_utils.set_router_replay_data": (
        # router_replay_utils.py:524-549: each of the model's routers gets its layer's rows
        "model_routers=list(iter_model_routers(model))",
        "router.set_target_indices(layers_topk_idx_reshape[idx].to(torch.int64),"
        "replay_mask=replay_mask_rmpad_split,)",
        "cp_layout=_context_parallel_layout(tf_config)",
    ),
    "util.preprocess_thd_engine": (
        # models/mcore/util.py:362-370: the CP group of a dynamic-CP micro-batch
        "cp_group=mpu.get_dynamic_data_context_parallel_groups(group_size=local_cp_size)",
        "cp_rank=torch.distributed.get_rank(group=cp_group)",
    ),
}


def _module(name: str) -> Any:
    """A verl / Megatron module, untyped (verl's functions are not annotated)."""
    import importlib

    return importlib.import_module(name)


def _squeezed(obj: Any) -> str:
    import inspect

    return re.sub(r"\s+", "", inspect.getsource(obj))


def check_verl_hooks() -> None:
    """The canary of :class:`RankLocalReplay`: raise ``RuntimeError`` naming what moved
    unless verl's Megatron engine is the code the hook was written against (0.9.1).

    Checks that ``transformer_impl`` still binds the names the hook replaces to verl's
    own functions, that the R3 branch, ``prepare_model_inputs``, ``forward_backward_batch``,
    ``set_router_replay_data`` and ``preprocess_thd_engine`` still contain the statements
    the hook stands in for (``_EXPECTED_SOURCE``), and that ``RouterReplay.set_target_indices``
    still takes ``(topk_indices, replay_mask=None)``.  Imports verl.
    """
    import importlib
    import inspect

    from verl.models.mcore import util
    from verl.utils.megatron import router_replay_utils as rru
    from verl.utils.megatron.router_replay_patch import RouterReplay
    from verl.workers.engine.megatron import transformer_impl as ti

    problems: list[str] = []
    for name, home in _PATCHED.items():
        bound = getattr(ti, name, None)
        own = getattr(importlib.import_module(home), name, None)
        if bound is None or own is None:
            problems.append(f"{'transformer_impl' if bound is None else home} has no {name}")
        elif getattr(bound, "_r3_original", bound) is not own:
            problems.append(f"transformer_impl.{name} is not {home}.{name}")
    owners = {
        "MegatronEngineWithLMHead": getattr(ti, "MegatronEngineWithLMHead", None),
        "MegatronEngine": getattr(ti, "MegatronEngine", None),
        "router_replay_utils": rru,
        "util": util,
    }
    for where, statements in _EXPECTED_SOURCE.items():
        owner_name, attr = where.split(".")
        target = getattr(owners[owner_name], attr, None)
        if target is None:
            problems.append(f"{where} is gone")
            continue
        target = getattr(target, "_r3_original", target)
        source = _squeezed(target)
        problems += [
            f"{where} no longer has `{s}`"
            for s in statements
            if re.sub(r"\s+", "", s) not in source
        ]
    params = list(inspect.signature(RouterReplay.set_target_indices).parameters)
    if params != ["self", "topk_indices", "replay_mask"]:
        problems.append(f"RouterReplay.set_target_indices takes {params}")
    for name in ("iter_model_routers", "_context_parallel_layout", "device_name"):
        if not hasattr(rru, name):
            problems.append(f"router_replay_utils has no {name}")
    if problems:
        raise RuntimeError(
            "verl's Megatron engine is not the code r3_client's rank-local replay hooks "
            "(verl 0.9.1, workers/engine/megatron/transformer_impl.py:1243-1434): "
            + "; ".join(problems)
        )


def _verl_rank(tf_config: Any, local_cp_size: int | None, layers: Sequence[int]) -> VerlRank:
    """This rank's :class:`VerlRank` for a micro-batch, asked of Megatron's parallel state
    exactly where verl's packing asks it (``preprocess_thd_engine``, models/mcore/util.py:358-370,
    and the SP scatter's TP group, router_replay_utils.py:507-514)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import mappings
    from verl.utils.megatron import router_replay_utils as rru

    tp = int(mpu.get_tensor_model_parallel_world_size())
    tp_rank = 0
    group = mappings.get_tensor_model_parallel_group_if_none(None)
    if group is not None and group.size() > 1:
        if group.size() != tp:
            raise RuntimeError(f"TP group of {group.size()} ranks, TP world size {tp}")
        tp_rank = int(group.rank())
    if local_cp_size is not None:  # dynamic CP: the micro-batch's own CP group
        cp = int(local_cp_size)
        cp_group = mpu.get_dynamic_data_context_parallel_groups(group_size=cp)
        cp_rank = int(dist.get_rank(group=cp_group))
    else:
        cp = int(mpu.get_context_parallel_world_size())
        cp_rank = int(mpu.get_context_parallel_rank())
    dsv4 = getattr(tf_config, "experimental_attention_variant", None) == "dsv4_hybrid"
    return VerlRank(
        tp_size=tp,
        tp_rank=tp_rank,
        cp_size=cp,
        cp_rank=cp_rank,
        stage_layers=tuple(layers),
        sequence_parallel=bool(getattr(tf_config, "sequence_parallel", True)),
        fp8_padding=getattr(tf_config, "fp8", None) in ("e4m3", "hybrid"),
        cp_layout="contiguous"
        if rru._context_parallel_layout(tf_config) == "contiguous"
        else "zigzag",
        min_local_rows=getattr(tf_config, "csa_window_size", None) if dsv4 else None,
    )


@dataclass(frozen=True)
class _Micro:
    """One micro-batch as the rank packs it: its rollouts and lengths, in verl's order."""

    ids: tuple[str, ...]
    prompt_lens: npt.NDArray[np.int64]
    response_lens: npt.NDArray[np.int64]
    local_cp_size: int | None


def _micro_of(batch: Any) -> _Micro:
    """The rollouts and lengths of a verl micro-batch (a TensorDict after
    ``left_right_2_no_padding``): ``input_ids`` is nested, one sequence per sample
    (padding.py:54-56); ``response_mask`` is what ``build_r3_replay_mask`` reads
    (router_replay_utils.py:380-396).  Lengths: ``P_i + R_i`` is the sequence's length,
    ``R_i`` the response mask's sum, so a sample is replayed (every token but its last)
    exactly when verl's mask replays it."""
    from verl.utils import tensordict_utils as tu

    raw = tu.get(batch, ROLLOUT_ID_KEY)
    ids = (raw,) if isinstance(raw, str) else tuple(str(x) for x in raw)
    input_ids = batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise TypeError("R3 router replay requires jagged input_ids (use_remove_padding)")
    total = np.asarray(input_ids.offsets().diff().tolist(), dtype=np.int64)
    response = np.asarray(batch["response_mask"].sum(dim=-1).tolist(), dtype=np.int64)
    response = np.minimum(response, total)
    if len(ids) != total.shape[0]:
        raise ValueError(f"{len(ids)} rollout ids for a micro-batch of {total.shape[0]} samples")
    local_cp_size = tu.get_non_tensor_data(data=batch, key="local_cp_size", default=None)
    return _Micro(
        ids, total - response, response, None if local_cp_size is None else int(local_cp_size)
    )


@dataclass(frozen=True)
class _Pending:
    """What ``prepare_model_inputs`` hands the R3 branch as ``routed_experts`` in the
    rank-local mode: the micro-batch, whose rows the hook's ``set_router_replay_data`` reads."""

    batch: Any
    ids: tuple[str, ...]


class _Step:
    """One ``forward_backward_batch`` of a hooked engine: the micro-batches verl made, the
    fetches in flight (one thread), and the replacements of verl's names."""

    def __init__(self, replay: RankLocalReplay, engine: Any) -> None:
        self.replay = replay
        self.engine = engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="r3-verl-fetch")
        self.micro: list[_Micro] = []
        self.index: dict[tuple[str, ...], int] = {}
        self.chunk_layers: list[tuple[int, ...]] = []
        self.inflight: dict[tuple[tuple[str, ...], VerlRank], Future[VerlRankSlice]] = {}
        self.fetched = 0

    # -- fetching
    def _submit(self, micro: _Micro, rank: VerlRank) -> Future[VerlRankSlice]:
        key = (micro.ids, rank)
        fut = self.inflight.get(key)
        if fut is None:
            source = self.replay.source()
            fut = self.pool.submit(
                fetch_verl_rank_slice,
                source,
                micro.ids,
                micro.prompt_lens,
                micro.response_lens,
                rank=rank,
                missing=self.replay.missing,
            )
            self.inflight[key] = fut
        return fut

    def _prefetch(self, i: int, layers: tuple[int, ...]) -> None:
        for j in range(i + 1, min(i + 1 + self.replay.prefetch, len(self.micro))):
            m = self.micro[j]
            self._submit(m, _verl_rank(self.engine.tf_config, m.local_cp_size, layers))

    def slice_for(
        self, pending: _Pending, layers: tuple[int, ...], tf_config: Any, local_cp_size: Any
    ) -> VerlRankSlice:
        """The chunk's slice of the micro-batch: prefetched, or fetched now."""
        i = self.index.get(pending.ids)
        micro = self.micro[i] if i is not None else _micro_of(pending.batch)
        rank = _verl_rank(tf_config, local_cp_size, layers)
        fut = self._submit(micro, rank)
        if i is not None:
            self._prefetch(i, layers)
        try:
            got = fut.result()
        finally:
            self.inflight.pop((micro.ids, rank), None)
        self.fetched += 1
        return got

    # -- verl's names, replaced
    def make_batch_generator(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def capture(batches: Any, vpp_size: int) -> Any:
            rru = _module("verl.utils.megatron.router_replay_utils")
            unwrap_model = _module("verl.utils.megatron_utils").unwrap_model

            self.micro = [_micro_of(b) for b in batches]
            self.index = {m.ids: i for i, m in enumerate(self.micro)}
            chunks = unwrap_model(list(self.engine.module))
            self.chunk_layers = [
                tuple(sorted({n - 1 for n, _ in rru.iter_model_routers(c)})) for c in chunks
            ]
            if self.micro and self.replay.prefetch > 0:
                first = self.micro[0]
                for layers in self.chunk_layers:
                    if layers:
                        rank = _verl_rank(self.engine.tf_config, first.local_cp_size, layers)
                        self._submit(first, rank)
            return original(batches, vpp_size=vpp_size)

        return capture

    def align(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def align_r3_router_replay_data(layers_topk_idx: Any, input_ids: Any) -> Any:
            if isinstance(layers_topk_idx, _Pending):
                return layers_topk_idx  # rows come aligned from the plan: no placeholder row
            return original(layers_topk_idx, input_ids)

        return align_r3_router_replay_data

    def set_data(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def set_router_replay_data(
            layers_topk_idx: Any,
            attention_mask: Any,
            tf_config: Any,
            vp_rank: Any = None,
            replay_mask: Any = None,
            local_cp_size: Any = None,
            model: Any = None,
        ) -> None:
            if not isinstance(layers_topk_idx, _Pending):
                return original(  # type: ignore[no-any-return]
                    layers_topk_idx,
                    attention_mask,
                    tf_config,
                    vp_rank,
                    replay_mask=replay_mask,
                    local_cp_size=local_cp_size,
                    model=model,
                )
            self.set_targets(layers_topk_idx, tf_config, local_cp_size, model)
            return None

        return set_router_replay_data

    def set_targets(
        self, pending: _Pending, tf_config: Any, local_cp_size: Any, model: Any
    ) -> None:
        """What ``set_router_replay_data(..., model=model)`` does with the whole batch
        (router_replay_utils.py:524-549), from the rank's slice: each router of the chunk
        gets its layer's rows (int64, on verl's device) and the replay mask."""
        import torch

        rru = _module("verl.utils.megatron.router_replay_utils")
        if model is None:
            raise RuntimeError("r3 rank-local replay needs the forwarded model (model=)")
        routers = list(rru.iter_model_routers(model))
        if not routers:
            raise RuntimeError("router_replay REPLAY found no routers in the forwarded model.")
        layers = tuple(sorted({n - 1 for n, _ in routers}))
        got = self.slice_for(pending, layers, tf_config, local_cp_size)
        device = rru.device_name
        targets = {
            layer: torch.as_tensor(rows).to(device)
            for layer, rows in zip(got.layer_ids, got.per_layer, strict=True)
        }
        mask = torch.as_tensor(got.replay_mask).to(device)
        for number, router in routers:
            router.set_target_indices(targets[number - 1], replay_mask=mask)

    def prepare(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def prepare_model_inputs(batch: Any) -> Any:
            inputs = original(batch)
            if inputs.get("routed_experts") is None and ROLLOUT_ID_KEY in batch.keys():  # noqa: SIM118
                from verl.utils import tensordict_utils as tu

                raw = tu.get(batch, ROLLOUT_ID_KEY)
                ids = (raw,) if isinstance(raw, str) else tuple(str(x) for x in raw)
                inputs["routed_experts"] = _Pending(batch, ids)
            return inputs

        return prepare_model_inputs

    @contextmanager
    def patched(self) -> Iterator[None]:
        """verl's three names in ``transformer_impl`` and the engine's
        ``prepare_model_inputs`` replaced, for this step only."""
        from verl.workers.engine.megatron import transformer_impl as ti

        saved = {name: getattr(ti, name) for name in _PATCHED}
        if any(hasattr(f, "_r3_original") for f in saved.values()):
            raise RuntimeError("r3 rank-local replay is already running a step in this process")
        makers = {
            "align_r3_router_replay_data": self.align,
            "set_router_replay_data": self.set_data,
            "make_batch_generator": self.make_batch_generator,
        }
        engine = self.engine
        own_prepare = vars(engine).get("prepare_model_inputs")
        try:
            for name, make in makers.items():
                wrapper = make(saved[name])
                wrapper._r3_original = saved[name]  # type: ignore[attr-defined]
                setattr(ti, name, wrapper)
            engine.prepare_model_inputs = self.prepare(engine.prepare_model_inputs)
            yield
        finally:
            for name, value in saved.items():
                setattr(ti, name, value)
            if own_prepare is None:
                vars(engine).pop("prepare_model_inputs", None)
            else:
                engine.prepare_model_inputs = own_prepare
            for fut in self.inflight.values():
                fut.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)


class RankLocalReplay:
    """Worker side of the rank-local mode: verl's Megatron engine replays each micro-batch
    from this rank's own slice of the cache.

    verl 0.9.1's R3 branch (``MegatronEngineWithLMHead.forward_step``,
    ``workers/engine/megatron/transformer_impl.py:1306-1327``) reads the micro-batch's
    ``routed_experts``, aligns it, builds the replay mask, then
    ``set_router_replay_data(..., local_cp_size=, model=unwrapped_model)`` packs the whole
    micro-batch and gives each router of the chunk its rank's rows.  For a micro-batch
    that carries ``r3_rollout_id`` and no ``routed_experts`` (the driver's
    ``RoutedRolloutManager(..., rank_local=True)``), a hooked engine's
    ``forward_backward_batch`` runs verl's own code with, for that call only:

    - ``engine.prepare_model_inputs`` answering a placeholder for ``routed_experts``
      (verl raises on ``None``, :1310);
    - ``transformer_impl.align_r3_router_replay_data`` passing the placeholder through;
    - ``transformer_impl.set_router_replay_data`` fetching the chunk's slice
      (:func:`~r3_client.rank_local.fetch_verl_rank_slice`: the micro-batch's rollouts and
      lengths in verl's packing order; :class:`~r3_client.layouts.VerlRank` from Megatron's
      parallel state, the dynamic-CP ``local_cp_size`` verl passes, the chunk's routers'
      layers from verl's ``iter_model_routers``, SP, FP8 padding and the CP layout from
      ``tf_config``) and calling ``router.set_target_indices(rows, replay_mask=mask)`` on
      each router, as verl's does (router_replay_utils.py:524-549);
    - ``transformer_impl.make_batch_generator`` recording the step's micro-batches
      (:961), so the next micro-batch's slice is fetched (one thread, ``prefetch``
      micro-batches ahead per chunk) while the current one computes.

    Each replacement calls verl's own function for anything that is not the placeholder;
    everything else (the replay actions, the backward replay list, recomputation, R2, a
    batch that carries ``routed_experts``) is verl's code unchanged.  :func:`check_verl_hooks`
    (run on :meth:`attach` and :meth:`install`) refuses a verl whose names or statements
    moved.  ``source``: a :class:`~r3_client.RoutingClient` or
    :class:`~r3_client.DirectReader`, or a callable making one in the worker on first use.
    ``missing``: as for :func:`~r3_client.rank_local.fetch_verl_rank_slice`.
    """

    def __init__(
        self,
        source: RangeSource | Callable[[], RangeSource],
        *,
        missing: Missing = "raise",
        prefetch: int = 1,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self._source: RangeSource | None = None
        self._factory: Callable[[], RangeSource] | None = None
        if hasattr(source, "get_ranges"):
            self._source = source
        elif callable(source):
            self._factory = source
        else:
            raise TypeError("source must have get_ranges, or make such an object when called")
        self.missing: Missing = missing
        self.prefetch = prefetch
        self._installed: tuple[type, Any] | None = None
        self.steps = 0  # hooked forward_backward_batch calls, for tests and logs

    def source(self) -> RangeSource:
        """The range source (made on first use when a factory was given)."""
        if self._source is None:
            assert self._factory is not None
            self._source = self._factory()
        return self._source

    @staticmethod
    def engaged(engine: Any, data: Any) -> bool:
        """Whether ``forward_backward_batch(data)`` replays from the cache: R3 on, the
        batch carries rollout ids and no ``routed_experts``."""
        config = getattr(engine, "engine_config", None)
        mode = getattr(getattr(config, "router_replay", None), "mode", None)
        return (
            bool(getattr(engine, "enable_routing_replay", False))
            and mode == "R3"
            and ROLLOUT_ID_KEY in data.keys()  # noqa: SIM118 (a TensorDict refuses `in`)
            and data.get("routed_experts", None) is None
        )

    def run(
        self,
        engine: Any,
        original: Callable[..., Any],
        data: Any,
        loss_function: Any,
        forward_only: bool = False,
    ) -> Any:
        """``original(data, loss_function, forward_only=...)`` (verl's
        ``forward_backward_batch``), hooked when :meth:`engaged`."""
        if not self.engaged(engine, data):
            return original(data, loss_function, forward_only=forward_only)
        step = _Step(self, engine)
        with step.patched():
            out = original(data, loss_function, forward_only=forward_only)
        self.steps += 1
        return out

    def attach(self, engine: Any) -> Any:
        """Hook one engine (a verl ``MegatronEngineWithLMHead``, e.g. a ``TrainingWorker``'s
        ``.engine``): its ``forward_backward_batch`` becomes :meth:`run` of verl's.  Returns
        the engine."""
        check_verl_hooks()
        if "forward_backward_batch" in vars(engine):
            raise RuntimeError("this engine's forward_backward_batch is already replaced")
        original = engine.forward_backward_batch

        def forward_backward_batch(
            data: Any, loss_function: Any, forward_only: bool = False
        ) -> Any:
            return self.run(engine, original, data, loss_function, forward_only)

        engine.forward_backward_batch = forward_backward_batch
        return engine

    def install(self) -> RankLocalReplay:
        """Hook every verl ``MegatronEngineWithLMHead`` of this process (class-wide, until
        :meth:`uninstall`): for a worker process, from a module named by
        ``actor_rollout_ref.model.external_lib``, which verl imports in each worker when it
        builds the model config (``workers/config/model.py:148-149``)."""
        check_verl_hooks()
        from verl.workers.engine.megatron import transformer_impl as ti

        cls = ti.MegatronEngineWithLMHead
        if self._installed is not None or "_r3_replay" in vars(cls):
            raise RuntimeError("a RankLocalReplay is already installed in this process")
        had = vars(cls).get("forward_backward_batch")
        original = cls.forward_backward_batch

        def forward_backward_batch(
            engine: Any, data: Any, loss_function: Any, forward_only: bool = False
        ) -> Any:
            bound = original.__get__(engine, type(engine))
            return self.run(engine, bound, data, loss_function, forward_only)

        setattr(cls, "forward_backward_batch", forward_backward_batch)  # noqa: B010
        setattr(cls, "_r3_replay", self)  # noqa: B010
        self._installed = (cls, had)
        return self

    def uninstall(self) -> None:
        """Undo :meth:`install`."""
        if self._installed is None:
            return
        cls, had = self._installed
        if had is None:
            delattr(cls, "forward_backward_batch")
        else:
            setattr(cls, "forward_backward_batch", had)  # noqa: B010
        delattr(cls, "_r3_replay")
        self._installed = None
