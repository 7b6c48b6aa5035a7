"""The service's seam: what the cache service, its benchmarks and tools use of the wire.

``r3_client`` is the public surface for everyone; this module adds the names that
only the other end of the wire needs: the frame prefix it hashes headers by, the
chunk check a store runs on a PUT, the batch stream's writer, the answers' HTTP and
gRPC forms, and the gRPC messages.  Code outside ``r3_client`` imports these from
here (or from ``r3_client``), never from a private module: the names below are the
stable ones, and the modules behind them may move.

Importing this module loads the codec (which ``r3_client`` has loaded already); the
gRPC messages and the transports (grpc, protobuf, httpx) load on first access.

Frames
    ``Context``, ``FrameHeader``, ``read_header``, ``encode_context``,
    ``decode_rollout``, ``slice_frame`` — as in ``r3_client``.
    ``frame_head``, ``join_frame``, ``chunk_spans``, ``needed_chunks``, ``ChunkSpan`` —
    a v3 frame as head and chunks, what the chunked store layout keeps (docs/store.md);
    ``chunk_field``, ``parse_chunk_field``, ``chunk_wanted``, ``ChunkField`` — the names
    of its chunk fields, which the service and a direct reader share; ``Chunked`` — a
    segment read as head and chunks;
    ``uncarried_contexts`` — the stored contexts a ranged read's frames need.
    ``FRAME_PREFIX`` — the fixed prefix's ``struct`` (magic, version, codec id,
    reserved, header length, body length); ``FRAME_PREFIX.size`` plus the header
    length is the span that identifies a frame's header.
    ``BLOCK_ROWS`` — token rows per v2 block, the writer's default;
    ``STORED_BLOCK_ROWS`` — the block sizes the store takes.
    ``check_chunks`` — verify a v2 frame's chunk CRCs without decoding it.
    ``layer_positions`` — where requested layer ids sit in a routing's layer list.
    ``MAX_LAYER_ID`` — the largest layer id a frame may name.
Batch stream (docs/client.md)
    ``STREAM_MEDIA_TYPE``, ``FRAME_MEDIA_TYPE``, ``stream_header``,
    ``encode_frame_item``, ``encode_error_item``, ``encode_trailer`` — the writer;
    ``StreamDecoder`` — the reader.
Answers
    ``PutResult``, ``RolloutInfo``, ``SegmentInfo`` — as in ``r3_client``;
    ``to_plain`` (HTTP JSON), ``to_message`` (gRPC message), ``PROTO_MESSAGES`` and
    ``proto_messages`` (the ``.proto`` text derived from them).
gRPC
    ``r3_cache_pb2``, ``r3_cache_pb2_grpc`` — the generated message and service modules.
Errors
    ``quote_items`` — how every error message quotes a list of values.
Transports
    ``HTTPTransport``, ``GrpcTransport`` — the clients' sync transports, for
    benchmarks that drive a transport directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from r3_client._answer_forms import proto_messages, to_message, to_plain
from r3_client._answers import (
    PROTO_MESSAGES,
    PutResult,
    RolloutInfo,
    SegmentInfo,
    ViewInfo,
    freed_total,
)
from r3_client._exceptions import quote_items
from r3_client._lazy import lazy_attributes
from r3_client._routing import MAX_LAYER_ID, layer_positions
from r3_client.codec import (
    ChunkSpan,
    Context,
    FrameHeader,
    chunk_spans,
    decode_rollout,
    encode_context,
    frame_head,
    join_frame,
    needed_chunks,
    read_header,
    slice_context,
    slice_frame,
)
from r3_client.codec.frame import BLOCK_ROWS, STORED_BLOCK_ROWS, is_context_frame, is_frame_head
from r3_client.codec.frame import PREFIX as FRAME_PREFIX
from r3_client.codec.stream import (
    FRAME_MEDIA_TYPE,
    STREAM_MEDIA_TYPE,
    StreamDecoder,
    encode_error_item,
    encode_frame_item,
    encode_trailer,
    stream_header,
)
from r3_client.codec.v2_read import check_chunks
from r3_client.stored import (
    Chunked,
    ChunkField,
    chunk_field,
    chunk_wanted,
    parse_chunk_field,
    uncarried_contexts,
)

if TYPE_CHECKING:
    from r3_client._proto import r3_cache_pb2, r3_cache_pb2_grpc
    from r3_client._transports._grpc import GrpcTransport
    from r3_client._transports._http import HTTPTransport

# Names served lazily (PEP 562): the gRPC messages and the transports load protobuf,
# grpc and httpx.
__getattr__, __dir__ = lazy_attributes(
    globals(),
    {
        "GrpcTransport": ("r3_client._transports._grpc", "GrpcTransport"),
        "HTTPTransport": ("r3_client._transports._http", "HTTPTransport"),
        "r3_cache_pb2": ("r3_client._proto.r3_cache_pb2", None),
        "r3_cache_pb2_grpc": ("r3_client._proto.r3_cache_pb2_grpc", None),
    },
)

__all__ = [
    "BLOCK_ROWS",
    "FRAME_MEDIA_TYPE",
    "FRAME_PREFIX",
    "MAX_LAYER_ID",
    "PROTO_MESSAGES",
    "STORED_BLOCK_ROWS",
    "STREAM_MEDIA_TYPE",
    "ChunkField",
    "ChunkSpan",
    "Chunked",
    "Context",
    "FrameHeader",
    "GrpcTransport",
    "HTTPTransport",
    "PutResult",
    "RolloutInfo",
    "SegmentInfo",
    "StreamDecoder",
    "ViewInfo",
    "check_chunks",
    "chunk_field",
    "chunk_spans",
    "chunk_wanted",
    "decode_rollout",
    "encode_context",
    "encode_error_item",
    "encode_frame_item",
    "encode_trailer",
    "frame_head",
    "freed_total",
    "is_context_frame",
    "is_frame_head",
    "join_frame",
    "layer_positions",
    "needed_chunks",
    "parse_chunk_field",
    "proto_messages",
    "quote_items",
    "r3_cache_pb2",
    "r3_cache_pb2_grpc",
    "read_header",
    "slice_context",
    "slice_frame",
    "stream_header",
    "to_message",
    "to_plain",
    "uncarried_contexts",
]
