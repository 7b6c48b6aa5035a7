"""gRPC transports (sync and grpc.aio) over the stubs in ``r3_client._proto``."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

import grpc

from r3_client._answer_forms import from_message, to_plain
from r3_client._answers import Deleted, DropResult, PutResult, RolloutInfo
from r3_client._config import Timeout
from r3_client._exceptions import ProtocolError, R3Error, error_for_code, from_grpc
from r3_client._proto import r3_cache_pb2 as pb
from r3_client._proto import r3_cache_pb2_grpc as pb_grpc
from r3_client.codec.stream import StreamItem

__all__ = ["AsyncGrpcTransport", "GrpcTransport"]

_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # Reconnect within a second of the service coming back. gRPC's default backoff
    # grows to 120 s, so a channel that failed through a 10 s restart kept answering
    # UNAVAILABLE long after the service was up (an engine then refused tagged
    # requests with 503; tests/engine/test_router.py's cache outage).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _plain(msg: Any, cls: type) -> dict[str, Any]:
    # The HTTP JSON's form of the same record: both are derived from one dataclass.
    out: dict[str, Any] = to_plain(from_message(msg, cls))
    return out


def _get_request(
    rollout_id: str,
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    view: int | None = None,
) -> pb.GetRolloutRequest:
    req = pb.GetRolloutRequest(
        rollout_id=rollout_id, start=start, layers=[int(x) for x in layers or ()]
    )
    if end is not None:
        req.end = end
    if view is not None:
        req.view = view
    return req


def _put_request(
    rollout_id: str, frame: bytes, view: int | None, share: bool | None
) -> pb.PutSegmentRequest:
    req = pb.PutSegmentRequest(rollout_id=rollout_id, frame=frame)
    if view is not None:
        req.view = view
    if share is not None:
        req.share = share
    return req


def _batch_request(
    ids: Sequence[str],
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    ranges: Sequence[tuple[int, int]] | None,
) -> pb.BatchGetRequest:
    req = pb.BatchGetRequest(
        rollout_ids=list(ids),
        start=start,
        layers=[int(x) for x in layers or ()],
        ranges=[pb.RowRange(start=int(a), end=int(b)) for a, b in ranges or ()],
    )
    if end is not None:
        req.end = end
    return req


def _item(msg: pb.BatchItem) -> StreamItem:
    which = msg.WhichOneof("result")
    if which == "frame":
        return StreamItem(msg.rollout_id, frame=msg.frame)
    if which == "error":
        e = msg.error
        return StreamItem(msg.rollout_id, None, e.code, e.message, e.http_status)
    raise ProtocolError(f"batch item for {msg.rollout_id!r} has neither frame nor error")


def _batch_items(msg: Any) -> list[tuple[str, dict[str, Any] | R3Error]]:
    """A ``BatchStatResponse``'s or ``BatchDeleteResponse``'s items: each the record's
    plain form or the error it names."""
    out: list[tuple[str, dict[str, Any] | R3Error]] = []
    for item in msg.items:
        which = item.WhichOneof("result")
        if which == "stat":
            out.append((item.rollout_id, _plain(item.stat, RolloutInfo)))
        elif which == "deleted":
            out.append((item.rollout_id, _plain(item.deleted, Deleted)))
        elif which == "error":
            e = item.error
            out.append((item.rollout_id, error_for_code(e.code, e.message, status=e.http_status)))
        else:
            raise ProtocolError(f"batch item for {item.rollout_id!r} has no result")
    return out


def _target(url: str) -> str:
    return url.removeprefix("grpc://")


class GrpcTransport:
    """Blocking gRPC transport (one channel)."""

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout: Timeout = Timeout()
    ) -> None:
        self._channel = grpc.insecure_channel(_target(url), options=_OPTIONS)
        self._stub = pb_grpc.RoutingCacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout = timeout.read

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, metadata=self._md, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None

    def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = _put_request(rollout_id, frame, view, share)
        return _plain(self._call(self._stub.PutSegment, req), PutResult)

    def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """See :class:`Transport`."""
        msg = self._call(self._stub.GetRollout, _get_request(rollout_id, start, end, layers, view))
        frame: bytes = msg.frame
        return frame

    def stat(self, rollout_id: str) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.RolloutRef(rollout_id=rollout_id)
        return _plain(self._call(self._stub.StatRollout, req), RolloutInfo)

    def stat_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        req = pb.BatchStatRequest(rollout_ids=list(rollout_ids))
        return _batch_items(self._call(self._stub.BatchStat, req))

    def delete(self, rollout_id: str) -> bool:
        """See :class:`Transport`."""
        msg = self._call(self._stub.DeleteRollout, pb.RolloutRef(rollout_id=rollout_id))
        return bool(msg.existed)

    def delete_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        req = pb.BatchDeleteRequest(rollout_ids=list(rollout_ids))
        return _batch_items(self._call(self._stub.BatchDelete, req))

    def drop_consumed(self, upto: str, cursor: str, max_rollouts: int | None) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.DropConsumedRequest(upto=upto, cursor=cursor)
        if max_rollouts is not None:
            req.max_rollouts = max_rollouts
        return _plain(self._call(self._stub.DropConsumed, req), DropResult)

    def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """See :class:`Transport`."""
        req = pb.TouchRequest(rollout_id=rollout_id)
        if ttl_s is not None:
            req.ttl_s = ttl_s
        self._call(self._stub.TouchRollout, req)

    def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.RewindRequest(rollout_id=rollout_id, rows=rows)
        return _plain(self._call(self._stub.RewindRollout, req), RolloutInfo)

    def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Generator[StreamItem, None, None]:
        """See :class:`Transport`."""
        stream = self._stub.BatchGet(
            _batch_request(rollout_ids, start, end, layers, ranges),
            metadata=self._md,
            timeout=self._timeout,
        )
        try:
            for msg in stream:
                yield _item(msg)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None
        finally:
            stream.cancel()

    def close(self) -> None:
        """See :class:`Transport`."""
        self._channel.close()


class AsyncGrpcTransport:
    """grpc.aio transport (one channel, created lazily inside the running loop)."""

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout: Timeout = Timeout()
    ) -> None:
        self._target = _target(url)
        self._md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout = timeout.read
        self._channel: grpc.aio.Channel | None = None
        self._stub_: Any = None

    @property
    def _stub(self) -> Any:
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=_OPTIONS)
            self._stub_ = pb_grpc.RoutingCacheStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub_

    async def _call(self, name: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, name)(
                request, metadata=self._md, timeout=self._timeout
            )
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None

    async def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = _put_request(rollout_id, frame, view, share)
        return _plain(await self._call("PutSegment", req), PutResult)

    async def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """See :class:`Transport`."""
        msg = await self._call("GetRollout", _get_request(rollout_id, start, end, layers, view))
        frame: bytes = msg.frame
        return frame

    async def stat(self, rollout_id: str) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.RolloutRef(rollout_id=rollout_id)
        return _plain(await self._call("StatRollout", req), RolloutInfo)

    async def stat_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        req = pb.BatchStatRequest(rollout_ids=list(rollout_ids))
        return _batch_items(await self._call("BatchStat", req))

    async def delete(self, rollout_id: str) -> bool:
        """See :class:`Transport`."""
        msg = await self._call("DeleteRollout", pb.RolloutRef(rollout_id=rollout_id))
        return bool(msg.existed)

    async def delete_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        req = pb.BatchDeleteRequest(rollout_ids=list(rollout_ids))
        return _batch_items(await self._call("BatchDelete", req))

    async def drop_consumed(
        self, upto: str, cursor: str, max_rollouts: int | None
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.DropConsumedRequest(upto=upto, cursor=cursor)
        if max_rollouts is not None:
            req.max_rollouts = max_rollouts
        return _plain(await self._call("DropConsumed", req), DropResult)

    async def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """See :class:`Transport`."""
        req = pb.TouchRequest(rollout_id=rollout_id)
        if ttl_s is not None:
            req.ttl_s = ttl_s
        await self._call("TouchRollout", req)

    async def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """See :class:`Transport`."""
        req = pb.RewindRequest(rollout_id=rollout_id, rows=rows)
        return _plain(await self._call("RewindRollout", req), RolloutInfo)

    async def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """See :class:`Transport`."""
        call = self._stub.BatchGet(
            _batch_request(rollout_ids, start, end, layers, ranges),
            metadata=self._md,
            timeout=self._timeout,
        )
        try:
            async for msg in call:
                yield _item(msg)
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None
        finally:
            call.cancel()

    async def aclose(self) -> None:
        """See :class:`AsyncTransport`."""
        if self._channel is not None:
            await self._channel.close()
