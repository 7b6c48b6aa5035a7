"""The gRPC front end (grpc.aio): the HTTP API's operations over the same service layer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from cache_service.auth import KeyRing
from cache_service.errors import error_message, status_for
from cache_service.grpc_gate import AuthGate, ReceiveBudget, namespace_of
from cache_service.logs import log_event
from cache_service.memory import Trimmer
from cache_service.routing_service import RoutingService
from r3_client import InvalidRequestError, LimitExceededError, R3Error
from r3_client.wire import r3_cache_pb2 as pb
from r3_client.wire import to_message

__all__ = ["RoutingCacheServicer", "start_grpc_server"]

T = TypeVar("T")
M = TypeVar("M")
logger = logging.getLogger("r3.cache")

#: What a PutSegment message carries besides its frame (rollout id, field tags).
_PUT_FRAMING = 1 << 12
#: How many of the largest messages the server accepts it may hold at once.
RECEIVE_BUDGET_MESSAGES = 4
#: Request bytes freed between two trims of the C heap (cache_service/memory.py).
TRIM_AFTER_BYTES = 64 << 20


def _message(record: Any, cls: type[M]) -> M:
    """``record`` (an r3_client answer dataclass) as a ``cls`` protobuf message."""
    message: M = to_message(record, cls)
    return message


def _item_error(exc: R3Error) -> pb.Error:
    """A batch item's error: the code, the message and the HTTP status its own call answers."""
    return pb.Error(code=exc.code, message=error_message(exc), http_status=status_for(exc).http)


class RoutingCacheServicer:
    """Translates gRPC requests into :class:`RoutingService` calls and errors into statuses.

    Every method is request-streaming at the transport (its ``requests`` iterator
    goes unused) and reads its one message itself, with ``context.read()``, as raw
    bytes, inside the :class:`ReceiveBudget`: an unauthenticated
    call never gets here (:class:`AuthGate` refuses it unread), a call waits
    while the budget is spent, and its size is checked *before* the message is
    parsed.  A malformed message is INVALID_ARGUMENT (gRPC's own deserializer
    would make it INTERNAL, which reads as a server bug).
    """

    def __init__(self, service: RoutingService, keys: KeyRing) -> None:
        self.service = service
        self.keys = keys
        self.metrics = service.metrics
        settings = service.settings
        # A PutSegment carries a frame; every other request is a few ids and numbers.
        # Only PutSegment's limit is grpc's own (the server's one receive limit, see
        # start_grpc_server); the others are checked once the message has arrived.
        self._limits = {
            "PutSegment": self.receive_limit,
            "BatchGet": settings.max_request_bytes,
        }
        self._default_limit = settings.max_request_bytes
        self.budget = ReceiveBudget(
            RECEIVE_BUDGET_MESSAGES * self.receive_limit,
            self.receive_limit,
            Trimmer(TRIM_AFTER_BYTES),
        )

    @property
    def receive_limit(self) -> int:
        """The largest message the server receives: a maximum-size PutSegment."""
        return self.service.settings.max_body_bytes + _PUT_FRAMING

    def _parse(self, method: str, cls: Any, raw: bytes) -> Any:
        limit = self._limits.get(method, self._default_limit)
        if len(raw) > limit:
            raise LimitExceededError(
                f"{method} request of {len(raw)} bytes exceeds the {limit}-byte limit"
            )
        try:
            return cls.FromString(raw)
        except DecodeError:
            raise InvalidRequestError(
                f"request is not a valid {cls.DESCRIPTOR.full_name} protobuf message"
            ) from None

    async def _call(
        self,
        method: str,
        cls: Any,
        context: grpc.aio.ServicerContext[Any, Any],
        fn: Callable[[str, Any], Awaitable[T]],
    ) -> T:
        """Authenticate, receive, parse, run ``fn(namespace, request)``; an error becomes
        a status.  The message's bytes count against the budget until ``fn`` returns."""
        op = _OPS[method]
        t0 = time.perf_counter()
        http_status = 200
        refusal: tuple[grpc.StatusCode, str | None, str] | None = None  # status, code, message
        try:
            return await self._serve(method, cls, context, fn)
        except R3Error as exc:
            status = status_for(exc)
            http_status = status.http
            refusal = (status.grpc, exc.code, error_message(exc))
        except MemoryError:
            http_status = 413
            refusal = (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                LimitExceededError.code,
                "the request needs more memory than the service allows",
            )
        except Exception:
            if context.done():
                raise
            http_status = 500
            logger.exception("gRPC %s failed", method)
            refusal = (
                grpc.StatusCode.INTERNAL,
                None,
                "internal error; the service log has the details",
            )
        finally:
            self.metrics.record_request("grpc", op, http_status, time.perf_counter() - t0)
            log_event(
                "request",
                logging.INFO,
                transport="grpc",
                op=op,
                status=refusal[0].name if refusal else "OK",
                ms=round((time.perf_counter() - t0) * 1e3, 2),
            )
        # Aborted only here, out of the except blocks: grpc keeps the abort's exception,
        # and raised inside one it would carry the error, its traceback, and through
        # that the frames holding the request's bytes (~2 copies of every failed
        # message, kept for good).
        status_code, r3_code, message = refusal
        if r3_code is not None:
            context.set_trailing_metadata((("r3-error-code", r3_code),))
        await context.abort(status_code, message)

    async def _serve(
        self,
        method: str,
        cls: Any,
        context: grpc.aio.ServicerContext[Any, Any],
        fn: Callable[[str, Any], Awaitable[T]],
    ) -> T:
        ns = namespace_of(self.keys, context.invocation_metadata())  # AuthGate checked it
        async with self.budget.receive(context) as raw:
            if raw is None:
                raise InvalidRequestError(f"{method} call carried no request message")
            self.metrics.bytes_in.labels("grpc").inc(len(raw))
            return await fn(ns, self._parse(method, cls, raw))

    async def PutSegment(  # noqa: N802 (gRPC method names)
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutSegmentResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.PutSegmentRequest) -> pb.PutSegmentResponse:
            view = request.view if request.HasField("view") else None
            share = request.share if request.HasField("share") else None
            r = await self.service.put_segment(
                ns, request.rollout_id, request.frame, view=view, share=share
            )
            return _message(r, pb.PutSegmentResponse)

        return await self._call("PutSegment", pb.PutSegmentRequest, context, run)

    async def GetRollout(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutFrame:
        """See the .proto."""

        async def run(ns: str, request: pb.GetRolloutRequest) -> pb.RolloutFrame:
            frame = await self.service.get_frame(
                ns,
                request.rollout_id,
                start=request.start,
                end=request.end if request.HasField("end") else None,
                layers=list(request.layers) or None,
                view=request.view if request.HasField("view") else None,
            )
            self.metrics.bytes_out.labels("grpc").inc(len(frame))
            return pb.RolloutFrame(frame=frame)

        return await self._call("GetRollout", pb.GetRolloutRequest, context, run)

    async def StatRollout(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutStat:
        """See the .proto."""

        async def run(ns: str, request: pb.RolloutRef) -> pb.RolloutStat:
            return _message(await self.service.stat(ns, request.rollout_id), pb.RolloutStat)

        return await self._call("StatRollout", pb.RolloutRef, context, run)

    async def BatchStat(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BatchStatResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.BatchStatRequest) -> pb.BatchStatResponse:
            ids = list(request.rollout_ids)
            results = await self.service.batch_stat(ns, ids)

            def convert() -> pb.BatchStatResponse:
                out = pb.BatchStatResponse()
                # An id named again is the same answer: converted once (the service held
                # the whole reply to its budget, so the copies are bounded).
                stats: dict[int, pb.RolloutStat] = {}
                for rid, res in zip(ids, results, strict=True):
                    if isinstance(res, R3Error):
                        out.items.append(pb.BatchStatItem(rollout_id=rid, error=_item_error(res)))
                    else:
                        stat = stats.get(id(res))
                        if stat is None:
                            stat = stats[id(res)] = _message(res, pb.RolloutStat)
                        out.items.append(pb.BatchStatItem(rollout_id=rid, stat=stat))
                return out

            # A worker thread: on the event loop, converting up to MAX_BATCH_STAT_BYTES
            # would hold every other call up for as long.
            return await asyncio.to_thread(convert)

        return await self._call("BatchStat", pb.BatchStatRequest, context, run)

    async def BatchDelete(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BatchDeleteResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.BatchDeleteRequest) -> pb.BatchDeleteResponse:
            ids = list(request.rollout_ids)
            results = await self.service.batch_delete(ns, ids)
            out = pb.BatchDeleteResponse()
            for rid, res in zip(ids, results, strict=True):
                if isinstance(res, R3Error):
                    out.items.append(pb.BatchDeleteItem(rollout_id=rid, error=_item_error(res)))
                else:
                    deleted = _message(res, pb.Deleted)
                    out.items.append(pb.BatchDeleteItem(rollout_id=rid, deleted=deleted))
            return out

        return await self._call("BatchDelete", pb.BatchDeleteRequest, context, run)

    async def DropConsumed(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DropResult:
        """See the .proto."""

        async def run(ns: str, request: pb.DropConsumedRequest) -> pb.DropResult:
            limit = request.max_rollouts if request.HasField("max_rollouts") else None
            res = await self.service.drop_consumed(ns, request.upto, request.cursor, limit)
            return _message(res, pb.DropResult)

        return await self._call("DropConsumed", pb.DropConsumedRequest, context, run)

    async def DeleteRollout(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteResponse:
        """See the .proto (deleting a missing rollout is not an error: ``existed=false``)."""

        async def run(ns: str, request: pb.RolloutRef) -> pb.DeleteResponse:
            return pb.DeleteResponse(existed=await self.service.delete(ns, request.rollout_id))

        return await self._call("DeleteRollout", pb.RolloutRef, context, run)

    async def TouchRollout(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TouchResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.TouchRequest) -> pb.TouchResponse:
            ttl = request.ttl_s if request.HasField("ttl_s") else None
            await self.service.touch(ns, request.rollout_id, ttl)
            return pb.TouchResponse()

        return await self._call("TouchRollout", pb.TouchRequest, context, run)

    async def RewindRollout(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutStat:
        """See the .proto."""

        async def run(ns: str, request: pb.RewindRequest) -> pb.RolloutStat:
            info = await self.service.rewind(ns, request.rollout_id, request.rows)
            return _message(info, pb.RolloutStat)

        return await self._call("RewindRollout", pb.RewindRequest, context, run)

    async def BatchGet(  # noqa: N802
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.BatchItem]:
        """See the .proto.  Items are produced as the client consumes them."""

        async def start(
            ns: str, request: pb.BatchGetRequest
        ) -> AsyncIterator[tuple[str, bytes | R3Error]]:
            items = self.service.batch_get(
                ns,
                list(request.rollout_ids),
                start=request.start,
                end=request.end if request.HasField("end") else None,
                layers=list(request.layers) or None,
                ranges=[(r.start, r.end) for r in request.ranges] or None,
            )
            first = await anext(items, None)  # surfaces a limit error as a status

            async def chain() -> AsyncIterator[tuple[str, bytes | R3Error]]:
                if first is not None:
                    yield first
                    async for item in items:
                        yield item

            return chain()

        stream = await self._call("BatchGet", pb.BatchGetRequest, context, start)
        async for rid, res in stream:
            if isinstance(res, bytes):
                self.metrics.bytes_out.labels("grpc").inc(len(res))
                yield pb.BatchItem(rollout_id=rid, frame=res)
            else:
                yield pb.BatchItem(rollout_id=rid, error=_item_error(res))


_OPS = {
    "PutSegment": "put_segment",
    "GetRollout": "get_rollout",
    "StatRollout": "stat_rollout",
    "DeleteRollout": "delete_rollout",
    "TouchRollout": "touch_rollout",
    "RewindRollout": "rewind_rollout",
    "BatchGet": "batch_get",
    "BatchStat": "batch_stat",
    "BatchDelete": "batch_delete",
    "DropConsumed": "drop_consumed",
}


def _handlers(servicer: RoutingCacheServicer) -> grpc.GenericRpcHandler:
    """Method handlers built from the .proto's service descriptor, request-streaming and
    taking raw request bytes (no request deserializer): the servicer reads its one
    message itself, inside the receive budget, and parses it after checking its size."""
    service = pb.DESCRIPTOR.services_by_name["RoutingCache"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        resp_cls = getattr(pb, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behavior, response_serializer=resp_cls.SerializeToString
            )
        else:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                behavior, response_serializer=resp_cls.SerializeToString
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


async def start_grpc_server(
    service: RoutingService, keys: KeyRing, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on ``host:port`` (0 = any free port); returns it and its port.

    grpc python has one receive limit per server, not per method: it is
    PutSegment's (the largest frame, ``max_body_bytes``, plus its framing), so
    grpc itself refuses a larger message of any method; the smaller limits of the
    other methods are checked once their message has arrived, inside the receive
    budget, and only for callers :class:`AuthGate` let through.
    """
    servicer = RoutingCacheServicer(service, keys)
    server = grpc.aio.server(
        interceptors=[AuthGate(keys, service.metrics, _OPS)],
        options=[
            ("grpc.max_receive_message_length", servicer.receive_limit),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((_handlers(servicer),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    return server, bound
