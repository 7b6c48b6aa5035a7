"""sglang-r3 client library: the routing format, its codec, and (later) fetch/stream clients.

The format module owns the bytes: the cache service and the SGLang plugin
import it from here and nothing else encodes or decodes routing.
"""

from r3_client._codec import (
    CODECS,
    FORMAT_VERSION,
    MAGIC,
    Frame,
    FrameHeader,
    decode_frame,
    encode_frame,
    read_header,
)
from r3_client._exceptions import (
    ChecksumError,
    CodecError,
    DuplicateExpertError,
    ExpertIdError,
    FormatError,
    FrameError,
    InvalidRequestError,
    PartialRowError,
    R3Error,
    RolloutNotFoundError,
    SegmentConflictError,
    ShapeError,
    StoreError,
    StoreUnavailableError,
    TruncatedFrameError,
    UnsupportedFrameError,
)
from r3_client._format import (
    MAX_EXPERTS,
    MAX_TOPK,
    Routing,
    Segment,
    canonical_rows,
    index_dtype,
    token_digest,
    validate_indices,
)

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_EXPERTS",
    "MAX_TOPK",
    "ChecksumError",
    "CodecError",
    "DuplicateExpertError",
    "ExpertIdError",
    "FormatError",
    "Frame",
    "FrameError",
    "FrameHeader",
    "InvalidRequestError",
    "PartialRowError",
    "R3Error",
    "RolloutNotFoundError",
    "Routing",
    "Segment",
    "SegmentConflictError",
    "ShapeError",
    "StoreError",
    "StoreUnavailableError",
    "TruncatedFrameError",
    "UnsupportedFrameError",
    "canonical_rows",
    "decode_frame",
    "encode_frame",
    "index_dtype",
    "read_header",
    "token_digest",
    "validate_indices",
]
