"""One table from domain errors to HTTP and gRPC statuses, used by both front ends."""

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

__all__ = ["ErrorStatus", "status_for"]


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
