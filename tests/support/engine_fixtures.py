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
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cache_service.redis_proc import RedisProcess
from r3_client import RoutingClient
from sglang_r3.releases import TESTED
from sglang_r3.tools.local_stack import EngineServer, build_tiny_model, engine_port, start_engine
from tests.support.engine_requests import CACHE_ENV, shim_env
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
    python: str | None = None,
) -> EngineServer:
    log = tmp_path_factory.mktemp(name) / "sglang.log"
    return start_engine(
        model,
        port=engine_port(),
        log=log,
        routing_cache=cache.http_url,
        api_key=KEY_A,
        env={**os.environ, **(env or {})},
        python=python,
    )


# ---------------------------------------------------------------- other SGLang releases

ROOT = Path(__file__).resolve().parents[2]


def release_python(version: str) -> str:
    """The interpreter of the environment holding SGLang ``version``: this one's when it is
    the installed release, else ``.venv-sglang-<version>`` (``scripts/bootstrap.sh``
    makes it for every release in :data:`sglang_r3.releases.TESTED`).  Missing: a
    failure saying how to make it, never a skip."""
    from importlib.metadata import version as installed

    if installed("sglang") == version:
        return sys.executable
    python = ROOT / f".venv-sglang-{version}" / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no environment with SGLang {version} at {python.parent.parent}: run "
            "`scripts/bootstrap.sh` (make test does), which installs every tested release"
        )
    return str(python)


# The CPU shims every engine on another release starts with: each is a no-op on a release
# that does not need it (``logits_unpinned``: SGLang 0.5.12 pins host memory when a
# prefill returns logprobs, which raises without an NVIDIA driver; 0.5.23 asks first).
RELEASE_SHIMS = ("logits_unpinned",)


def release_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus ``env`` plus the test-only CPU shims of :data:`RELEASE_SHIMS`,
    for an engine started with :func:`release_python`'s interpreter."""
    return {**os.environ, **shim_env(*RELEASE_SHIMS), **(env or {})}


def release_engine(
    release: str,
    family: str,
    tiny_models: dict[str, Path],
    cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """The session's engine of ``family`` (``qwen3_moe``: :func:`qwen_engine`,
    ``glm4_moe``: :func:`glm_engine`, the same settings) on SGLang ``release``, shared by
    every module that asks for it."""
    python = release_python(release)
    env = None
    if family == "glm4_moe":
        env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_R3_FORMAT_VERSION": "2"}
    name = f"{family}-engine-{release}"

    def make() -> EngineServer:
        return _engine(tmp_path_factory, tiny_models[family], cache, name, release_env(env), python)

    short = "qwen_engine" if family == "qwen3_moe" else "glm_engine"
    shared = short if python == sys.executable else f"{short}@{release}"
    with _shared(shared, make, lambda s: s.stop()) as server:
        yield server


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


@pytest.fixture(scope="module", params=sorted(TESTED, reverse=True))
def sglang_release(request: pytest.FixtureRequest) -> str:
    """A tested SGLang release (the newest first), for modules that run on each: they
    ask for :func:`release_qwen_engine` / :func:`release_glm_engine` (or
    :func:`release_python` of this) instead of the session's engines."""
    return str(request.param)


@pytest.fixture(scope="module")
def release_qwen_engine(
    sglang_release: str,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """:func:`qwen_engine`'s settings on :func:`sglang_release`."""
    yield from release_engine(
        sglang_release, "qwen3_moe", tiny_models, engine_cache, tmp_path_factory
    )


@pytest.fixture(scope="module")
def release_glm_engine(
    sglang_release: str,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """:func:`glm_engine`'s settings (forced retractions, format v2) on :func:`sglang_release`."""
    yield from release_engine(
        sglang_release, "glm4_moe", tiny_models, engine_cache, tmp_path_factory
    )
