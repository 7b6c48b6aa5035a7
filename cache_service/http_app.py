"""The HTTP front end: a FastAPI app from :func:`create_app`.

Binary in, binary out: segments are PUT as routing frames
(``application/x-r3-frame``), rollouts come back as the stored frames, batch
gets as a length-prefixed frame stream (``application/x-r3-stream``).  Errors
are JSON ``{"error": {"code": …, "message": …}}`` with a 4xx/503 status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.auth import KeyRing, MetricsAccess
from cache_service.errors import error_message, status_for
from cache_service.http_guard import RequestGuard
from cache_service.http_routes import ErrorResponse, batch, operations, rollouts
from cache_service.logs import log_event
from cache_service.metrics import Metrics
from cache_service.routing_service import RoutingService
from cache_service.settings import ServiceSettings, get_settings
from cache_service.store.segment_store import SegmentStore
from r3_client import (
    LimitExceededError,
    R3Error,
)

__all__ = ["create_app"]


class State(TypedDict):
    """What the lifespan yields; handlers read it from ``request.state``."""

    service: RoutingService


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (400, 401, 404, 409, 413, 422, 503)
}


class _Observe:
    """Pure ASGI middleware: request metrics and one JSON log line per request.

    Wraps ``send`` only, so streamed bodies pass straight through (Starlette's
    ``BaseHTTPMiddleware`` re-streams every chunk through an extra task: ~20% of
    the service's CPU on a batch get, measured in bench/service_bench.py).
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status, sent = 500, 0

        async def observed_send(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            op = getattr(scope.get("route"), "name", "unknown")
            m = self.metrics
            m.record_request("http", op, status, time.perf_counter() - t0)
            m.bytes_out.labels("http").inc(sent)
            length = dict(scope.get("headers", ())).get(b"content-length", b"")
            if length.isdigit():
                m.bytes_in.labels("http").inc(int(length))
            if op not in ("metrics", "healthz", "readyz"):
                log_event(
                    "request",
                    logging.INFO if status < 500 else logging.ERROR,
                    transport="http",
                    op=op,
                    method=scope.get("method"),
                    path=scope.get("path"),
                    status=status,
                    ms=round((time.perf_counter() - t0) * 1e3, 2),
                )


def _install_error_handlers(app: FastAPI) -> None:
    """Every error becomes ``{"error": {"code", "message"}}`` with its status, never a trace."""

    @app.exception_handler(R3Error)
    async def _on_r3(request: Request, exc: R3Error) -> JSONResponse:
        return _error(status_for(exc).http, exc.code, error_message(exc))

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
            for e in exc.errors()[:5]
        ]
        return _error(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "no_such_route", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(MemoryError)
    async def _on_memory(request: Request, exc: MemoryError) -> JSONResponse:
        # A request that needs more memory than the process has is the request's
        # size, not a server fault: answered like any other limit.
        return _error(413, LimitExceededError.code, "the request needs more memory than allowed")

    @app.exception_handler(Exception)
    async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets JSON, not internals.
        return _error(500, "internal_error", "internal error; the service log has the details")


# ---- the app ----------------------------------------------------------------------------------
def create_app(
    settings: ServiceSettings | None = None,
    service: RoutingService | None = None,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The HTTP app.

    With ``service`` given (``r3 serve``, which shares it with gRPC) the app
    uses it; otherwise the lifespan connects to ``settings.redis_url`` and
    closes the pool on shutdown.  ``settings`` defaults to the environment
    (:func:`get_settings`), so ``uvicorn --factory cache_service.http_app:create_app``
    works for an HTTP-only deployment.
    """
    settings = settings or get_settings()
    keys = KeyRing(settings.all_api_keys(), enabled=settings.auth_enabled())
    metrics_key = settings.metrics_key()
    settings.check_direct_reads()
    metrics_access = MetricsAccess(
        required=keys.enabled,
        keys=KeyRing({metrics_key: "metrics"}, enabled=True) if metrics_key else None,
    )
    metrics = metrics or (service.metrics if service else Metrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[State]:
        if service is not None:
            yield {"service": service}
            return
        if settings.redis_url is None:
            raise RuntimeError("create_app without a service needs settings.redis_url")
        store = await SegmentStore.connect(settings.store_settings(settings.redis_url))
        try:
            own = RoutingService(store, settings, metrics)
            await own.check_direct_reads()
            yield {"service": own}
        finally:
            await store.close()

    app = FastAPI(
        title="sglang-r3 routing cache",
        version="1",
        description=(
            "Stores MoE routing (per-token top-k experts per MoE layer) by rollout id. "
            "Frames are the binary format of docs/format.md; send "
            "`Authorization: Bearer <key>` when auth is on."
        ),
        lifespan=lifespan,
        responses=_ERRORS,
    )

    _install_error_handlers(app)

    # Added first, so it runs inside _Observe (whose status and latency include it).
    app.add_middleware(
        RequestGuard,
        keys=keys,
        metrics=metrics_access,
        max_body_bytes=settings.max_body_bytes,
        max_request_bytes=settings.max_request_bytes,
    )
    app.add_middleware(_Observe, metrics=metrics)

    for router in (rollouts, batch, operations):
        app.include_router(router)
    return app
