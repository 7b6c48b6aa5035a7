"""Run the whole service in one process: embedded Redis (optional), HTTP and gRPC.

``r3 serve`` calls :func:`serve`.  Both front ends share one
:class:`RoutingService` and so one Redis pool.  SIGINT/SIGTERM stop the
listeners, close the pool, and stop an embedded ``redis-server`` (AOF flushed).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
from pathlib import Path

import uvicorn

from cache_service.auth import KeyRing
from cache_service.grpc_api import start_grpc_server
from cache_service.http_app import create_app
from cache_service.logs import configure_logging, log_event
from cache_service.metrics import Metrics
from cache_service.redis_proc import RedisProcess, free_port
from cache_service.routing_service import RoutingService
from cache_service.settings import ServiceSettings
from cache_service.store.segment_store import SegmentStore

__all__ = ["serve"]


def _embedded_redis(data_dir: Path) -> RedisProcess:
    """A redis-server with AOF (fsync always) whose files live in ``data_dir/redis``.

    Its ``default`` user has a fresh random password that only this process knows:
    other local users cannot read the store, and direct reads (whose per-namespace
    users mean something only where Redis asks for credentials) work with it.
    """
    password = secrets.token_urlsafe(32)
    return RedisProcess(free_port(), data_dir / "redis", appendonly=True, password=password).start()


async def run(settings: ServiceSettings) -> None:
    """Serve until SIGINT/SIGTERM."""
    configure_logging(settings.log_level)
    keys = KeyRing(settings.all_api_keys(), enabled=settings.auth_enabled())
    settings.check_direct_reads()
    embedded: RedisProcess | None = None
    redis_url = settings.redis_url
    if redis_url is None:
        embedded = _embedded_redis(settings.data_dir)
        redis_url = embedded.url
        log_event(
            "embedded redis-server started",
            pid=embedded.pid,
            url=f"redis://127.0.0.1:{embedded.port}/0",  # not the password
            dir=str(embedded.data_dir),
        )
    try:
        store = await SegmentStore.connect(settings.store_settings(redis_url))
        try:
            service = RoutingService(store, settings, Metrics())
            await service.check_direct_reads()
            await _serve(settings, service, keys)
        finally:
            await store.close()
    finally:
        if embedded is not None:
            embedded.stop()
            log_event("embedded redis-server stopped")


async def _serve(settings: ServiceSettings, service: RoutingService, keys: KeyRing) -> None:
    grpc_server, grpc_port = await start_grpc_server(
        service, keys, settings.grpc_host, settings.grpc_port
    )
    app = create_app(settings, service)
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
        # Idle keep-alive connections stay open 75 s: clients (httpx: 5 s) expire theirs
        # first, so a request never races the server closing its connection.
        timeout_keep_alive=75,
    )
    http = uvicorn.Server(config)
    # uvicorn captures SIGINT/SIGTERM while serving and re-raises them afterwards;
    # with asyncio handlers installed first, that re-raise lands here (a no-op)
    # instead of killing the process before the embedded Redis is stopped.
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(http, "should_exit", True))
    log_event(
        "serving",
        http=f"{settings.http_host}:{settings.http_port}",
        grpc=f"{settings.grpc_host}:{grpc_port}",
        auth=keys.enabled,
    )
    try:
        await http.serve()
    finally:
        with contextlib.suppress(Exception):
            await grpc_server.stop(grace=5)
        log_event("stopped")


def serve(settings: ServiceSettings) -> None:
    """Blocking entry point for the CLI."""
    asyncio.run(run(settings))
