"""The routing codec: the only code that knows the bytes (spec: docs/format.md).

This package ``__init__`` is the codec's public surface.  The compiled backend plugs in
below the entry points: :mod:`r3_client._kernels.native` picks it or numpy per kernel call.
Everything above the codec (the clients, :mod:`r3_client`, :mod:`r3_client.wire`) imports the
entry points from here, never from the modules below.

Modules, from the bottom up (each imports only those before it):

* below this package: :mod:`~r3_client._kernels.sortnet`, :mod:`~r3_client._kernels.native`
  and the compiled ``_r3codec.c`` — the backend: the sorting network, and which
  implementation (compiled or numpy) runs each hot loop; :mod:`r3_client._routing` and this
  package both import them, downward.
* :mod:`~r3_client.codec.frame` — constants, limits, the prefix, strict header fields,
  :func:`~r3_client.codec.frame.assemble_frame` (every frame's prefix, header, body, CRC).
* :mod:`~r3_client.codec.inflate` — bounded zstd inflation (hostile bodies and tables).
* :mod:`~r3_client.codec.setrank` — the set rank (combinatorial number system), bit packing.
* :mod:`~r3_client.codec.header` — :class:`FrameHeader`, :class:`Frame`, the rollout
  :class:`Context` a header carries or names, content digests, provenance fields.
* :mod:`~r3_client.codec.bodies` — ``raw`` / ``set`` / ``set-zstd`` body and chunk coders.
* :mod:`~r3_client.codec.v1`, :mod:`~r3_client.codec.v2_write`,
  :mod:`~r3_client.codec.v2_read` — the two format versions (the v2 reader does not
  import the writer).
* :mod:`~r3_client.codec.entry` — one frame, any version: encode, read the header, decode.
* :mod:`~r3_client.codec.rollout` — many frames as one rollout: slice, split, stitch.
* :mod:`~r3_client.codec.stream` — the batch stream of many rollouts' frames.

Layout (all integers little-endian)::

    0   4  magic  b"R3RF"
    4   1  format version (1 or 2)
    5   1  codec id (0 raw, 1 set, 2 set-zstd; 3 a v2 context frame)
    6   2  reserved, must be 0
    8   4  header length H
    12  8  body length B
    20  H  header: msgpack map (see FrameHeader)
    20+H B  body (codec-specific)
    …   4  CRC-32 (zlib) of every preceding byte

Codecs:

* ``raw`` — ids as the smallest unsigned dtype holding E plus the sentinel
  (uint8 when E <= 255, else uint16), -1 stored as the dtype's maximum, token-
  major ``[R, L, K]``.  Keeps the writer's within-row order.
* ``set`` — each (token, layer) row's top-k *set* ranked in the combinatorial
  number system and bit-packed at ``bit_length(C(E, K))`` bits, i.e. within one
  bit of ``log2 C(E, K)``.  Decodes to ascending rows.
* ``set-zstd`` — the entropy stage: rows as sorted gaps, layer-major, zstd;
  when the frame has at least E rows, each layer's experts are first relabelled
  by popularity (most used → 0) and the table travels in the payload.  16-bit
  gaps are stored as a low-byte plane then a high-byte plane.  Below the set
  bound on skewed, token-correlated routing; a little above it on uniform
  routing.  Decodes to rows in popularity order (relabelled) or ascending.

Version 2 cuts the body into chunks (token blocks x layer groups), each with its length
and CRC in the header, and names the rollout's context (E, K, layers, the relabel table)
by digest; a rollout's first frame, or a context frame, carries it.

The hot loops run in the compiled ``r3_client._kernels._r3codec`` when it is built, else in numpy
(the reference; :func:`backend` says which, :func:`use_backend` switches for a block, and
``R3_CODEC_BACKEND=numpy`` switches it off for a process): the same bytes either way
(docs/notes/native-codec.md).

``codec="auto"`` (the default) picks ``set-zstd`` when a trial on the data says
it is smaller than ``set``, else ``set``; it falls back to ``raw`` when
``C(E, K)`` needs more than 128 bits.
"""

from __future__ import annotations

from r3_client._kernels.native import backend
from r3_client._kernels.native import use as use_backend
from r3_client.codec.entry import decode_frame, encode_frame, read_header
from r3_client.codec.frame import CODECS, FORMAT_VERSION, MAGIC, MAX_DECODED_BYTES, CodecName
from r3_client.codec.header import Context, Frame, FrameHeader, content_digest
from r3_client.codec.rollout import (
    ChunkSpan,
    chunk_spans,
    decode_rollout,
    frame_head,
    join_frame,
    needed_chunks,
    slice_context,
    slice_frame,
    split_frames,
)
from r3_client.codec.v2_write import encode_context

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_DECODED_BYTES",
    "ChunkSpan",
    "CodecName",
    "Context",
    "Frame",
    "FrameHeader",
    "backend",
    "chunk_spans",
    "content_digest",
    "decode_frame",
    "decode_rollout",
    "encode_context",
    "encode_frame",
    "frame_head",
    "join_frame",
    "needed_chunks",
    "read_header",
    "slice_context",
    "slice_frame",
    "split_frames",
    "use_backend",
]
