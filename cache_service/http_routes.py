"""The HTTP API's routes: one ``APIRouter`` per resource, with their models and dependencies.

``rollouts`` (segments in, frames and stats out, delete, touch), ``batch`` (many
rollouts in one stream, direct-read plans) and ``operations`` (health, readiness,
metrics).  :func:`cache_service.http_app.create_app` mounts them behind the
request guard and the observing middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, StrictInt, StrictStr

from cache_service.errors import error_message, status_for
from cache_service.http_guard import NAMESPACE_STATE
from cache_service.routing_service import MAX_TTL_S, RoutingService
from r3_client import (
    Deleted,
    DropResult,
    InvalidRequestError,
    PutResult,
    R3Error,
    RolloutInfo,
    RolloutNotFoundError,
)
from r3_client.wire import (
    FRAME_MEDIA_TYPE,
    STREAM_MEDIA_TYPE,
    encode_error_item,
    encode_frame_item,
    encode_trailer,
    stream_header,
    to_plain,
)

__all__ = ["ErrorResponse", "batch", "operations", "rollouts"]

_BINARY = {"schema": {"type": "string", "format": "binary"}}


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
# (r3_client/_answer_forms.py), so each answer is defined once.


class TouchRequest(BaseModel):
    """New TTL in seconds (0 = never expire; omitted = the service default)."""

    ttl_s: int | None = Field(default=None, ge=0, le=MAX_TTL_S)


class RewindRequest(BaseModel):
    """The rows to keep: every segment starting at or after ``rows`` is dropped."""

    rows: int = Field(ge=1, le=1 << 40)


class BatchDeleteRequest(BaseModel):
    """Rollouts to delete (with their views), e.g. a step's, once trained on."""

    rollout_ids: list[str] = Field(min_length=1)


class BatchDeleteItem(BaseModel):
    """One id's outcome (``deleted``), or the error its own ``DELETE`` would answer."""

    rollout_id: str
    deleted: Deleted | None = None
    error: ErrorBody | None = None
    status: int | None = None  # the HTTP status of ``error``


class BatchDeleteResponse(BaseModel):
    """One item per id asked, in request order."""

    items: list[BatchDeleteItem]


class DropConsumedRequest(BaseModel):
    """Drop the namespace's rollouts whose every row was computed under a weight version
    ``<= upto`` (decimal digits, or an int); one bounded step, resumed with ``cursor``."""

    upto: StrictInt | StrictStr = Field(union_mode="left_to_right")
    cursor: str = Field(default="", max_length=64)
    # a JSON integer: "5", true and 5.0 are not counts (the service checks the range)
    max_rollouts: StrictInt | None = None


class ReadPlanResponse(BaseModel):
    """Direct-read credentials: a Redis user that can only read this namespace's keys."""

    redis_url: str
    cluster: bool
    username: str
    password: str
    key_prefix: str


class BatchGetRequest(BaseModel):
    """Many rollouts at once, optionally the same token range and layers of each, or
    one row range per item (``ranges``: a training rank's slice, ids may repeat)."""

    rollout_ids: list[str] = Field(min_length=1)
    start: int = Field(default=0, ge=0)
    end: int | None = Field(default=None, ge=1)
    layers: list[int] | None = None
    ranges: list[tuple[int, int]] | None = None


class BatchStatRequest(BaseModel):
    """Many rollouts' stats at once (metadata only)."""

    rollout_ids: list[str] = Field(min_length=1)


class BatchStatItem(BaseModel):
    """One rollout's stat, or the error its own ``GET .../stat`` would answer."""

    rollout_id: str
    stat: RolloutInfo | None = None
    error: ErrorBody | None = None
    status: int | None = None  # the HTTP status of ``error``


class BatchStatResponse(BaseModel):
    """One item per id asked, in request order."""

    items: list[BatchStatItem]


def _item_error(exc: R3Error) -> dict[str, Any]:
    """A batch item's ``error`` and ``status`` fields: what the id's own call would answer."""
    return {
        "error": ErrorBody(code=exc.code, message=error_message(exc)),
        "status": status_for(exc).http,
    }


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
ViewQ = Annotated[
    int | None,
    Query(ge=0, le=(1 << 40) - 1, description="the view serving this row (docs/store.md, Views)"),
]
ShareQ = Annotated[
    bool | None,
    Query(
        description="true: keep the segment in a blob other rollouts share (a GRPO group's "
        "prompt); false: keep it private; absent: the store's rule (docs/store.md)"
    ),
]
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


rollouts = APIRouter(tags=["rollouts"])
batch = APIRouter(tags=["batch"])
operations = APIRouter(tags=["operations"])


@rollouts.put(
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
    rollout_id: str,
    request: Request,
    svc: ServiceDep,
    ns: NamespaceDep,
    view: ViewQ = None,
    share: ShareQ = None,
) -> JSONResponse:
    """Store one segment of a rollout (``view``: of its view serving that row; ``share``:
    whether it is kept in a blob other rollouts share). Idempotent; a differing overlap is a
    409."""
    body = await request.body()  # bounded by RequestGuard while it streamed in
    res = await svc.put_segment(ns, rollout_id, body, view=view, share=share)
    return JSONResponse(to_plain(res), status_code=201 if res.status == "stored" else 200)


@rollouts.get(
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
    view: ViewQ = None,
) -> Response:
    """A rollout's stored frames, whole or cut to a token range / layer subset."""
    if fmt != "frame":
        # format=npy would mean decoding here, and the service never decodes routing.
        raise InvalidRequestError(
            f"format={fmt[:16]!r} is not served: the service returns the stored frames "
            "undecoded (format=frame); decode them with r3_client.decode_rollout, or "
            "write a .npy with `r3 get <id> -o out.npy`"
        )
    lay = _parse_layers(layers)
    data = await svc.get_frame(ns, rollout_id, start=start, end=end, layers=lay, view=view)
    return Response(data, media_type=FRAME_MEDIA_TYPE)


@rollouts.get("/v1/rollouts/{rollout_id}/stat", name="stat_rollout", response_model=RolloutInfo)
async def stat_rollout(rollout_id: str, svc: ServiceDep, ns: NamespaceDep) -> RolloutInfo:
    """Segments, sizes and TTL of a rollout, without its rows."""
    return await svc.stat(ns, rollout_id)


@rollouts.delete(
    "/v1/rollouts/{rollout_id}", name="delete_rollout", status_code=204, response_class=Response
)
async def delete_rollout(rollout_id: str, svc: ServiceDep, ns: NamespaceDep) -> Response:
    """Delete a rollout (404 if there was none)."""
    if not await svc.delete(ns, rollout_id):
        raise RolloutNotFoundError(f"rollout {rollout_id} not found")
    return Response(status_code=204)


@rollouts.post(
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


@rollouts.post(
    "/v1/rollouts/{rollout_id}/rewind", name="rewind_rollout", response_model=RolloutInfo
)
async def rewind_rollout(
    rollout_id: str, body: RewindRequest, svc: ServiceDep, ns: NamespaceDep
) -> RolloutInfo:
    """Drop the segments starting at or after ``rows`` (409 if one straddles it); the stat.

    For a driver that lost the answer to a turn the engine finished and stored: it
    goes back to the rows it holds, then sends the turn again.  Idempotent.
    """
    return await svc.rewind(ns, rollout_id, body.rows)


@batch.post(
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
async def batch_get(req: BatchGetRequest, svc: ServiceDep, ns: NamespaceDep) -> StreamingResponse:
    """Many rollouts in one streamed response, in request order, bounded memory."""
    items = svc.batch_get(
        ns, req.rollout_ids, start=req.start, end=req.end, layers=req.layers, ranges=req.ranges
    )
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
                else encode_error_item(rid, res.code, error_message(res), status_for(res).http)
            )
            count += 1
            yield chunk
            pending = await anext(items, None)
        yield encode_trailer(count)

    return StreamingResponse(body(), media_type=STREAM_MEDIA_TYPE)


@batch.post("/v1/batch/stat", name="batch_stat", response_model=BatchStatResponse)
async def batch_stat(req: BatchStatRequest, svc: ServiceDep, ns: NamespaceDep) -> Response:
    """Many rollouts' stats in one request, in request order, each its stat or its error.

    The answer (up to ``MAX_BATCH_STAT_BYTES``) is encoded in a worker thread: on the
    event loop, its encoding would hold every other request up for as long.
    """
    results = await svc.batch_stat(ns, req.rollout_ids)

    def encode() -> bytes:
        items = [
            BatchStatItem(rollout_id=rid, stat=res)
            if isinstance(res, RolloutInfo)
            else BatchStatItem(rollout_id=rid, **_item_error(res))
            for rid, res in zip(req.rollout_ids, results, strict=True)
        ]
        return BatchStatResponse(items=items).model_dump_json().encode()

    return Response(await asyncio.to_thread(encode), media_type="application/json")


@batch.post("/v1/batch/delete", name="batch_delete", response_model=BatchDeleteResponse)
async def batch_delete(
    req: BatchDeleteRequest, svc: ServiceDep, ns: NamespaceDep
) -> BatchDeleteResponse:
    """Delete many rollouts and their views in one request: each id's outcome (whether it
    existed, the bytes Redis freed) or its error, in request order."""
    results = await svc.batch_delete(ns, req.rollout_ids)
    return BatchDeleteResponse(
        items=[
            BatchDeleteItem(rollout_id=rid, deleted=res)
            if isinstance(res, Deleted)
            else BatchDeleteItem(rollout_id=rid, **_item_error(res))
            for rid, res in zip(req.rollout_ids, results, strict=True)
        ]
    )


@batch.post("/v1/drop-consumed", name="drop_consumed", response_model=DropResult)
async def drop_consumed(req: DropConsumedRequest, svc: ServiceDep, ns: NamespaceDep) -> DropResult:
    """One bounded step of dropping what a trainer consumed up to a weight version: rollouts
    dropped whole or kept whole; call again with the answer's ``cursor`` until it is empty."""
    return await svc.drop_consumed(ns, req.upto, req.cursor, req.max_rollouts)


@batch.post("/v1/read-plan", name="read_plan", response_model=ReadPlanResponse)
async def read_plan(svc: ServiceDep, ns: NamespaceDep) -> ReadPlanResponse:
    """Credentials to read this namespace's rollouts from Redis directly (read-only)."""
    return ReadPlanResponse(**await svc.read_plan(ns))  # type: ignore[arg-type]


@operations.get("/healthz", name="healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process serves requests."""
    return {"status": "ok"}


@operations.get("/readyz", name="readyz", responses={503: {"model": ErrorResponse}})
async def readyz(svc: ServiceDep) -> dict[str, str]:
    """Readiness: Redis answers PING."""
    await svc.ready()
    return {"status": "ready"}


@operations.get("/metrics", name="metrics", response_class=Response)
async def metrics_endpoint(svc: ServiceDep) -> Response:
    """Prometheus metrics (with auth on, only for the metrics key: RequestGuard)."""
    # On a Redis failure the gauges keep their last value: the scrape must not fail.
    with contextlib.suppress(R3Error):
        await svc.refresh_store_gauges()
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")
