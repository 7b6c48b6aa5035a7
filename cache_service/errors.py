"""One table from domain errors to HTTP and gRPC statuses, and the one bound on the
messages both front ends send with them."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from r3_client import (
    AuthError,
    FormatError,
    FrameError,
    InvalidRequestError,
    LimitExceededError,
    R3Error,
    RolloutNotFoundError,
    SegmentConflictError,
    StoreUnavailableError,
)

__all__ = ["MAX_MESSAGE_BYTES", "ErrorStatus", "error_message", "status_for"]


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    """How one error class is reported on each transport."""

    http: int
    grpc: grpc.StatusCode


# Most specific first: the first isinstance match wins.
_TABLE: tuple[tuple[type[R3Error], ErrorStatus], ...] = (
    (AuthError, ErrorStatus(401, grpc.StatusCode.UNAUTHENTICATED)),
    (LimitExceededError, ErrorStatus(413, grpc.StatusCode.RESOURCE_EXHAUSTED)),
    (RolloutNotFoundError, ErrorStatus(404, grpc.StatusCode.NOT_FOUND)),
    (SegmentConflictError, ErrorStatus(409, grpc.StatusCode.ALREADY_EXISTS)),
    (InvalidRequestError, ErrorStatus(400, grpc.StatusCode.INVALID_ARGUMENT)),
    (FrameError, ErrorStatus(400, grpc.StatusCode.INVALID_ARGUMENT)),
    (FormatError, ErrorStatus(422, grpc.StatusCode.INVALID_ARGUMENT)),
    (StoreUnavailableError, ErrorStatus(503, grpc.StatusCode.UNAVAILABLE)),
)
# Any other store failure (a Redis error reply, an expired shared blob): the
# request was fine and may succeed later, so it is "unavailable", never a 500.
_DEFAULT = ErrorStatus(503, grpc.StatusCode.UNAVAILABLE)


def status_for(exc: R3Error) -> ErrorStatus:
    """The HTTP and gRPC status for ``exc``."""
    for cls, status in _TABLE:
        if isinstance(exc, cls):
            return status
    return _DEFAULT


#: Longest error message (UTF-8 bytes) either front end sends.  gRPC carries it in
#: the ``grpc-message`` trailer, which clients refuse past 8-16 KiB of metadata
#: (percent-encoding can triple it), and every item of a batch may carry one.
MAX_MESSAGE_BYTES = 1024


def error_message(exc: R3Error) -> str:
    """``str(exc)`` cut to :data:`MAX_MESSAGE_BYTES`, saying how long it was.

    Messages already quote lists by :func:`r3_client.wire.quote_items`;
    this is the bound that holds whatever a message quotes.
    """
    text = str(exc)
    raw = text.encode()
    if len(raw) <= MAX_MESSAGE_BYTES:
        return text
    cut = raw[: MAX_MESSAGE_BYTES - 40].decode(errors="ignore")
    return f"{cut}... ({len(raw)} bytes, cut)"
