"""The batch stream: many rollouts' frames in one length-prefixed byte stream.

HTTP batch gets answer with this (media type ``application/x-r3-stream``); the
gRPC service streams the same items as messages.  Layout (little-endian)::

    stream  = b"R3ST" version:u8 item* trailer
    item    = kind:u8 id_len:u16 id:utf8 payload_len:u32 payload
    kind 0  payload is a routing frame (see docs/format.md)
    kind 1  payload is JSON {"code": str, "message": str, "status": int}
    trailer = kind 2, id_len 0, payload JSON {"count": n}

The trailer lets a reader tell a complete stream from a cut one.  Items come in
request order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from r3_client._exceptions import FrameError, TruncatedFrameError

__all__ = [
    "STREAM_MAGIC",
    "STREAM_MEDIA_TYPE",
    "StreamDecoder",
    "StreamItem",
    "encode_error_item",
    "encode_frame_item",
    "encode_trailer",
    "stream_header",
]

STREAM_MAGIC: Final = b"R3ST"
STREAM_VERSION: Final = 1
STREAM_MEDIA_TYPE: Final = "application/x-r3-stream"
#: The media type of one routing frame (PUT bodies, single GETs).
FRAME_MEDIA_TYPE: Final = "application/x-r3-frame"
ITEM_FRAME = 0  # item kinds of the stream (not a media type: that is STREAM_MEDIA_TYPE)
ITEM_ERROR = 1
ITEM_TRAILER = 2
_HEAD = struct.Struct("<BH")
_LEN = struct.Struct("<I")
#: Largest payload a reader accepts (a frame of ~1M tokens x 94 layers in `set`).
MAX_ITEM: Final = 1 << 31


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One rollout's result in a batch: its frame, or the error that replaced it."""

    rollout_id: str
    frame: bytes | None = None
    error_code: str | None = None
    error_message: str | None = None
    status: int = 200

    @property
    def ok(self) -> bool:
        """True when the item carries a frame."""
        return self.frame is not None


def stream_header() -> bytes:
    """The bytes a stream starts with."""
    return STREAM_MAGIC + bytes([STREAM_VERSION])


def _item(kind: int, rollout_id: str, payload: bytes) -> bytes:
    rid = rollout_id.encode()
    return _HEAD.pack(kind, len(rid)) + rid + _LEN.pack(len(payload)) + payload


def encode_frame_item(rollout_id: str, frame: bytes) -> bytes:
    """An item carrying ``frame`` for ``rollout_id``."""
    return _item(ITEM_FRAME, rollout_id, frame)


def encode_error_item(rollout_id: str, code: str, message: str, status: int) -> bytes:
    """An item saying why ``rollout_id`` has no frame (e.g. ``not_found``, 404)."""
    body = json.dumps({"code": code, "message": message, "status": status}).encode()
    return _item(ITEM_ERROR, rollout_id, body)


def encode_trailer(count: int) -> bytes:
    """The closing record: how many items the stream held."""
    return _item(ITEM_TRAILER, "", json.dumps({"count": count}).encode())


class StreamDecoder:
    """Incremental reader: ``feed`` chunks as they arrive, iterate complete items.

    Call :meth:`close` at the end of input: it raises
    :class:`TruncatedFrameError` if the trailer never came.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._started = False
        self._count = 0
        self.done = False

    def feed(self, chunk: bytes) -> Iterator[StreamItem]:
        """Add bytes; yield every item that is now complete."""
        self._buf += chunk
        if not self._started:
            if len(self._buf) < 5:
                return
            if bytes(self._buf[:4]) != STREAM_MAGIC or self._buf[4] != STREAM_VERSION:
                raise FrameError("not an r3 batch stream (bad magic or version)")
            del self._buf[:5]
            self._started = True
        while True:
            if self.done:
                if self._buf:
                    raise FrameError("bytes after the batch stream trailer")
                return
            if len(self._buf) < _HEAD.size:
                return
            kind, id_len = _HEAD.unpack_from(self._buf)
            at = _HEAD.size + id_len
            if len(self._buf) < at + _LEN.size:
                return
            (plen,) = _LEN.unpack_from(self._buf, at)
            if plen > MAX_ITEM:
                raise FrameError(f"batch stream item of {plen} bytes exceeds {MAX_ITEM}")
            end = at + _LEN.size + plen
            if len(self._buf) < end:
                return
            rid = bytes(self._buf[_HEAD.size : at]).decode()
            payload = bytes(self._buf[at + _LEN.size : end])
            del self._buf[:end]
            if kind == ITEM_FRAME:
                self._count += 1
                yield StreamItem(rid, frame=payload)
            elif kind == ITEM_ERROR:
                self._count += 1
                err = json.loads(payload)
                yield StreamItem(rid, None, err["code"], err["message"], int(err["status"]))
            elif kind == ITEM_TRAILER:
                if json.loads(payload).get("count") != self._count:
                    raise FrameError("batch stream trailer count does not match its items")
                self.done = True
            else:
                raise FrameError(f"unknown batch stream item kind {kind}")

    def close(self) -> None:
        """Raise :class:`TruncatedFrameError` unless the stream ended with its trailer."""
        if not self.done:
            raise TruncatedFrameError("batch stream ended before its trailer (cut off?)")
