"""The gRPC front end (grpc.aio): the HTTP API's operations over the same service layer."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from cache_service.auth import KeyRing, bearer_token
from cache_service.errors import error_message, status_for
from cache_service.logs import log_event
from cache_service.service import RoutingService
from r3_client import InvalidRequestError, LimitExceededError, R3Error
from r3_client._proto import r3_cache_pb2 as pb
from r3_client._records import to_message

__all__ = ["RoutingCacheServicer", "start_grpc_server"]

T = TypeVar("T")
logger = logging.getLogger("r3.cache")


class RoutingCacheServicer:
    """Translates gRPC requests into :class:`RoutingService` calls and errors into statuses.

    Methods take the request's raw bytes: each call is authenticated from its
    metadata and its size checked *before* the message is parsed, and a
    malformed message is INVALID_ARGUMENT (gRPC's own deserializer would make it
    INTERNAL, which reads as a server bug).
    """

    def __init__(self, service: RoutingService, keys: KeyRing) -> None:
        self.service = service
        self.keys = keys
        self.metrics = service.metrics
        settings = service.settings
        # A PutSegment carries a frame; every other request is a few ids and numbers.
        self._limits = {
            "PutSegment": settings.max_body_bytes + (1 << 12),
            "BatchGet": settings.max_request_bytes,
        }
        self._default_limit = settings.max_request_bytes

    def _namespace(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        md = dict(context.invocation_metadata() or ())
        value = md.get("authorization")
        return self.keys.namespace(bearer_token(value if isinstance(value, str) else None))

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
        raw: bytes,
        context: grpc.aio.ServicerContext[Any, Any],
        fn: Callable[[str, Any], Awaitable[T]],
    ) -> T:
        """Authenticate, parse, run ``fn(namespace, request)``; an error becomes a status."""
        op = _OPS[method]
        t0 = time.perf_counter()
        code, http_status = "OK", 200
        try:
            ns = self._namespace(context)  # before the message is even parsed
            self.metrics.bytes_in.labels("grpc").inc(len(raw))
            return await fn(ns, self._parse(method, cls, raw))
        except R3Error as exc:
            status = status_for(exc)
            code, http_status = status.grpc.name, status.http
            context.set_trailing_metadata((("r3-error-code", exc.code),))
            await context.abort(status.grpc, error_message(exc))
            raise  # abort() raises; this line is never reached
        except MemoryError:
            code, http_status = grpc.StatusCode.RESOURCE_EXHAUSTED.name, 413
            context.set_trailing_metadata((("r3-error-code", LimitExceededError.code),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the request needs more memory than the service allows",
            )
            raise
        except Exception:
            if context.done():
                raise
            code, http_status = grpc.StatusCode.INTERNAL.name, 500
            logger.exception("gRPC %s failed", method)
            await context.abort(
                grpc.StatusCode.INTERNAL, "internal error; the service log has the details"
            )
            raise
        finally:
            self.metrics.record_request("grpc", op, http_status, time.perf_counter() - t0)
            log_event(
                "request",
                logging.INFO,
                transport="grpc",
                op=op,
                status=code,
                ms=round((time.perf_counter() - t0) * 1e3, 2),
            )

    async def PutSegment(  # noqa: N802 (gRPC method names)
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutSegmentResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.PutSegmentRequest) -> pb.PutSegmentResponse:
            r = await self.service.put_segment(ns, request.rollout_id, request.frame)
            message: pb.PutSegmentResponse = to_message(r, pb.PutSegmentResponse)
            return message

        return await self._call("PutSegment", pb.PutSegmentRequest, raw, context, run)

    async def GetRollout(  # noqa: N802
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutFrame:
        """See the .proto."""

        async def run(ns: str, request: pb.GetRolloutRequest) -> pb.RolloutFrame:
            frame = await self.service.get_frame(
                ns,
                request.rollout_id,
                start=request.start,
                end=request.end if request.HasField("end") else None,
                layers=list(request.layers) or None,
            )
            self.metrics.bytes_out.labels("grpc").inc(len(frame))
            return pb.RolloutFrame(frame=frame)

        return await self._call("GetRollout", pb.GetRolloutRequest, raw, context, run)

    async def StatRollout(  # noqa: N802
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutStat:
        """See the .proto."""

        async def run(ns: str, request: pb.RolloutRef) -> pb.RolloutStat:
            message: pb.RolloutStat = to_message(
                await self.service.stat(ns, request.rollout_id), pb.RolloutStat
            )
            return message

        return await self._call("StatRollout", pb.RolloutRef, raw, context, run)

    async def DeleteRollout(  # noqa: N802
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteResponse:
        """See the .proto (deleting a missing rollout is not an error: ``existed=false``)."""

        async def run(ns: str, request: pb.RolloutRef) -> pb.DeleteResponse:
            return pb.DeleteResponse(existed=await self.service.delete(ns, request.rollout_id))

        return await self._call("DeleteRollout", pb.RolloutRef, raw, context, run)

    async def TouchRollout(  # noqa: N802
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TouchResponse:
        """See the .proto."""

        async def run(ns: str, request: pb.TouchRequest) -> pb.TouchResponse:
            ttl = request.ttl_s if request.HasField("ttl_s") else None
            await self.service.touch(ns, request.rollout_id, ttl)
            return pb.TouchResponse()

        return await self._call("TouchRollout", pb.TouchRequest, raw, context, run)

    async def BatchGet(  # noqa: N802
        self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
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
            )
            first = await anext(items, None)  # surfaces a limit error as a status

            async def chain() -> AsyncIterator[tuple[str, bytes | R3Error]]:
                if first is not None:
                    yield first
                    async for item in items:
                        yield item

            return chain()

        stream = await self._call("BatchGet", pb.BatchGetRequest, raw, context, start)
        async for rid, res in stream:
            if isinstance(res, bytes):
                self.metrics.bytes_out.labels("grpc").inc(len(res))
                yield pb.BatchItem(rollout_id=rid, frame=res)
            else:
                err = pb.Error(
                    code=res.code, message=error_message(res), http_status=status_for(res).http
                )
                yield pb.BatchItem(rollout_id=rid, error=err)


_OPS = {
    "PutSegment": "put_segment",
    "GetRollout": "get_rollout",
    "StatRollout": "stat_rollout",
    "DeleteRollout": "delete_rollout",
    "TouchRollout": "touch_rollout",
    "BatchGet": "batch_get",
}


def _handlers(servicer: RoutingCacheServicer) -> grpc.GenericRpcHandler:
    """Method handlers built from the .proto's service descriptor, taking raw request bytes
    (no request deserializer): the servicer authenticates before it parses."""
    service = pb.DESCRIPTOR.services_by_name["RoutingCache"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        resp_cls = getattr(pb, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                behavior, response_serializer=resp_cls.SerializeToString
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                behavior, response_serializer=resp_cls.SerializeToString
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


async def start_grpc_server(
    service: RoutingService, keys: KeyRing, host: str, port: int, max_message_bytes: int
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on ``host:port`` (0 = any free port); returns it and its port."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes + (1 << 16)),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
        ]
    )
    server.add_generic_rpc_handlers((_handlers(RoutingCacheServicer(service, keys)),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    return server, bound
