"""Tensor and data parallelism with the plugin on a real SGLang engine (CPU).

Every stored rollout is compared with the rows the reference engine (the session's
``qwen_engine``: tp=1, dp=1) computes for the same greedy tokens, as sets per (token,
layer), requests one at a time.  A DP rank is a tp=1 engine: its rows must be equal
exactly.  Under tensor parallelism each layer's output is a bf16 all-reduce of partial
sums, which rounds differently from tp=1, so a router whose 2nd and 3rd experts are
near-tied may pick the other one: a difference is accepted as a *near-tie* only where a
``transformers`` forward of the same tokens puts those two logits less than
``rows_judge.NEAR_TIE`` apart (the median gap is ~0.07); any other difference fails the
test, and the counts are printed.  Engines run one at a time (module fixtures), each stopped
before the next starts.

- ``--tp-size 2`` (test-only shim ``no_pynccl``: SGLang asks only out-of-tree platforms
  whether they support PyNccl, ``parallel_state.py:2180-2185``).
- ``--dp-size 2`` (``SGLANG_CPU_OMP_THREADS_BIND='0|1'``: one OpenMP bind per rank,
  ``numa_utils.py:463``), with ``--routing-dp-affinity rollout`` (the default): each
  rollout's requests go to the rank its id hashes to, so turn 2 finds its prefix KV.
- Heavy, run only with ``R3_TEST_HEAVY_PARALLEL=1`` (start-up 85-160 s each on 2 cores,
  over CI's budget): ``--tp-size 2 --dp-size 2 --enable-dp-attention`` (shims
  ``no_pynccl`` + ``torch_native_cpu_fill``), and ``--dp-size 2`` with
  ``--routing-dp-affinity off``, which measures how often a later turn misses its
  prefix under SGLang's round robin.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.config import ConfigError, EngineConfig
from sglang_r3.http_server.generate_hooks import dp_rank_of
from sglang_r3.tools.local_stack import EngineServer, start_engine
from tests.support.engine_requests import as_sets, generate, rid, shim_env, sp
from tests.support.rows_judge import judge_rows, reference_rows
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(900)

LAYERS, TOPK = 3, 2
NEW = 6
TOOL = [7, 8, 9]  # the "tool output" appended after each answer
HEAVY = os.environ.get("R3_TEST_HEAVY_PARALLEL") == "1"
heavy = pytest.mark.skipif(
    not HEAVY,
    reason="DP attention (tp 2, dp 2) and a second dp-2 engine start in 85-160 s each "
    "on 2 cores, over CI's time budget: run with R3_TEST_HEAVY_PARALLEL=1",
)
# One OpenMP bind per rank: without it SGLang asserts ranks <= NUMA nodes (1 here).
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def _prompt(k: int, length: int = 24) -> list[int]:
    return [(37 * k + 11 * i) % 1000 + 3 for i in range(length)]


def _spread_ids(prefix: str, count: int) -> list[str]:
    """``count`` fresh rollout ids that hash to both DP ranks of 2 (random ids all land
    on one rank with probability 2 / 2**count)."""
    while True:
        ids = [rid(f"{prefix}{k}") for k in range(count)]
        if {dp_rank_of(i, 2) for i in ids} == {0, 1}:
            return ids


def _serve(
    models: dict[str, Path],
    cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    args: tuple[str, ...],
    shims: tuple[str, ...] = (),
) -> Iterator[EngineServer]:
    """A module fixture's engine: the tiny Qwen3-MoE with ``args`` and the CPU ``shims``,
    logging under a fresh ``name`` directory, stopped when the fixture ends."""
    logs = tmp_path_factory.mktemp(name)
    server = start_engine(
        models["qwen3_moe"],
        port=free_port(),
        log=logs / "sglang.log",
        routing_cache=cache.http_url,
        api_key=KEY_A,
        extra_args=args,
        env={**os.environ, **shim_env(*shims, **BIND)},
        timeout_s=400,
    )
    yield server
    server.stop()


# ---------------------------------------------------------------------------- helpers


def converse(url: str, prompt: list[int], turns: int, rollout: str | None) -> list[dict[str, Any]]:
    """``turns`` greedy turns of one conversation: each sends everything so far plus
    the tool output; tagged with ``rollout`` (or untagged, asking for inline rows)."""
    tokens = list(prompt)
    outs = []
    for _ in range(turns):
        body: dict[str, Any] = {"input_ids": tokens, "sampling_params": sp(rollout, NEW)}
        if rollout is None:
            body["return_routed_experts"] = True
        status, out = generate(url, body)
        assert status == 200, out
        out["input_ids"] = tokens
        outs.append(out)
        tokens = tokens + out["output_ids"] + TOOL
    return outs


def final_tokens(outs: list[dict[str, Any]]) -> list[int]:
    """The trajectory through the last turn's answer."""
    return list(outs[-1]["input_ids"]) + list(outs[-1]["output_ids"])


def assert_rows_match(
    got: npt.NDArray[Any], want: npt.NDArray[Any], tokens: list[int], model: Path | None
) -> int:
    """``got`` equals ``want`` as sets per (token, layer); with ``model`` (tensor
    parallel engines), differences at near-tied routers are allowed.  Their count."""
    if model is None:
        np.testing.assert_array_equal(as_sets(got), as_sets(want))
        return 0
    judged = judge_rows(got, want, model, tokens, LAYERS, TOPK, after_tie_ok=False)
    real = judged.real
    assert not real, f"rows differ at routers that are not near-ties (token, layer, gap): {real}"
    return judged.near_ties


NEAR_TIES: dict[str, list[int]] = {}  # configuration -> [near-ties, routers compared]


def check_conversation(
    engine_url: str,
    ref_url: str,
    client: RoutingClient,
    prompt: list[int],
    turns: int,
    model: Path | None = None,
    name: str = "",
    rollout: str | None = None,
) -> list[dict[str, Any]]:
    """Run a tagged conversation on the engine and the same one untagged on the
    reference, and compare the stored rollout (one segment per turn, each from where
    the last ended) with the reference engine's rows for the engine's own tokens.

    Without ``model`` both computed every row the same way (same batch shapes, prefix
    from the radix cache): the greedy tokens and the rows must be equal exactly.  With
    ``model`` (tensor parallel, or a prefix recomputed in one prefill where the
    reference decoded it token by token, which rounds differently in bf16), near-tied
    routers may differ, and greedy tokens may part at a near-tied logit; both are
    counted under ``name`` (:data:`NEAR_TIES`, :data:`DIVERGED`).
    """
    rollout = rollout or rid("par")
    got = converse(engine_url, prompt, turns, rollout)
    ref = converse(ref_url, prompt, turns, None)
    same = [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert same or model is not None, "a tp=1 engine's greedy tokens differ from tp=1's"
    DIVERGED[name] = DIVERGED.get(name, 0) + (not same)
    refs = [o["meta_info"]["r3"] for o in got]
    assert all(r["stored"] for r in refs), refs
    assert [(r["start"], r["end"]) for r in refs] == [
        (0 if t == 0 else refs[t - 1]["end"], len(o["input_ids"]) + NEW - 1)
        for t, o in enumerate(got)
    ]
    tokens = final_tokens(got)
    stored = client.get(rollout)
    assert stored.indices.shape == (len(tokens) - 1, LAYERS, 2)
    ties = assert_rows_match(
        stored.indices, reference_rows(ref_url, tokens, LAYERS, TOPK), tokens, model
    )
    tally = NEAR_TIES.setdefault(name, [0, 0])
    tally[0] += ties
    tally[1] += stored.indices.shape[0] * LAYERS
    for o in got:
        o["rollout"] = rollout
    return got


DIVERGED: dict[str, int] = {}  # configuration -> conversations whose tokens parted


# ---------------------------------------------------------------------------- units


def test_dp_rank_of_is_stable_and_spreads() -> None:
    # Fixed values: the same in every process and run (Python's hash() is salted).
    assert [dp_rank_of(f"rollout-{i}", 2) for i in range(8)] == [
        dp_rank_of(f"rollout-{i}", 2) for i in range(8)
    ]
    assert (
        dp_rank_of("abc", 4)
        == int.from_bytes(__import__("hashlib").blake2b(b"abc", digest_size=8).digest(), "big") % 4
    )
    counts = np.bincount([dp_rank_of(f"r-{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 900, counts


def test_dp_affinity_option() -> None:
    assert EngineConfig.from_env({}).dp_affinity == "rollout"
    off = EngineConfig.from_env({"SGLANG_R3_DP_AFFINITY": "off"})
    assert off.dp_affinity == "off"
    assert EngineConfig.from_env(off.to_env()).dp_affinity == "off"
    with pytest.raises(ConfigError, match="rollout or off"):
        EngineConfig.from_env({"SGLANG_R3_DP_AFFINITY": "sticky"})


def test_dp_routing_internals() -> None:
    """Where --routing-dp-affinity plugs in, as read in SGLang 0.5.23 (canary)."""
    import inspect

    from sglang.srt.managers.data_parallel_controller import DataParallelController
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    # The number of DP ranks the hook hashes over, and what generate_request checks
    # routed_dp_rank against.
    assert "self.elastic_worker_count = parallel.num_dp_ranks" in inspect.getsource(
        TokenizerManager.__init__
    )
    assert "num_dp_ranks = self.elastic_worker_count" in inspect.getsource(
        TokenizerManager.generate_request
    )
    # Every load-balancing method sends a request naming a rank there first.
    for method in ("round_robin_scheduler", "total_requests_scheduler", "total_tokens_scheduler"):
        src = inspect.getsource(getattr(DataParallelController, method))
        assert "self.maybe_external_dp_rank_routing(req)" in src, method
    # One request's items all inherit its routed_dp_rank (a batch is pinned per item
    # in the send hooks instead).
    assert "routed_dp_rank=self.routed_dp_rank" in inspect.getsource(GenerateReqInput.__getitem__)


# ---------------------------------------------------------------------------- tp 2


@pytest.fixture(scope="module")
def reference(qwen_engine: EngineServer) -> str:
    """The reference engine's URL (started before any engine of this module)."""
    return qwen_engine.url


@pytest.fixture(scope="module")
def tp2_engine(
    reference: str,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    yield from _serve(
        tiny_models, engine_cache, tmp_path_factory, "tp2", ("--tp-size", "2"), ("no_pynccl",)
    )


def test_tp2_stores_the_reference_rows(
    tp2_engine: EngineServer,
    reference: str,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    """tp 2: every TP rank computes the same top-k; one row set per token is stored,
    equal to tp=1's, across two turns and three rollouts."""
    model = tiny_models["qwen3_moe"]
    for k in range(3):
        prompt = _prompt(k, 20 + 4 * k)
        check_conversation(tp2_engine.url, reference, cache_client, prompt, 2, model, "tp2")
    ties, routers = NEAR_TIES["tp2"]
    print(
        f"tp 2: {ties} near-ties in {routers} (token, layer) routers, 0 other differences; "
        f"{DIVERGED['tp2']} of 3 conversations' greedy tokens parted from tp=1's"
    )
    assert ties <= routers // 20  # bf16 rounding, not a systematic difference


# ---------------------------------------------------------------------------- dp 2


@pytest.fixture(scope="module")
def dp2_engine(
    tp2_engine: EngineServer,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    tp2_engine.stop()  # one engine of this module at a time (2 cores)
    yield from _serve(tiny_models, engine_cache, tmp_path_factory, "dp2", ("--dp-size", "2"))


def test_dp2_pins_rollouts_to_their_rank_and_turn_two_hits_its_prefix(
    dp2_engine: EngineServer, reference: str, cache_client: RoutingClient
) -> None:
    """dp 2, --routing-dp-affinity rollout: each rollout's turns land on the rank its
    id hashes to (meta_info.dp_rank), both ranks get rollouts, every later turn is a
    radix hit over the whole previous turn, and rows equal the reference's."""
    assert httpx.get(f"{dp2_engine.url}/r3/info", timeout=10).json()["dp_affinity"] == "rollout"
    ranks = set()
    for k, rollout in enumerate(_spread_ids("aff", 6)):
        prompt = _prompt(10 + k)
        outs = check_conversation(
            dp2_engine.url, reference, cache_client, prompt, 2, rollout=rollout
        )
        want = dp_rank_of(outs[0]["rollout"], 2)
        assert [o["meta_info"]["dp_rank"] for o in outs] == [want, want]
        # Turn 1's prompt and answer are in the rank's radix cache (its last token's
        # KV was never computed: it is turn 2's first new position).
        previous = len(outs[0]["input_ids"]) + NEW - 1
        assert outs[1]["meta_info"]["cached_tokens"] >= previous, outs[1]["meta_info"]
        ranks.add(want)
    assert ranks == {0, 1}


def test_dp2_request_naming_its_rank_is_not_repinned(
    dp2_engine: EngineServer,
    reference: str,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    """A turn that names a rank itself (``routed_dp_rank``) goes there: on the rank
    that never saw the rollout it recomputes the prefix (what SGLang's round robin does
    to about half of all later turns), and the stored rows are still the reference's."""
    rollout = rid("pin")
    other = 1 - dp_rank_of(rollout, 2)
    tokens = _prompt(30)
    status, t1 = generate(
        dp2_engine.url, {"input_ids": tokens, "sampling_params": sp(rollout, NEW)}
    )
    assert status == 200, t1
    tokens = tokens + t1["output_ids"] + TOOL
    body = {"input_ids": tokens, "sampling_params": sp(rollout, NEW), "routed_dp_rank": other}
    status, t2 = generate(dp2_engine.url, body)
    assert status == 200, t2
    assert t2["meta_info"]["dp_rank"] == other
    assert t2["meta_info"]["cached_tokens"] == 0
    assert t2["meta_info"]["r3"]["start"] == t1["meta_info"]["r3"]["end"]
    final = tokens + t2["output_ids"]
    # The prefix was prefilled in one pass there, decoded token by token on the
    # reference: near-tied routers may round the other way.
    stored = cache_client.get(rollout).indices
    assert_rows_match(
        stored, reference_rows(reference, final, LAYERS, TOPK), final, tiny_models["qwen3_moe"]
    )


def test_dp2_batch_of_rollouts_each_on_its_rank(
    dp2_engine: EngineServer, reference: str, cache_client: RoutingClient
) -> None:
    """One request with several prompts, one rollout each: every prompt goes to its own
    rollout's rank (set per item in the send hooks), rows equal the reference's."""
    prompts = [_prompt(40 + k, 16) for k in range(6)]
    ids = _spread_ids("b", 6)
    status, outs = generate(
        dp2_engine.url,
        {
            "input_ids": prompts,
            "sampling_params": [sp(i, NEW) for i in ids],
        },
    )
    assert status == 200, outs
    assert [o["meta_info"]["dp_rank"] for o in outs] == [dp_rank_of(i, 2) for i in ids]
    assert {o["meta_info"]["dp_rank"] for o in outs} == {0, 1}
    for p, i, o in zip(prompts, ids, outs, strict=True):
        ref = reference_rows(reference, p + o["output_ids"], LAYERS, TOPK)
        np.testing.assert_array_equal(as_sets(cache_client.get(i).indices), as_sets(ref))


# ---------------------------------------------------------------------------- heavy


@pytest.fixture(scope="module")
def dp_attention_engine(
    dp2_engine: EngineServer,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    dp2_engine.stop()
    yield from _serve(
        tiny_models,
        engine_cache,
        tmp_path_factory,
        "dpattn",
        ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"),
        ("no_pynccl", "torch_native_cpu_fill"),
    )


@heavy
def test_dp_attention_stores_the_reference_rows_on_pinned_ranks(
    dp_attention_engine: EngineServer,
    reference: str,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    """tp 2 + dp 2 + DP attention: rows from each rank's slice of the gathered capture
    buffer are the rollout's own and equal the reference's; turns pinned, prefix hits."""
    ranks = set()
    model = tiny_models["qwen3_moe"]
    for k, rollout in enumerate(_spread_ids("dpa", 4)):
        prompt = _prompt(50 + k)
        url = dp_attention_engine.url
        outs = check_conversation(url, reference, cache_client, prompt, 2, model, "dpa", rollout)
        want = dp_rank_of(outs[0]["rollout"], 2)
        assert [o["meta_info"]["dp_rank"] for o in outs] == [want, want]
        assert outs[1]["meta_info"]["cached_tokens"] >= len(outs[0]["input_ids"]) + NEW - 1
        ranks.add(want)
    assert ranks == {0, 1}
    ties, routers = NEAR_TIES["dpa"]
    print(
        f"DP attention: {ties} near-ties in {routers} routers, 0 other differences; "
        f"{DIVERGED['dpa']} of 4 conversations' greedy tokens parted from tp=1's"
    )
    assert ties <= routers // 20


@pytest.fixture(scope="module")
def dp2_round_robin_engine(
    dp_attention_engine: EngineServer,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    dp_attention_engine.stop()
    yield from _serve(
        tiny_models,
        engine_cache,
        tmp_path_factory,
        "dp2off",
        ("--dp-size", "2", "--routing-dp-affinity", "off"),
    )


@heavy
def test_dp2_without_affinity_later_turns_miss(
    dp2_round_robin_engine: EngineServer,
    reference: str,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    """--routing-dp-affinity off (SGLang's round robin): turn 2 of a rollout lands on the
    other rank whenever the requests in between moved the counter by an odd number,
    so its prefix is recomputed (rows still right).  Two-turn rollouts run one after
    the other: turn 2 always follows its own turn 1 directly, so every turn 2 misses."""
    info = httpx.get(f"{dp2_round_robin_engine.url}/r3/info", timeout=10).json()
    assert info["dp_affinity"] == "off"
    misses = 0
    model = tiny_models["qwen3_moe"]
    for k in range(6):
        url = dp2_round_robin_engine.url
        outs = check_conversation(url, reference, cache_client, _prompt(60 + k), 2, model, "off")
        if outs[1]["meta_info"]["dp_rank"] != outs[0]["meta_info"]["dp_rank"]:
            assert outs[1]["meta_info"]["cached_tokens"] == 0
            misses += 1
    ties, routers = NEAR_TIES["off"]
    print(
        f"affinity off: {misses} of 6 second turns on another rank (prefix recomputed); "
        f"{ties} near-ties in {routers} routers, {DIVERGED['off']} of 6 token divergences"
    )
    assert misses == 6
