"""verl training-worker side (each Megatron rank): :class:`RankLocalReplay` replays every
micro-batch from the rank's own slice of the cache."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import IntegrationError, InvalidRequestError, UsageError
from r3_client._views import ViewPolicy, check_policy
from r3_client.integrations.verl._keys import ROLLOUT_ID_KEY, STATE_KEY
from r3_client.layouts import Missing, VerlRank, VerlRankSlice
from r3_client.rank_local import RangeSource, fetch_verl_rank_slice

if TYPE_CHECKING:
    pass

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

    return importlib.import_module(name)


def _squeezed(obj: Any) -> str:
    import inspect

    return re.sub(r"\s+", "", inspect.getsource(obj))


def check_verl_hooks() -> None:
    """The canary of :class:`RankLocalReplay`: raise :class:`~r3_client.IntegrationError`
    naming what moved unless verl's Megatron engine is the code the hook was written against
    (0.9.1).

    Checks that ``transformer_impl`` still binds the names the hook replaces to verl's
    own functions, that the R3 branch, ``prepare_model_inputs``, ``forward_backward_batch``,
    ``set_router_replay_data`` and ``preprocess_thd_engine`` still contain the statements
    the hook stands in for (``_EXPECTED_SOURCE``), and that ``RouterReplay.set_target_indices``
    still takes ``(topk_indices, replay_mask=None)``.  Imports verl.
    """
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
        raise IntegrationError(
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
            raise IntegrationError(f"TP group of {group.size()} ranks, TP world size {tp}")
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
    states: tuple[int, ...] | None = None  # an expanded batch's rows' states (r3_state)

    @property
    def key(self) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
        """What tells this micro-batch from another (a rollout's states may be in two)."""
        return self.ids, self.states


def _ids_and_states(batch: Any) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """A verl micro-batch's rollout ids and, for an expanded batch
    (:func:`~r3_client.integrations.verl.expand_verl_batch`), each row's state."""
    from verl.utils import tensordict_utils as tu

    raw = tu.get(batch, ROLLOUT_ID_KEY)
    ids = (raw,) if isinstance(raw, str) else tuple(str(x) for x in raw)
    if STATE_KEY not in batch.keys():  # noqa: SIM118 (a TensorDict refuses `in`)
        return ids, None
    got = tu.get(batch, STATE_KEY)
    states = (int(got),) if np.ndim(got) == 0 else tuple(int(x) for x in got)
    return ids, states


def _micro_of(batch: Any) -> _Micro:
    """The rollouts and lengths of a verl micro-batch (a TensorDict after
    ``left_right_2_no_padding``): ``input_ids`` is nested, one sequence per sample
    (padding.py:54-56); ``response_mask`` is what ``build_r3_replay_mask`` reads
    (router_replay_utils.py:380-396).  Lengths: ``P_i + R_i`` is the sequence's length,
    ``R_i`` the response mask's sum, so a sample is replayed (every token but its last)
    exactly when verl's mask replays it."""
    from verl.utils import tensordict_utils as tu

    ids, states = _ids_and_states(batch)
    input_ids = batch["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        raise UsageError("R3 router replay requires jagged input_ids (use_remove_padding)")
    total = np.asarray(input_ids.offsets().diff().tolist(), dtype=np.int64)
    response = np.asarray(batch["response_mask"].sum(dim=-1).tolist(), dtype=np.int64)
    response = np.minimum(response, total)
    if len(ids) != total.shape[0]:
        raise InvalidRequestError(
            f"{len(ids)} rollout ids for a micro-batch of {total.shape[0]} samples"
        )
    local_cp_size = tu.get_non_tensor_data(data=batch, key="local_cp_size", default=None)
    return _Micro(
        ids,
        total - response,
        response,
        None if local_cp_size is None else int(local_cp_size),
        states,
    )


@dataclass(frozen=True)
class _Pending:
    """What ``prepare_model_inputs`` hands the R3 branch as ``routed_experts`` in the
    rank-local mode: the micro-batch, whose rows the hook's ``set_router_replay_data`` reads."""

    batch: Any
    key: tuple[tuple[str, ...], tuple[int, ...] | None]


class _Step:
    """One ``forward_backward_batch`` of a hooked engine: the micro-batches verl made, the
    fetches in flight (one thread), and the replacements of verl's names."""

    def __init__(self, replay: RankLocalReplay, engine: Any) -> None:
        self.replay = replay
        self.engine = engine
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="r3-verl-fetch")
        self.micro: list[_Micro] = []
        self.index: dict[tuple[tuple[str, ...], tuple[int, ...] | None], int] = {}
        self.chunk_layers: list[tuple[int, ...]] = []
        self.inflight: dict[tuple[Any, VerlRank], Future[VerlRankSlice]] = {}
        self.fetched = 0

    # -- fetching
    def _submit(self, micro: _Micro, rank: VerlRank) -> Future[VerlRankSlice]:
        key = (micro.key, rank)
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
                view=self.replay.view,
                states=micro.states,
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
        i = self.index.get(pending.key)
        micro = self.micro[i] if i is not None else _micro_of(pending.batch)
        rank = _verl_rank(tf_config, local_cp_size, layers)
        fut = self._submit(micro, rank)
        if i is not None:
            self._prefetch(i, layers)
        try:
            got = fut.result()
        finally:
            self.inflight.pop((micro.key, rank), None)
        self.fetched += 1
        return got

    # -- verl's names, replaced
    def make_batch_generator(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def capture(batches: Any, vpp_size: int) -> Any:
            rru = _module("verl.utils.megatron.router_replay_utils")
            unwrap_model = _module("verl.utils.megatron_utils").unwrap_model

            self.micro = [_micro_of(b) for b in batches]
            self.index = {m.key: i for i, m in enumerate(self.micro)}
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
            raise IntegrationError("r3 rank-local replay needs the forwarded model (model=)")
        routers = list(rru.iter_model_routers(model))
        if not routers:
            raise IntegrationError("router_replay REPLAY found no routers in the forwarded model.")
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
                inputs["routed_experts"] = _Pending(batch, _ids_and_states(batch))
            return inputs

        return prepare_model_inputs

    @contextmanager
    def patched(self) -> Iterator[None]:
        """verl's three names in ``transformer_impl`` and the engine's
        ``prepare_model_inputs`` replaced, for this step only."""
        from verl.workers.engine.megatron import transformer_impl as ti

        saved = {name: getattr(ti, name) for name in _PATCHED}
        if any(hasattr(f, "_r3_original") for f in saved.values()):
            raise IntegrationError("r3 rank-local replay is already running a step in this process")
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
    ``missing``: as for :func:`~r3_client.rank_local.fetch_verl_rank_slice`.  ``view``:
    the policy each rank reads under (``"exact"``, the default: each row of an expanded
    batch, :func:`~r3_client.integrations.verl.expand_verl_batch`, in its state
    ``non_tensor_batch["r3_state"]``, and a row of an unexpanded batch refused where it
    spans several states; ``"latest"`` / ``"generated"`` by name).
    """

    def __init__(
        self,
        source: RangeSource | Callable[[], RangeSource],
        *,
        missing: Missing = "raise",
        prefetch: int = 1,
        view: ViewPolicy = "exact",
    ) -> None:
        if prefetch < 0:
            raise InvalidRequestError(f"prefetch must be >= 0, got {prefetch}")
        self._source: RangeSource | None = None
        self._factory: Callable[[], RangeSource] | None = None
        if hasattr(source, "get_ranges"):
            self._source = source
        elif callable(source):
            self._factory = source
        else:
            raise UsageError("source must have get_ranges, or make such an object when called")
        self.missing: Missing = missing
        self.prefetch = prefetch
        self.view: ViewPolicy = check_policy(view)
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
            raise IntegrationError("this engine's forward_backward_batch is already replaced")
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
            raise IntegrationError("a RankLocalReplay is already installed in this process")
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
