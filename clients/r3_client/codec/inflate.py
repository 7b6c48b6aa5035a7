"""Bounded zstd inflation: the one place any decoder turns a zstd body into bytes.

A stored body is written by whoever holds a namespace's key, so every reader treats
it as hostile.  The declared content size is checked against what the header's shape
allows before anything is allocated, and the frame is then inflated in one shot into
a buffer of exactly that size: libzstd stops with "Destination buffer is too small"
the moment a block would write past it.  Never stream: a streaming decompressor
inflates until the zstd frame ends and only then notices the declared size was a lie
(a 33 KB frame declaring 4 MiB takes a streaming reader to 1 GiB).
"""

from __future__ import annotations

import zstandard

from r3_client._exceptions import CodecError

__all__ = ["inflate_exact"]


def inflate_exact(
    blob: bytes | bytearray | memoryview, want: int, what: str, *, check_only: bool = False
) -> bytes | None:
    """One complete zstd frame declaring exactly ``want`` bytes, inflated to at most ``want``.

    Peak memory is ``want`` plus the (bounded) decoder state, whatever the frame's
    blocks would produce.  Raises :class:`CodecError` naming ``what`` for a frame
    that is not zstd, hides or misstates its size, carries trailing bytes, or does
    not decode.  ``check_only`` stops after the declaration (no inflation): what the
    service checks at PUT.
    """
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: not a zstd frame: {exc}") from None
    if declared != want:
        raise CodecError(
            f"{what}: zstd frame declares {declared} content bytes (-1 = unknown), expected {want}"
        )
    if check_only:
        return None
    try:
        # One shot into a want-byte buffer (python-zstandard allocates the declared
        # content size, checked above); no extra frames, no reading across frames.
        out = zstandard.ZstdDecompressor().decompress(
            blob, max_output_size=want, read_across_frames=False, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        if "unused data" in str(exc):
            raise CodecError(f"{what}: not exactly one complete zstd frame") from None
        raise CodecError(f"{what}: does not decompress within its declared size: {exc}") from None
    if len(out) != want:
        raise CodecError(f"{what}: inflated to {len(out)} bytes, not {want}")
    return out
