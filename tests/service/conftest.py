"""Fixtures: a real cache service (uvicorn + grpc.aio in a subprocess) over real Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _service import Service, start_service

from cache_service.redis_proc import RedisProcess


@pytest.fixture(scope="session")
def service_single(
    redis_single: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service over the session's standalone redis-server."""
    svc = start_service(tmp_path_factory.mktemp("svc-single"), redis_single.url)
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def service_cluster(
    redis_cluster: list[RedisProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service over the session's 3-master Redis Cluster."""
    svc = start_service(tmp_path_factory.mktemp("svc-cluster"), redis_cluster[0].url, cluster=True)
    yield svc
    svc.stop()


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.cluster)])
def svc(request: pytest.FixtureRequest) -> Service:
    """The service, once per Redis backend."""
    fixture = "service_single" if request.param == "single" else "service_cluster"
    service: Service = request.getfixturevalue(fixture)
    return service
