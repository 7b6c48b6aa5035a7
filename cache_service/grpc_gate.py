"""What stands between a gRPC call and its message: the key check, and the receive budget.

grpc reads a unary call's message off the wire and hands it over whole, so a
check in the servicer comes after the service already holds the message (up
to the server's ``grpc.max_receive_message_length``).  Two things keep that
memory bounded:

* :class:`AuthGate`, a server interceptor, checks the API key from the call's
  metadata before any handler runs.  A call it refuses is answered
  UNAUTHENTICATED by a request-streaming handler that never reads a message,
  so an unauthenticated caller costs the service at most one HTTP/2
  flow-control window, whatever it sends.
* :class:`ReceiveBudget` bounds the bytes of request messages held at once:
  a call reserves the largest message the server accepts before it reads its
  own, keeps what actually arrived until it finishes, and waits while the
  budget is spent (grpc has one receive limit per server, not per method, so
  any method's message may be that large until it is read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeAlias

import grpc

from cache_service.auth import KeyRing, bearer_token
from cache_service.errors import error_message
from cache_service.logs import log_event
from cache_service.memory import Trimmer
from cache_service.metrics import Metrics
from r3_client import AuthError

__all__ = ["AuthGate", "ReceiveBudget", "namespace_of"]


def namespace_of(keys: KeyRing, metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The namespace of the call whose metadata is ``metadata``; raises :class:`AuthError`."""
    value = dict(metadata or ()).get("authorization")
    return keys.namespace(bearer_token(value if isinstance(value, str) else None))


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only to the type stubs


class AuthGate(grpc.aio.ServerInterceptor):
    """Refuse a call with a missing or unknown key before its message is read."""

    def __init__(self, keys: KeyRing, metrics: Metrics, ops: dict[str, str]) -> None:
        self.keys = keys
        self.metrics = metrics
        self.ops = ops  # method name -> metrics op name

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """The method's handler, or one that refuses the call unread."""
        t0 = time.perf_counter()
        try:
            namespace_of(self.keys, handler_call_details.invocation_metadata)
        except AuthError as exc:
            method = str(handler_call_details.method).rpartition("/")[2]
            return self._refusal(self.ops.get(method, "unknown"), exc, t0)
        return await continuation(handler_call_details)

    def _refusal(self, op: str, exc: AuthError, t0: float) -> Handler:
        async def refuse(requests: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            # Request-streaming, and the iterator is never touched: nothing is read.
            self.metrics.record_request("grpc", op, 401, time.perf_counter() - t0)
            log_event(
                "request",
                logging.INFO,
                transport="grpc",
                op=op,
                status=grpc.StatusCode.UNAUTHENTICATED.name,
                ms=round((time.perf_counter() - t0) * 1e3, 2),
            )
            context.set_trailing_metadata((("r3-error-code", exc.code),))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error_message(exc))

        return grpc.stream_unary_rpc_method_handler(refuse)


class ReceiveBudget:
    """Bytes of request messages the gRPC front end holds at once (see the module docstring).

    ``total`` must be at least ``most``, the largest message the server accepts.
    Waiters are served first come, first served.  ``trimmer`` hears of every
    message the service is done with, to hand its memory back.
    """

    def __init__(self, total: int, most: int, trimmer: Trimmer | None = None) -> None:
        if total < most:
            raise ValueError(f"a receive budget of {total} bytes cannot hold a {most}-byte message")
        self.total = total
        self.most = most
        self.free = total
        self.trimmer = trimmer
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def _take(self, n: int) -> None:
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((n, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._give(n)  # granted, then cancelled before it could run
            raise

    def _give(self, n: int) -> None:
        # Synchronous, so a cancelled call still gives back what it held.
        self.free += n
        while self._waiters and self._waiters[0][0] <= self.free:
            want, granted = self._waiters.popleft()
            if not granted.done():
                self.free -= want
                granted.set_result(None)

    @asynccontextmanager
    async def receive(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes | None]:
        """The call's one message (None if the client sent none), its bytes counted until exit.

        Read with ``context.read()``, not the request iterator: the iterator's
        generator keeps the last message it yielded for as long as grpc keeps the call.
        """
        await self._take(self.most)
        held, size = self.most, 0
        try:
            got = await context.read()
            raw = got if isinstance(got, bytes) else None  # grpc.aio.EOF: no message
            size = len(raw) if raw is not None else 0
            self._give(held - size)  # from here on, only what arrived
            held = size
            yield raw
        finally:
            self._give(held)
            if self.trimmer is not None:
                self.trimmer.freed(size)
