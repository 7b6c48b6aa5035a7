"""What an RL loop relies on when it pushes new weights to SGLang (real server, CPU).

* ``/update_weights_from_disk`` flushes the radix cache by default, so a prompt the
  engine served before returns rows computed with the new weights; with
  ``flush_cache: false`` it returns the old weights' rows for the cached prefix
  (shown here, so the hazard and what protects against it are both on record);
* the pushed ``weight_version`` reaches every segment stored after the push, and a
  multi-turn rollout whose turns straddle a push keeps each turn's version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _engine import as_sets, rid
from _service import KEY_A, Service

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.harness import EngineServer, build_tiny_model, start_engine

pytestmark = pytest.mark.timeout(600)

PROMPT = [21 + i for i in range(24)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of the same shape with different random weights."""
    root = tmp_path_factory.mktemp("weights")
    return {
        name: build_tiny_model("qwen3_moe", root / name, seed=seed, init_std=0.2)
        for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def engine(
    weights: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """Its own engine: the tests change its weights."""
    server = start_engine(
        weights["a"],
        port=free_port(),
        log=tmp_path_factory.mktemp("push") / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
    )
    yield server
    server.stop()


def _push(engine: EngineServer, path: Path, version: str, **extra: Any) -> None:
    r = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": version, **extra},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    info = httpx.get(f"{engine.url}/model_info", timeout=30).json()
    assert info["weight_version"] == version


def _generate(engine: EngineServer, tokens: list[int], rollout: str, new: int) -> Any:
    """A greedy tagged ``/generate``; its JSON."""
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": tokens,
            "sampling_params": {
                "max_new_tokens": new,
                "temperature": 0,
                "custom_params": {"r3": {"rollout_id": rollout}},
            },
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_rows(engine: EngineServer, client: RoutingClient, tokens: list[int]) -> Any:
    """Generate one token for ``tokens`` under a fresh rollout; its stored prompt rows."""
    rollout = rid("push")
    _generate(engine, tokens, rollout, 1)
    return as_sets(client.get(rollout).indices[: len(tokens) - 1])


def test_a_push_flushes_the_prefix_cache_and_without_a_flush_rows_go_stale(
    engine: EngineServer, weights: dict[str, Path], cache_client: RoutingClient
) -> None:
    _push(engine, weights["a"], "a-0")
    rows_a = _prompt_rows(engine, cache_client, PROMPT)
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_a)  # a cache hit
    # Without the flush, the cached prefix keeps the rows the old weights produced.
    _push(engine, weights["b"], "b-stale", flush_cache=False)
    stale = _prompt_rows(engine, cache_client, PROMPT)
    httpx.post(f"{engine.url}/flush_cache", timeout=60)
    rows_b = _prompt_rows(engine, cache_client, PROMPT)
    assert not np.array_equal(rows_b, rows_a), "the two checkpoints route alike"
    assert np.array_equal(stale, rows_a), "SGLang recomputed the prefix without a flush"
    # The default push flushes: a prompt served under b is served fresh under a.
    _push(engine, weights["a"], "a-1")
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_a)
    _push(engine, weights["b"], "b-1")
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_b)


def test_turns_straddling_a_push_keep_their_versions(
    engine: EngineServer, weights: dict[str, Path], cache_client: RoutingClient
) -> None:
    _push(engine, weights["a"], "v1")
    rollout = rid("straddle")

    first = _generate(engine, PROMPT, rollout, 4)
    first_rows = cache_client.get(rollout).indices.copy()
    _push(engine, weights["b"], "v2")
    second = _generate(engine, PROMPT + first["output_ids"] + [7, 8], rollout, 4)
    assert second["meta_info"]["r3"]["weight_version"] == "v2"
    info = cache_client.stat(rollout)
    assert [s.segment.weight_version for s in info.segments] == ["v1", "v2"]
    assert info.segments[1].segment.start == first["meta_info"]["r3"]["end"]
    # The first turn's rows are those of the weights that generated it.
    now = cache_client.get(rollout).indices
    np.testing.assert_array_equal(now[: len(first_rows)], first_rows)
