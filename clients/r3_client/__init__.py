"""sglang-r3 client library: the routing format and codec, and clients of the routing cache.

The codec (:mod:`r3_client.codec`) owns the bytes: the SGLang plugin imports it
from here, the cache service from here and from its seam :mod:`r3_client.wire`, and
nothing else encodes or decodes routing.

Importing the package loads only the format, the codec, the models and the
errors: the clients (and with them httpx, grpc and tqdm) load on first access
to ``RoutingClient`` or ``AsyncRoutingClient``, so the SGLang plugin and
trainers that only decode do not pay for the transports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from r3_client._answers import Deleted, DropResult, PutResult, RolloutInfo, SegmentInfo, ViewInfo
from r3_client._config import Retry, Timeout
from r3_client._direct import DirectReader
from r3_client._exceptions import (
    AuthError,
    ChecksumError,
    CodecError,
    ConnectError,
    DuplicateExpertError,
    ExpertIdError,
    FormatError,
    FrameError,
    FrameworkImportError,
    IntegrationError,
    InvalidRequestError,
    LimitExceededError,
    MegatronReplayError,
    PartialRowError,
    ProtocolError,
    R3Error,
    ReplayError,
    RequestTimeoutError,
    RolloutNotFoundError,
    SegmentConflictError,
    ServiceError,
    ShapeError,
    StoreError,
    StoreUnavailableError,
    TransportError,
    TruncatedFrameError,
    UnsupportedFrameError,
    UsageError,
)
from r3_client._lazy import lazy_attributes
from r3_client._routing import (
    MAX_EXPERTS,
    MAX_TOPK,
    Routing,
    Segment,
    canonical_rows,
    check_rollout_id,
    check_text,
    check_weight_version,
    index_dtype,
    token_digest,
    validate_indices,
)
from r3_client._views import ServedRouting, ViewPolicy
from r3_client.codec import (
    CODECS,
    FORMAT_VERSION,
    MAGIC,
    MAX_DECODED_BYTES,
    Context,
    Frame,
    FrameHeader,
    content_digest,
    decode_frame,
    decode_rollout,
    encode_context,
    encode_frame,
    read_header,
    slice_frame,
    split_frames,
)
from r3_client.expansion import Expansion, SampleState, expand_infos, expand_states

if TYPE_CHECKING:
    from r3_client._async_client import AsyncRoutingClient
    from r3_client._sync_client import RoutingClient

# Names served lazily (PEP 562): the clients load httpx, grpc and tqdm.
__getattr__, __dir__ = lazy_attributes(
    globals(),
    {
        "AsyncRoutingClient": ("r3_client._async_client", "AsyncRoutingClient"),
        "RoutingClient": ("r3_client._sync_client", "RoutingClient"),
    },
)

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DECODED_BYTES",
    "MAX_EXPERTS",
    "MAX_TOPK",
    "AsyncRoutingClient",
    "AuthError",
    "ChecksumError",
    "CodecError",
    "ConnectError",
    "Context",
    "Deleted",
    "DirectReader",
    "DropResult",
    "DuplicateExpertError",
    "Expansion",
    "ExpertIdError",
    "FormatError",
    "Frame",
    "FrameError",
    "FrameHeader",
    "FrameworkImportError",
    "IntegrationError",
    "InvalidRequestError",
    "LimitExceededError",
    "MegatronReplayError",
    "PartialRowError",
    "ProtocolError",
    "PutResult",
    "R3Error",
    "ReplayError",
    "RequestTimeoutError",
    "Retry",
    "RolloutInfo",
    "RolloutNotFoundError",
    "Routing",
    "RoutingClient",
    "SampleState",
    "Segment",
    "SegmentConflictError",
    "SegmentInfo",
    "ServedRouting",
    "ServiceError",
    "ShapeError",
    "StoreError",
    "StoreUnavailableError",
    "Timeout",
    "TransportError",
    "TruncatedFrameError",
    "UnsupportedFrameError",
    "UsageError",
    "ViewInfo",
    "ViewPolicy",
    "canonical_rows",
    "check_rollout_id",
    "check_text",
    "check_weight_version",
    "content_digest",
    "decode_frame",
    "decode_rollout",
    "encode_context",
    "encode_frame",
    "expand_infos",
    "expand_states",
    "index_dtype",
    "read_header",
    "slice_frame",
    "split_frames",
    "token_digest",
    "validate_indices",
]
