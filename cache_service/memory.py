"""Handing the memory of large requests back to the system.

grpc receives a message as many small buffers, allocated by its own threads in
glibc's per-thread arenas; freed, they stay in those arenas, so without a trim the
process keeps ~250 MiB of RSS per 256 MiB message received, for good.  ``malloc_trim(0)``
returns the free pages of every arena: after three 256 MiB PutSegment calls
one after another, a service that started at 91 MiB was at 95 MiB with a trim
after each, and at 299, 447 and 477 MiB without.  A fixed
``M_MMAP_THRESHOLD`` of 64 KiB worked too, but makes every allocation over 64 KiB
a system call for the life of the process; trimming after large requests costs
only when they happen.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

__all__ = ["Trimmer"]

logger = logging.getLogger("r3.cache")


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class Trimmer:
    """Trims the C heap, off the event loop, once ``after_bytes`` of requests were freed."""

    def __init__(self, after_bytes: int) -> None:
        self.after_bytes = after_bytes
        self._trim = _malloc_trim()
        self._freed = 0
        self._running: asyncio.Task[None] | None = None

    def freed(self, nbytes: int) -> None:
        """Note that a request of ``nbytes`` is done with; trim when enough added up."""
        if self._trim is None:
            return
        self._freed += nbytes
        if self._freed >= self.after_bytes and self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._trim is not None
        try:
            while self._freed >= self.after_bytes:  # more may be freed while it trims
                self._freed = 0
                await asyncio.to_thread(self._trim)
        except Exception:  # a failed trim only leaves memory where it was
            logger.exception("malloc_trim failed")
        finally:
            self._running = None
