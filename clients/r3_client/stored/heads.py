"""A stored segment as a read holds it (its frame, or its head and the chunks read) and
its header, parsed once per read.

Whoever reads a rollout's hash builds these: the cache service answering a GET (in its
process), a :class:`~r3_client.DirectReader` in a training rank's.  One :class:`Headers`
lives for one read of one hash: the stages of the read (which chunks and contexts to
fetch, the cut) share its parses instead of each parsing the heads again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from r3_client.codec.entry import read_header
from r3_client.codec.frame import is_frame_head
from r3_client.codec.header import Context, FrameHeader

__all__ = [
    "Chunked",
    "Headers",
    "ParseHeader",
    "Segments",
    "Stored",
    "head_of",
    "read_stored_header",
]


@dataclass(frozen=True, slots=True)
class Chunked:
    """A segment stored chunked, as a read fetched it: its frame's head and the chunks read,
    by index (all of them for a whole read); cut or joined into a frame where it is
    answered (``slice_frame(pieces=…)``)."""

    head: bytes
    pieces: dict[int, bytes]


#: A segment as read: its frame, or its head and chunks (the chunked layout).
Stored = bytes | Chunked
#: A read's segments: ``(start, end, stored)``, by start.
Segments = list[tuple[int, int, Stored]]


def head_of(stored: Stored) -> tuple[bytes, bool]:
    """The bytes a stored segment's header is read from, and whether they are a head (a
    chunked segment's, or a field's value that is one) rather than a whole frame."""
    if isinstance(stored, Chunked):
        return stored.head, True
    return stored, is_frame_head(stored)


# ---- headers, parsed once per read ----------------------------------------------------------


class ParseHeader(Protocol):
    """How a reader parses a stored header (``read_header``'s arguments, or the service's
    cache of verified headers, ``cache_service.store.header_cache.HeaderCache.header``)."""

    def __call__(
        self,
        frame: bytes | bytearray | memoryview,
        context: Context | None = None,
        *,
        head: bool = False,
    ) -> FrameHeader: ...


def read_stored_header(
    frame: bytes | bytearray | memoryview, context: Context | None = None, *, head: bool = False
) -> FrameHeader:
    """A stored header as a reader that decodes what it reads parses it: a head checked
    against its trailer (v3: it covers exactly the prefix and header, so it costs the
    header's bytes), a whole frame's header unchecked (its decode checks it, body and all)."""
    return read_header(frame, verify=head, context=context, head=head)


class Headers:
    """The parsed headers of one read's stored segments: each parsed once (and, for a
    continuation, once more against its context) however many stages of the read ask
    (which chunks to fetch, which contexts to fetch, the cut).

    Kept by the identity of the bytes parsed (and held, so an id is never reused while
    the read lasts); a parse that fails is not kept, so each stage that asks raises it.
    """

    def __init__(self, parse: ParseHeader = read_stored_header) -> None:
        self._parse = parse
        self._seen: dict[tuple[int, bool, str], tuple[bytes, FrameHeader]] = {}

    def parsed(self, raw: bytes, head: bool, context: Context | None = None) -> FrameHeader:
        """The header of ``raw`` (a head when ``head``), resolved against ``context``."""
        key = (id(raw), head, context.digest if context is not None else "")
        hit = self._seen.get(key)
        if hit is None:
            hit = self._seen[key] = (raw, self._parse(raw, context, head=head))
        return hit[1]

    def of(self, stored: Stored, context: Context | None = None) -> FrameHeader:
        """A stored segment's header (:func:`head_of` says what it is read from)."""
        raw, head = head_of(stored)
        return self.parsed(raw, head, context)
