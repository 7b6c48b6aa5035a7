"""HiCache (``--enable-hierarchical-cache``): routing rows follow their KV to the host
tier and back (:mod:`sglang_r3.hicache`).

The engine has a 300-token KV pool and a host tier twice that size, so three 100-token
fillers evict a 100-token prefix from the device; the next prompt over that prefix
loads its KV back from the host (``cached_tokens_details["host"]``) into new device
slots, whose upstream rows belong to the fillers (sglang#26975).  Stored rows are
compared, as sets per (token, layer), with the rows the session's ``qwen_engine`` (no
HiCache, same model) computes for the same tokens, and the greedy tokens must agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _engine import as_sets, generate, inline_rows, rid, shim_env, sp
from _service import KEY_A, Service

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.harness import EngineServer, start_engine

pytestmark = pytest.mark.timeout(600)

LAYERS = 3
PROMPT = 100
NEW = 8
# The verified configuration (sglang_r3.hicache): direct io into a layer-first host pool.
HICACHE_ARGS = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
    "--hicache-ratio",
    "2",
)


@pytest.fixture(scope="module")
def hicache_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """The plugin on the tiny Qwen3-MoE with HiCache and a 300-token device pool."""
    server = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=tmp_path_factory.mktemp("hicache-engine") / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        extra_args=HICACHE_ARGS,
        max_total_tokens=300,
        env={**os.environ, **shim_env("hicache_cpu_io")},
    )
    try:
        yield server
    finally:
        server.stop()


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids (3..1002), distinct per ``seed``."""
    return [3 + (seed * 7919 + 31 * k) % 1000 for k in range(n)]


def _run(url: str, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    status, out = generate(url, {"input_ids": ids, "sampling_params": params})
    assert status == 200, out
    return out


def _evict_to_host(url: str, seed: int) -> None:
    """Three untagged 100-token prompts: together they need the whole device pool."""
    for f in range(3):
        _run(url, _tokens(seed * 10 + f, PROMPT), sp(None, NEW))


def _reference(qwen_engine: EngineServer, turns: list[list[int]]) -> tuple[list[int], Any]:
    """The same turns on the engine without HiCache, untagged: the last turn's greedy
    tokens and its rows ``[0, len + NEW - 1)``.  Each turn's prefix stays on that
    engine's device, so every row is computed in the same forward shape as on the
    HiCache engine (a single prefill of the whole sequence would differ on bf16
    near-ties)."""
    out: dict[str, Any] = {}
    for i, ids in enumerate(turns):
        status, out = generate(
            qwen_engine.url,
            {"input_ids": ids, "sampling_params": sp(None, NEW), "return_routed_experts": True},
        )
        assert status == 200, out
        if i:
            assert out["meta_info"]["cached_tokens"] >= len(turns[i - 1]) + NEW - 1
    return out["output_ids"], inline_rows(out, LAYERS)


def _stale(stored: Any, ref: Any) -> list[int]:
    """Positions whose stored rows differ from the reference's (as sets)."""
    assert stored.shape == ref.shape
    return np.flatnonzero((as_sets(stored) != as_sets(ref)).any(axis=(1, 2))).tolist()


def _host_hit(out: dict[str, Any]) -> int:
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0))


def test_episode_with_prefix_loaded_from_host_stores_reference_rows(
    hicache_engine: EngineServer, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("hc-episode")
    turn1 = _tokens(1, PROMPT)
    out1 = _run(hicache_engine.url, turn1, sp(rollout, NEW))
    _evict_to_host(hicache_engine.url, seed=2)
    turn2 = turn1 + out1["output_ids"] + _tokens(3, 20)
    out2 = _run(hicache_engine.url, turn2, sp(rollout, NEW))
    assert _host_hit(out2) >= PROMPT, out2["meta_info"]  # the prefix came back from host

    tokens, ref = _reference(qwen_engine, [turn1, turn2])
    assert out2["output_ids"] == tokens
    stored = cache_client.get(rollout)
    assert [(s.start, s.end) for s in stored.segments] == [
        (0, PROMPT + NEW - 1),
        (PROMPT + NEW - 1, len(turn2) + NEW - 1),
    ]
    stale = _stale(stored.indices, ref)
    assert not stale, f"{len(stale)} stale positions: {stale[:12]}"


def test_new_rollout_on_host_tier_prefix_stores_reference_rows(
    hicache_engine: EngineServer, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """A GRPO sibling or shared system prompt: a *new* rollout whose prompt hits a
    prefix loaded back from the host tier asks for every row, those of the prefix too
    (before sglang_r3.hicache, all of them were the fillers' rows, and stored)."""
    first = _tokens(4, PROMPT)
    out1 = _run(hicache_engine.url, first, sp(rid("hc-first"), NEW))
    _evict_to_host(hicache_engine.url, seed=5)
    prompt = first + out1["output_ids"] + _tokens(6, 20)
    rollout = rid("hc-sibling")
    out2 = _run(hicache_engine.url, prompt, sp(rollout, NEW))
    assert _host_hit(out2) >= PROMPT, out2["meta_info"]

    tokens, ref = _reference(qwen_engine, [first, prompt])
    assert out2["output_ids"] == tokens
    stale = _stale(cache_client.get(rollout).indices, ref)
    assert not stale, f"{len(stale)} stale positions: {stale[:12]}"
