"""Parsed frame headers, kept by content, so a stored frame's header is parsed once.

A ranged GET slices stored frames by their block tables; parsing a header is what
that costs (~65 µs for a 16k-row frame, 17 ms for a frame of 32,000 one-row blocks).
Frames are immutable once stored, and a parsed header is a function of the frame's
prefix and header bytes, its length and the context it is resolved against, so
the cache is keyed by a BLAKE2b digest of exactly those: two tenants' identical
bytes share an entry, and different bytes can never be served another frame's
header.  Bounded by the header bytes it holds; least recently used first out.

Only verified headers are kept: a miss parses with the trailing CRC checked, and the
key covers the trailer too, so a hit means bytes identical to a verified header (in v3
the trailer covers exactly prefix + header, so the check would pass again).  A v2
trailer covers the body as well, which the key does not: what the service cuts from a
v2 body is covered by the chunk CRCs, checked at each slice
(``slice_frame(verify=True)``).  Damaged bytes fail the parse and are never cached.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from r3_client import read_header
from r3_client.wire import FRAME_PREFIX as _PREFIX
from r3_client.wire import Context, FrameHeader

__all__ = ["HeaderCache"]

#: The trailing CRC's size (docs/format.md section 4): part of the key.
_TRAILER = 4


class HeaderCache:
    """Thread-safe LRU of verified parsed headers (``read_header(frame, context=…)``).

    ``max_bytes`` bounds the summed prefix + header bytes of the frames whose parsed
    headers it keeps (a parsed header is a few times its encoded size).  ``parses``
    counts the headers actually parsed, for tests and metrics.
    """

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self.parses = 0
        self._held = 0
        self._entries: OrderedDict[bytes, tuple[FrameHeader, int]] = OrderedDict()
        self._lock = threading.Lock()

    def header(
        self,
        frame: bytes | bytearray | memoryview,
        context: Context | None = None,
        *,
        head: bool = False,
    ) -> FrameHeader:
        """``frame``'s parsed header (resolved against ``context``), parsed and its
        trailing CRC checked at most once while it stays cached; errors (a
        :class:`ChecksumError` for damaged bytes) are :func:`read_header`'s and are not
        cached."""
        view = memoryview(frame).cast("B")
        span = _PREFIX.size + _PREFIX.unpack_from(view)[4] if len(view) >= _PREFIX.size else 0
        span = min(span, len(view))
        h = hashlib.blake2b(view[:span], digest_size=20)
        h.update(len(view).to_bytes(8, "little"))
        h.update(bytes(view[-_TRAILER:]))  # the CRC checked on the miss that cached it
        h.update(context.digest.encode() if context is not None else b"-")
        h.update(b"h" if head else b"f")
        key = h.digest()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        hdr = read_header(view, verify=True, context=context, head=head)
        with self._lock:
            self.parses += 1
            if span <= self.max_bytes and key not in self._entries:
                self._entries[key] = (hdr, span)
                self._held += span
                while self._held > self.max_bytes:
                    _, (_, size) = self._entries.popitem(last=False)
                    self._held -= size
        return hdr
