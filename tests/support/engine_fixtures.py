"""Fixtures for tests that run real SGLang: tiny MoE checkpoints, a cache service, servers.

Each SGLang server is ``python -m sglang_r3.launch_server --device cpu`` on a free
loopback port, started once per session and stopped by process group.

``tests/engine/conftest.py`` re-exports these; a test module elsewhere (the
adversarial suite) imports the ones it uses.  pytest then holds two definitions of
each fixture, so the resources behind them are shared by name and reference-counted
(:func:`_shared`): one SGLang server per session, however many directories use it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import RoutingClient
from sglang_r3.tools.local_stack import EngineServer, build_tiny_model, start_engine
from tests.support.engine_requests import CACHE_ENV
from tests.support.service_process import KEY_A, Service, start_service

T = TypeVar("T")
_SHARED: dict[str, list[Any]] = {}  # name -> [resource, users]


@contextlib.contextmanager
def _shared(name: str, make: Callable[[], T], stop: Callable[[T], object]) -> Iterator[T]:
    """``make()`` once per session for every fixture definition named ``name``;
    ``stop`` it when the last of them is torn down."""
    entry = _SHARED.get(name)
    if entry is None:
        entry = _SHARED[name] = [make(), 0]
    entry[1] += 1
    try:
        yield entry[0]
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _SHARED[name]
            stop(entry[0])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Qwen3-MoE (every layer sparse) and GLM-4-MoE (layer 0 dense), 3 layers, 8 experts, top-2."""

    def make() -> dict[str, Path]:
        root = tmp_path_factory.mktemp("models")
        return {f: build_tiny_model(f, root / f) for f in ("qwen3_moe", "glm4_moe")}

    with _shared("tiny_models", make, lambda _: None) as models:
        yield models


@pytest.fixture(scope="session")
def engine_cache(
    redis_single: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The cache service the engines ship to (external Redis, so it can be restarted)."""

    def make() -> Service:
        return start_service(
            tmp_path_factory.mktemp("engine-cache"), redis_single.url, env=CACHE_ENV
        )

    with _shared("engine_cache", make, lambda svc: svc.stop()) as svc:
        yield svc


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

    def make() -> EngineServer:
        return _engine(tmp_path_factory, tiny_models["qwen3_moe"], engine_cache, "qwen-engine")

    with _shared("qwen_engine", make, lambda s: s.stop()) as server:
        yield server


@pytest.fixture(scope="session")
def glm_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """SGLang + extension on the tiny GLM-4-MoE, with upstream's forced-retraction test mode
    (``SGLANG_TEST_RETRACT=1``: the scheduler retracts running requests every few steps),
    writing format v2 frames (``SGLANG_R3_FORMAT_VERSION=2``) into the cache the Qwen engine
    writes v3 to: the engine suites run a fleet mid-upgrade (docs/format.md 18.5)."""

    def make() -> EngineServer:
        return _engine(
            tmp_path_factory,
            tiny_models["glm4_moe"],
            engine_cache,
            "glm-engine",
            env={"SGLANG_TEST_RETRACT": "1", "SGLANG_R3_FORMAT_VERSION": "2"},
        )

    with _shared("glm_engine", make, lambda s: s.stop()) as server:
        yield server
