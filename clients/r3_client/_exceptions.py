"""Every error this project raises, in one tree.

    R3Error
    ├── FormatError (ValueError)        routing data breaks the format rules
    │   ├── ShapeError                  wrong rank, dtype, sizes or row count
    │   ├── ExpertIdError               an id outside [0, E) (other than a whole -1 row)
    │   ├── PartialRowError             a row mixing -1 with expert ids
    │   └── DuplicateExpertError        the same expert twice in one row
    ├── FrameError (ValueError)         bytes that are not a valid routing frame
    │   ├── TruncatedFrameError         fewer bytes than the frame declares
    │   ├── ChecksumError               the CRC does not match: corrupted in transit/at rest
    │   ├── UnsupportedFrameError       unknown magic, format version or codec id
    │   └── CodecError                  a codec cannot represent this data (e.g. C(E,K) ≥ 2^128)
    ├── StoreError                      the segment store refused or failed
    │   ├── RolloutNotFoundError        no such rollout (or it expired)
    │   ├── SegmentConflictError        a segment overlaps stored data and differs from it
    │   ├── InvalidRequestError         a well-formed request that asks for the impossible
    │   └── StoreUnavailableError       the backing Redis cannot be reached
    ├── AuthError                       missing or wrong API key
    ├── LimitExceededError              body, segment or batch larger than the service allows
    ├── ServiceError                    an error answer with a code this library does not know
    ├── ReplayError (ValueError)        the trainer cannot replay routing as given (model, shapes)
    │   └── MegatronReplayError         Megatron-Core cannot replay as configured or as given
    ├── UsageError (TypeError)          an argument of the wrong kind (a caller's bug)
    ├── IntegrationError (RuntimeError) a framework not set up as its glue needs
    │   └── FrameworkImportError        the framework a glue wraps cannot be imported (ImportError)
    └── TransportError                  the request failed on the way (it may not have arrived)
        ├── ConnectError                cannot connect (refused, DNS, TLS)
        ├── RequestTimeoutError         no complete answer within the timeout
        └── ProtocolError               an answer that is not what the API promises

The service maps these to HTTP/gRPC statuses in one place; the client maps
error codes back to the same classes (:func:`error_for_code`), and every httpx
and grpc exception is translated here too (:func:`from_httpx`,
:func:`from_grpc`), so callers catch one tree whatever the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AuthError",
    "ChecksumError",
    "CodecError",
    "ConnectError",
    "DuplicateExpertError",
    "ExpertIdError",
    "FormatError",
    "FrameError",
    "FrameworkImportError",
    "IntegrationError",
    "InvalidRequestError",
    "LimitExceededError",
    "MegatronReplayError",
    "PartialRowError",
    "ProtocolError",
    "R3Error",
    "ReplayError",
    "RequestTimeoutError",
    "RolloutNotFoundError",
    "SegmentConflictError",
    "ServiceError",
    "ShapeError",
    "StoreError",
    "StoreUnavailableError",
    "TransportError",
    "TruncatedFrameError",
    "UnsupportedFrameError",
    "UsageError",
    "error_for_code",
    "from_grpc",
    "from_httpx",
    "quote_items",
]

#: How many items of a list an error message quotes; the rest are counted, not shown.
QUOTED_ITEMS = 8


def quote_items(values: Sequence[object], *, head: int = QUOTED_ITEMS) -> str:
    """``values`` as an error message shows them: a short list whole, a long one as its
    first ``head`` items and a count, e.g. ``[0, 1, 2, ... (100000 items)]``.

    Use it wherever a message quotes a list a caller sent: quoted whole, a
    100,000-entry layer list made a 0.7 MB request cost 44 MB of error replies.
    """
    shown = ", ".join(_clip(str(v), 40) for v in values[:head])
    if len(values) <= head:
        return f"[{shown}]"
    return f"[{shown}, ... ({len(values)} items)]"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class R3Error(Exception):
    """Base of every error raised by sglang-r3.

    ``code`` is a stable machine-readable name (used in HTTP/gRPC error bodies).
    """

    code = "r3_error"


class FormatError(R3Error, ValueError):
    """Routing data violates the format (see docs/format.md)."""

    code = "invalid_routing"


class ShapeError(FormatError):
    """Wrong array rank, dtype, dimension sizes, or row count for the token range."""

    code = "invalid_shape"


class ExpertIdError(FormatError):
    """An expert id outside ``[0, num_experts)`` that is not part of a whole ``-1`` row."""

    code = "invalid_expert_id"


class PartialRowError(FormatError):
    """A row mixes ``-1`` ("no route") with real expert ids; ``-1`` must fill a whole row."""

    code = "partial_row"


class DuplicateExpertError(FormatError):
    """The same expert appears twice in one (token, layer) row."""

    code = "duplicate_expert"


class FrameError(R3Error, ValueError):
    """Bytes that cannot be decoded as a routing frame."""

    code = "invalid_frame"


class TruncatedFrameError(FrameError):
    """The buffer is shorter than the lengths the frame declares (longer is a FrameError)."""

    code = "truncated_frame"


class ChecksumError(FrameError):
    """A frame's or a chunk's checksum (CRC-32 in v1/v2, CRC-32C in v3) does not match its
    bytes."""

    code = "checksum_mismatch"


class UnsupportedFrameError(FrameError):
    """Unknown magic, format version, or codec id."""

    code = "unsupported_frame"


class CodecError(FrameError):
    """A codec cannot represent the data, or its body is internally inconsistent."""

    code = "codec_error"


class StoreError(R3Error):
    """The segment store refused the operation or failed."""

    code = "store_error"


class RolloutNotFoundError(StoreError, KeyError):
    """No routing is stored under this rollout id (never written, deleted, or expired)."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "rollout not found"


class SegmentConflictError(StoreError):
    """A segment overlaps stored segments and is not identical to them."""

    code = "conflict"


class InvalidRequestError(StoreError, ValueError):
    """A request that is well-formed but cannot be served (bad id, empty range, …)."""

    code = "invalid_request"


class StoreUnavailableError(StoreError):
    """The backing Redis is unreachable or failing."""

    code = "store_unavailable"


class AuthError(R3Error):
    """The request carries no API key, or one the service does not know."""

    code = "unauthenticated"


class LimitExceededError(R3Error, ValueError):
    """A body, segment or batch exceeds a configured service limit."""

    code = "limit_exceeded"


class ServiceError(R3Error):
    """An error answer whose code this library does not know (a newer service?)."""

    code = "service_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        if code:
            self.code = code


class ReplayError(R3Error, ValueError):
    """Routing cannot be replayed on this model as given (unsupported model, wrong shape)."""

    code = "replay_error"


class MegatronReplayError(ReplayError):
    """Megatron-Core cannot replay routing as configured (e.g. fused routing) or as given."""

    code = "megatron_replay_error"


class UsageError(R3Error, TypeError):
    """An argument of the wrong kind given to the library (a required one left out, a source
    without the method it is used for): a caller's bug, raised before anything is read."""

    code = "usage_error"


class IntegrationError(R3Error, RuntimeError):
    """A framework is not set up as its glue needs: a hook installed twice, a hook whose
    upstream signature moved, a model without routers, a process group of another size."""

    code = "integration_error"


class FrameworkImportError(IntegrationError, ImportError):
    """The framework a glue wraps (or the class a path names) cannot be imported."""

    code = "framework_import_error"


class TransportError(R3Error):
    """The request could not be completed; it may or may not have reached the service."""

    code = "transport_error"


class ConnectError(TransportError):
    """No connection to the service (refused, unreachable, name resolution)."""

    code = "connect_error"


class RequestTimeoutError(TransportError):
    """The service did not answer completely within the configured timeout."""

    code = "timeout"


class ProtocolError(TransportError):
    """The answer does not follow the API (bad stream, unexpected content type)."""

    code = "protocol_error"


def _all_subclasses(cls: type[R3Error]) -> list[type[R3Error]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_for_code(code: str, message: str, *, status: int | None = None) -> R3Error:
    """The exception for an error ``code`` sent by the service (``ServiceError`` if unknown)."""
    for cls in _all_subclasses(R3Error):
        if cls.code == code and cls is not ServiceError:
            return cls(message)
    return ServiceError(message, status=status, code=code)


def from_httpx(exc: Exception) -> TransportError:
    """The r3 error for an ``httpx.HTTPError`` raised while talking to the service."""
    import httpx  # lazy: the format does not need the HTTP stack

    if isinstance(exc, httpx.TimeoutException):
        return RequestTimeoutError(f"timed out talking to the routing service: {exc!r}")
    if isinstance(exc, httpx.ConnectError | httpx.NetworkError):
        return ConnectError(f"cannot reach the routing service: {exc}")
    return TransportError(f"HTTP transport failed: {exc!r}")


def from_grpc(exc: Exception) -> R3Error:
    """The r3 error for a failed gRPC call: the service's error code, else its status."""
    import grpc  # lazy, as above

    call: Any = exc
    md = dict(call.trailing_metadata() or ())
    code, details = call.code(), call.details() or ""
    if "r3-error-code" in md:
        return error_for_code(str(md["r3-error-code"]), details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectError(f"cannot reach the routing service: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeoutError(f"timed out talking to the routing service: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own message-size limit
        return error_for_code("limit_exceeded", details)
    return TransportError(f"gRPC call failed with {code.name}: {details}")
