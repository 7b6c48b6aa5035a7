"""Combinatorial number system for top-k sets, and fixed-width bit packing.

A sorted row ``c_1 < c_2 < … < c_K`` with ids in ``[0, E)`` has the rank
``Σ_i C(c_i, i)`` in ``[0, C(E, K))`` (its position in colex order).  The
value ``C(E, K)`` itself is the "-1 row" sentinel, so every row takes exactly
``b = bit_length(C(E, K))`` bits, i.e. ``ceil(log2(C(E, K) + 1))``: within one
bit of the information bound ``log2 C(E, K)`` per row.

Ranks up to 64 bits (E=128,K=8 → 41; E=384,K=8 → 54) use one uint64 lane;
up to 128 bits (E=1024,K=16 → 116) a (hi, lo) pair with explicit carries.
Everything is vectorised over rows and processed in cache-sized chunks; the
only Python loops run over K, the 64 packing lanes, and chunks.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import CodecError

__all__ = ["SetRanker", "pack_bits", "unpack_bits"]

U64 = np.uint64
_MASK64 = (1 << 64) - 1
#: Rows per chunk: big enough to amortise numpy call overhead, small enough for L2.
CHUNK = 1 << 15  # multiple of 64 (packing lanes)
#: Slack below the float guess; float32 error is < 1e-3 ids for E <= 65535.
_MARGIN = 0.01

Array = npt.NDArray[Any]


def _lanes(width: int) -> list[tuple[int, int, bool]]:
    """For 64 consecutive ``width``-bit fields: (word, shift, straddles-next-word)."""
    out = []
    for j in range(64):
        pos = j * width
        word, shift = pos >> 6, pos & 63
        out.append((word, shift, shift + width > 64))
    return out


def pack_bits(values: Array, width: int) -> bytes:
    """Pack uint64 ``values`` (each < 2**width, 1 <= width <= 64) LSB-first.

    Field ``n`` occupies bits ``[n*width, (n+1)*width)`` of the little-endian
    bit stream; the output is ``ceil(len(values) * width / 8)`` bytes.
    """
    n = len(values)
    nbytes = (n * width + 7) // 8
    groups = -(-n // 64)
    padded = np.zeros(groups * 64, dtype=U64)
    padded[:n] = values
    v = padded.reshape(groups, 64)
    out = np.zeros((groups, width), dtype=U64)
    for j, (word, shift, straddle) in enumerate(_lanes(width)):
        col = v[:, j]
        out[:, word] |= col << U64(shift)
        if straddle:
            out[:, word + 1] |= col >> U64(64 - shift)
    return out.astype("<u8", copy=False).tobytes()[:nbytes]


def unpack_bits(data: bytes | memoryview, count: int, width: int) -> Array:
    """Inverse of :func:`pack_bits`: ``count`` fields of ``width`` bits as uint64.

    Raises :class:`CodecError` if ``data`` is not exactly the packed length or
    its padding bits are not zero.
    """
    nbytes = (count * width + 7) // 8
    if len(data) != nbytes:
        raise CodecError(f"packed body is {len(data)} bytes, expected {nbytes}")
    groups = -(-count // 64)
    buf = np.zeros(groups * width * 8, dtype=np.uint8)
    buf[:nbytes] = np.frombuffer(data, dtype=np.uint8)
    w = buf.view("<u8").reshape(groups, width)
    out = np.empty((groups, 64), dtype=U64)
    mask = U64(_MASK64 if width == 64 else (1 << width) - 1)
    for j, (word, shift, straddle) in enumerate(_lanes(width)):
        col = w[:, word] >> U64(shift)
        if straddle:
            col |= w[:, word + 1] << U64(64 - shift)
        out[:, j] = col & mask
    flat = out.reshape(-1)
    if flat[count:].any() or (
        nbytes * 8 > count * width and int(buf[nbytes - 1]) >> ((count * width) % 8)
    ):
        raise CodecError("packed body has non-zero padding bits")
    return flat[:count]


class SetRanker:
    """Rank / unrank sorted top-k rows for fixed ``(E, K)``; see module docstring."""

    def __init__(self, num_experts: int, topk: int) -> None:
        self.E, self.K = num_experts, topk
        self.sentinel = math.comb(num_experts, topk)
        self.bits = max(1, self.sentinel.bit_length())
        if self.bits > 128:
            raise CodecError(
                f"C({num_experts}, {topk}) needs {self.bits} bits per row; the set codec "
                "supports up to 128 — use the raw codec"
            )
        self.wide = self.bits > 64
        # C(n, i) for n in 0..E; index E is a guard that is never <= a valid remainder.
        binom = [[math.comb(n, i) for n in range(num_experts + 1)] for i in range(topk + 1)]
        for row in binom:
            row[num_experts] = (1 << 128) - 1
        self._lo = np.array([[x & _MASK64 for x in row] for row in binom], dtype=U64)
        self._hi = np.array([[x >> 64 for x in row] for row in binom], dtype=U64)
        self._root = [1.0] + [math.factorial(i) ** (1.0 / i) for i in range(1, topk + 1)]
        # How many +1 fix-ups each position's float guess can need, measured over every
        # possible answer c at both ends of its rank interval (the guess is monotone).
        # float32 guesses are 2x faster; fall back to float64 where they are not safe.
        self._f32 = not self.wide
        try:
            self._steps = [0, 0] + [self._max_steps(binom, i) for i in range(2, topk + 1)]
        except ArithmeticError:
            self._f32 = False
            self._steps = [0, 0] + [self._max_steps(binom, i) for i in range(2, topk + 1)]

    def _max_steps(self, binom: list[list[int]], i: int) -> int:
        cs = np.arange(i - 1, self.E)
        ends = [binom[i][c] for c in cs] + [binom[i][c + 1] - 1 for c in cs[:-1]]
        want = np.concatenate([cs, cs[:-1]])
        lo = np.array([x & _MASK64 for x in ends], dtype=U64)
        hi = np.array([x >> 64 for x in ends], dtype=U64) if self.wide else None
        short = want - self._guess(lo, hi, i)
        if short.min() < 0:  # float error beat _MARGIN: the guess must stay a lower bound
            raise ArithmeticError(f"set rank guess overshoots for E={self.E}, i={i}")
        return int(short.max())

    # ---- ranking -------------------------------------------------------------------------
    def rank(self, rows: Array, empty: Array) -> tuple[Array, Array | None]:
        """Ranks of ascending ``rows`` ``[N, K]``; rows where ``empty`` get the sentinel.

        Returns ``(lo, hi)`` uint64 arrays; ``hi`` is None when ranks fit 64 bits.
        """
        n = rows.shape[0]
        lo = np.zeros(n, dtype=U64)
        hi = np.zeros(n, dtype=U64) if self.wide else None
        for i in range(1, self.K + 1):
            col = rows[:, i - 1].astype(np.intp)
            col[empty] = i - 1  # any valid id; overwritten by the sentinel below
            add = self._lo[i].take(col)
            lo += add
            if hi is not None:
                hi += self._hi[i].take(col) + (lo < add)
        lo[empty] = U64(self.sentinel & _MASK64)
        if hi is not None:
            hi[empty] = U64(self.sentinel >> 64)
        return lo, hi

    def unrank(self, lo: Array, hi: Array | None) -> Array:
        """Inverse of :meth:`rank`: ascending rows ``[N, K]`` (int16/int32), -1 for sentinels.

        Raises :class:`CodecError` for a rank above the sentinel.
        """
        n = lo.shape[0]
        dtype = np.int16 if self.E <= 32767 else np.int32
        out = np.empty((n, self.K), dtype=dtype)
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            out[a:b] = self._unrank_chunk(lo[a:b].copy(), None if hi is None else hi[a:b].copy())
        return out

    def _unrank_chunk(self, lo: Array, hi: Array | None) -> Array:
        s_lo, s_hi = U64(self.sentinel & _MASK64), U64(self.sentinel >> 64)
        if hi is None:
            if (lo > s_lo).any():
                raise CodecError("set rank above C(E, K): body is corrupt")
            empty = lo == s_lo
            lo[empty] = 0
        else:
            if ((hi > s_hi) | ((hi == s_hi) & (lo > s_lo))).any():
                raise CodecError("set rank above C(E, K): body is corrupt")
            empty = (hi == s_hi) & (lo == s_lo)
            lo[empty] = 0
            hi[empty] = 0
        cols = np.empty((self.K, lo.shape[0]), dtype=np.intp)
        for i in range(self.K, 1, -1):
            tab_lo, tab_hi = self._lo[i], self._hi[i]
            c = self._guess(lo, hi, i)
            for _ in range(self._steps[i]):  # exact after this many +1 fix-ups (see init)
                c += self._le(tab_lo, tab_hi, c + 1, lo, hi)
            cols[i - 1] = c
            sub = tab_lo.take(c)
            if hi is not None:
                hi -= tab_hi.take(c) + (lo < sub)
            lo -= sub
        cols[0] = lo.astype(np.intp)
        # A valid rank always decomposes into strictly increasing ids below E; anything
        # else (a corrupt body whose CRC still matched) is refused, never returned.
        bad = cols[0] >= self.E
        for j in range(1, self.K):
            bad |= cols[j - 1] >= cols[j]
        if hi is not None:
            bad |= hi != 0
        if bad.any():
            raise CodecError("set rank does not decompose: body is corrupt")
        out = cols.T.astype(np.int16 if self.E <= 32767 else np.int32)
        out[empty] = -1
        return out

    def _guess(self, lo: Array, hi: Array | None, i: int) -> Array:
        """A lower bound (within ``_steps[i]``) of the largest c with C(c, i) <= r.

        AM-GM gives C(c, i) <= (c - (i-1)/2)**i / i!, so the root below never
        overshoots in exact arithmetic; ``_MARGIN`` absorbs float rounding (the
        constructor proves no overshoot for every possible answer).
        float32 suffices (and is 2x faster) while ranks fit 64 bits.
        """
        if self._f32:
            r = lo.astype(np.float32)
            g = np.power(r, np.float32(1.0 / i)) * np.float32(self._root[i])
        else:
            r64 = lo.astype(np.float64)
            if hi is not None:
                r64 += hi.astype(np.float64) * 18446744073709551616.0
            g = np.power(r64, 1.0 / i) * self._root[i]
        c = (g + ((i - 1) / 2 - _MARGIN)).astype(np.intp)
        np.clip(c, i - 1, self.E - 1, out=c)
        return c

    @staticmethod
    def _le(tab_lo: Array, tab_hi: Array, c: Array, lo: Array, hi: Array | None) -> Array:
        """Elementwise ``C(c, i) <= r`` for table row i."""
        t_lo = tab_lo.take(c)
        if hi is None:
            return t_lo <= lo
        t_hi = tab_hi.take(c)
        out: Array = (t_hi < hi) | ((t_hi == hi) & (t_lo <= lo))
        return out


@lru_cache(maxsize=64)
def ranker(num_experts: int, topk: int) -> SetRanker:
    """Cached :class:`SetRanker` (tables are O(E·K) Python ints to build)."""
    return SetRanker(num_experts, topk)
