"""Shared fixtures: real ``redis-server`` processes and real cache services, stopped by PID."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cache_service.redis_proc import RedisProcess, free_port, start_cluster
from cache_service.store import SegmentStore, StoreSettings
from tests.support.service_process import DIRECT_READS, Service, start_service


@pytest.fixture(scope="session")
def redis_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One standalone redis-server for the whole session; its ``url`` carries its password
    (a Redis that admits anyone is no place for direct reads)."""
    proc = RedisProcess(
        free_port(),
        tmp_path_factory.mktemp("redis"),
        appendonly=False,
        password=secrets.token_urlsafe(24),
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """A 3-master Redis Cluster on loopback ports, every node with the same password."""
    nodes = start_cluster(
        Path(tmp_path_factory.mktemp("cluster")), password=secrets.token_urlsafe(24)
    )
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.cluster)])
async def store(
    request: pytest.FixtureRequest,
) -> AsyncIterator[SegmentStore]:
    """A SegmentStore on a real Redis (standalone or cluster), isolated by a fresh key prefix."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "single":
        server: RedisProcess = request.getfixturevalue("redis_single")
        settings = StoreSettings(redis_url=server.url, key_prefix=prefix)
    else:
        nodes: list[RedisProcess] = request.getfixturevalue("redis_cluster")
        settings = StoreSettings(redis_url=nodes[0].url, cluster=True, key_prefix=prefix)
    st = await SegmentStore.connect(settings)
    yield st
    await st.close()


@pytest.fixture(scope="session")
def service_single(
    redis_single: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service over the session's standalone redis-server, direct reads on."""
    svc = start_service(tmp_path_factory.mktemp("svc-single"), redis_single.url, env=DIRECT_READS)
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def service_cluster(
    redis_cluster: list[RedisProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service over the session's 3-master Redis Cluster, direct reads on."""
    svc = start_service(
        tmp_path_factory.mktemp("svc-cluster"), redis_cluster[0].url, cluster=True, env=DIRECT_READS
    )
    yield svc
    svc.stop()


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.cluster)])
def svc(request: pytest.FixtureRequest) -> Service:
    """The service, once per Redis backend."""
    fixture = "service_single" if request.param == "single" else "service_cluster"
    service: Service = request.getfixturevalue(fixture)
    return service


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests where CUDA is absent, saying so (``-ra`` lists every one)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="gpu: needs a CUDA GPU and torch.cuda.is_available() is False here "
        "(CI has none); run `pytest -m gpu` on a GPU machine"
    )
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(params=["http", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    """The client transport a test runs over: HTTP or gRPC."""
    return str(request.param)


@pytest.fixture
def step_check_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """pytest's caplog, with the step check's logger (``r3_client.rank_local``) at INFO.

    Set on the module's logger object itself: AReaL's ``getLogger`` (imported by earlier
    tests of the session) replaces ``logging.Logger.manager``, after which
    ``logging.getLogger(name)``, what ``caplog.set_level(logger=...)`` uses, answers another
    object than the one that logs (records still reach caplog through the original root)."""
    import logging

    from r3_client import _step_check

    was = _step_check._log.level
    _step_check._log.setLevel(logging.INFO)
    yield caplog
    _step_check._log.setLevel(was)
