"""The cut of a read: a rollout's stored segments as the frames that answer rows
``[start, end)`` and ``layers``, with the contexts those frames continue.

Runs where the read runs: in the cache service's process for every GET that names a
range or layers (:func:`cut`, whose answer it sends as bytes it vouches for), and in a
training rank's for a :class:`~r3_client.DirectReader`'s reads (the same cut, whole frames
left as stored for its decode to check).  Every frame cut is checked first: a head's
trailer (or a whole frame's CRC) through the read's :class:`~r3_client.stored.Headers`,
its rows against its field's, and every chunk copied against its CRC
(``slice_frame(verify=True)``): a slice's new trailer would vouch for whatever it copied,
so a row is either right or refused (:class:`StoreError` naming the rollout and segment).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from r3_client._exceptions import FormatError, FrameError, InvalidRequestError, StoreError
from r3_client.codec.header import Context, FrameHeader
from r3_client.codec.rollout import slice_context, slice_frame
from r3_client.codec.v2_write import encode_context
from r3_client.stored.heads import Chunked, Headers, Stored, head_of

__all__ = ["cut", "damaged", "outside_rows"]


def damaged(rollout_id: str, a: int, b: int, why: str) -> str:
    """The message of a read refused because a stored segment's bytes fail a check."""
    return (
        f"rollout {rollout_id}: the stored bytes of segment [{a}, {b}) are damaged ({why}); "
        "no rows are answered from them (delete the rollout and write it again)"
    )


def outside_rows(
    rollout_id: str, start: int, end: int | None, stored_end: int
) -> InvalidRequestError | None:
    """The answer to a read of rows ``[start, end)`` (``start < end``) outside a rollout's
    stored rows ``[0, stored_end)``, or None when it is inside: never ``-1`` rows."""
    if end is None and start >= stored_end:
        return InvalidRequestError(
            f"start {start} is past the last stored row of rollout {rollout_id} "
            f"(it holds rows [0, {stored_end}))"
        )
    if end is not None and end > stored_end:
        return InvalidRequestError(
            f"token range [{start}, {end}) is outside rollout {rollout_id}'s rows [0, {stored_end})"
        )
    return None


class _Contexts:
    """The contexts of one cut: those the read's frames carry (answered or not), the stored
    ones to draw on, and which the answer must send before its frames."""

    def __init__(self, stored: Mapping[str, bytes]) -> None:
        self.stored = stored
        self.known: dict[str, Context] = {}  # carried by a frame of the read
        self.used: dict[str, Context] = {}  # continued by an answered frame
        self.carried: set[str] = set()  # carried by an answered frame
        self.named: dict[str, Context] = {}  # trimmed, named by an answered continuation
        self.sent: set[str] = set()  # trimmed, carried by an answered frame

    def seen(self, hdr: FrameHeader, answered: bool) -> None:
        """Note the context ``hdr`` carries (a later continuation resolves against it)."""
        if hdr.context is not None and not hdr.base:
            self.known.setdefault(hdr.context.digest, hdr.context)
            if answered:
                self.carried.add(hdr.context.digest)

    def resolve(self, base: str) -> Context | None:
        """The context ``base`` names: carried by a frame of the read, else the stored one
        (a ranged read fetches it only when no frame read carries it); None if neither."""
        ctx = self.known.get(base)
        if ctx is None and base in self.stored:
            ctx = self.known[base] = Context.parse(self.stored[base], tables=False)
        if ctx is not None:
            self.used.setdefault(base, ctx)
        return ctx

    def trimmed(self, hdr: FrameHeader, ctx: Context | None, layers: Sequence[int]) -> None:
        """Note the context the slice of ``hdr`` by ``layers`` carries or names."""
        own = ctx if hdr.base else hdr.context
        assert own is not None
        sliced = slice_context(hdr, own, layers)
        if hdr.base:
            self.named[sliced.digest] = sliced
        else:
            self.sent.add(sliced.digest)

    def gap(self, rollout_id: str) -> None:
        """A read in a gap: the first stored context says E, K and the layers."""
        d, raw = next(iter(self.stored.items()))
        try:
            ctx = Context.parse(raw, tables=False)
        except FrameError as exc:
            raise StoreError(
                f"rollout {rollout_id}: its stored context is damaged ({exc})"
            ) from None
        if ctx.digest != d:
            raise StoreError(f"rollout {rollout_id}: its stored context {d[:12]}… is damaged")
        self.used = {d: ctx}

    def frames(self, trim: bool) -> list[bytes]:
        """The context frames the answer sends first."""
        if trim:
            return [encode_context(c) for d, c in self.named.items() if d not in self.sent]
        return [encode_context(c) for d, c in self.used.items() if d not in self.carried]


def cut(
    rollout_id: str,
    segments: Sequence[tuple[int, int, Stored]],
    contexts: Mapping[str, bytes],
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    *,
    headers: Headers,
    cut_whole: bool = True,
    trim_contexts: bool = True,
) -> list[bytes]:
    """The frames (or slices) answering rows ``[start, end)`` and ``layers`` from a read's
    ``segments`` (by start) and stored ``contexts`` (by digest), the contexts the answered
    continuation frames need and none of them carries first.

    A chunked segment is put together from its head and the chunks read, cut where the
    range or ``layers`` cut it; one no range row lies in is left out.  ``cut_whole``: a
    segment stored whole is checked and cut too (the service's answer, sent as bytes it
    vouches for); off, it is answered as stored, unchecked (a reader that decodes it here,
    and so checks it, body and all).  ``trim_contexts``: a read by ``layers`` carries
    (or names) each frame's context for the layers it keeps only (a pipeline stage's
    share of the relabel table).  ``headers`` parses each header once for the read.
    Raises :class:`StoreError` naming the segment whose bytes fail a check.
    """
    book = _Contexts(contexts)
    trim = trim_contexts and layers is not None
    parts: list[bytes] = []
    for a, b, stored in segments:
        try:
            if isinstance(stored, bytes) and not cut_whole:
                parts.append(_as_stored(stored, book, headers))
            elif b > start and (end is None or a < end):
                parts.append(
                    _cut_one(rollout_id, a, b, stored, book, headers, start, end, layers, trim)
                )
            else:  # another read's rows: its context may still serve this read
                _harvest(stored, book, headers)
        except (FormatError, FrameError) as exc:
            # Damaged at rest (a bad disk, a bug, a tenant's write path): never sliced,
            # signed anew and answered as rows.
            raise StoreError(damaged(rollout_id, a, b, str(exc))) from None
    if not parts and contexts:
        book.gap(rollout_id)
    return [*book.frames(trim and bool(parts)), *parts]


def _harvest(stored: Stored, book: _Contexts, headers: Headers) -> None:
    """Note the context a segment outside the read carries (a head a direct reader read
    for it); one that does not parse is not this read's to refuse."""
    with contextlib.suppress(FormatError, FrameError):
        book.seen(headers.of(stored), answered=False)


def _as_stored(frame: bytes, book: _Contexts, headers: Headers) -> bytes:
    """A whole frame answered as stored: what it carries and continues noted."""
    hdr = headers.of(frame)
    book.seen(hdr, answered=True)
    if hdr.base:
        book.resolve(hdr.base)  # missing: its decode names it
    return frame


def _cut_one(
    rollout_id: str,
    a: int,
    b: int,
    stored: Stored,
    book: _Contexts,
    headers: Headers,
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    trim: bool,
) -> bytes:
    """Segment ``[a, b)``'s answer: checked, resolved against its context, and put together
    or cut (``slice_frame``: the blocks and layer groups that cover the read)."""
    raw, _ = head_of(stored)
    hdr = headers.of(stored)
    book.seen(hdr, answered=True)
    if hdr.version == 1:  # stored before format v2: whole, the reader trims
        return raw
    ctx = None
    if hdr.base:
        ctx = book.resolve(hdr.base)
        if ctx is None:
            raise StoreError(f"rollout {rollout_id}: the context of segment [{a}, {b}) is missing")
        hdr = headers.of(stored, ctx)
    if (hdr.start, hdr.end) != (a, b):
        raise FrameError(f"the frame holds rows [{hdr.start}, {hdr.end})")
    if trim:
        assert layers is not None
        book.trimmed(hdr, ctx, layers)
    pieces = stored.pieces if isinstance(stored, Chunked) else None
    cuts = start > a or (end is not None and end < b) or layers is not None
    if pieces is None and not cuts:
        return raw  # uncut: as stored (its body is the reader's to verify)
    return slice_frame(
        raw,
        start=start if cuts else None,
        end=end if cuts else None,
        layers=layers,
        context=ctx,
        parsed=hdr,
        verify=True,
        pieces=pieces,
        trim_context=trim,
    )
