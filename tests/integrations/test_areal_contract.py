"""AReaL 1.0.4's own remote-engine code, with ``r3_client.integrations.areal``, against a real
SGLang with our plugin and the real cache (docs/integrations.md, "AReaL 1.0.4 (PyPI)").

Nothing of AReaL's is restated here; its code runs (paths inside the wheel):

* the request: ``SGLangBackend.build_generation_request`` (``areal/engine/sglang_remote.py:44-90``)
  of a ``RemoteSGLangEngine`` the glue is installed on, sent by AReaL's HTTP helper
  ``arequest_with_retry`` (``areal/infra/utils/http.py:128``) and read back by its parser
  ``parse_generation_response`` (``sglang_remote.py:92-126``);
* the response: ``RemoteInfEngine.agenerate`` (``areal/infra/remote_inf_engine.py:781-946``), its
  resume loop (``:849-915``) and its inline decoding, on an engine set up by AReaL's own
  ``initialize(addr=...)``;
* a weight update in the middle of a generation, the way AReaL's trainer does one from disk:
  ``rollout.pause()`` (``areal/trainer/rl_trainer.py:754``), then the actor's
  ``_update_weights_from_disk`` (``areal/engine/fsdp_engine.py:1665-1686``: ``pause_generation``,
  ``update_weights_from_disk`` -- which posts ``abort_all_requests: true`` once the name
  resolver holds the save's timestamp --, ``continue_generation``), ``set_version(new)``
  (``rl_trainer.py:775``) and ``resume()`` (``:859``);
* the docs recipe as written, on AReaL's real ``RLVRWorkflow`` (``areal/workflow/rlvr.py``).

AReaL is installed ``--no-deps`` (scripts/bootstrap.sh, the ``areal`` extra in pyproject.toml)
with what its imports need.  Its package ``__init__`` also imports ray (its Ray scheduler,
launcher and name resolver) and hydra (its command-line config loader); neither is on this
path, so where they are not installed stubs stand in for them while AReaL is imported, in
this process only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from cache_service.redis_proc import free_port
from r3_client import AsyncRoutingClient
from r3_client.integrations.areal import rollout as r3_areal
from sglang_r3.tools.local_stack import EngineServer, build_tiny_model, start_engine
from tests.support.engine_fixtures import (  # noqa: F401  (fixtures, found by pytest by name)
    engine_cache,
    glm_engine,
    qwen_engine,
    tiny_models,
)
from tests.support.service_process import KEY_A, Service
from tests.support.stubs import StubModule, installed

if importlib.util.find_spec("areal") is None:
    pytest.skip(
        "AReaL is not installed: scripts/bootstrap.sh installs areal==1.0.4 --no-deps "
        "(the `areal` extra in pyproject.toml)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
NUM_LAYERS, TOPK = 3, 2  # the tiny checkpoints (sglang_r3.tools.local_stack.build_tiny_model)
PROMPT = [21 + i for i in range(24)]


# ------------------------------------------------------------------ AReaL, imported


def _stubs() -> dict[str, types.ModuleType]:
    """ray and hydra as AReaL's package import reaches them, where they are not installed.

    ``@ray.remote`` decorates a class at import (``areal/utils/name_resolve.py:779``); no Ray
    cluster exists (``ray.is_initialized()`` is False).
    """
    names = {
        "ray": ("ray.exceptions", "ray.runtime_env", "ray.util.placement_group",
                "ray.util.scheduling_strategies", "ray.cloudpickle", "ray.actor"),
        "hydra": ("hydra.core.global_hydra",),
    }  # fmt: skip
    out: dict[str, types.ModuleType] = {}
    for top, subs in names.items():
        if installed(top):
            continue
        for full in (top, *subs):
            parts = full.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in out:
                    out[name] = StubModule(name)
                    out[name].__path__ = []
                    if i > 1:
                        setattr(out[".".join(parts[: i - 1])], parts[i - 1], out[name])
    if "ray" in out:
        ray: Any = out["ray"]
        ray.remote = lambda obj=None, **options: obj if obj is not None else (lambda o: o)
        ray.is_initialized = lambda: False
    return out


@dataclass(frozen=True)
class Areal:
    """AReaL 1.0.4's classes and functions this module drives."""

    RemoteSGLangEngine: Any
    InferenceEngineConfig: Any
    GenerationHyperparameters: Any
    NameResolveConfig: Any
    ModelRequest: Any
    WeightUpdateMeta: Any
    arequest_with_retry: Callable[..., Any]
    remote_inf_engine: types.ModuleType
    name_resolve: types.ModuleType
    names: types.ModuleType


@pytest.fixture(scope="module")
def areal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Areal]:
    """AReaL imported, with the stubs in ``sys.modules`` while this module runs."""
    with pytest.MonkeyPatch.context() as mp:
        for name, module in _stubs().items():
            mp.setitem(sys.modules, name, module)
        import areal as areal_pkg
        from areal.api.cli_args import (
            GenerationHyperparameters,
            InferenceEngineConfig,
            NameResolveConfig,
        )
        from areal.api.io_struct import ModelRequest, WeightUpdateMeta
        from areal.engine.sglang_remote import RemoteSGLangEngine
        from areal.infra import remote_inf_engine
        from areal.infra.utils.http import arequest_with_retry
        from areal.utils import name_resolve, names

        assert areal_pkg.__version__ == "1.0.4", areal_pkg.__version__
        # Disk weight updates wait for the trainer's "saved" record in AReaL's name
        # resolver: its file-backed one, in a temporary directory.
        root = tmp_path_factory.mktemp("names")
        name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(root)))
        yield Areal(
            RemoteSGLangEngine,
            InferenceEngineConfig,
            GenerationHyperparameters,
            NameResolveConfig,
            ModelRequest,
            WeightUpdateMeta,
            arequest_with_retry,
            remote_inf_engine,
            name_resolve,
            names,
        )


@pytest.fixture
def make_engine(areal: Areal) -> Iterator[Callable[[EngineServer], Any]]:
    """``make_engine(server)``: a ``RemoteSGLangEngine`` set up by AReaL's ``initialize`` on
    the server's address, with ``rollout.return_routed_experts`` on (as a run that wants
    routing sets it); destroyed after the test."""
    made: list[Any] = []

    def make(server: EngineServer) -> Any:
        config = areal.InferenceEngineConfig(
            experiment_name="r3",
            trial_name=f"t{uuid.uuid4().hex[:8]}",
            backend="sglang:d1",
            return_routed_experts=True,
            request_timeout=120,
            setup_timeout=60,
        )
        engine = areal.RemoteSGLangEngine(config)
        engine.initialize(addr=server.url.removeprefix("http://"), train_data_parallel_size=1)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.destroy()


def fixture(request: pytest.FixtureRequest, name: str) -> Any:
    """A fixture of tests/support/engine_fixtures.py (imported above, as the adversarial
    suite does), by name: the session's cache service, engines and checkpoints."""
    return request.getfixturevalue(name)


@pytest.fixture
async def r3(request: pytest.FixtureRequest) -> AsyncIterator[AsyncRoutingClient]:
    """The trainer's client of the cache the engines ship to."""
    cache: Service = fixture(request, "engine_cache")
    async with AsyncRoutingClient(cache.http_url, api_key=KEY_A) as client:
        yield client


def greedy(areal: Areal, new: int, **kw: Any) -> Any:
    return areal.GenerationHyperparameters(max_new_tokens=new, greedy=True, **kw)


def as_sets(a: npt.ArrayLike) -> npt.NDArray[Any]:
    """AReaL's ``[rows, L*K]`` as ``[rows, L, K]`` sorted within each (token, layer)."""
    return np.sort(np.asarray(a).reshape(-1, NUM_LAYERS, TOPK), axis=-1)


# ------------------------------------------------------------------ (a) the request


async def test_areals_request_with_the_glue_is_stored_under_its_rid_without_inline_routing(
    request: pytest.FixtureRequest,
    areal: Areal,
    make_engine: Callable[[EngineServer], Any],
    r3: AsyncRoutingClient,
) -> None:
    """AReaL's request body, built by its backend for a request that asks for routing, gets
    the tag ``{rollout_id: rid, weight_version: AReaL's version}`` and loses
    ``return_routed_experts``; the rest is AReaL's.  The engine stores the routing under the
    rid (one row per token but the last, labelled with that version) and answers without
    inline routing, which AReaL's parser reads as ``routed_experts=None``."""
    server: EngineServer = fixture(request, "qwen_engine")
    engine = make_engine(server)
    req = areal.ModelRequest(
        input_ids=list(PROMPT), gconfig=greedy(areal, 6), metadata={"return_routed_experts": True}
    )
    backend = engine._engine.backend
    own = backend.build_generation_request(req.copy(), with_lora=False, version=3)
    assert own.payload["return_routed_experts"] is True  # sglang_remote.py:78-80
    assert "custom_params" not in own.payload["sampling_params"] and "rid" not in own.payload

    r3_areal.install(engine)
    sent = req.copy()
    http_req = engine._engine.backend.build_generation_request(sent, with_lora=False, version=3)
    payload = http_req.payload
    tag = {"rollout_id": req.rid, "weight_version": "3"}
    want = {k: v for k, v in own.payload.items() if k != "return_routed_experts"}
    want["sampling_params"] = {**own.payload["sampling_params"], "custom_params": {"r3": tag}}
    assert payload == want
    assert (http_req.endpoint, http_req.method) == ("/generate", own.method)
    # agenerate's copy no longer asks its loop to require inline routing (:886-895)
    assert "return_routed_experts" not in sent.metadata

    result = await areal.arequest_with_retry(
        addr=server.url.removeprefix("http://"),
        endpoint=http_req.endpoint,
        payload=payload,
        method=http_req.method,
        max_retries=1,
        timeout=120,
    )
    meta = result["meta_info"]
    assert meta.get("routed_experts") is None
    parsed = backend.parse_generation_response(result)
    assert parsed.routed_experts is None and parsed.stop_reason == "length"
    assert len(parsed.output_tokens) == 6 and parsed.output_tokens == result["output_ids"]
    rows = len(PROMPT) + 6 - 1
    assert meta["r3"]["stored"] is True and meta["r3"]["rollout_id"] == req.rid
    info = await r3.stat(req.rid)
    assert info.num_rows == rows and info.layer_ids == tuple(range(NUM_LAYERS))
    assert [(s.segment.start, s.segment.end, s.segment.weight_version) for s in info.segments] == [
        (0, rows, "3")
    ]


# ------------------------------------------------------------------ (b) the response


@pytest.mark.parametrize("server", ["qwen_engine", "glm_engine"])
async def test_routed_experts_from_the_cache_equal_areals_inline_ones(
    server: str,
    request: pytest.FixtureRequest,
    areal: Areal,
    make_engine: Callable[[EngineServer], Any],
    r3: AsyncRoutingClient,
) -> None:
    """The same greedy requests through AReaL's ``agenerate`` twice: as AReaL ships (inline
    ``return_routed_experts``, decoded by its parser into ``int32 [P+N-1, L*K]``) and with
    the glue (tagged, ``routed_experts`` filled from the cache).  Same tokens, same shape and
    dtype, the same experts per (token, layer); qwen: every layer MoE, glm: layer 0 dense.
    A group of samples sent at once, as AReaL's grouped workflow does, gets one rollout each."""
    engine_server: EngineServer = fixture(request, server)
    inline = make_engine(engine_server)
    # AReaL's inline routing is each position's first computation: generated, by name (the
    # default, exact, refuses a response whose tokens span several routing states)
    routed = r3_areal.RoutedEngine(
        make_engine(engine_server), r3, num_layers=NUM_LAYERS, view="generated"
    )
    dense = (0,) if server == "glm_engine" else ()
    for prompt, new in ((PROMPT, 8), ([5, 9, 200, 17, 33], 12)):
        want = await inline.agenerate(
            areal.ModelRequest(input_ids=list(prompt), gconfig=greedy(areal, new))
        )
        req = areal.ModelRequest(input_ids=list(prompt), gconfig=greedy(areal, new))
        got = await routed.agenerate(req)
        assert got.output_tokens == want.output_tokens and len(got.output_tokens) == new
        assert got.input_tokens == want.input_tokens == prompt
        shape = (len(prompt) + new - 1, NUM_LAYERS * TOPK)
        assert got.routed_experts.shape == want.routed_experts.shape == shape
        assert got.routed_experts.dtype == want.routed_experts.dtype == np.int32
        np.testing.assert_array_equal(as_sets(got.routed_experts), as_sets(want.routed_experts))
        for layer in dense:  # SGLang's inline array has zeros there; so has the glue's
            assert not as_sets(want.routed_experts)[:, layer].any()
        assert (await r3.stat(req.rid)).num_rows == shape[0]

    group = [areal.ModelRequest(input_ids=list(PROMPT), gconfig=greedy(areal, 8)) for _ in range(4)]
    want = await inline.agenerate(
        areal.ModelRequest(input_ids=list(PROMPT), gconfig=greedy(areal, 8))
    )
    answers = await asyncio.gather(*(routed.agenerate(r) for r in group))
    assert len({r.rid for r in group}) == 4
    for req, got in zip(group, answers, strict=True):
        assert got.output_tokens == want.output_tokens
        np.testing.assert_array_equal(as_sets(got.routed_experts), as_sets(want.routed_experts))
        assert (await r3.stat(req.rid)).num_rows == len(PROMPT) + 8 - 1


# ------------------------------------------------------------------ (c) abort + resume

NEW = 120  # tokens per interrupted request: ~5 s of decoding on the CPU engine


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of the same shape with different random weights."""
    root = tmp_path_factory.mktemp("areal-weights")
    return {
        name: build_tiny_model("qwen3_moe", root / name, seed=seed, init_std=0.2)
        for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def push_engine(
    request: pytest.FixtureRequest,
    weights: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """Its own engine: these tests change its weights."""
    cache: Service = fixture(request, "engine_cache")
    server = start_engine(
        weights["a"],
        port=free_port(),
        log=tmp_path_factory.mktemp("areal-push") / "sglang.log",
        routing_cache=cache.http_url,
        api_key=KEY_A,
    )
    yield server
    server.stop()


def areal_weight_update(areal: Areal, engine: Any, path: Path) -> None:
    """What AReaL's trainer does to load new weights from disk (the actor's rank 0):
    rl_trainer.py:754, fsdp_engine.py:1669-1686 (the save itself is the checkpoint at
    ``path``), rl_trainer.py:775 and :859.  Blocking, as AReaL calls it."""
    engine.pause()
    engine.pause_generation()
    meta = areal.WeightUpdateMeta(type="disk", path=str(path), clear_checkpoint_after_load=False)
    fut = engine.update_weights_from_disk(meta)
    config = engine.config
    key = areal.names.update_weights_from_disk(
        config.experiment_name, config.trial_name, engine.get_version()
    )
    areal.name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120)
    fut.result()
    engine.continue_generation()
    engine.set_version(engine.get_version() + 1)
    engine.resume()


async def decoding(server: EngineServer, past: int, within_s: float = 120) -> None:
    """Return once the engine holds a running request with more than ``past`` tokens."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < deadline:
            load = (await http.get(f"{server.url}/v1/loads")).json()["loads"][0]
            if load["num_running_reqs"] >= 1 and load["num_used_tokens"] > past:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError("the request never started decoding")


async def engine_version(server: EngineServer) -> str:
    """SGLang's own ``weight_version``."""
    async with httpx.AsyncClient(timeout=30) as http:
        return str((await http.get(f"{server.url}/model_info")).json()["weight_version"])


@dataclass
class Interrupted:
    """One AReaL ``agenerate`` aborted by a weight update and resumed."""

    response: Any
    calls: list[dict[str, Any]]  # the /generate payloads AReaL's loop sent
    n1: int  # tokens of the aborted call


async def interrupted_generation(
    areal: Areal,
    server: EngineServer,
    engine: Any,
    agenerate: Callable[[Any], Any],
    req: Any,
    new_weights: Path,
) -> Interrupted:
    """``agenerate(req)``, with AReaL's weight update to ``new_weights`` while it decodes."""
    calls: list[dict[str, Any]] = []
    send = areal.remote_inf_engine.arequest_with_retry

    async def recorded(**kwargs: Any) -> Any:
        if kwargs["endpoint"] == "/generate":
            calls.append(kwargs["payload"])
        return await send(**kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(areal.remote_inf_engine, "arequest_with_retry", recorded)
        task = asyncio.create_task(agenerate(req))
        await decoding(server, len(req.input_ids))
        await asyncio.to_thread(areal_weight_update, areal, engine, new_weights)
        response = await task
    v1 = engine.get_version() - 1
    n1 = response.output_versions.count(v1)
    # AReaL's own account: n1 tokens under the old version, the rest under the new one
    assert response.output_versions == [v1] * n1 + [v1 + 1] * (NEW - n1), response.output_versions
    assert 1 <= n1 < NEW and response.stop_reason == "length"
    assert (
        len(calls) == 2
        and calls[1]["input_ids"] == list(req.input_ids) + response.output_tokens[:n1]
    )
    return Interrupted(response, calls, n1)


async def test_a_request_aborted_for_a_weight_update_and_resumed_keeps_its_rollout(
    areal: Areal,
    push_engine: EngineServer,
    weights: dict[str, Path],
    make_engine: Callable[[EngineServer], Any],
    r3: AsyncRoutingClient,
) -> None:
    """With the glue, both of AReaL's calls carry the same rollout id and their version
    and no inline routing; the cache holds one row per token, the aborted call's rows
    under version 1 and the resumed call's under 2; ``routed_experts`` is ``[P+N-1, L*K]``."""
    engine = make_engine(push_engine)
    engine.set_version(1)
    routed = r3_areal.RoutedEngine(engine, r3, num_layers=NUM_LAYERS, view="generated")
    own_version = await engine_version(push_engine)
    req = areal.ModelRequest(input_ids=list(PROMPT), gconfig=greedy(areal, NEW, ignore_eos=True))
    run = await interrupted_generation(
        areal, push_engine, engine, routed.agenerate, req, weights["b"]
    )
    tags = [c["sampling_params"]["custom_params"]["r3"] for c in run.calls]
    assert tags == [
        {"rollout_id": req.rid, "weight_version": "1"},
        {"rollout_id": req.rid, "weight_version": "2"},
    ]
    assert not any("return_routed_experts" in c for c in run.calls)
    # AReaL's disk update names no version (sglang_remote.py:201-210): the engine's own
    # stays as it was; the labels below are AReaL's, carried by the tag.
    assert await engine_version(push_engine) == own_version

    rows = len(PROMPT) + NEW - 1
    boundary = len(PROMPT) + run.n1 - 1
    info = await r3.stat(req.rid)
    segments = [(s.segment.start, s.segment.end, s.segment.weight_version) for s in info.segments]
    assert sorted(segments) == [(0, boundary, "1"), (boundary, rows, "2")]
    assert info.num_rows == rows

    got = run.response.routed_experts
    assert got.shape == (rows, NUM_LAYERS * TOPK) and got.dtype == np.int32
    assert rows == len(run.response.input_tokens) + len(run.response.output_tokens) - 1
    stored = await r3.get(req.rid)
    np.testing.assert_array_equal(
        got, r3_areal.routed_experts(stored, rows + 1, num_layers=NUM_LAYERS)
    )
    assert (got >= 0).all() and (got < 8).all()


async def test_areals_inline_path_repeats_the_prefix_after_a_resume(
    areal: Areal,
    push_engine: EngineServer,
    weights: dict[str, Path],
    make_engine: Callable[[EngineServer], Any],
) -> None:
    """The defect the glue removes, reproduced: without it, AReaL concatenates each call's
    inline array (remote_inf_engine.py:903-905, 925-929), and the resumed call's covers the
    whole sequence again: ``(P + n1 - 1) + (P + N - 1)`` rows for ``P + N`` tokens."""
    engine = make_engine(push_engine)
    engine.set_version(1)
    req = areal.ModelRequest(input_ids=list(PROMPT), gconfig=greedy(areal, NEW, ignore_eos=True))
    run = await interrupted_generation(
        areal, push_engine, engine, engine.agenerate, req, weights["a"]
    )
    assert all(c.get("return_routed_experts") is True for c in run.calls)
    assert not any("custom_params" in c["sampling_params"] for c in run.calls)
    first = len(PROMPT) + run.n1 - 1
    whole = len(PROMPT) + NEW - 1
    assert run.response.routed_experts.shape == (first + whole, NUM_LAYERS * TOPK)


# ------------------------------------------------------------------ the docs recipe


def completion_length(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """A reward function (AReaL runs it in a process pool: it must pickle)."""
    return float(len(completion_ids))


def recipe() -> str:
    """The python block of docs/integrations.md's AReaL section."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    m = re.search(r"^## AReaL 1\.0\.4.*?(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, "docs/integrations.md has an AReaL 1.0.4 section"
    blocks = re.findall(r"```python\n(.*?)```", m.group(0), flags=re.S)
    assert len(blocks) == 1, "the AReaL section shows one recipe"
    return str(blocks[0])


async def test_docs_recipe_runs_on_areals_rlvr_workflow(
    request: pytest.FixtureRequest,
    areal: Areal,
    make_engine: Callable[[EngineServer], Any],
    r3: AsyncRoutingClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The recipe as written, subclassing AReaL's real ``RLVRWorkflow`` (chat template,
    request, reward, trajectory): every response it gets has ``routed_experts``
    ``[P+N-1, L*K]`` equal to the cache.  The trajectory dict RLVRWorkflow 1.0.4 returns
    carries no routing (rlvr.py:170-178): that is AReaL's to add (PR #1207)."""
    from transformers import AutoTokenizer

    cache: Service = fixture(request, "engine_cache")
    models: dict[str, Path] = fixture(request, "tiny_models")
    for k, v in {
        "R3_URL": cache.http_url,
        "R3_KEY": KEY_A,
        "R3_NUM_LAYERS": str(NUM_LAYERS),
    }.items():
        monkeypatch.setenv(k, v)
    filled: list[tuple[str, Any]] = []
    fill = r3_areal.fill_routed_experts

    async def spy(response: Any, client: Any, rollout_id: str, **kw: Any) -> None:
        await fill(response, client, rollout_id, **kw)
        filled.append((rollout_id, response))

    monkeypatch.setattr(r3_areal, "fill_routed_experts", spy)
    ns: dict[str, Any] = {}
    exec(compile(recipe(), "docs/integrations.md#areal", "exec"), ns)
    tokenizer = AutoTokenizer.from_pretrained(models["qwen3_moe"])
    engine = make_engine(fixture(request, "qwen_engine"))

    try:
        workflow = ns["R3RLVRWorkflow"](
            reward_fn=completion_length, gconfig=greedy(areal, 10), tokenizer=tokenizer
        )
        data = {"messages": [{"role": "user", "content": "route me"}]}
        trajectories = await asyncio.gather(
            *(workflow.arun_episode(engine, data) for _ in range(2))
        )
    finally:
        await ns["r3"].aclose()
        # the reward's process pool (areal/api/reward_api.py), otherwise shut at exit
        from areal.api.reward_api import AsyncRewardWrapper

        AsyncRewardWrapper._atexit_shutdown_all()
    assert len(filled) == 2 and filled[0][0] != filled[1][0]
    seqs = []
    for rollout, response in filled:
        seq = response.input_tokens + response.output_tokens
        seqs.append(seq)
        want = r3_areal.routed_experts(await r3.get(rollout), len(seq), num_layers=NUM_LAYERS)
        assert response.routed_experts.shape == (len(seq) - 1, NUM_LAYERS * TOPK)
        np.testing.assert_array_equal(response.routed_experts, want)
    for traj in trajectories:
        assert traj["input_ids"][0].tolist() in seqs
        assert traj["rewards"].item() == traj["loss_mask"].sum().item()  # the reward ran
        assert "routed_experts" not in traj
