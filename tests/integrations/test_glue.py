"""``r3_client.integrations``: slime, miles and AReaL glue against a real cache service.

The engine is a fake SGLang with our plugin, as far as the glue can tell: it reads the
tag with the plugin's own parser (``sglang_r3.http_server.tagging.output_tags``) or from the
``X-SMG-Routing-Key`` header, refuses what the plugin refuses, and stores each call's
new rows in the real service (``service_single``) as the plugin does, one segment per
call under the call's weight version.  slime, miles and AReaL are stub modules whose
``generate`` / request / resume code is restated minimally from the pinned lines
(slime @ 624b824, miles @ 31f1ca9, AReaL 1.0.4), as tests/integrations/
test_slime_miles_contract.py does; docs/integrations.md's recipes run as written.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
import re
import subprocess
import sys
import types
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3_client import (
    AsyncRoutingClient,
    InvalidRequestError,
    RolloutNotFoundError,
    Segment,
    ShapeError,
    canonical_rows,
)
from r3_client.integrations import areal as r3_areal
from r3_client.integrations import miles as r3_miles
from r3_client.integrations import slime as r3_slime
from r3_client.integrations import tags
from r3_client.layouts import miles_layout, slime_layout
from r3_client.synthetic import synthetic_routing
from sglang_r3.config import DEFAULT_TAG_HEADER
from sglang_r3.http_server.tagging import output_tags
from tests.support.service_process import KEY_A, Service

ROOT = Path(__file__).resolve().parents[2]
E, K = 8, 2
NUM_LAYERS, MOE_IDS = 6, (2, 3, 4, 5)  # dense first layers (DeepSeek-V3 style)
PROMPT = [11, 12, 13, 14, 15]
NEW = 4  # tokens an uninterrupted call generates before it stops


# ------------------------------------------------------------------ the engine


class ConflictError(Exception):
    """What the plugin answers 409: a turn that does not extend the stored rollout."""


class FakeEngine:
    """SGLang + the r3 plugin: tagged calls store their new rows in the real cache."""

    def __init__(self, client: AsyncRoutingClient, *, behind_router: bool) -> None:
        self.client = client
        self.behind_router = behind_router  # sglang-router drops custom_params
        self.version = "v1"  # the engine's own weight version
        self.tokens: dict[str, list[int]] = {}  # stored trajectory per rollout
        self.truth: dict[str, np.ndarray] = {}  # rows stored per rollout, MoE layers only
        self.calls: list[dict[str, Any]] = []  # what each call carried
        self.abort_after: int | None = None  # the next call is aborted after this many tokens
        self.on_abort: Callable[[], None] = lambda: None

    def _tag(self, payload: dict[str, Any], headers: dict[str, str] | None) -> Any:
        sp = payload.get("sampling_params") or {}
        if self.behind_router:
            sp = {k: v for k, v in sp.items() if k != "custom_params"}
        tagged = output_tags(sp, batch_size=1, n=1, max_outputs=16)
        header = {k.lower(): v for k, v in (headers or {}).items()}.get(DEFAULT_TAG_HEADER)
        if tagged:
            return tagged[0]
        if header:
            return types.SimpleNamespace(rollout_id=header, weight_version="", share_prompt=None)
        return None

    async def generate(
        self, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """One ``/generate`` call: the answer's ``meta_info`` as SGLang gives it."""
        tag = self._tag(payload, headers)
        inp = list(payload["input_ids"])
        self.calls.append({"tag": tag, "payload": copy.deepcopy(payload), "headers": headers})
        if tag is not None and "routed_experts_start_len" in payload:
            raise AssertionError("the plugin refuses routed_experts_start_len on a tagged request")
        budget = payload["sampling_params"]["max_new_tokens"]
        n, reason = (NEW, "stop") if budget >= NEW else (budget, "length")
        if self.abort_after is not None:
            n, reason, self.abort_after = min(n, self.abort_after), "abort", None
        out = [1000 * len(self.calls) + i for i in range(n)]  # sampled: differs per call
        tokens = inp + out
        meta: dict[str, Any] = {
            "output_token_logprobs": [(-0.5, t, None) for t in out],
            "prompt_tokens": len(inp),
            "completion_tokens": n,
            "finish_reason": {"type": reason},
            "weight_version": self.version,
        }
        if tag is not None:
            await self._store(tag.rollout_id, tag.weight_version or self.version, tokens)
        elif payload.get("return_routed_experts"):  # upstream's inline base64, all rows
            rows = self._rows("untagged", 0, len(tokens) - 1)
            meta["routed_experts"] = inline_b64(rows)
        if reason == "abort":
            self.on_abort()
        return meta

    def _rows(self, key: str, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)`` of a rollout, each sorted: rows are sets, kept sorted by
        the cache (``canonical_rows``), so the truth is kept that way too."""
        seed = zlib.crc32(f"{key}:{start}".encode())
        return canonical_rows(synthetic_routing(end - start, len(MOE_IDS), E, K, seed=seed), E)

    async def _store(self, key: str, version: str, tokens: list[int]) -> None:
        have = self.tokens.get(key, [])
        if tokens[: len(have)] != have:
            raise ConflictError(f"rollout {key} does not continue its stored trajectory")
        start = max(0, len(have) - 1)
        end = len(tokens) - 1
        self.tokens[key] = tokens
        if end <= start:
            return
        rows = self._rows(key, start, end)
        seg = Segment(start, end, "tiny-moe", version)
        await self.client.put(key, rows, num_experts=E, layer_ids=MOE_IDS, segment=seg)
        old = self.truth.get(key, rows[:0])
        self.truth[key] = np.concatenate([old, rows])


def inline_b64(moe_rows: np.ndarray) -> str:
    """Upstream SGLang's ``meta_info["routed_experts"]``: int32 ``[rows, num_hidden_layers,
    K]``, dense layers 0."""
    full = np.zeros((moe_rows.shape[0], NUM_LAYERS, K), dtype=np.int32)
    full[:, list(MOE_IDS)] = moe_rows
    return base64.b64encode(full.tobytes()).decode("ascii")


@pytest.fixture
async def client(service_single: Service) -> AsyncIterator[AsyncRoutingClient]:
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as c:
        yield c


@pytest.fixture
def run() -> str:
    """A run name no other test uses (each test stores its own rollouts)."""
    return f"run-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------ slime and miles, restated


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclasses.dataclass
class Sample:
    """The ``Sample`` fields used here (slime/utils/types.py:93-150, miles/utils/types.py:25-80)."""

    index: int | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    response_length: int = 0
    status: Status = Status.PENDING
    session_id: str | None = None  # slime
    routing_key: str | None = None  # miles
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout_routed_experts: Any = None
    Status = Status

    def reset_for_retry(self) -> None:
        """miles/utils/types.py:246-268: outputs cleared; index, routing_key, metadata kept."""
        self.tokens, self.response_length, self.rollout_routed_experts = [], 0, None
        self.status = Status.ABORTED


FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def _append(sample: Sample, meta: dict[str, Any], num_layers: int) -> None:
    """The answer into the sample (slime types.py:352-377 / miles sglang_rollout.py:238-275):
    new tokens appended; inline routing, when present, decoded over all tokens."""
    new = [t for _, t, _ in meta["output_token_logprobs"]]
    sample.tokens = sample.tokens + new
    sample.response_length += len(new)
    if "routed_experts" in meta:
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        sample.rollout_routed_experts = flat.reshape(len(sample.tokens) - 1, num_layers, -1)
    sample.status = FINISH[meta["finish_reason"]["type"]]


def slime_generate(engine: FakeEngine) -> Any:
    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        """slime/rollout/sglang_rollout.py:151-222, minimal."""
        assert sample.status in (Status.PENDING, Status.ABORTED)
        prompt_ids = sample.tokens or list(PROMPT)  # _prepare_prompt_ids, :42-61
        sampling_params["max_new_tokens"] -= sample.response_length
        if sampling_params["max_new_tokens"] == 0:
            sample.status = Status.TRUNCATED
            return sample
        payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
        if args.use_rollout_routing_replay:
            payload["return_routed_experts"] = True
        payload["input_ids"] = prompt_ids
        if not sample.tokens:
            sample.tokens = prompt_ids
        headers = None
        if sample.session_id and getattr(args, "router_policy", None) == "consistent_hashing":
            headers = {"X-SMG-Routing-Key": sample.session_id}
        _append(sample, await engine.generate(payload, headers), args.num_layers)
        return sample

    return generate


def miles_generate(engine: FakeEngine) -> Any:
    async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        """miles/rollout/sglang_rollout.py:141-275, minimal (routing headers:
        generate_utils/generate_endpoint_utils.py:37-49)."""
        assert sample.status in (Status.PENDING, Status.ABORTED)
        prompt_ids = list(PROMPT)  # tokenized prompt
        if sample.response_length > 0:
            sampling_params["max_new_tokens"] -= len(sample.tokens) - len(prompt_ids)
        payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
        if args.use_rollout_routing_replay:
            payload["return_routed_experts"] = True
        if sample.response_length > 0:
            payload["input_ids"] = sample.tokens
        else:
            payload["input_ids"] = prompt_ids
            if not sample.tokens:
                sample.tokens = prompt_ids
        headers = {"X-SMG-Routing-Key": sample.routing_key} if sample.routing_key else None
        _append(sample, await engine.generate(payload, headers), args.num_layers)
        return sample

    return generate


FRAMEWORKS = {
    "slime": (r3_slime, slime_generate, slime_layout, "session_id"),
    "miles": (r3_miles, miles_generate, miles_layout, "routing_key"),
}


def args_for(framework: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        use_rollout_routing_replay=True,  # turns the trainer's replay on, and inline asks
        num_layers=NUM_LAYERS,
        router_policy="consistent_hashing",  # slime
        sglang_router_policy="consistent_hashing",  # miles
    )


def stub_framework(monkeypatch: pytest.MonkeyPatch, framework: str, engine: FakeEngine) -> None:
    """``<framework>.rollout.sglang_rollout.generate`` and ``<framework>.utils.types.Sample``."""
    generate = FRAMEWORKS[framework][1](engine)
    for name in ("", ".rollout", ".utils"):
        monkeypatch.setitem(sys.modules, framework + name, types.ModuleType(framework + name))
    rollout = types.ModuleType(f"{framework}.rollout.sglang_rollout")
    rollout.generate = generate  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, rollout.__name__, rollout)
    typ = types.ModuleType(f"{framework}.utils.types")
    typ.Sample = Sample  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, typ.__name__, typ)


def params() -> dict[str, Any]:
    return {"max_new_tokens": 16, "temperature": 1.0}


async def check_filled(
    client: AsyncRoutingClient, engine: FakeEngine, sample: Sample, framework: str
) -> str:
    """The field equals the layout of what the cache holds, exactly; that is what the engine
    stored, one row per token but the last; returns the key."""
    _, _, layout, key_field = FRAMEWORKS[framework]
    key = getattr(sample, key_field)
    want = layout(await client.get(key), len(sample.tokens), num_layers=NUM_LAYERS)
    got = sample.rollout_routed_experts
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.shape == (len(sample.tokens) - 1, NUM_LAYERS, K)
    assert got.dtype == (np.int16 if framework == "slime" else np.int32)
    assert np.array_equal(got[:, list(MOE_IDS)], engine.truth[key])
    assert not got[:, [0, 1]].any()  # dense layers 0
    return str(key)


# ------------------------------------------------------------------ slime and miles


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_wrap_generate_keys_resumes_and_fills(
    framework: str, client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind sglang-router (header only): group siblings get distinct keys; a partial rollout
    aborted by a weight update keeps its key when resumed and the engine continues it (rows
    under v1 then v2, one segment each); the filled field is exactly the layout's output."""
    module, _, _, key_field = FRAMEWORKS[framework]
    engine = FakeEngine(client, behind_router=True)
    stub_framework(monkeypatch, framework, engine)
    generate_r3 = module.wrap_generate(run=run, client=client, num_layers=NUM_LAYERS)
    args = args_for(framework)
    group = [Sample(index=i) for i in (40, 41)]

    engine.abort_after = 2
    engine.on_abort = lambda: setattr(engine, "version", "v2")  # a weight update aborted it
    for s in group:
        assert await generate_r3(args, s, params()) is s
    partial, done = group
    assert partial.status is Status.ABORTED and partial.rollout_routed_experts is None
    assert done.status is Status.COMPLETED
    await check_filled(client, engine, done, framework)

    assert await generate_r3(args, partial, params()) is partial  # the partial rollout resumes
    key = await check_filled(client, engine, partial, framework)
    keys = [c["tag"].rollout_id for c in engine.calls]
    assert keys == [key, getattr(done, key_field), key]  # resume kept it, siblings differ
    assert len(set(keys)) == 2
    assert all(c["payload"]["return_routed_experts"] for c in engine.calls)  # still asked ...
    assert all(c["tag"].share_prompt is None for c in engine.calls)  # header: engine defaults
    info = await client.stat(key)
    p = len(PROMPT)
    spans = [(s.segment.start, s.segment.end, s.segment.weight_version) for s in info.segments]
    assert spans == [(0, p + 2 - 1, "v1"), (p + 2 - 1, p + 2 + NEW - 1, "v2")]
    if framework == "slime":
        assert key == f"{run}.40"
    else:
        assert key == f"{run}.40.0"


async def test_miles_retry_from_the_prompt_starts_a_new_rollout(
    client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reset_for_retry keeps routing_key and clears tokens: the next attempt gets a new key
    (the old one would be a 409: the prompt does not extend the stored trajectory)."""
    engine = FakeEngine(client, behind_router=True)
    stub_framework(monkeypatch, "miles", engine)
    generate_r3 = r3_miles.wrap_generate(run=run, client=client, num_layers=NUM_LAYERS)
    sample = Sample(index=7)
    await generate_r3(args_for("miles"), sample, params())
    first = sample.routing_key
    sample.reset_for_retry()
    await generate_r3(args_for("miles"), sample, params())
    assert (first, sample.routing_key) == (f"{run}.7.0", f"{run}.7.1")
    await check_filled(client, engine, sample, "miles")
    with pytest.raises(ConflictError):  # what the old key would have met
        await engine.generate(
            {"input_ids": PROMPT, "sampling_params": params()}, {"X-SMG-Routing-Key": str(first)}
        )


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_direct_engine_reads_the_body_tag_with_share_prompt(
    framework: str, client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a router the body tag arrives whole (the plugin's parser reads it), carrying
    share_prompt; evaluation samples pass through untagged."""
    module = FRAMEWORKS[framework][0]
    engine = FakeEngine(client, behind_router=False)
    stub_framework(monkeypatch, framework, engine)
    generate_r3 = module.wrap_generate(
        run=run, client=client, num_layers=NUM_LAYERS, share_prompt=True
    )
    s = Sample(index=3)
    await generate_r3(args_for(framework), s, params())
    await check_filled(client, engine, s, framework)
    assert engine.calls[-1]["tag"].share_prompt is True
    ev = Sample(index=0)
    await generate_r3(args_for(framework), ev, params(), evaluation=True)
    assert engine.calls[-1]["tag"] is None and ev.session_id is None and ev.routing_key is None
    assert ev.rollout_routed_experts is not None  # upstream's inline routing, untouched


async def test_slime_refuses_a_router_policy_that_drops_the_key(
    client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeEngine(client, behind_router=True)
    stub_framework(monkeypatch, "slime", engine)
    generate_r3 = r3_slime.wrap_generate(run=run, client=client, num_layers=NUM_LAYERS)
    args = args_for("slime")
    args.router_policy = "round_robin"
    with pytest.raises(ValueError, match="consistent_hashing"):
        await generate_r3(args, Sample(index=1), params())
    assert engine.calls == []


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_fill_a_group_in_one_batch(
    framework: str, client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fill_routed_experts on a group fetches with get_many (never get)."""
    module, _, _, key_field = FRAMEWORKS[framework]
    engine = FakeEngine(client, behind_router=True)
    group = []
    for i in range(4):
        s = Sample(index=i, tokens=PROMPT + [1] * i, status=Status.COMPLETED)
        setattr(s, key_field, f"{run}.{i}")
        await engine._store(f"{run}.{i}", "v1", s.tokens)
        group.append(s)

    async def no_single_get(*_: Any, **__: Any) -> Any:
        raise AssertionError("a group is fetched with get_many")

    monkeypatch.setattr(client, "get", no_single_get)
    await module.fill_routed_experts(group, client, num_layers=NUM_LAYERS)
    monkeypatch.undo()
    for s in group:
        await check_filled(client, engine, s, framework)


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_missing_partial_and_unshipped_rollouts_fail_loudly(
    framework: str, client: AsyncRoutingClient, run: str
) -> None:
    module, _, _, key_field = FRAMEWORKS[framework]
    engine = FakeEngine(client, behind_router=True)

    def sample(key: str, n_tokens: int) -> Sample:
        s = Sample(index=0, tokens=list(range(n_tokens)), status=Status.COMPLETED)
        setattr(s, key_field, key)
        return s

    missing = sample(f"{run}.missing", 9)
    with pytest.raises(RolloutNotFoundError):
        await module.fill_routed_experts(missing, client, num_layers=NUM_LAYERS)
    # partial: the engine stored 8 tokens' rows, the sample has 12 tokens
    await engine._store(f"{run}.partial", "v1", list(range(8)))
    partial = sample(f"{run}.partial", 12)
    with pytest.raises(ShapeError, match=rf"rollout '{run}\.partial'.*7 rows.*12 tokens"):
        await module.fill_routed_experts(partial, client, num_layers=NUM_LAYERS)
    # rows nobody shipped: segments [0, 3) and [5, 10), rows 3..4 never stored
    gap = f"{run}.gap"
    for a, b in ((0, 3), (5, 10)):
        seg = Segment(a, b, "tiny-moe", "v1")
        await client.put(
            gap, engine._rows(gap, a, b), num_experts=E, layer_ids=MOE_IDS, segment=seg
        )
    unshipped = sample(gap, 11)
    with pytest.raises(ShapeError, match=r"nobody shipped"):
        await module.fill_routed_experts(unshipped, client, num_layers=NUM_LAYERS)
    # in a group, one bad rollout fails the fill and no sample is changed
    good = sample(f"{run}.good", 6)
    await engine._store(f"{run}.good", "v1", good.tokens)
    with pytest.raises(ShapeError):
        await module.fill_routed_experts([good, partial], client, num_layers=NUM_LAYERS)
    assert [s.rollout_routed_experts for s in (missing, partial, unshipped, good)] == [None] * 4
    # untagged samples and siblings sharing a key are refused before any fetch
    with pytest.raises(ValueError, match=f"no {key_field}"):
        await module.fill_routed_experts(Sample(index=5), client, num_layers=NUM_LAYERS)
    with pytest.raises(ValueError, match="share rollout key"):
        await module.fill_routed_experts([good, good], client, num_layers=NUM_LAYERS)


def test_rollout_keys() -> None:
    s = Sample(index=41)
    assert r3_slime.rollout_key("grpo-r2", s) == "grpo-r2.41"
    assert r3_slime.rollout_key("grpo-r2", s, conversation=3) == "grpo-r2.41.3"
    with pytest.raises(InvalidRequestError):
        r3_slime.rollout_key("grpo/r2", s)
    m = Sample(index=41)
    assert r3_miles.rollout_key("r", m) == "r.41.0"  # a fresh start
    m.tokens = [1, 2]
    assert r3_miles.rollout_key("r", m) == "r.41.0"  # resuming: same attempt
    m.tokens = []
    assert r3_miles.rollout_key("r", m) == "r.41.1"  # started again from the prompt
    assert m.metadata == {r3_miles.ATTEMPT_KEY: 1}


def test_importing_the_glue_imports_no_framework() -> None:
    """Importing r3_client imports no integration; importing every integration module imports
    no framework (and no transport: the clients load on first use)."""
    code = (
        "import sys, r3_client\n"
        "assert not any(m.startswith('r3_client.integrations') for m in sys.modules)\n"
        "import r3_client.integrations.slime, r3_client.integrations.miles\n"
        "import r3_client.integrations.areal, r3_client.integrations.tags\n"
        "bad = {'slime', 'miles', 'areal', 'torch', 'httpx', 'grpc', 'sglang', 'sglang_r3'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ tags


def test_tags_are_what_the_engine_parses() -> None:
    payload = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 4, "custom_params": {"other": 1}},
        "return_routed_experts": True,
        "routed_experts_start_len": 3,
    }
    before = copy.deepcopy(payload)
    out = tags.tag_generate(payload, "r-1", weight_version="7", share_prompt=True)
    assert payload == before  # the given payload is not changed
    assert not set(tags.INLINE_ROUTING_FIELDS) & set(out)
    assert out["sampling_params"]["custom_params"]["other"] == 1
    (tag,) = output_tags(out["sampling_params"], batch_size=1, n=1, max_outputs=8) or []
    assert (tag.rollout_id, tag.weight_version, tag.share_prompt) == ("r-1", "7", True)
    batch = tags.tag_generate({"sampling_params": [{}, {}]}, ["a", "b"])
    parsed = output_tags(batch["sampling_params"], batch_size=2, n=1, max_outputs=8) or []
    assert [t.rollout_id for t in parsed] == ["a", "b"]
    with pytest.raises(ValueError, match="one rollout id per prompt"):
        tags.tag_generate({"sampling_params": [{}, {}]}, "a")
    chat = tags.tag_openai({"messages": [], "return_routed_experts": True}, "c")
    assert chat == {"messages": [], "custom_params": {"r3": {"rollout_id": "c"}}}
    headers = tags.routing_headers("r-1")
    assert {k.lower(): v for k, v in headers.items()} == {DEFAULT_TAG_HEADER: "r-1"}
    with pytest.raises(InvalidRequestError):
        tags.routing_headers("a/b")
    with pytest.raises(InvalidRequestError):
        tags.tag_generate(payload, "x" * 201)


# ------------------------------------------------------------------ AReaL 1.0.4, restated


@dataclasses.dataclass
class GenerationHyperparameters:
    max_new_tokens: int = 16
    max_tokens: int = 1 << 20
    n_samples: int = 1

    def new(self, **kw: Any) -> GenerationHyperparameters:
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass
class ModelRequest:
    """areal/api/io_struct.py:27-59 (the fields used here)."""

    rid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    input_ids: list[int] = dataclasses.field(default_factory=list)
    gconfig: GenerationHyperparameters = dataclasses.field(
        default_factory=GenerationHyperparameters
    )
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def copy(self) -> ModelRequest:
        return ModelRequest(
            self.rid, self.input_ids.copy(), self.gconfig.new(), self.metadata.copy()
        )


@dataclasses.dataclass
class ModelResponse:
    """areal/api/io_struct.py:62-83."""

    input_tokens: list[int] = dataclasses.field(default_factory=list)
    output_tokens: list[int] = dataclasses.field(default_factory=list)
    output_versions: list[int] = dataclasses.field(default_factory=list)
    stop_reason: str = "stop"
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass
class HttpRequest:
    endpoint: str
    payload: dict[str, Any]


class SGLangBackend:
    def build_generation_request(
        self, req: ModelRequest, with_lora: bool, version: int
    ) -> HttpRequest:
        """areal/engine/sglang_remote.py:44-90 (no stop words, images, LoRA)."""
        sample_params = {"max_new_tokens": req.gconfig.max_new_tokens, "temperature": 1.0}
        payload: dict[str, Any] = {
            "input_ids": req.input_ids.copy(),
            "sampling_params": sample_params,
            "return_logprob": True,
            "stream": False,
        }
        if req.metadata.get("return_routed_experts", False):
            payload["return_routed_experts"] = True
        return HttpRequest(endpoint="/generate", payload=payload)

    def parse_generation_response(self, meta_info: dict[str, Any]) -> dict[str, Any]:
        """sglang_remote.py:92-127: tokens, stop reason, inline routing as int32
        ``(prompt_tokens + completion_tokens - 1, -1)``."""
        routed = meta_info.get("routed_experts")
        if routed is not None:
            rows = meta_info["prompt_tokens"] + meta_info["completion_tokens"] - 1
            routed = np.frombuffer(base64.b64decode(routed), dtype=np.int32).reshape(rows, -1)
        return {
            "output_tokens": [t for _, t, _ in meta_info["output_token_logprobs"]],
            "stop_reason": meta_info["finish_reason"]["type"],
            "routed_experts": routed,
        }


class RemoteInfEngine:
    def __init__(self, server: FakeEngine, return_routed_experts: bool) -> None:
        self.backend: Any = SGLangBackend()
        self.server = server
        self.return_routed_experts = return_routed_experts
        self.version = 1

    def get_version(self) -> int:
        return self.version

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """areal/infra/remote_inf_engine.py:781-944: resend with ``input_ids`` += output until
        stop/length, each call's inline routing concatenated."""
        req = req.copy()
        if self.return_routed_experts:
            req.metadata["return_routed_experts"] = True
        req.gconfig.max_new_tokens = min(
            req.gconfig.max_tokens - len(req.input_ids), req.gconfig.max_new_tokens
        )
        out: list[int] = []
        versions: list[int] = []
        routed: list[np.ndarray] = []
        stop_reason = None
        budget = req.gconfig.max_new_tokens
        while stop_reason not in ("stop", "tool_calls", "length") and len(out) < budget:
            http_req = self.backend.build_generation_request(req, False, self.get_version())
            res = self.backend.parse_generation_response(
                await self.server.generate(http_req.payload)
            )
            stop_reason = res["stop_reason"]
            asked = req.metadata.get("return_routed_experts", False)
            if asked and res["routed_experts"] is None and stop_reason != "abort":
                raise RuntimeError("Requested return_routed_experts=True but received None")
            out.extend(res["output_tokens"])
            versions.extend([self.get_version()] * len(res["output_tokens"]))
            if res["routed_experts"] is not None:
                routed.append(res["routed_experts"])
            req.input_ids += res["output_tokens"]
            req.gconfig.max_new_tokens -= len(res["output_tokens"])
        return ModelResponse(
            input_tokens=req.input_ids[: len(req.input_ids) - len(out)],
            output_tokens=out,
            output_versions=versions,
            stop_reason="length" if stop_reason == "abort" else str(stop_reason),
            routed_experts=np.concatenate(routed) if routed else None,
        )


class RemoteSGLangEngine:
    """areal/engine/sglang_remote.py:367-382: composes a RemoteInfEngine."""

    def __init__(self, server: FakeEngine, return_routed_experts: bool = True) -> None:
        self._engine = RemoteInfEngine(server, return_routed_experts)

    def get_version(self) -> int:
        return self._engine.get_version()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return await self._engine.agenerate(req)


def abort_once_then_update(server: FakeEngine, engine: RemoteSGLangEngine) -> None:
    """The next call is aborted after 2 tokens by a weight update to version 2."""
    server.abort_after = 2
    server.on_abort = lambda: setattr(engine._engine, "version", 2)


def areal_inline(rows: np.ndarray) -> np.ndarray:
    """What AReaL's remote engine decodes from upstream SGLang for an uninterrupted call."""
    flat = np.frombuffer(base64.b64decode(inline_b64(rows)), dtype=np.int32)
    return flat.reshape(rows.shape[0], -1)


async def test_areal_resumed_request_keeps_its_id_and_gets_what_inline_gives(
    client: AsyncRoutingClient,
) -> None:
    """AReaL aborts a request for a weight update and resumes it: both calls carry the same
    rollout id and their weight version, none asks for inline routing (and AReaL's loop does
    not require it); the engine stores rows under "1" then "2"; the filled routed_experts is
    int32 [P+N-1, L*K], exactly what AReaL decodes inline for an uninterrupted call."""
    server = FakeEngine(client, behind_router=False)
    engine = RemoteSGLangEngine(server)
    routed = r3_areal.RoutedEngine(engine, client, num_layers=NUM_LAYERS)
    abort_once_then_update(server, engine)
    reqs = [ModelRequest(input_ids=list(PROMPT)) for _ in range(2)]  # a group: two samples
    resps = [await routed.agenerate(r) for r in reqs]
    assert [c["tag"].rollout_id for c in server.calls] == [reqs[0].rid] * 2 + [reqs[1].rid]
    assert [c["tag"].weight_version for c in server.calls] == ["1", "2", "2"]
    assert not any("return_routed_experts" in c["payload"] for c in server.calls)
    assert reqs[0].metadata == {}  # the caller's request is untouched
    p = len(PROMPT)
    info = await client.stat(reqs[0].rid)
    spans = [(s.segment.start, s.segment.end, s.segment.weight_version) for s in info.segments]
    assert spans == [(0, p + 2 - 1, "1"), (p + 2 - 1, p + 2 + NEW - 1, "2")]
    for req, resp in zip(reqs, resps, strict=True):
        got = resp.routed_experts
        want = areal_inline(server.truth[req.rid])
        assert got is not None and got.dtype == np.int32 == want.dtype
        assert got.shape == want.shape == (p + len(resp.output_tokens) - 1, NUM_LAYERS * K)
        assert np.array_equal(got, want)
        assert np.array_equal(
            got,
            r3_areal.routed_experts(
                await client.get(req.rid), p + len(resp.output_tokens), num_layers=NUM_LAYERS
            ),
        )
    assert len(resps[0].output_tokens) == 2 + NEW
    # installing is idempotent: one wrapper around AReaL's backend
    r3_areal.install(engine)
    assert isinstance(engine._engine.backend, r3_areal.TaggingBackend)
    assert isinstance(engine._engine.backend.wrapped, SGLangBackend)


async def test_areal_inline_path_repeats_rows_after_a_resume(client: AsyncRoutingClient) -> None:
    """Why the glue matters (docs/integrations.md, AReaL): without it a resumed call's inline
    routing repeats everything before it, (P+n1-1) + (P+n1+n2-1) rows."""
    server = FakeEngine(client, behind_router=False)
    engine = RemoteSGLangEngine(server)
    abort_once_then_update(server, engine)
    resp = await engine.agenerate(ModelRequest(input_ids=list(PROMPT)))
    p, n1, n2 = len(PROMPT), 2, NEW
    assert resp.routed_experts is not None
    assert resp.routed_experts.shape[0] == (p + n1 - 1) + (p + n1 + n2 - 1) != p + n1 + n2 - 1


async def test_areal_multi_turn_episode_and_failures(client: AsyncRoutingClient, run: str) -> None:
    """One id per episode (metadata) continues the stored rollout turn after turn; a rollout the
    cache lacks, or one with fewer rows than the response's tokens, fails loudly."""
    server = FakeEngine(client, behind_router=False)
    engine = RemoteSGLangEngine(server, return_routed_experts=False)
    routed = r3_areal.RoutedEngine(engine, client, num_layers=NUM_LAYERS)
    episode = f"{run}.ep"
    history = list(PROMPT)
    for _turn in range(2):
        req = ModelRequest(input_ids=list(history), metadata={r3_areal.ROLLOUT_ID_KEY: episode})
        resp = await routed.agenerate(req)
        history = resp.input_tokens + resp.output_tokens + [7, 8]  # the user's next message
        assert resp.routed_experts is not None
        assert np.array_equal(resp.routed_experts, areal_inline(server.truth[episode]))
    assert {c["tag"].rollout_id for c in server.calls} == {episode}
    lost = ModelResponse(input_tokens=list(PROMPT), output_tokens=[1, 2])
    with pytest.raises(RolloutNotFoundError):
        await r3_areal.fill_routed_experts(lost, client, f"{run}.nope", num_layers=NUM_LAYERS)
    longer = ModelResponse(input_tokens=history, output_tokens=[1, 2])
    with pytest.raises(ShapeError, match=rf"rollout '{run}\.ep'"):
        await r3_areal.fill_routed_experts(longer, client, episode, num_layers=NUM_LAYERS)
    assert lost.routed_experts is None and longer.routed_experts is None
    with pytest.raises(TypeError, match=r"RemoteSGLangEngine\._engine\.backend"):
        r3_areal.install(object())


# ------------------------------------------------------------------ docs/integrations.md


def recipe(title: str) -> str:
    """The python block of a docs/integrations.md section."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/integrations.md has a '## {title}' section"
    blocks = re.findall(r"```python\n(.*?)```", m.group(0), flags=re.S)
    assert len(blocks) == 1, f"the {title} section shows one recipe"
    return str(blocks[0])


@pytest.fixture
def recipe_env(
    monkeypatch: pytest.MonkeyPatch, service_single: Service, run: str
) -> dict[str, str]:
    env = {
        "R3_URL": service_single.http_url,
        "R3_KEY": KEY_A,
        "R3_RUN": run,
        "R3_NUM_LAYERS": str(NUM_LAYERS),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_docs_recipe_runs(
    framework: str,
    client: AsyncRoutingClient,
    recipe_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slime / miles recipe as written: a group with a partial rollout, resumed."""
    engine = FakeEngine(client, behind_router=True)
    stub_framework(monkeypatch, framework, engine)
    ns: dict[str, Any] = {}
    exec(compile(recipe(framework), f"docs/integrations.md#{framework}", "exec"), ns)
    try:
        generate_r3 = ns["generate_r3"]
        args = args_for(framework)
        group = [Sample(index=i) for i in (40, 41)]
        engine.abort_after = 1
        for s in group:
            await generate_r3(args, s, params())
        await generate_r3(args, group[0], params())  # resumed
        keys = [await check_filled(client, engine, s, framework) for s in group]
        assert len(set(keys)) == 2
        assert [c["tag"].rollout_id for c in engine.calls] == [keys[0], keys[1], keys[0]]
        assert all(k.startswith(recipe_env["R3_RUN"] + ".") for k in keys)
    finally:
        await ns["r3"].aclose()


async def test_docs_areal_recipe_runs(
    client: AsyncRoutingClient, recipe_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AReaL recipe as written: RLVRWorkflow (restated, rlvr.py:139-185) gets an engine
    whose responses carry routed_experts, its resumed request included."""
    server = FakeEngine(client, behind_router=False)
    engine = RemoteSGLangEngine(server)

    class RLVRWorkflow:
        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
            req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(data["prompt"]))
            resp = await engine.agenerate(req)
            # PR #1207's workflows carry the response's routed_experts on
            return {"rid": req.rid, "resp": resp}

    for name in ("areal", "areal.workflow"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    rlvr = types.ModuleType("areal.workflow.rlvr")
    rlvr.RLVRWorkflow = RLVRWorkflow  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, rlvr.__name__, rlvr)
    ns: dict[str, Any] = {}
    exec(compile(recipe("AReaL 1.0.4"), "docs/integrations.md#areal", "exec"), ns)
    try:
        workflow = ns["R3RLVRWorkflow"]()
        abort_once_then_update(server, engine)
        results = [await workflow.arun_episode(engine, {"prompt": PROMPT}) for _ in range(2)]
        assert results[0]["rid"] != results[1]["rid"]
        for res in results:
            want = areal_inline(server.truth[res["rid"]])
            got = res["resp"].routed_experts
            assert got.dtype == want.dtype and np.array_equal(got, want)
        assert [c["tag"].rollout_id for c in server.calls] == [results[0]["rid"]] * 2 + [
            results[1]["rid"]
        ]
    finally:
        await ns["r3"].aclose()


# ------------------------------------------------------------------ views (docs/store.md)

RECOMPUTED_FROM = 2  # a call that recomputes stored positions redoes rows [2, its own start)


class RecomputingEngine(FakeEngine):
    """A continuing call (a resume after a weight push, a next turn) finds its radix cache
    flushed and recomputes rows ``[2, serves)`` of what it continues, under its own weight
    version, and ships them first as the view serving its own rows (``serves``: where its
    segment starts), as the plugin does."""

    def __init__(self, client: AsyncRoutingClient, *, behind_router: bool) -> None:
        super().__init__(client, behind_router=behind_router)
        self.recomputed: dict[str, tuple[int, np.ndarray]] = {}  # key -> (serves, rows)

    async def _store(self, key: str, version: str, tokens: list[int]) -> None:
        have = self.tokens.get(key, [])
        serves = len(have) - 1
        if serves > RECOMPUTED_FROM and len(tokens) - 1 > serves:
            rows = self._rows(f"{key}:recomputed", RECOMPUTED_FROM, serves)
            seg = Segment(RECOMPUTED_FROM, serves, "tiny-moe", version)
            await self.client.put(
                key, rows, num_experts=E, layer_ids=MOE_IDS, segment=seg, view=serves
            )
            self.recomputed[key] = (serves, rows)
        await super()._store(key, version, tokens)

    def latest(self, key: str) -> np.ndarray:
        """The MoE rows the rollout's last call attended to: the first computations with
        the recomputed rows written over them."""
        rows = self.truth[key].copy()
        serves, recomputed = self.recomputed[key]
        rows[RECOMPUTED_FROM:serves] = recomputed
        assert not np.array_equal(rows, self.truth[key])  # the view really differs
        return rows


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_a_rollout_with_a_view_yields_the_latest_rows_when_asked(
    framework: str, client: AsyncRoutingClient, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial rollout resumed after a weight push recomputed part of its prefix (a view):
    wrap_generate(view="latest") fills the rows the resumed call attended to, one sample
    (get) or a group (one get per sample); the default gives the first computations."""
    module, _, layout, key_field = FRAMEWORKS[framework]
    engine = RecomputingEngine(client, behind_router=True)
    stub_framework(monkeypatch, framework, engine)
    generate_r3 = module.wrap_generate(run=run, client=client, num_layers=NUM_LAYERS, view="latest")
    args = args_for(framework)
    s, plain = Sample(index=60), Sample(index=61)
    engine.abort_after = 3
    engine.on_abort = lambda: setattr(engine, "version", "v2")
    await generate_r3(args, s, params())
    await generate_r3(args, plain, params())
    assert s.status is Status.ABORTED and plain.status is Status.COMPLETED
    await generate_r3(args, s, params())  # resumed: recomputes rows [2, 7) first
    key = getattr(s, key_field)
    assert [v.serves for v in (await client.stat(key)).views] == [len(PROMPT) + 3 - 1]
    got = s.rollout_routed_experts
    assert np.array_equal(got[:, list(MOE_IDS)], engine.latest(key))
    want = layout(await client.get(key, view="latest"), len(s.tokens), num_layers=NUM_LAYERS)
    assert got.dtype == want.dtype and np.array_equal(got, want)

    pkey = getattr(plain, key_field)
    for sample in (s, plain):
        sample.rollout_routed_experts = None
    await module.fill_routed_experts([s, plain], client, num_layers=NUM_LAYERS, view="latest")
    assert np.array_equal(s.rollout_routed_experts[:, list(MOE_IDS)], engine.latest(key))
    assert np.array_equal(plain.rollout_routed_experts[:, list(MOE_IDS)], engine.truth[pkey])
    await module.fill_routed_experts([s, plain], client, num_layers=NUM_LAYERS, view="generated")
    assert np.array_equal(s.rollout_routed_experts[:, list(MOE_IDS)], engine.truth[key])
    await check_filled(client, engine, s, framework)

    # exact (the default) replays one routing per state: the straddled sample is refused,
    # never filled with one of them; the plain one is filled; no generation is made
    calls = len(engine.calls)
    s.rollout_routed_experts = None
    with pytest.raises(InvalidRequestError, match="expand the sample"):
        await module.fill_routed_experts([s, plain], client, num_layers=NUM_LAYERS)
    assert s.rollout_routed_experts is None
    await module.fill_routed_experts(plain, client, num_layers=NUM_LAYERS)
    assert np.array_equal(plain.rollout_routed_experts[:, list(MOE_IDS)], engine.truth[pkey])
    with pytest.raises(InvalidRequestError, match="view must be one of"):
        await module.fill_routed_experts(s, client, num_layers=NUM_LAYERS, view="newest")
    assert len(engine.calls) == calls


async def test_areal_resumed_request_yields_the_latest_rows_when_asked(
    client: AsyncRoutingClient,
) -> None:
    """AReaL resumes a request aborted for a weight update; the resumed call recomputed part
    of the prefix (a view): RoutedEngine(view="latest") fills what that call attended to,
    the default what AReaL's inline concatenation of first computations holds."""
    server = RecomputingEngine(client, behind_router=False)
    engine = RemoteSGLangEngine(server, return_routed_experts=False)
    routed = r3_areal.RoutedEngine(engine, client, num_layers=NUM_LAYERS, view="latest")
    server.abort_after = 3
    server.on_abort = lambda: setattr(engine._engine, "version", 2)
    req = ModelRequest(input_ids=list(PROMPT))
    resp = await routed.agenerate(req)
    assert [v.weight_version for v in (await client.stat(req.rid)).views] == ["2"]
    assert resp.routed_experts is not None
    assert np.array_equal(resp.routed_experts, areal_inline(server.latest(req.rid)))
    n = len(resp.input_tokens) + len(resp.output_tokens)
    want = r3_areal.routed_experts(
        await client.get(req.rid, view="latest"), n, num_layers=NUM_LAYERS
    )
    assert np.array_equal(resp.routed_experts, want)
    await r3_areal.fill_routed_experts(
        resp, client, req.rid, num_layers=NUM_LAYERS, view="generated"
    )
    assert np.array_equal(resp.routed_experts, areal_inline(server.truth[req.rid]))
    # exact (the default): the resumed response spans two routing states: refused, never
    # filled with one of them
    with pytest.raises(InvalidRequestError, match="expand the sample"):
        await r3_areal.fill_routed_experts(resp, client, req.rid, num_layers=NUM_LAYERS)
