"""The gate in front of every HTTP route: authenticate first, then bound the body.

A pure ASGI middleware, so it runs before FastAPI reads or parses anything:

1. ``/v1/…`` requests are authenticated from their headers alone; a missing or
   wrong key is answered 401 without reading a byte of the body.  The tenant's
   namespace is handed to the route in ``scope["state"]``.  ``/metrics`` asks
   for the metrics key when one is configured (see :class:`MetricsAccess`).
2. Every body is bounded: segment PUTs by ``max_body_bytes``, every other
   request (JSON bodies of batch gets and touches, and bodies nobody should
   send) by ``max_request_bytes``.  A declared ``Content-Length`` over the limit
   is a 413 at once; a chunked body is counted as it streams in and answered
   413 the moment it passes the limit, and the route sees a disconnect instead
   of the rest.  Memory per request is thus bounded by the limit, whatever the
   client sends.
"""

from __future__ import annotations

import json

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_service.auth import KeyRing, MetricsAccess, bearer_token
from r3_client import AuthError, LimitExceededError, R3Error

__all__ = ["NAMESPACE_STATE", "RequestGuard"]

#: Key of the authenticated namespace in ``scope["state"]`` (``request.state``).
NAMESPACE_STATE = "r3_namespace"


async def _answer(send: Send, status: int, exc: R3Error) -> None:
    body = json.dumps({"error": {"code": exc.code, "message": str(exc)}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread rest of the body makes the connection unusable.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """Authenticate ``/v1/`` and ``/metrics`` requests, and bound every body (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyRing,
        metrics: MetricsAccess,
        max_body_bytes: int,
        max_request_bytes: int,
    ) -> None:
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_request_bytes = max_request_bytes

    def _limit(self, scope: Scope) -> int:
        if scope["method"] == "PUT" and scope["path"].endswith("/segments"):
            return self.max_body_bytes
        return self.max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope["path"]
        try:
            if path.startswith("/v1/"):
                ns = self.keys.namespace(bearer_token(headers.get("authorization")))
                scope.setdefault("state", {})[NAMESPACE_STATE] = ns
            elif path == "/metrics":
                self.metrics.check(headers.get("authorization"))
        except AuthError as exc:
            await _answer(send, 401, exc)
            return
        limit = self._limit(scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _answer(
                send,
                413,
                LimitExceededError(f"body of {declared} bytes exceeds the {limit}-byte limit"),
            )
            return
        await self._bounded(scope, receive, send, limit)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        received = 0
        refused = False
        responded = False

        async def guarded_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not responded:
                        await _answer(
                            send,
                            413,
                            LimitExceededError(f"body exceeds the {limit}-byte limit"),
                        )
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if refused:
                return  # the 413 already went out; the route's own answer is moot
            if message["type"] == "http.response.start":
                responded = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # The route failed reading the body we cut off; the 413 is the answer.
