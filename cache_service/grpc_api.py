"""The gRPC front end (grpc.aio): the HTTP API's operations over the same service layer."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from cache_service.auth import KeyRing, bearer_token
from cache_service.errors import status_for
from cache_service.logs import log_event
from cache_service.service import RoutingService
from r3_client import R3Error, RolloutInfo, Segment
from r3_client._proto import r3_cache_pb2 as pb
from r3_client._proto import r3_cache_pb2_grpc as pb_grpc

__all__ = ["RoutingCacheServicer", "start_grpc_server"]

T = TypeVar("T")


def _segment(seg: Segment) -> pb.Segment:
    return pb.Segment(**seg.to_dict())


def _stat(st: RolloutInfo) -> pb.RolloutStat:
    fields = st.to_dict()
    segments = [
        pb.SegmentInfo(
            segment=pb.Segment(**{k: s[k] for k in pb.Segment.DESCRIPTOR.fields_by_name}),
            codec=s["codec"],
            nbytes=s["nbytes"],
            shared=s["shared"],
        )
        for s in fields.pop("segments")
    ]
    # unset optional fields mean "unknown" (memory) and "no expiry" (ttl)
    present = {k: v for k, v in fields.items() if v is not None}
    return pb.RolloutStat(**present, segments=segments)


class RoutingCacheServicer(pb_grpc.RoutingCacheServicer):
    """Translates gRPC requests into :class:`RoutingService` calls and errors into statuses."""

    def __init__(self, service: RoutingService, keys: KeyRing) -> None:
        self.service = service
        self.keys = keys
        self.metrics = service.metrics

    def _namespace(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        md = dict(context.invocation_metadata() or ())
        value = md.get("authorization")
        return self.keys.namespace(bearer_token(value if isinstance(value, str) else None))

    async def _call(
        self,
        op: str,
        context: grpc.aio.ServicerContext[Any, Any],
        fn: Callable[[str], Awaitable[T]],
        nbytes_in: int = 0,
    ) -> T:
        """Authenticate, run ``fn(namespace)``, and turn an R3Error into a gRPC status."""
        t0 = time.perf_counter()
        code = "OK"
        try:
            self.metrics.bytes_in.labels("grpc").inc(nbytes_in)
            return await fn(self._namespace(context))
        except R3Error as exc:
            status = status_for(exc)
            code = status.grpc.name
            context.set_trailing_metadata((("r3-error-code", exc.code),))
            await context.abort(status.grpc, str(exc))
            raise  # abort() raises; this line is never reached
        finally:
            self.metrics.requests.labels("grpc", op, code).inc()
            self.metrics.latency.labels("grpc", op).observe(time.perf_counter() - t0)
            log_event(
                "request",
                logging.INFO,
                transport="grpc",
                op=op,
                status=code,
                ms=round((time.perf_counter() - t0) * 1e3, 2),
            )

    async def PutSegment(  # noqa: N802 (gRPC method names)
        self, request: pb.PutSegmentRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PutSegmentResponse:
        """See the .proto."""

        async def run(ns: str) -> pb.PutSegmentResponse:
            r = await self.service.put_segment(ns, request.rollout_id, request.frame)
            return pb.PutSegmentResponse(
                status=r.status,
                rollout_id=r.rollout_id,
                segment=_segment(r.segment),
                nbytes=r.nbytes,
                shared=r.shared,
                dedupe_hit=r.dedupe_hit,
            )

        return await self._call("put_segment", context, run, len(request.frame))

    async def GetRollout(  # noqa: N802
        self, request: pb.GetRolloutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutFrame:
        """See the .proto."""

        async def run(ns: str) -> pb.RolloutFrame:
            frame = await self.service.get_frame(
                ns,
                request.rollout_id,
                start=request.start,
                end=request.end if request.HasField("end") else None,
                layers=list(request.layers) or None,
            )
            self.metrics.bytes_out.labels("grpc").inc(len(frame))
            return pb.RolloutFrame(frame=frame)

        return await self._call("get_rollout", context, run)

    async def StatRollout(  # noqa: N802
        self, request: pb.RolloutRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RolloutStat:
        """See the .proto."""

        async def run(ns: str) -> pb.RolloutStat:
            return _stat(await self.service.stat(ns, request.rollout_id))

        return await self._call("stat_rollout", context, run)

    async def DeleteRollout(  # noqa: N802
        self, request: pb.RolloutRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteResponse:
        """See the .proto (deleting a missing rollout is not an error: ``existed=false``)."""

        async def run(ns: str) -> pb.DeleteResponse:
            return pb.DeleteResponse(existed=await self.service.delete(ns, request.rollout_id))

        return await self._call("delete_rollout", context, run)

    async def TouchRollout(  # noqa: N802
        self, request: pb.TouchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TouchResponse:
        """See the .proto."""

        async def run(ns: str) -> pb.TouchResponse:
            ttl = request.ttl_s if request.HasField("ttl_s") else None
            await self.service.touch(ns, request.rollout_id, ttl)
            return pb.TouchResponse()

        return await self._call("touch_rollout", context, run)

    async def BatchGet(  # noqa: N802
        self, request: pb.BatchGetRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.BatchItem]:
        """See the .proto.  Items are produced as the client consumes them."""

        async def start(ns: str) -> AsyncIterator[tuple[str, bytes | R3Error]]:
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

        stream = await self._call("batch_get", context, start)
        async for rid, res in stream:
            if isinstance(res, bytes):
                self.metrics.bytes_out.labels("grpc").inc(len(res))
                yield pb.BatchItem(rollout_id=rid, frame=res)
            else:
                err = pb.Error(code=res.code, message=str(res), http_status=status_for(res).http)
                yield pb.BatchItem(rollout_id=rid, error=err)


async def _parse(cls: Any, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    """Deserialize a request ourselves: a malformed message is INVALID_ARGUMENT, not INTERNAL."""
    try:
        return cls.FromString(raw)
    except DecodeError:
        context.set_trailing_metadata((("r3-error-code", "invalid_request"),))
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request is not a valid {cls.DESCRIPTOR.full_name} protobuf message",
        )


def _handlers(servicer: RoutingCacheServicer) -> grpc.GenericRpcHandler:
    """Method handlers built from the .proto's service descriptor.

    Unlike the generated ``add_RoutingCacheServicer_to_server``, requests reach
    us as raw bytes: gRPC's own deserializer turns a malformed message into
    INTERNAL, which would read as a server bug.
    """
    service = pb.DESCRIPTOR.services_by_name["RoutingCache"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.server_streaming:

            async def stream(
                raw: bytes, context: Any, behavior: Any = behavior, req_cls: Any = req_cls
            ) -> AsyncIterator[Any]:
                async for item in behavior(await _parse(req_cls, raw, context), context):
                    yield item

            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=resp_cls.SerializeToString
            )
        else:

            async def unary(
                raw: bytes, context: Any, behavior: Any = behavior, req_cls: Any = req_cls
            ) -> Any:
                return await behavior(await _parse(req_cls, raw, context), context)

            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=resp_cls.SerializeToString
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
