"""``r3_client.integrations.verl`` through verl 0.9.1's own rollout code, against a real cache.

What runs is verl's (paths under ``site-packages/verl/``): ``AgentLoopManager.generate_sequences``
-> ``AgentLoopWorker.generate_sequences`` (a task per sample, hydra instantiating the
agent-loop config entries of docs/integrations.md, padding, ``_postprocess`` into a
``DataProto``) -> ``SingleTurnAgentLoop`` / ``ToolAgentLoop`` -> ``LLMServerClient`` /
``FullyAsyncLLMServerClient`` (its resume loop) -> ``SGLangHttpServer.generate``, which
builds SGLang's own ``GenerateReqInput``.  Ray is stubbed (an actor handle's ``.remote``
calls the object in this process); the manager, worker and server are made without their
``__init__``, which start Ray actors, load a model and launch SGLang.

SGLang's ``TokenizerManager`` is the engine, as far as verl can tell: it reads the tag with
the plugin's own parser (``sglang_r3.http_server.tagging.output_tags``), refuses what the plugin
refuses (``routed_experts_start_len`` on a tagged request, a turn that does not extend the
stored trajectory) and stores each call's new rows in the real service
(``service_single``), one segment per call with the plugin's token digest
(``sglang_r3/http_server/shipping.py:262``).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.abc
import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import types
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if any(importlib.util.find_spec(m) is None for m in ("verl", "hydra", "cachetools")):
    pytest.skip(
        "verl's agent loop is not installed: scripts/bootstrap.sh installs the `verl` extra "
        "(verl==0.9.1, hydra-core, cachetools) --no-deps",
        allow_module_level=True,
    )

from r3_client import (
    InvalidRequestError,
    RolloutNotFoundError,
    RoutingClient,
    Segment,
    ShapeError,
    canonical_rows,
    token_digest,
)
from r3_client.integrations import verl as r3_verl
from r3_client.layouts import verl_layout
from r3_client.synthetic import synthetic_routing
from sglang_r3.http_server.tagging import output_tags
from tests.support.service_process import KEY_A, Service

ROOT = Path(__file__).resolve().parents[2]
E, K = 8, 2
NUM_LAYERS, MOE_IDS, DENSE = 4, (1, 2, 3), (0,)
PROMPT_LEN, RESPONSE_LEN = 8, 16
VOCAB, CALL = 64, 9  # the tiny tokenizer's size; "w9" asks for the test tool
NEW = 4  # tokens a call generates when its budget allows


# ------------------------------------------------------------------ ray, verl


def _stand_in(name: str) -> Any:
    """A ray attribute the stub does not define: a class for a capitalised name, else a
    function that refuses to run (nothing here runs Ray)."""
    if name.startswith("__"):
        raise AttributeError(name)
    if name[:1].isupper():
        return _CLASSES.setdefault(name, type(name, (), {}))

    def absent(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"ray.{name} is a stub in tests/integrations/test_verl_glue.py")

    return absent


_CLASSES: dict[str, type] = {}


def _remote(*args: Any, **kwargs: Any) -> Any:
    """``@ray.remote`` and ``@ray.remote(...)``: the class or function unchanged."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


class _RayStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``ray.*`` submodules as empty modules of stand-ins."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.startswith("ray."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stand_in  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _stub_ray() -> None:
    """verl's agent loop imports ray and its submodules at module level (the ``verl``
    extra does not install it): stand-ins, in this process only.  Extends the smaller
    stub of test_verl_contract.py when that one came first."""
    ray = sys.modules.get("ray")
    if ray is None:
        if importlib.util.find_spec("ray") is not None:
            return  # the real ray
        ray = sys.modules["ray"] = types.ModuleType("ray")
    elif getattr(ray, "__file__", None):
        return
    ray.__path__ = []
    ray.__getattr__ = _stand_in  # type: ignore[method-assign]
    ray.remote = _remote  # type: ignore[attr-defined]
    if not any(isinstance(f, _RayStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _RayStub())


class Actor:
    """A Ray actor handle for ``obj``: ``handle.method.remote(...)`` runs it in this loop, on
    copies of the arguments, as Ray serializes them (SGLangHttpServer.generate pops keys off
    the ``sampling_params`` it is given)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)

        def remote(*args: Any, **kwargs: Any) -> Any:
            return asyncio.ensure_future(method(*copy.deepcopy(args), **copy.deepcopy(kwargs)))

        return types.SimpleNamespace(remote=remote)


class LoadBalancer:
    """verl's GlobalRequestLoadBalancer with one server (``llm_server.py:70-88``)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def require_acquire_fields(self) -> list[str]:
        return []

    async def require_release_fields(self) -> list[str]:
        return []

    async def acquire_server(self, request_id: str, **fields: Any) -> tuple[str, Actor]:
        return "s0", Actor(self.server)

    async def release_server(self, server_id: str, **fields: Any) -> None:
        return None


@dataclass
class Verl:
    """verl 0.9.1's classes this module drives."""

    registry: dict[str, Any]
    AgentLoopManager: Any
    AgentLoopWorker: Any
    LLMServerClient: Any
    FullyAsyncLLMServerClient: Any
    SGLangHttpServer: Any
    DataProto: Any
    FunctionTool: Any
    ToolSchema: Any


@pytest.fixture(scope="module")
def verl() -> Verl:
    _stub_ray()
    import verl as verl_pkg

    assert verl_pkg.__version__ == "0.9.1", verl_pkg.__version__
    from verl.experimental.agent_loop import agent_loop
    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
    from verl.protocol import DataProto
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer

    @ToolParser.register("r3_test")
    class CallParser(ToolParser):  # type: ignore[misc]
        """A response holding token w9 calls the tool ``lookup``."""

        async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> Any:
            calls = [FunctionCall(name="lookup", arguments="{}")] if CALL in responses_ids else []
            return self.tokenizer.decode(responses_ids), calls

    return Verl(
        agent_loop._agent_loop_registry,
        agent_loop.AgentLoopManager,
        agent_loop.AgentLoopWorker,
        LLMServerClient,
        FullyAsyncLLMServerClient,
        SGLangHttpServer,
        DataProto,
        FunctionTool,
        OpenAIFunctionToolSchema,
    )


# ------------------------------------------------------------------ the engine


class ConflictError(Exception):
    """What the plugin answers 409: a turn that does not extend the stored rollout."""


class Engine:
    """SGLang's TokenizerManager with the r3 plugin: tagged calls store their new rows."""

    def __init__(self, cache: RoutingClient) -> None:
        self.cache = cache
        self.version = "v1"
        self.requests: list[dict[str, Any]] = []  # what each GenerateReqInput carried
        self.tokens: dict[str, list[int]] = {}  # stored trajectory per rollout
        self.truth: dict[str, np.ndarray] = {}  # rows stored per rollout, MoE layers only
        self.abort_after: int | None = None  # the next call is aborted after this many tokens
        self.on_abort: Callable[[], None] = lambda: None

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        """``TokenizerManager.generate_request`` as ``SGLangHttpServer.generate`` uses it
        (async_sglang_server.py:657): one output dict."""
        found = output_tags(obj.sampling_params, batch_size=1, n=1, max_outputs=16)
        tag = found[0] if found else None
        prompt = list(obj.input_ids)
        self.requests.append(
            {
                "tag": tag,
                "rid": obj.rid,
                "input_ids": prompt,
                "sampling_params": dict(obj.sampling_params),
                "return_routed_experts": obj.return_routed_experts,
            }
        )
        if tag is not None and obj.routed_experts_start_len:
            raise ValueError("the plugin refuses routed_experts_start_len on a tagged request")
        turn = sum(
            1 for r in self.requests if r["tag"] and tag and r["tag"].rollout_id == tag.rollout_id
        )
        budget = obj.sampling_params["max_new_tokens"]
        n, reason = (NEW, "stop") if budget >= NEW else (budget, "length")
        if self.abort_after is not None:
            n, reason, self.abort_after = min(n, self.abort_after), "abort", None
        base = 10 + (7 * len(self.requests)) % 40
        out = [base + i for i in range(n)]
        if turn == 1 and n > 0:
            out[0] = CALL  # a first turn asks for the tool (ToolAgentLoop calls it)
        self.requests[-1]["output_ids"] = out
        if tag is not None:
            self._store(tag.rollout_id, tag.weight_version or self.version, prompt + out)
        if reason == "abort":
            self.on_abort()
        yield {
            "output_ids": out,
            "meta_info": {
                "finish_reason": {"type": reason},
                "output_token_logprobs": [(-0.5, t, None) for t in out],
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
            },
        }

    def rows(self, key: str, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)`` of a rollout, each sorted (the cache keeps rows sorted)."""
        seed = zlib.crc32(f"{key}:{start}".encode())
        return canonical_rows(synthetic_routing(end - start, len(MOE_IDS), E, K, seed=seed), E)

    def _store(self, key: str, version: str, tokens: list[int]) -> None:
        have = self.tokens.get(key, [])
        if tokens[: len(have)] != have:
            raise ConflictError(f"rollout {key} does not continue its stored trajectory")
        start, end = max(0, len(have) - 1), len(tokens) - 1
        self.tokens[key] = tokens
        if end <= start:
            return
        rows = self.rows(key, start, end)
        seg = Segment(start, end, "tiny-moe", version, token_digest(tokens[:end]))
        self.cache.put(key, rows, num_experts=E, layer_ids=MOE_IDS, segment=seg)
        self.truth[key] = np.concatenate([self.truth.get(key, rows[:0]), rows])


# ------------------------------------------------------------------ verl, assembled


def tokenizer() -> Any:
    """The word-level tokenizer of sglang_r3.tools.local_stack's tiny models ("w{id}" per token)."""
    from sglang_r3.tools.local_stack import tiny_tokenizer

    return tiny_tokenizer(VOCAB)


def config(**rollout: Any) -> Any:
    """verl's config, the keys this path reads (verl/trainer/config/rollout/rollout.yaml)."""
    from omegaconf import OmegaConf

    base: dict[str, Any] = {
        "name": "sglang",
        "enable_rollout_routing_replay": False,
        "prompt_length": PROMPT_LEN,
        "response_length": RESPONSE_LEN,
        "max_model_len": 64,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "calculate_log_probs": True,
        "full_determinism": False,
        "skip_tokenizer_init": False,
        "mtp": None,
        "val_kwargs": {"temperature": 0, "top_p": 1.0, "top_k": -1},
        "agent": {"default_agent_loop": "r3_single_turn_agent"},
        "multi_turn": {
            "max_user_turns": 4,
            "max_assistant_turns": 4,
            "max_parallel_calls": 1,
            "max_tool_response_length": 32,
            "tool_response_truncate_side": "left",
            "format": "r3_test",
        },
    }
    base.update(rollout)
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": base},
            "data": {"apply_chat_template_kwargs": {}},
            "async_training": {"partial_rollout": True},
        }
    )


@dataclass
class Rig:
    engine: Engine
    manager: Any  # verl's AgentLoopManager


def rig(
    verl: Verl,
    cache: RoutingClient,
    *,
    fully_async: bool = False,
    engine_cls: type[Engine] = Engine,
    **rollout: Any,
) -> Rig:
    """verl's manager -> worker -> agent loops -> LLM client -> SGLang server, one process."""
    cfg = config(**rollout)
    engine = engine_cls(cache)
    server = object.__new__(verl.SGLangHttpServer)
    server.__dict__.update(
        config=cfg.actor_rollout_ref.rollout,
        model_config=types.SimpleNamespace(lora_rank=0, lora={}, hf_config=None),
        _disaggregation_role="null",
        tokenizer_manager=engine,
        global_steps=1,
        replica_rank=0,
    )
    client_cls = verl.FullyAsyncLLMServerClient if fully_async else verl.LLMServerClient
    llm = client_cls(cfg, load_balancer_handle=Actor(LoadBalancer(server)))
    lookup = verl.FunctionTool(
        name="lookup",
        fn=lambda: "w7 w8",
        tool_schema=verl.ToolSchema.model_validate(
            {"type": "function", "function": {"name": "lookup", "description": "look up"}}
        ),
    )
    worker = object.__new__(verl.AgentLoopWorker)
    worker.__dict__.update(
        config=cfg,
        llm_client=llm,
        rollout_config=cfg.actor_rollout_ref.rollout,
        tokenizer=tokenizer(),
        processor=None,
        hf_model_type=None,
        dataset_cls=None,
        tools=[lookup],
        reward_loop_worker_handles=None,
        teacher_client=None,
        distillation_enabled=False,
        mm_processor_kwargs={},
    )
    manager = object.__new__(verl.AgentLoopManager)
    manager.agent_loop_workers = [Actor(worker)]
    return Rig(engine, manager)


def section(title: str) -> str:
    text = (ROOT / "docs" / "integrations.md").read_text()
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/integrations.md has a '## {title}' section"
    return m.group(0)


def block(lang: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", section("verl 0.9.1"), flags=re.S)
    assert len(blocks) == 1, f"the verl section shows one {lang} block"
    return str(blocks[0])


@pytest.fixture(scope="module")
def routed(verl: Verl, tmp_path_factory: pytest.TempPathFactory) -> None:
    """docs/integrations.md's agent-loop config file, registered the way
    AgentLoopWorker.__init__ reads ``agent_loop_config_path`` (agent_loop.py:534-539)."""
    from omegaconf import OmegaConf

    path = tmp_path_factory.mktemp("verl") / "r3_agent_loops.yaml"
    path.write_text(block("yaml"))
    for entry in OmegaConf.load(path):
        verl.registry[entry.name] = entry


@pytest.fixture
def cache(service_single: Service) -> Iterator[RoutingClient]:
    with RoutingClient(service_single.http_url, api_key=KEY_A) as c:
        yield c


def prompts(verl: Verl, texts: list[str], n: int, agent: str | None = None, **meta: Any) -> Any:
    """A generation batch as RayPPOTrainer.fit builds it: ``n`` copies of each prompt,
    interleaved (ray_trainer.py:1488)."""
    raw = np.empty(len(texts), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    extra: dict[str, Any] = {
        "raw_prompt": raw,
        "uid": np.array([f"u{i}" for i in range(len(texts))], dtype=object),
    }
    if agent is not None:
        extra["agent_name"] = np.array([agent] * len(texts), dtype=object)
    batch = verl.DataProto.from_dict(non_tensors=extra, meta_info=meta)
    return batch.repeat(repeat_times=n, interleave=True)


def spans(batch: Any, i: int) -> tuple[int, int, int]:
    """(prompt_len, this sample's prompt tokens, its response tokens) from attention_mask."""
    plen = int(batch.batch["prompts"].shape[1])
    mask = batch.batch["attention_mask"][i]
    return plen, int(mask[:plen].sum()), int(mask[plen:].sum())


def sample_tokens(batch: Any, i: int) -> list[int]:
    plen, p, r = spans(batch, i)
    return [int(t) for t in batch.batch["input_ids"][i, plen - p : plen + r]]


def check_attached(batch: Any, cache: RoutingClient, engine: Engine) -> list[str]:
    """``routed_experts`` is exactly verl_layout's output for the stored rollouts, int16, and
    holds what the engine stored at each sample's tokens (dense layers 0); returns the ids."""
    ids = [str(i) for i in batch.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]]
    plen = int(batch.batch["prompts"].shape[1])
    rlen = int(batch.batch["responses"].shape[1])
    lens = [spans(batch, i)[1:] for i in range(len(ids))]
    want = verl_layout(
        [cache.get(key) for key in ids],
        [p for p, _ in lens],
        [r for _, r in lens],
        prompt_len=plen,
        response_len=rlen,
        num_layers=NUM_LAYERS,
    )
    got = batch.batch["routed_experts"]
    assert got.dtype == torch.int16 and got.shape == (len(ids), plen + rlen, NUM_LAYERS, K)
    assert torch.equal(got, torch.from_numpy(want))
    for i, key in enumerate(ids):
        p, r = lens[i]
        rows = got[i, plen - p : plen + r - 1].numpy()
        assert np.array_equal(rows[:, list(MOE_IDS)], engine.truth[key])
        assert not rows[:, list(DENSE)].any()
        assert engine.tokens[key] == sample_tokens(batch, i)
    return ids


# ------------------------------------------------------------------ rollout side


@pytest.fixture
def recipe_env(monkeypatch: pytest.MonkeyPatch, service_single: Service) -> None:
    for k, v in {
        "R3_URL": service_single.http_url,
        "R3_KEY": KEY_A,
        "R3_NUM_LAYERS": str(NUM_LAYERS),
    }.items():
        monkeypatch.setenv(k, v)


def test_doc_recipe_routes_a_group_through_verls_rollout(
    verl: Verl, routed: None, cache: RoutingClient, recipe_env: None
) -> None:
    """The docs' YAML entries and python block, as written: a group of two prompts x two
    samples through verl's manager; each sample's request carries its own rollout id and
    asks for no inline routing; the trainer's batch gets routed_experts equal to
    verl_layout's output; a validation batch is not fetched."""
    r = rig(verl, cache)
    ns: dict[str, Any] = {}
    exec(compile(block("python"), "docs/integrations.md#verl", "exec"), ns)
    try:
        trainer = types.SimpleNamespace(async_rollout_manager=r.manager)
        ns["install_r3"](trainer)
        assert isinstance(trainer.async_rollout_manager, r3_verl.RoutedRolloutManager)
        out = trainer.async_rollout_manager.generate_sequences(
            prompts(verl, ["w5 w6", "w7 w8 w9"], n=2)
        )
        ids = check_attached(out, cache, r.engine)
        assert len(set(ids)) == 4 and all(re.fullmatch(r"verl\.[0-9a-f]{32}", i) for i in ids)
        assert sorted(req["tag"].rollout_id for req in r.engine.requests) == sorted(ids)
        assert not any(req["return_routed_experts"] for req in r.engine.requests)
        tags = [req["sampling_params"]["custom_params"]["r3"] for req in r.engine.requests]
        assert tags == [{"rollout_id": req["tag"].rollout_id} for req in r.engine.requests]
        assert sample_tokens(out, 0)[:2] == sample_tokens(out, 1)[:2] == [5, 6]  # a group
        # validation: generated (and stored) but not fetched
        before = len(r.engine.requests)
        val = trainer.async_rollout_manager.generate_sequences(
            prompts(verl, ["w5"], n=1, validate=True)
        )
        assert (
            "routed_experts" not in list(val.batch.keys()) and len(r.engine.requests) == before + 1
        )
    finally:
        ns["r3"].close()


@pytest.mark.parametrize("response_len", [RESPONSE_LEN, 9], ids=["whole", "cut"])
def test_multi_turn_trajectory_continues_one_rollout(
    verl: Verl, routed: None, cache: RoutingClient, response_len: int
) -> None:
    """verl's ToolAgentLoop: turn 1 calls the tool, turn 2 answers; both turns carry the
    trajectory's id (and the entry's share_prompt), turn 2's prompt extends what turn 1
    stored, so the rollout holds one segment per turn.  With response_length 9 verl cuts the
    response (tool_agent_loop.py:195): the attached rows are the rollout's first ones."""
    r = rig(verl, cache, response_length=response_len)
    batch = prompts(verl, ["w5 w6", "w7"], n=1, agent="r3_tool_agent")
    out = r.manager.generate_sequences(batch)
    ids = [str(i) for i in out.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]]
    assert list(out.non_tensor_batch["__num_turns__"]) == [4, 4]  # user, assistant, tool, assistant
    for key in ids:
        turns = [req for req in r.engine.requests if req["tag"].rollout_id == key]
        assert len(turns) == 2 and all(t["tag"].share_prompt is True for t in turns)
        stored = turns[0]["input_ids"] + turns[0]["output_ids"]  # turn 1, with its tool call
        assert CALL in turns[0]["output_ids"] and CALL not in turns[1]["output_ids"]
        assert turns[1]["input_ids"][: len(stored)] == stored  # + the tool's answer
        assert len(turns[1]["input_ids"]) > len(stored)
        segs = cache.stat(key).segments
        assert len(segs) == 2 and segs[0].segment.end == segs[1].segment.start
    r3_verl.attach_routed_experts(out, cache, num_layers=NUM_LAYERS)
    if response_len == RESPONSE_LEN:
        check_attached(out, cache, r.engine)
        assert (out.batch["response_mask"] == 0).any()  # the tool's tokens are in the response
        return
    plen = int(out.batch["prompts"].shape[1])
    for i, key in enumerate(ids):
        _, p, resp = spans(out, i)
        assert resp == response_len < len(r.engine.tokens[key]) - p  # verl cut it
        assert r.engine.tokens[key][: p + resp] == sample_tokens(out, i)
        rows = out.batch["routed_experts"][i, plen - p : plen + resp - 1].numpy()
        assert np.array_equal(rows[:, list(MOE_IDS)], r.engine.truth[key][: p + resp - 1])
        assert not out.batch["routed_experts"][i, plen + resp - 1 :].any()


def test_resumed_partial_rollout_keeps_its_id(
    verl: Verl, routed: None, cache: RoutingClient
) -> None:
    """FullyAsyncLLMServerClient resumes a request aborted by a weight update with the tokens
    so far (llm_server.py:289-345): the resume carries the same rollout id, the engine stores
    only its new rows (under v1, then v2), and the attached rows equal verl_layout's."""
    r = rig(verl, cache, fully_async=True)
    r.engine.abort_after = 2
    r.engine.on_abort = lambda: setattr(r.engine, "version", "v2")
    out = r.manager.generate_sequences(prompts(verl, ["w5 w6 w7"], n=1))
    r3_verl.attach_routed_experts(out, cache, num_layers=NUM_LAYERS)
    (key,) = check_attached(out, cache, r.engine)
    assert [req["tag"].rollout_id for req in r.engine.requests] == [key, key]
    first, second = r.engine.requests
    assert len(first["output_ids"]) == 2  # aborted there
    assert second["input_ids"] == first["input_ids"] + first["output_ids"]
    p = len(first["input_ids"])
    got = [
        (s.segment.start, s.segment.end, s.segment.weight_version) for s in cache.stat(key).segments
    ]
    assert got == [(0, p + 1, "v1"), (p + 1, p + 2 + NEW - 1, "v2")]


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"enable_rollout_routing_replay": True}, "enable_rollout_routing_replay=False"),
        ({"name": "vllm"}, "not 'sglang'"),
    ],
)
def test_a_config_that_would_not_store_routing_is_refused(
    verl: Verl, routed: None, cache: RoutingClient, setting: dict[str, Any], match: str
) -> None:
    r = rig(verl, cache, **setting)
    with pytest.raises(ValueError, match=match):
        r.manager.generate_sequences(prompts(verl, ["w5"], n=1))
    assert r.engine.requests == []


# ------------------------------------------------------------------ trainer side


def test_missing_partial_and_foreign_rollouts_fail_loudly(
    verl: Verl, routed: None, cache: RoutingClient
) -> None:
    """Each refusal names the sample and rollout and leaves the batch without the field."""
    r = rig(verl, cache)
    out = r.manager.generate_sequences(prompts(verl, ["w5 w6", "w7 w8 w9"], n=1))
    ids = [str(i) for i in out.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]]
    tokens = sample_tokens(out, 1)
    run = f"{ids[1]}-bad"

    def refused(exc: type[Exception], match: str, rollout_ids: list[str] | None) -> None:
        with pytest.raises(exc, match=match):
            r3_verl.attach_routed_experts(out, cache, rollout_ids, num_layers=NUM_LAYERS)
        assert "routed_experts" not in list(out.batch.keys())

    refused(RolloutNotFoundError, re.escape(f"{run}.missing"), [ids[0], f"{run}.missing"])
    # partial: the engine stored all but the last two tokens' rows
    r.engine._store(f"{run}.partial", "v1", tokens[:-2])
    refused(
        ShapeError,
        rf"verl sample 1, rollout '{re.escape(run)}\.partial'.*partial",
        [ids[0], f"{run}.partial"],
    )
    # a rollout that went on past the sample, whose response verl did not cut
    r.engine._store(f"{run}.longer", "v1", [*tokens, 11, 12])
    refused(ShapeError, r"was not cut at response_length", [ids[0], f"{run}.longer"])
    # another sample's rows: same length, other tokens
    r.engine._store(f"{run}.other", "v1", [t + 1 for t in tokens])
    refused(ShapeError, r"other tokens than the sample's", [ids[0], f"{run}.other"])
    # rows nobody shipped: segments [0, 2) and [4, end), rows 2..3 never stored
    gap, end = f"{run}.gap", len(tokens) - 1
    for a, b in ((0, 2), (4, end)):
        seg = Segment(a, b, "tiny-moe", "v1")
        cache.put(gap, r.engine.rows(gap, a, b), num_experts=E, layer_ids=MOE_IDS, segment=seg)
    refused(
        ShapeError,
        rf"verl sample 1's routing has no recorded route.*'{re.escape(gap)}'",
        [ids[0], gap],
    )
    filled = r3_verl.attach_routed_experts(
        out, cache, [ids[0], gap], num_layers=NUM_LAYERS, missing="fill"
    )
    plen, p, _ = spans(out, 1)
    assert not filled.batch["routed_experts"][1, plen - p + 2 : plen - p + 4].any()
    out.batch.pop("routed_experts")
    # ids shared, absent or miscounted are refused before any fetch
    refused(ValueError, "share rollout id", [ids[0], ids[0]])
    refused(ValueError, "2 samples", [ids[0]])
    refused(ValueError, "verl sample 1 has no rollout id", [ids[0], ""])
    out.non_tensor_batch.pop(r3_verl.ROLLOUT_ID_KEY)
    refused(ValueError, "not routed", None)
    # and with the ids given explicitly, a good batch attaches
    out.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY] = np.array(ids, dtype=object)
    r3_verl.attach_routed_experts(out, cache, ids, num_layers=NUM_LAYERS)
    check_attached(out, cache, r.engine)


def test_routed_agent_loop_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ImportError, match="no_such_module"):
        r3_verl.routed_agent_loop("no_such_module.Loop")
    with pytest.raises(TypeError, match="not a class"):
        r3_verl.routed_agent_loop("os.path.join")
    with pytest.raises(InvalidRequestError):
        r3_verl.routed_agent_loop("os.PathLike", prefix="bad/prefix")


def test_importing_the_verl_glue_imports_no_framework() -> None:
    code = (
        "import sys, r3_client.integrations.verl\n"
        "bad = {'verl', 'torch', 'ray', 'hydra', 'httpx', 'grpc', 'sglang', 'sglang_r3'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ views (docs/store.md)

RECOMPUTED_FROM = 2  # a call that recomputes stored positions redoes rows [2, its own start)


class RecomputingEngine(Engine):
    """A next turn finds its radix cache flushed (a weight push between turns) and
    recomputes rows ``[2, serves)`` of the trajectory it continues, shipping them first as
    the view serving its own rows (``serves``: where its segment starts), as the plugin does."""

    def __init__(self, cache: RoutingClient) -> None:
        super().__init__(cache)
        self.recomputed: dict[str, tuple[int, np.ndarray]] = {}  # key -> (serves, rows)

    def _store(self, key: str, version: str, tokens: list[int]) -> None:
        serves = len(self.tokens.get(key, [])) - 1
        if serves > RECOMPUTED_FROM and len(tokens) - 1 > serves:
            rows = self.rows(f"{key}:recomputed", RECOMPUTED_FROM, serves)
            seg = Segment(
                RECOMPUTED_FROM, serves, "tiny-moe", version, token_digest(tokens[:serves])
            )
            self.cache.put(key, rows, num_experts=E, layer_ids=MOE_IDS, segment=seg, view=serves)
            self.recomputed[key] = (serves, rows)
        super()._store(key, version, tokens)

    def latest(self, key: str) -> np.ndarray:
        """The MoE rows the trajectory's last turn attended to."""
        rows = self.truth[key].copy()
        serves, recomputed = self.recomputed[key]
        rows[RECOMPUTED_FROM:serves] = recomputed
        assert not np.array_equal(rows, self.truth[key])  # the view really differs
        return rows


def test_a_rollout_with_a_view_yields_the_latest_rows_when_asked(
    verl: Verl, routed: None, cache: RoutingClient
) -> None:
    """ToolAgentLoop's second turn recomputed part of the trajectory (a view): the
    RoutedRolloutManager with view="latest" attaches what that turn attended to (verl#6054's
    answer), equal to verl_layout of the client's latest reads; the default attaches the
    first computations; exact is refused."""
    r = rig(verl, cache, engine_cls=RecomputingEngine)
    engine = r.engine
    assert isinstance(engine, RecomputingEngine)
    manager = r3_verl.RoutedRolloutManager(r.manager, cache, num_layers=NUM_LAYERS, view="latest")
    out = manager.generate_sequences(prompts(verl, ["w5 w6", "w7"], n=1, agent="r3_tool_agent"))
    ids = [str(i) for i in out.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]]
    plen = int(out.batch["prompts"].shape[1])
    rlen = int(out.batch["responses"].shape[1])
    lens = [spans(out, i)[1:] for i in range(len(ids))]
    want = verl_layout(
        [cache.get(key, view="latest") for key in ids],
        [p for p, _ in lens],
        [n for _, n in lens],
        prompt_len=plen,
        response_len=rlen,
        num_layers=NUM_LAYERS,
    )
    assert torch.equal(out.batch["routed_experts"], torch.from_numpy(want))
    for i, key in enumerate(ids):
        assert [v.serves for v in cache.stat(key).views] == [engine.recomputed[key][0]]
        p, n = lens[i]
        rows = out.batch["routed_experts"][i, plen - p : plen + n - 1].numpy()
        assert np.array_equal(rows[:, list(MOE_IDS)], engine.latest(key))
    r3_verl.attach_routed_experts(out, cache, num_layers=NUM_LAYERS, view="generated")
    check_attached(out, cache, engine)
    # exact, the default: a sample spanning two routing states is refused, never attached
    # with one of them; expanded (one row per state) each row gets its own state's rows
    with pytest.raises(InvalidRequestError, match="expand the sample"):
        r3_verl.attach_routed_experts(out, cache, num_layers=NUM_LAYERS)
    with pytest.raises(InvalidRequestError, match="expand first"):
        r3_verl.expand_verl_batch(out, cache)  # routed_experts attached: one per sample
    out.batch.pop("routed_experts")
    exp = r3_verl.expand_verl_batch(out, cache)
    assert exp.meta_info["r3_expansion"]["extra_rows"] == len(ids)  # each sample: 2 states
    r3_verl.attach_routed_experts(exp, cache, num_layers=NUM_LAYERS)
    for j, key in enumerate(exp.non_tensor_batch[r3_verl.ROLLOUT_ID_KEY]):
        i, state = (
            int(exp.non_tensor_batch["r3_origin"][j]),
            int(exp.non_tensor_batch["r3_state"][j]),
        )
        p, _ = lens[i]
        n = int(exp.batch["attention_mask"][j].sum())
        rows = exp.batch["routed_experts"][j, plen - p : plen - p + n - 1].numpy()
        served = {s.serves_start: s for s in cache.get_served(str(key))}[state]
        want_rows = served.routing.indices[: n - 1]
        assert np.array_equal(np.sort(rows[:, list(MOE_IDS)], -1), np.sort(want_rows, -1))
