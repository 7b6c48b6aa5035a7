"""verl 0.9.1's Megatron engine replaying each micro-batch from the rank's own slice of the cache.

``r3_client.integrations.verl``: the driver (``RoutedRolloutManager(..., rank_local=True)``)
checks the step and attaches nothing; the worker's engine, hooked by ``RankLocalReplay``,
fetches each micro-batch's rows for its rank only.  What runs is verl's (paths under
``site-packages/verl/``): ``DataProto.to_tensordict`` -> ``left_right_2_no_padding``
(``trainer/ppo/ray_trainer.py:1295``), then ``MegatronEngine.forward_backward_batch``
(``workers/engine/megatron/transformer_impl.py:834``: dynamic-batch-size micro-batches, which
reorder the samples, ``make_batch_generator`` with one iterator per VPP chunk, the global
``REPLAY_FORWARD`` action) and ``MegatronEngineWithLMHead.forward_step`` (its R3 branch,
:1306-1327, and the action switches around it).  Standing in: the engine is made without
its ``__init__`` (no model build), its chunks are ``TopKRouter`` shells with verl's
``RouterReplay`` (all ``iter_model_routers`` reads, as tests/client/test_layout_slices.py),
Megatron's schedule is a loop calling verl's ``forward_step`` chunk by chunk, and the model
forward records what each router was set to.  TP / CP coordinates reach verl's and our code
through Megatron's parallel state (fake groups, one process).

For every (tp, cp, pp[, vp]) rank, all-MoE and dense-first models: the targets and replay
masks our path sets equal those verl's own path sets from ``verl_layout``'s whole batch,
micro-batch by micro-batch and chunk by chunk, each fetched once.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is not installed: scripts/bootstrap.sh installs verl==0.9.1 --no-deps "
        "(the `verl` extra in pyproject.toml)",
        allow_module_level=True,
    )

from r3_client import (
    InvalidRequestError,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    Segment,
    ShapeError,
    token_digest,
)
from r3_client.integrations import verl as r3_verl
from r3_client.layouts import verl_layout
from r3_client.rank_local import StepCheck
from r3_client.synthetic import synthetic_routing
from tests.client.test_layout_slices import (
    MODELS,
    NUM_LAYERS,
    E,
    K,
    Model,
    megatron_chunks,
    set_rank,
)
from tests.support.frames import rid
from tests.support.megatron_model import _hide_broken_flash_mla, megatron_env, schedule_env
from tests.support.service_process import KEY_A, Service
from tests.support.verl_stubs import (
    import_megatron_engine,
    router_shells,
    stub_ray,
    verl_tensors,
)

# A zero-length response (not replayed), a one-token response (its only token is the last).
PROMPTS = (3, 5, 2, 4, 7, 1, 6)
RESPONSES = (4, 1, 6, 3, 0, 9, 5)
PROMPT_LEN, RESPONSE_LEN, VOCAB = 8, 10, 256
MAX_TOKENS = 16  # max_token_len_per_gpu: several micro-batches, samples reordered


@dataclass
class Verl:
    """verl 0.9.1's modules this file drives."""

    ti: Any  # workers.engine.megatron.transformer_impl
    rru: Any  # utils.megatron.router_replay_utils
    tu: Any  # utils.tensordict_utils
    DataProto: Any
    RouterReplay: Any
    TopKRouter: Any
    left_right_2_no_padding: Any
    compute_position_id_with_mask: Any


@pytest.fixture(scope="module")
def verl() -> Iterator[Verl]:
    stub_ray()
    _hide_broken_flash_mla()
    import verl as verl_pkg

    assert verl_pkg.__version__ == "0.9.1", verl_pkg.__version__
    with megatron_env(torch.device("cpu")):
        from megatron.core.transformer.moe.router import TopKRouter
        from verl.protocol import DataProto
        from verl.utils import tensordict_utils as tu
        from verl.utils.megatron import router_replay_utils as rru
        from verl.utils.megatron.router_replay_patch import RouterReplay
        from verl.utils.model import compute_position_id_with_mask
        from verl.workers.utils.padding import left_right_2_no_padding

        ti = import_megatron_engine()  # without the FSDP engine's peft

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rru, "device_name", "cpu")  # verl has no CPU platform: it says "cuda"
            try:
                yield Verl(
                    ti,
                    rru,
                    tu,
                    DataProto,
                    RouterReplay,
                    TopKRouter,
                    left_right_2_no_padding,
                    compute_position_id_with_mask,
                )
            finally:
                RouterReplay.router_instances.clear()


# ------------------------------------------------------------------ the batch and the cache


def _routings(model: Model, seed: int) -> list[Routing]:
    return [
        Routing.from_array(
            synthetic_routing(p + r - 1, len(model.moe_ids), E, K, seed=seed + i),
            num_experts=E,
            layer_ids=model.moe_ids,
        )
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]


def _store(client: RoutingClient, routings: Sequence[Routing]) -> list[str]:
    """Each rollout as an engine writes it: a prompt segment, then a continuation."""
    ids = []
    for r, p in zip(routings, PROMPTS, strict=True):
        key = rid()
        n = r.indices.shape[0]
        for a, b in ((0, min(p, n)), (min(p, n), n)):
            if a < b:
                client.put(
                    key,
                    r.indices[a:b],
                    num_experts=E,
                    layer_ids=r.layer_ids,
                    segment=Segment(a, b, "tiny-moe", "v1"),
                )
        ids.append(key)
    return ids


def _rollout(v: Verl, ids: Sequence[str] | None = None, routed: np.ndarray | None = None) -> Any:
    """The DataProto verl's agent loop hands the trainer (prompts left-, responses
    right-padded), with ``r3_rollout_id`` and/or ``routed_experts``."""
    tensors = verl_tensors(
        PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, VOCAB, v.compute_position_id_with_mask
    )
    if routed is not None:
        tensors["routed_experts"] = torch.from_numpy(routed)
    data = v.DataProto.from_dict(tensors=tensors)
    if ids is not None:
        data.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY] = np.array(ids, dtype=object)
    return data


def _whole(client: RoutingClient, ids: Sequence[str]) -> np.ndarray:
    """verl_layout of the rollouts as the cache holds them (each row's experts in the
    cache's canonical order), what attach_routed_experts would attach."""
    routings = [r for _, r in client.get_many(list(ids))]
    return verl_layout(
        routings,  # type: ignore[arg-type]
        PROMPTS,
        RESPONSES,
        prompt_len=PROMPT_LEN,
        response_len=RESPONSE_LEN,
        num_layers=NUM_LAYERS,
    )


def _worker_batch(v: Verl, data: Any) -> Any:
    """What ``update_actor`` / ``compute_log_prob`` hand the engine (ray_trainer.py:1295-1330,
    engine_workers.py:62-70)."""
    td = v.left_right_2_no_padding(data.to_tensordict())
    v.tu.assign_non_tensor(
        td,
        temperature=1.0,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=MAX_TOKENS,
        enable_routing_replay=True,
    )
    return td


# ------------------------------------------------------------------ verl's engine, on CPU


@dataclass
class Recorder:
    """The model forward as far as routing goes: what each chunk's routers were set to."""

    calls: list[tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]] = field(
        default_factory=list
    )
    chunks: list[Any] = field(default_factory=list)

    def forward_fn(self, model: Any, input_ids: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from verl.utils.megatron.router_replay_utils import iter_model_routers

        routers = [
            (n, r.target_topk_idx.clone(), r.target_replay_mask.clone())
            for n, r in iter_model_routers(model)
        ]
        self.calls.append((next(i for i, c in enumerate(self.chunks) if c is model), routers))
        return {}


def _chunk(v: Verl, layers: Sequence[int], config: Any, vp: int) -> torch.nn.Module:
    chunk = router_shells(v.TopKRouter, v.RouterReplay, layers)
    chunk.config = config  # type: ignore[assignment]  # _get_context_parallel_layout reads it
    chunk.vp_stage = vp  # type: ignore[assignment]
    return chunk


def _engine(
    v: Verl, model: Model, chunk_layers: Sequence[Sequence[int]], *, tp: int, cp: int
) -> Any:
    """A ``MegatronEngineWithLMHead`` made without ``__init__``: R3 on, one chunk per VP stage."""
    v.RouterReplay.router_instances.clear()  # as apply_router_replay_patch leaves it per engine
    config = types.SimpleNamespace(
        num_layers=NUM_LAYERS,
        moe_layer_freq=list(model.freq),
        fp8=None,
        experimental_attention_variant=None,
        csa_window_size=None,
        sequence_parallel=tp > 1,
        calculate_per_token_loss=False,
        virtual_pipeline_model_parallel_size=len(chunk_layers) if len(chunk_layers) > 1 else None,
    )
    engine = v.ti.MegatronEngineWithLMHead.__new__(v.ti.MegatronEngineWithLMHead)
    engine.engine_config = types.SimpleNamespace(
        use_fused_kernels=False,
        pad_to_length=False,
        pad_to_length_bucket=None,
        use_remove_padding=True,
        pad_bshd_to_minibatch_max=False,
        dynamic_context_parallel=False,
        context_parallel_size=cp,
        router_replay=types.SimpleNamespace(mode="R3"),
    )
    engine.enable_routing_replay = True
    engine.mini_layer_topk_idx_list = []
    engine.tf_config = config
    engine.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
    )
    engine.module = [_chunk(v, layers, config, vp) for vp, layers in enumerate(chunk_layers)]
    return engine


def _schedule(
    forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int, **kw: Any
) -> list[Any]:
    """Megatron's schedule as far as verl's forward_step can tell: every micro-batch through
    every chunk, chunk-major (as an interleaved schedule's warm-up runs them)."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for chunk, it in zip(model, iterators, strict=True):
        for _ in range(num_microbatches):
            forward_step_func(it, chunk)
    return []


@pytest.fixture
def engine_env(verl: Verl, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """verl's engine module with Megatron's schedule, the model forward and the output
    gathering (none of them R3) stood in for."""
    import verl.models.mcore as mcore

    rec = Recorder()
    monkeypatch.setattr(verl.ti, "get_forward_backward_func", lambda: _schedule)
    monkeypatch.setattr(verl.ti, "postprocess_batch_func", lambda **kw: {})
    monkeypatch.setattr(mcore, "get_mcore_engine_forward_fn", lambda hf_config: rec.forward_fn)
    return rec


class CountingSource:
    """A RoutingClient whose ``get_ranges`` calls are recorded (layers and rows asked)."""

    def __init__(self, client: RoutingClient) -> None:
        self.client = client
        self.calls: list[tuple[list[tuple[str, int, int]], tuple[int, ...] | None]] = []

    def get_ranges(
        self, reads: Any, *, layers: Any = None, view: Any = "exact", return_errors: bool = False
    ) -> Any:
        reads = list(reads)
        self.calls.append((reads, None if layers is None else tuple(layers)))
        return self.client.get_ranges(reads, layers=layers, view=view, return_errors=return_errors)


def _run(v: Verl, engine: Any, rec: Recorder, td: Any) -> list[Any]:
    rec.calls.clear()
    rec.chunks = list(engine.module)
    with schedule_env(torch.device("cpu")):
        engine.forward_backward_batch(td, loss_function=None, forward_only=True)
    return list(rec.calls)


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want) and want
    assert any(routers for _, routers in want) or all(not r for _, r in got)
    for (c1, routers1), (c2, routers2) in zip(got, want, strict=True):
        assert c1 == c2
        assert [n for n, _, _ in routers1] == [n for n, _, _ in routers2]
        for (n, t1, m1), (_, t2, m2) in zip(routers1, routers2, strict=True):
            assert t1.dtype == t2.dtype == torch.int64, n
            assert m1.dtype == m2.dtype, n
            assert torch.equal(t1, t2), f"layer {n - 1}: targets differ"
            assert torch.equal(m1, m2), f"layer {n - 1}: replay masks differ"


# (tp, cp, pp, vpp); TP > 1 with sequence parallel, verl's default (engine.py:195).
GRID = [
    (tp, cp, pp, vpp)
    for tp, cp, (pp, vpp) in itertools.product([1, 2], [1, 2], [(1, None), (2, None), (2, 2)])
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize(("tp", "cp", "pp", "vpp"), GRID, ids=lambda x: str(x))
def test_each_rank_replays_what_verls_own_r3_branch_sets(
    verl: Verl,
    engine_env: Recorder,
    svc: Service,
    model: Model,
    tp: int,
    cp: int,
    pp: int,
    vpp: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl's forward_backward_batch + forward_step, on every (tp, cp, pp[, vp]) rank: with
    only ``r3_rollout_id`` in the batch, the hooked engine's routers hold exactly the targets
    and replay masks verl's own R3 branch sets from the whole ``routed_experts`` (same engine,
    same micro-batches), and each (micro-batch, chunk) is fetched once, its chunk's layers only."""
    routings = _routings(model, seed=7 * tp + 3 * cp + pp)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        whole = _worker_batch(verl, _rollout(verl, ids, routed=_whole(client, ids)))
        local = _worker_batch(verl, _rollout(verl, ids))
        assert "routed_experts" not in local.keys()  # noqa: SIM118 (TensorDict refuses `in`)
        chunks = megatron_chunks(pp, vpp)
        for tp_rank, cp_rank, pp_rank in itertools.product(range(tp), range(cp), range(pp)):
            layers = [[i for i in chunks[pp_rank, vp] if model.freq[i]] for vp in range(vpp or 1)]
            set_rank(monkeypatch, tp, tp_rank, cp, cp_rank)
            source = CountingSource(client)
            replay = r3_verl.RankLocalReplay(source)
            engine = replay.attach(_engine(verl, model, layers, tp=tp, cp=cp))
            want = _run(verl, engine, engine_env, whole)  # verl's path: routed_experts attached
            assert replay.steps == 0 and not source.calls  # passed through untouched
            got = _run(verl, engine, engine_env, local)
            _assert_same(got, want)  # a dense chunk: verl's branch never runs, in both paths
            assert replay.steps == 1
            routed = [chunk for chunk, routers in got if routers]
            assert len(source.calls) == len(routed)  # each (micro-batch, chunk) fetched once
            assert {c[1] for c in source.calls} == {tuple(ls) for ls in layers if ls}
            if tp == cp == 1 and source.calls:  # dynamic batch size: several, reordered
                order = [
                    r
                    for reads, lay in source.calls
                    if lay == source.calls[0][1]
                    for r in dict.fromkeys(key for key, *_ in reads)
                ]
                assert sorted(order) == sorted(ids) and order != ids
                assert len(got) >= 2 * len(layers)
            for name in r3_verl.worker._PATCHED:  # verl's names are back
                assert not hasattr(getattr(verl.ti, name), "_r3_original")


def test_a_rollout_missing_at_the_rank_is_refused_naming_it(
    verl: Verl, engine_env: Recorder, service_single: Service
) -> None:
    """A rollout gone between the driver's check and the rank's fetch: the step fails naming
    the sample and rollout, and verl's names are restored."""
    model = MODELS[1]
    routings = _routings(model, seed=50)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        ids[3] = rid()  # never stored
        td = _worker_batch(verl, _rollout(verl, ids))
        layers = [[i for i in range(NUM_LAYERS) if model.freq[i]]]
        engine = r3_verl.RankLocalReplay(client).attach(_engine(verl, model, layers, tp=1, cp=1))
        with pytest.raises(RolloutNotFoundError, match=rf"sample \d \(rollout '{ids[3]}'\)"):
            _run(verl, engine, engine_env, td)
    for name in r3_verl.worker._PATCHED:
        assert not hasattr(getattr(verl.ti, name), "_r3_original")
    assert "prepare_model_inputs" not in vars(engine)


def test_install_hooks_every_engine_of_the_process_until_uninstalled(
    verl: Verl, engine_env: Recorder, service_single: Service
) -> None:
    """``install()`` (what a module named by ``model.external_lib`` calls in each worker):
    engines made afterwards replay from the cache; ``uninstall()`` gives verl's method back."""
    model = MODELS[0]
    routings = _routings(model, seed=60)
    before = vars(verl.ti.MegatronEngineWithLMHead).get("forward_backward_batch")
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        replay = r3_verl.RankLocalReplay(lambda: client).install()
        try:
            with pytest.raises(RuntimeError, match="already installed"):
                r3_verl.RankLocalReplay(client).install()
            layers = [list(range(NUM_LAYERS))]
            engine = _engine(verl, model, layers, tp=1, cp=1)
            got = _run(verl, engine, engine_env, _worker_batch(verl, _rollout(verl, ids)))
            want = _run(
                verl,
                engine,
                engine_env,
                _worker_batch(verl, _rollout(verl, ids, routed=_whole(client, ids))),
            )
            _assert_same(got, want)
            assert replay.steps == 1
        finally:
            replay.uninstall()
    assert vars(verl.ti.MegatronEngineWithLMHead).get("forward_backward_batch") is before
    assert not hasattr(verl.ti.MegatronEngineWithLMHead, "_r3_replay")


# ------------------------------------------------------------------ the driver side


class Manager:
    """The trainer's AgentLoopManager, as far as RoutedRolloutManager can tell."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def generate_sequences(self, prompts: Any) -> Any:
        return self.batch


def test_driver_attaches_nothing_but_the_checked_ids(verl: Verl, service_single: Service) -> None:
    routings = _routings(MODELS[1], seed=70)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        batch = _rollout(verl, ids)
        keys = set(batch.batch.keys())
        out = r3_verl.RoutedRolloutManager(
            Manager(batch), client, rank_local=True
        ).generate_sequences(verl.DataProto())
        assert out is batch and set(out.batch.keys()) == keys  # no tensor attached
        assert list(out.non_tensor_batch) == [r3_verl.ROLLOUT_ID_KEY]
        assert list(out.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]) == ids
        # rollouts without views: every token replayed with the routing it attended to
        tokens = sum(PROMPTS) + sum(RESPONSES) - len(PROMPTS)
        assert out.meta_info["r3_step_check"] == StepCheck(7, 0, 0, 0, tokens, "exact")
        # the driver fetches nothing: its policy is the one its check reports for (the
        # ranks' RankLocalReplay reads under theirs); a name that is no policy is refused
        latest = r3_verl.RoutedRolloutManager(
            Manager(batch), client, rank_local=True, view="latest"
        )
        assert latest.generate_sequences(verl.DataProto()).meta_info["r3_step_check"].policy == (
            "latest"
        )
        with pytest.raises(InvalidRequestError, match="view must be one of"):
            r3_verl.RoutedRolloutManager(Manager(batch), client, rank_local=True, view="last")  # type: ignore[arg-type]
        got = r3_verl.check_rank_local_batch(_rollout(verl, ids), client, view="generated")
        assert got.meta_info["r3_step_check"].policy == "generated"
        with pytest.raises(TypeError, match="num_layers"):
            r3_verl.RoutedRolloutManager(Manager(batch), client)
        attached = _rollout(verl, ids, routed=_whole(client, ids))
        with pytest.raises(ValueError, match="routed_experts"):
            r3_verl.check_rank_local_batch(attached, client)


def test_driver_refuses_a_missing_or_short_rollout_before_dispatch(
    verl: Verl, service_single: Service
) -> None:
    routings = _routings(MODELS[0], seed=80)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        missing = list(ids)
        missing[2] = rid()
        manager = r3_verl.RoutedRolloutManager(
            Manager(_rollout(verl, missing)), client, rank_local=True
        )
        with pytest.raises(RolloutNotFoundError, match=rf"sample 2 \(rollout '{missing[2]}'\)"):
            manager.generate_sequences(verl.DataProto())
        short = list(ids)
        short[5] = rid()  # sample 5 (P=1, R=9): 9 rows needed, 4 stored
        client.put(short[5], routings[5].indices[:4], num_experts=E, layer_ids=MODELS[0].moe_ids)
        manager.wrapped = Manager(_rollout(verl, short))
        with pytest.raises(ShapeError, match=rf"sample 5 \(rollout '{short[5]}'\) holds 4 rows"):
            manager.generate_sequences(verl.DataProto())
        # rows computed from other tokens (an earlier attempt's): their digest differs
        foreign = list(ids)
        foreign[0] = rid()  # sample 0: P=3, R=4, so 7 tokens and 6 rows
        digest = token_digest(list(range(1, 7)))
        seg = Segment(0, 6, "tiny-moe", "v1", digest)
        client.put(
            foreign[0], routings[0].indices, num_experts=E, layer_ids=MODELS[0].moe_ids, segment=seg
        )
        manager.wrapped = Manager(_rollout(verl, foreign))
        with pytest.raises(ShapeError, match=r"sample 0 .*computed from other tokens"):
            manager.generate_sequences(verl.DataProto())
        # more rows than the sample, whose response verl did not cut (R=1 < response_length)
        longer = list(ids)
        longer[1] = rid()  # sample 1: P=5, R=1, so 5 rows
        extra = routings[1].indices[np.arange(8) % 5]
        client.put(longer[1], extra, num_experts=E, layer_ids=MODELS[0].moe_ids)
        manager.wrapped = Manager(_rollout(verl, longer))
        with pytest.raises(ShapeError, match=r"sample 1 .*holds 8 rows, more than .* 5"):
            manager.generate_sequences(verl.DataProto())
        validation = verl.DataProto(meta_info={"validate": True})
        assert manager.generate_sequences(validation) is manager.wrapped.batch  # not checked


# ------------------------------------------------------------------ the canary


def test_canary_passes_on_verl_0_9_1_and_fails_loudly_when_verl_moves(
    verl: Verl, monkeypatch: pytest.MonkeyPatch
) -> None:
    r3_verl.check_verl_hooks()
    with monkeypatch.context() as mp:
        mp.setattr(verl.ti, "set_router_replay_data", lambda *a, **k: None)
        with pytest.raises(RuntimeError, match=r"transformer_impl\.set_router_replay_data is not"):
            r3_verl.check_verl_hooks()
    with monkeypatch.context() as mp:
        mp.delattr(verl.ti, "make_batch_generator")
        with pytest.raises(RuntimeError, match="transformer_impl has no make_batch_generator"):
            r3_verl.check_verl_hooks()

    def forward_step(self: Any, batch_iter: Any, model: Any, *a: Any) -> Any:
        model_inputs = self.prepare_model_inputs(next(batch_iter))
        return model_inputs  # the R3 branch moved elsewhere

    with monkeypatch.context() as mp:
        mp.setattr(verl.ti.MegatronEngineWithLMHead, "forward_step", forward_step)
        with pytest.raises(RuntimeError, match="forward_step no longer has") as exc:
            r3_verl.check_verl_hooks()
        assert "align_r3_router_replay_data" in str(exc.value)
        with pytest.raises(RuntimeError, match="not the code r3_client's rank-local replay"):
            r3_verl.RankLocalReplay(lambda: None).attach(types.SimpleNamespace())  # type: ignore[arg-type,return-value]

    def set_target_indices(self: Any, topk_indices: Any, mask: Any = None) -> None: ...

    with monkeypatch.context() as mp:
        mp.setattr(verl.RouterReplay, "set_target_indices", set_target_indices)
        with pytest.raises(RuntimeError, match="set_target_indices takes"):
            r3_verl.check_verl_hooks()
    r3_verl.check_verl_hooks()


# ------------------------------------------------------------------ exact: an expanded batch


def _store_straddled(
    client: RoutingClient, model: Model, seed: int
) -> tuple[list[str], list[list[np.ndarray]]]:
    """The step's rollouts, sample 5 a three-turn agent with a push before each later turn
    (views serving rows 3 and 6) and sample 6 recomputed after an eviction (a view of rows
    [2, 8) serving row 8), the others single calls; each sample's states' rows."""
    g = np.random.default_rng(seed)
    layers = model.moe_ids

    def rows(n: int) -> np.ndarray:
        # each row's experts ascending: the cache's canonical order (a set per token)
        return np.sort(np.argsort(g.random((n, len(layers), E)), axis=-1)[..., :K], axis=-1).astype(
            np.int16
        )

    def put(key: str, idx: np.ndarray, start: int, version: str, view: int | None = None) -> None:
        seg = Segment(start, start + idx.shape[0], "tiny-moe", version)
        client.put(key, idx, num_experts=E, layer_ids=layers, segment=seg, view=view)

    ids: list[str] = []
    states: list[list[np.ndarray]] = []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        key = rid()
        n = p + r - 1
        first = rows(n)
        if i == 5:  # turns [0, 3), [3, 6), [6, 9)
            again, third = rows(3), rows(6)
            put(key, first[:3], 0, "w1")
            put(key, again, 0, "w2", view=3)
            put(key, first[3:6], 3, "w2")
            put(key, third, 0, "w3", view=6)
            put(key, first[6:9], 6, "w3")
            s1 = np.concatenate([again, first[3:6]])
            states.append([first[:3], s1, np.concatenate([third, first[6:9]])])
        elif i == 6:  # rows [2, 8) recomputed for the turn starting at row 8
            redo = rows(6)
            put(key, first[:8], 0, "w1")
            put(key, redo, 2, "w1", view=8)
            put(key, first[8:], 8, "w1")
            states.append([first[:8], np.concatenate([first[:2], redo, first[8:]])])
        elif n > 0:
            put(key, first, 0, "w1")
            states.append([first])
        else:
            states.append([first])
        ids.append(key)
    return ids, states


@pytest.mark.parametrize(
    ("tp", "cp", "pp", "vpp"), [(1, 1, 1, None), (2, 2, 2, None), (1, 2, 2, 2)]
)
def test_an_expanded_batch_replays_each_row_in_its_own_state_on_every_rank(
    verl: Verl,
    engine_env: Recorder,
    svc: Service,
    tp: int,
    cp: int,
    pp: int,
    vpp: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``expand_verl_batch`` on the driver, ``RankLocalReplay`` (exact, the default) on every
    (tp, cp, pp[, vp]) rank through verl's real ``forward_backward_batch``: the routers hold
    what verl's own R3 branch sets from a whole ``routed_experts`` laid out from each
    expanded row's own state; the unexpanded batch is refused at the rank, never replayed
    with one state for all its tokens."""
    model = MODELS[0]
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids, states = _store_straddled(client, model, seed=11 * tp + cp + pp)
        data = _rollout(verl, ids)
        exp = r3_verl.expand_verl_batch(data, client)
        origin = list(exp.non_tensor_batch["r3_origin"])
        state = list(exp.non_tensor_batch["r3_state"])
        assert origin == [0, 1, 2, 3, 4, 5, 5, 5, 6, 6] and state[5:] == [0, 3, 6, 0, 8]
        assert exp.meta_info["r3_expansion"]["extra_rows"] == 3
        # the whole-batch reference: verl_layout of each row's own state's rows
        plens = [PROMPTS[i] for i in origin]
        totals = exp.batch["attention_mask"].sum(dim=1).tolist()
        rlens = [t - p for t, p in zip(totals, plens, strict=True)]
        seen: dict[int, int] = {}
        own = []
        for i in origin:
            k = seen.get(i, 0)
            seen[i] = k + 1
            own.append(states[i][k])
        routings = [
            Routing.from_array(rows[: t - 1], num_experts=E, layer_ids=model.moe_ids)
            for rows, t in zip(own, totals, strict=True)
        ]
        routed = verl_layout(
            routings, plens, rlens, prompt_len=PROMPT_LEN, response_len=RESPONSE_LEN,
            num_layers=NUM_LAYERS,
        )  # fmt: skip
        whole_data = copy.deepcopy(exp)
        whole_data.batch["routed_experts"] = torch.from_numpy(routed)
        whole = _worker_batch(verl, whole_data)
        local = _worker_batch(verl, exp)
        plain = _worker_batch(verl, _rollout(verl, ids))
        chunks = megatron_chunks(pp, vpp)
        refused = 0
        for tp_rank, cp_rank, pp_rank in itertools.product(range(tp), range(cp), range(pp)):
            layers = [[i for i in chunks[pp_rank, vp] if model.freq[i]] for vp in range(vpp or 1)]
            set_rank(monkeypatch, tp, tp_rank, cp, cp_rank)
            replay = r3_verl.RankLocalReplay(client)
            engine = replay.attach(_engine(verl, model, layers, tp=tp, cp=cp))
            want = _run(verl, engine, engine_env, whole)
            got = _run(verl, engine, engine_env, local)
            _assert_same(got, want)
            # unexpanded: every rank that reads any row of a straddled sample refuses it
            source = CountingSource(client)
            engine = r3_verl.RankLocalReplay(source).attach(
                _engine(verl, model, layers, tp=tp, cp=cp)
            )
            try:
                _run(verl, engine, engine_env, plain)
            except InvalidRequestError as exc:
                refused += "expand the sample" in str(exc)
            else:
                read = {key for reads, _ in source.calls for key, *_ in reads}
                assert not read & {ids[5], ids[6]}, "a straddled sample replayed in one state"
        assert refused > 0
