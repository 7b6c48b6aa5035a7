"""The HTTP front end: a FastAPI app from :func:`create_app`.

Binary in, binary out: segments are PUT as routing frames
(``application/x-r3-frame``), rollouts come back as frames or ``.npy``, batch
gets as a length-prefixed frame stream (``application/x-r3-stream``).  Errors
are JSON ``{"error": {"code": …, "message": …}}`` with a 4xx/503 status.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypedDict

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.auth import KeyRing, MetricsAccess
from cache_service.errors import status_for
from cache_service.http_guard import NAMESPACE_STATE, RequestGuard
from cache_service.logs import log_event
from cache_service.metrics import Metrics
from cache_service.service import MAX_TTL_S, RoutingService
from cache_service.settings import ServiceSettings, get_settings
from cache_service.store import SegmentStore
from r3_client import (
    InvalidRequestError,
    LimitExceededError,
    PutResult,
    R3Error,
    RolloutInfo,
    RolloutNotFoundError,
)
from r3_client._records import to_plain
from r3_client._stream import (
    FRAME_MEDIA_TYPE,
    STREAM_MEDIA_TYPE,
    encode_error_item,
    encode_frame_item,
    encode_trailer,
    stream_header,
)

__all__ = ["FRAME_MEDIA_TYPE", "create_app"]


_BINARY = {"schema": {"type": "string", "format": "binary"}}


class State(TypedDict):
    """What the lifespan yields; handlers read it from ``request.state``."""

    service: RoutingService


# ---- response and request models -------------------------------------------------------------
class ErrorBody(BaseModel):
    """``{"code": machine-readable, "message": for a person}``."""

    code: str
    message: str


class ErrorResponse(BaseModel):
    """Every non-2xx answer."""

    error: ErrorBody


# PUT and stat answers are r3_client's dataclasses (PutResult, RolloutInfo): FastAPI
# derives their JSON and OpenAPI schema from them, as the gRPC messages are derived
# (r3_client/_records.py), so each answer is defined once.


class TouchRequest(BaseModel):
    """New TTL in seconds (0 = never expire; omitted = the service default)."""

    ttl_s: int | None = Field(default=None, ge=0, le=MAX_TTL_S)


class ReadPlanResponse(BaseModel):
    """Direct-read credentials: a Redis user that can only read this namespace's keys."""

    redis_url: str
    cluster: bool
    username: str
    password: str
    key_prefix: str


class BatchGetRequest(BaseModel):
    """Many rollouts at once, optionally the same token range and layers of each."""

    rollout_ids: list[str] = Field(min_length=1)
    start: int = Field(default=0, ge=0)
    end: int | None = Field(default=None, ge=1)
    layers: list[int] | None = None


# ---- dependencies -------------------------------------------------------------------------------
def _service(request: Request) -> RoutingService:
    service: RoutingService = request.state.service
    return service


def _namespace(request: Request) -> str:
    # Authenticated by RequestGuard before the body was read.
    ns: str = getattr(request.state, NAMESPACE_STATE)
    return ns


ServiceDep = Annotated[RoutingService, Depends(_service)]
NamespaceDep = Annotated[str, Depends(_namespace)]
StartQ = Annotated[int, Query(ge=0, description="first token row")]
EndQ = Annotated[int | None, Query(ge=1, description="one past the last token row")]
LayersQ = Annotated[
    str | None, Query(description="comma-separated absolute MoE layer ids", max_length=8192)
]


def _parse_layers(layers: str | None) -> list[int] | None:
    if layers is None:
        return None
    try:
        return [int(x) for x in layers.split(",")]
    except ValueError:
        raise InvalidRequestError(
            f"layers must be comma-separated integers, got {layers[:100]!r}"
        ) from None


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
    (:func:`get_settings`), so ``uvicorn --factory cache_service.http_api:create_app``
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
            yield {"service": RoutingService(store, settings, metrics)}
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

    @app.exception_handler(R3Error)
    async def _on_r3(request: Request, exc: R3Error) -> JSONResponse:
        return _error(status_for(exc).http, exc.code, str(exc))

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

    # Added first, so it runs inside _Observe (whose status and latency include it).
    app.add_middleware(
        RequestGuard,
        keys=keys,
        metrics=metrics_access,
        max_body_bytes=settings.max_body_bytes,
        max_request_bytes=settings.max_request_bytes,
    )
    app.add_middleware(_Observe, metrics=metrics)

    @app.put(
        "/v1/rollouts/{rollout_id}/segments",
        name="put_segment",
        status_code=201,
        response_model=PutResult,
        responses={200: {"model": PutResult, "description": "the same segment was stored"}},
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "one routing frame (docs/format.md) carrying the segment",
                "content": {FRAME_MEDIA_TYPE: _BINARY, "application/octet-stream": _BINARY},
            }
        },
    )
    async def put_segment(
        rollout_id: str, request: Request, svc: ServiceDep, ns: NamespaceDep
    ) -> JSONResponse:
        """Store one segment of a rollout. Idempotent; a differing overlap is a 409."""
        body = await request.body()  # bounded by RequestGuard while it streamed in
        res = await svc.put_segment(ns, rollout_id, body)
        return JSONResponse(to_plain(res), status_code=201 if res.status == "stored" else 200)

    @app.get(
        "/v1/rollouts/{rollout_id}",
        name="get_rollout",
        response_class=Response,
        responses={
            200: {
                "description": (
                    "the stored frames overlapping the request, concatenated, undecoded "
                    "(context frames first; decode with r3_client.decode_rollout)"
                ),
                "content": {FRAME_MEDIA_TYPE: _BINARY},
            }
        },
    )
    async def get_rollout(
        rollout_id: str,
        svc: ServiceDep,
        ns: NamespaceDep,
        start: StartQ = 0,
        end: EndQ = None,
        layers: LayersQ = None,
        fmt: Annotated[str, Query(alias="format", max_length=16)] = "frame",
    ) -> Response:
        """A rollout's stored frames, whole or cut to a token range / layer subset."""
        if fmt != "frame":
            # format=npy meant decoding here; the service no longer decodes routing.
            raise InvalidRequestError(
                f"format={fmt[:16]!r} is not served: the service returns the stored frames "
                "undecoded (format=frame); decode them with r3_client.decode_rollout, or "
                "write a .npy with `r3 get <id> -o out.npy`"
            )
        lay = _parse_layers(layers)
        data = await svc.get_frame(ns, rollout_id, start=start, end=end, layers=lay)
        return Response(data, media_type=FRAME_MEDIA_TYPE)

    @app.get("/v1/rollouts/{rollout_id}/stat", name="stat_rollout", response_model=RolloutInfo)
    async def stat_rollout(rollout_id: str, svc: ServiceDep, ns: NamespaceDep) -> RolloutInfo:
        """Segments, sizes and TTL of a rollout, without its rows."""
        return await svc.stat(ns, rollout_id)

    @app.delete(
        "/v1/rollouts/{rollout_id}", name="delete_rollout", status_code=204, response_class=Response
    )
    async def delete_rollout(rollout_id: str, svc: ServiceDep, ns: NamespaceDep) -> Response:
        """Delete a rollout (404 if there was none)."""
        if not await svc.delete(ns, rollout_id):
            raise RolloutNotFoundError(f"rollout {rollout_id} not found")
        return Response(status_code=204)

    @app.post(
        "/v1/rollouts/{rollout_id}/touch",
        name="touch_rollout",
        status_code=204,
        response_class=Response,
    )
    async def touch_rollout(
        rollout_id: str, svc: ServiceDep, ns: NamespaceDep, body: TouchRequest | None = None
    ) -> Response:
        """Reset a rollout's TTL."""
        await svc.touch(ns, rollout_id, body.ttl_s if body else None)
        return Response(status_code=204)

    @app.post(
        "/v1/batch/get",
        name="batch_get",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "length-prefixed stream of frames / errors (docs/format.md)",
                "content": {STREAM_MEDIA_TYPE: _BINARY},
            }
        },
    )
    async def batch_get(
        req: BatchGetRequest, svc: ServiceDep, ns: NamespaceDep
    ) -> StreamingResponse:
        """Many rollouts in one streamed response, in request order, bounded memory."""
        items = svc.batch_get(ns, req.rollout_ids, start=req.start, end=req.end, layers=req.layers)
        first = await anext(items, None)  # a limit error still becomes a 413, not a cut stream

        async def body() -> AsyncIterator[bytes]:
            yield stream_header()
            count = 0
            pending = first
            while pending is not None:
                rid, res = pending
                chunk = (
                    encode_frame_item(rid, res)
                    if isinstance(res, bytes)
                    else encode_error_item(rid, res.code, str(res), status_for(res).http)
                )
                count += 1
                yield chunk
                pending = await anext(items, None)
            yield encode_trailer(count)

        return StreamingResponse(body(), media_type=STREAM_MEDIA_TYPE)

    @app.post("/v1/read-plan", name="read_plan", response_model=ReadPlanResponse)
    async def read_plan(svc: ServiceDep, ns: NamespaceDep) -> ReadPlanResponse:
        """Credentials to read this namespace's rollouts from Redis directly (read-only)."""
        return ReadPlanResponse(**await svc.read_plan(ns))  # type: ignore[arg-type]

    @app.get("/healthz", name="healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves requests."""
        return {"status": "ok"}

    @app.get("/readyz", name="readyz", responses={503: {"model": ErrorResponse}})
    async def readyz(svc: ServiceDep) -> dict[str, str]:
        """Readiness: Redis answers PING."""
        await svc.ready()
        return {"status": "ready"}

    @app.get("/metrics", name="metrics", response_class=Response)
    async def metrics_endpoint(svc: ServiceDep) -> Response:
        """Prometheus metrics (with auth on, only for the metrics key: RequestGuard)."""
        # On a Redis failure the gauges keep their last value: the scrape must not fail.
        with contextlib.suppress(R3Error):
            await svc.refresh_store_gauges()
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
