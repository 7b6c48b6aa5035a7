"""Fixtures for the engine tests: tiny MoE checkpoints, a cache service, real SGLang servers.

Each SGLang server is ``python -m sglang_r3.launch_server --device cpu`` on a free
loopback port, started once per session and stopped by process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _engine import CACHE_ENV
from _service import KEY_A, Service, start_service

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import RoutingClient
from sglang_r3.testing import EngineServer, build_tiny_model, start_engine


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-MoE (every layer sparse) and GLM-4-MoE (layer 0 dense), 3 layers, 8 experts, top-2."""
    root = tmp_path_factory.mktemp("models")
    return {f: build_tiny_model(f, root / f) for f in ("qwen3_moe", "glm4_moe")}


@pytest.fixture(scope="session")
def engine_cache(
    redis_single: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The cache service the engines ship to (external Redis, so it can be restarted)."""
    svc = start_service(
        tmp_path_factory.mktemp("engine-cache"),
        redis_single.url,
        env=CACHE_ENV,
    )
    yield svc
    svc.stop()


@pytest.fixture
def cache_client(engine_cache: Service) -> Iterator[RoutingClient]:
    """A client of the engines' cache, as a trainer would hold."""
    with RoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        yield client


def _engine(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path,
    cache: Service,
    name: str,
    env: dict[str, str] | None = None,
) -> EngineServer:
    import os

    log = tmp_path_factory.mktemp(name) / "sglang.log"
    return start_engine(
        model,
        port=free_port(),
        log=log,
        routing_cache=cache.http_url,
        api_key=KEY_A,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def qwen_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """SGLang + extension on the tiny Qwen3-MoE."""
    server = _engine(tmp_path_factory, tiny_models["qwen3_moe"], engine_cache, "qwen-engine")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def glm_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """SGLang + extension on the tiny GLM-4-MoE, with upstream's forced-retraction test mode
    (``SGLANG_TEST_RETRACT=1``: the scheduler retracts running requests every few steps)."""
    server = _engine(
        tmp_path_factory,
        tiny_models["glm4_moe"],
        engine_cache,
        "glm-engine",
        env={"SGLANG_TEST_RETRACT": "1"},
    )
    yield server
    server.stop()
