"""The segment store itself: :class:`SegmentStore` (connecting and writes here, reads in
:mod:`cache_service.store.reads`, durability in :mod:`cache_service.store.durability`,
direct reads' Redis users in :mod:`cache_service.store.grants`).

Runs in the service's process, for every PUT, rewind and touch.  Key layout and rules:
:mod:`cache_service.store`; what each hash field holds and how a frame is stored (whole,
or head and chunks): :mod:`r3_client.stored`, which every reader of the store shares.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from cache_service.store.base import RedisClient, redacted
from cache_service.store.durability import DurableWrites
from cache_service.store.grants import ReaderGrants
from cache_service.store.lifecycle import StoreLifecycle
from cache_service.store.reads import StoreReads
from cache_service.store.settings import StoreSettings
from r3_client import (
    FrameError,
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    SegmentConflictError,
    StoreError,
    StoreUnavailableError,
    UnsupportedFrameError,
    index_dtype,
    read_header,
)
from r3_client.stored import (
    context_field,
    meta_value,
    parse_meta,
    pointer,
    segment_info,
    split_frame,
    view_registration,
)
from r3_client.wire import (
    BLOCK_ROWS,
    STORED_BLOCK_ROWS,
    Context,
    FrameHeader,
    PutResult,
    check_chunks,
    quote_items,
)

__all__ = ["SegmentStore"]

_PUT_ACKED = (b"stored", b"duplicate")
_BLOB_ACKED = (b"new", b"same")


def _check_blocks(hdr: FrameHeader) -> None:
    """A stored frame's blocks are ``B`` rows each, the last maybe shorter, for one ``B`` of
    ``STORED_BLOCK_ROWS`` (the writer's default, 512, and 2,048, what writers before issue 44
    wrote).

    The format lets a writer pick any block size; the store takes these only, so a header
    grows with its rows at a known rate (a frame of one-row blocks has a header as big as
    its body, parsed on every ranged read) and a ranged read never returns more than one
    block's rows past what it asked for at each end.
    """
    *full, last = hdr.blocks
    size = full[0] if full else None
    if (
        (size is not None and size not in STORED_BLOCK_ROWS)
        or any(b != size for b in full)
        or (last > (size or max(STORED_BLOCK_ROWS)))
    ):
        shown = list(hdr.blocks[:4]) + (["…"] if len(hdr.blocks) > 4 else [])
        sizes = " or ".join(str(b) for b in STORED_BLOCK_ROWS)
        raise FrameError(
            f"a stored frame's blocks are {sizes} rows each (the last may be shorter); this "
            f"one has {len(hdr.blocks)} blocks {shown} for {hdr.num_rows} rows: encode it "
            f"with the default block_rows ({BLOCK_ROWS})"
        )


class SegmentStore(StoreLifecycle, ReaderGrants, DurableWrites, StoreReads):
    """Async segment store over redis-py asyncio (single Redis or Redis Cluster).

    Create with :meth:`connect` (pings with bounded retries) and close with
    :meth:`close`, or use ``async with SegmentStore.connect(...)``.
    """

    @classmethod
    async def connect(cls, settings: StoreSettings) -> SegmentStore:
        """Build the client from ``settings.redis_url`` and ping it, retrying with backoff."""
        client: RedisClient
        if settings.cluster:
            client = RedisCluster.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                max_connections=settings.max_connections,
            )
        else:
            client = aioredis.Redis.from_url(
                settings.redis_url,
                socket_timeout=settings.socket_timeout_s,
                max_connections=settings.max_connections,
            )
        delay = 0.1
        for attempt in range(settings.connect_retries + 1):
            try:
                await client.ping()
                break
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterError) as exc:
                if attempt == settings.connect_retries:
                    await client.aclose()
                    raise StoreUnavailableError(
                        f"cannot reach Redis at {redacted(settings.redis_url)}: {exc}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        store = cls(client, settings)
        try:
            await store.check_durability()
        except BaseException:
            await client.aclose()
            raise
        return store

    async def close(self) -> None:
        """Close the connection pool."""
        await self._r.aclose()

    async def __aenter__(self) -> SegmentStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _keep_blobs(self, refs: Sequence[bytes], ttl_ms: int) -> None:
        """Extend the TTL of shared blobs a rollout references (one slot each).

        Sequential on purpose: the caller holds one of ``max_connections`` slots,
        and a rollout references few blobs (its prompt segments).
        """
        for ref in refs:
            await self._write(ref.decode(), self._keep_blob, [ttl_ms], bool)

    async def ping(self) -> bool:
        """True when Redis answers."""
        async with self._guarded():
            return bool(await self._r.ping())

    # ---- writes ------------------------------------------------------------------------
    async def put_segment(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        ttl_s: int | None = None,
        view: int | None = None,
        share: bool | None = None,
    ) -> PutResult:
        """Check ``frame``'s header and store it unchanged as one segment of ``rollout_id``.

        No routing is decoded: the header (geometry, limits, contiguity), the CRC,
        each chunk's declared inflated size and the writer's content digest are
        checked, and the bytes are stored as they are.  Raises :class:`FrameError`
        for bad bytes (a v1 frame, which lacks declared sizes and digest, is
        :class:`UnsupportedFrameError`), :class:`SegmentConflictError` for an
        overlapping different segment, different E/K/layers or a continuation
        frame whose context the rollout does not hold, and
        :class:`InvalidRequestError` when the rollout has too many segments or the
        segment starts too far past the stored rows.

        ``view``: store the frame as rows of the rollout's *view* serving row ``view``
        (docs/store.md, "Views"): rows the engine recomputed, at or below ``view``, that
        the tokens of the segment starting at ``view`` attended to.

        ``share``: keep the frame in a blob shared by every rollout that puts the same
        segment (GRPO prompt dedupe; docs/store.md): True for a segment the writer knows
        others share (the engine: a GRPO group's prompt), False for one it knows they do
        not, None for the store's rule, which shares a segment from row 0 only (a later
        segment's share key holds its rollout's own trajectory, so nobody shares it).  A
        frame without a token digest, or with dedupe off, is always stored privately;
        views are never shared (:class:`InvalidRequestError` for ``share=True``).
        """
        if view is not None:
            if share:
                raise InvalidRequestError(
                    "a view is never shared: its rows are what one call recomputed, and "
                    "they live and go with its rollout; put it without share"
                )
            return await self._put_view(rollout_id, frame, view, ttl_s)
        key = self.key(rollout_id)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidRequestError(f"ttl must be >= 0 seconds, got {ttl}")
        return await self._put_at(
            rollout_id, key, frame, ttl, self.settings.max_gap_rows, share=share
        )

    async def _put_at(
        self,
        rollout_id: str,
        key: str,
        frame: bytes,
        ttl: int,
        max_gap: int,
        *,
        share: bool | None = None,
    ) -> PutResult:
        """Store ``frame`` as one segment of the rollout hash at ``key``.

        A shared segment is two scripts in two slots, ordered so that no rollout ever
        points at a missing blob: ``put_blob.lua`` stores the blob (or finds it) and takes
        a reference with a fresh token, then ``put_segment.lua`` writes the rollout's
        pointer and the token beside it.  When the rollout does not keep that reference
        (refused, or a duplicate of a segment stored earlier) it is released again.  If
        the rollout write itself fails (Redis gone, a wait unconfirmed) the reference is
        kept, since the pointer may have been written: at worst a blob outlives its last
        rollout until its TTL.
        """
        hdr, context = await self._checked_header(rollout_id, key, frame)
        assert hdr.segment is not None
        segment = hdr.segment
        meta = meta_value(hdr.num_experts, hdr.topk, hdr.layer_ids)
        value, chunks = self._stored_form(frame, hdr)
        ref, token, dedupe_hit = "", "", False
        if share is None:
            share = segment.start == 0
        async with self._guarded():
            if share and segment.tokens_digest and self.settings.dedupe:
                blob, token = self._blob_key(meta, segment), secrets.token_hex(8)
                shared = await self._write(
                    blob,
                    self._put_blob,
                    [value, hdr.digest, ttl * 1000, token, key, *chunks],
                    _BLOB_ACKED.__contains__,
                )
                if shared in (b"new", b"same"):
                    value, ref, dedupe_hit = pointer(blob), blob, shared == b"same"
                    chunks = []  # they live in the blob
                else:
                    token = ""  # no reference taken: a private copy
            info = segment_info(segment, hdr.codec, len(frame), bool(ref))
            args = [meta, segment.start, segment.end, value, hdr.digest, info, ttl * 1000]
            args += [self.settings.max_segments, len(frame), ref, *context]
            args += [max_gap, self.settings.max_rollout_gap_rows, token, *chunks]
            res = await self._write(key, self._put, args, lambda r: r[0] in _PUT_ACKED)
            acked = res[0] in _PUT_ACKED
            if token and not (acked and res[1] == b"1"):
                await self._release([ref, token])
            if acked:
                await self._keep_blobs(res[2:], ttl * 1000)
        status = res[0].decode()
        if status == "stored" or status == "duplicate":
            hit = dedupe_hit and status == "stored"
            return PutResult(status, rollout_id, segment, len(frame), bool(ref), hit)
        raise self._put_refusal(status, res, rollout_id, hdr)

    async def _put_view(
        self, rollout_id: str, frame: bytes, serves: int, ttl_s: int | None
    ) -> PutResult:
        """Store a view's frame in the view's hash and register it in the rollout's, in one
        script (``lua/put_view.lua``).

        A view obeys the segment rules: its frame passes the same header checks, it ends
        at or before ``serves``, ``serves`` lies within ``max_gap_rows`` of the rollout's
        stored end, its geometry is the rollout's (a view of a rollout not stored yet sets
        the rollout's geometry), and a rollout holds at most ``max_views`` views.  A view
        that differs from one stored for the same ``serves`` replaces it only while no
        segment starts at ``serves`` (its call's own rows were never stored, so nothing
        was read against it); after that a view is fixed, like a segment.  The rollout and
        all its views share one TTL, reset by this write.
        """
        key, vkey = self.key(rollout_id), self.view_key(rollout_id, serves)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidRequestError(f"ttl must be >= 0 seconds, got {ttl}")
        if serves > self.settings.max_rollout_rows:
            raise InvalidRequestError(
                f"a view serving row {serves} of rollout {rollout_id} serves rows past "
                f"{self.settings.max_rollout_rows}, the most one rollout may hold "
                "(R3_CACHE_MAX_ROLLOUT_ROWS)"
            )
        hdr = read_header(frame, verify=False)
        if hdr.base:
            raise FrameError(
                "a view is stored as a self-contained frame (it carries its context); "
                "this one continues another frame's context"
            )
        if hdr.segment is not None and hdr.segment.end > serves:
            raise InvalidRequestError(
                f"a view serving row {serves} holds rows below it; this frame holds rows "
                f"[{hdr.segment.start}, {hdr.segment.end})"
            )
        hdr, (ctx_field, ctx, _) = await self._checked_header(rollout_id, vkey, frame)
        assert hdr.segment is not None
        seg = hdr.segment
        meta = meta_value(hdr.num_experts, hdr.topk, hdr.layer_ids)
        info = segment_info(seg, hdr.codec, len(frame), False)
        reg = view_registration(seg.start, seg.end, seg.weight_version, len(frame))
        value, chunks = self._stored_form(frame, hdr)
        args = [meta, serves, seg.start, seg.end, value, hdr.digest, info, ttl * 1000]
        args += [len(frame), ctx_field, ctx, reg, self.settings.max_views]
        args += [self.settings.max_gap_rows, *chunks]
        async with self._guarded():
            res = await self._write(
                key, self._view_put, args, lambda r: r[0] in _PUT_ACKED, keys=[vkey]
            )
            if res[0] in _PUT_ACKED:
                await self._keep_blobs(res[1:], ttl * 1000)
        status = res[0].decode()
        if status == "stored" or status == "duplicate":
            return PutResult(status, rollout_id, seg, len(frame), False, False)
        raise self._view_refusal(status, res, rollout_id, serves, hdr)

    def _view_refusal(
        self, status: str, res: Sequence[Any], rollout_id: str, serves: int, hdr: FrameHeader
    ) -> R3Error:
        """The error for a view put ``put_view.lua`` refused (``status`` its first reply)."""
        assert hdr.segment is not None
        seg = hdr.segment
        if status == "views":
            return InvalidRequestError(
                f"rollout {rollout_id} already holds {int(res[1])} views (limit "
                f"{self.settings.max_views}, R3_CACHE_MAX_VIEWS); a view serving row {serves} "
                "would be one more"
            )
        if status == "gap":
            return InvalidRequestError(
                f"a view serving row {serves} of rollout {rollout_id} serves rows "
                f"{serves - int(res[1])} past its stored rows [0, {int(res[1])}); the limit "
                f"is {self.settings.max_gap_rows} (R3_CACHE_MAX_GAP_ROWS)"
            )
        if status == "unviewed":
            return SegmentConflictError(
                f"rollout {rollout_id} stored the segment starting at row {serves} without a "
                f"view: what its tokens attended to is fixed; a view is written before the "
                "segment it serves"
            )
        if status == "conflict":
            a, b = res[1].decode().split(":")
            return SegmentConflictError(
                f"the view serving row {serves} of rollout {rollout_id} is fixed (a segment "
                f"starts at {serves}) and holds rows [{a}, {b}); this view, rows "
                f"[{seg.start}, {seg.end}), "
                + (
                    "has other content (routing, metadata or format version)"
                    if res[2] == b"differs"
                    else "covers other rows"
                )
            )
        return self._put_refusal(status, res, rollout_id, hdr, "view")

    def _stored_form(self, frame: bytes, hdr: FrameHeader) -> tuple[bytes, list[Any]]:
        """What a checked segment frame is stored as (``r3_client.stored.split_frame``):
        the frame itself, or, in layout ``chunked``, its head and its chunk fields."""
        value, chunks = split_frame(frame, hdr, chunked=self.settings.layout == "chunked")
        return value, list(chunks)

    async def _checked_header(
        self, rollout_id: str, key: str, frame: bytes
    ) -> tuple[FrameHeader, tuple[str, bytes, str]]:
        """The frame's header, checked for storing, and its context fields for the script.

        The context fields are ``(field, bytes, base field)``: a frame carrying its own
        context stores it under ``c:<digest>``; a continuation frame names the stored
        one it extends (which must be there).
        """
        hdr = read_header(frame)
        if hdr.version < 2:
            raise UnsupportedFrameError(
                "format v1 frames cannot be stored: the service keeps frames without decoding "
                "them and needs format v2's declared sizes and content digest "
                "(upgrade the writer's r3-client)"
            )
        if hdr.codec == "context" or hdr.segment is None or not hdr.digest:
            raise FrameError(
                "a stored frame must be one whole segment carrying its content digest "
                "(what encode_frame writes with a segment)"
            )
        segment = hdr.segment
        if hdr.base:
            async with self._guarded():
                raw_ctx = await self._r.hget(key, context_field(hdr.base))
            if not isinstance(raw_ctx, bytes):
                raise SegmentConflictError(self._no_base(rollout_id, hdr.base))
            hdr = read_header(frame, verify=False, context=Context.parse(raw_ctx, tables=False))
            context: tuple[str, bytes, str] = ("", b"", context_field(hdr.base))
        else:
            assert hdr.context is not None
            context = (context_field(hdr.context.digest), hdr.context.raw, "")
        assert hdr.context is not None
        if hdr.layer_ids != hdr.context.layer_ids:
            raise FrameError("a stored segment frame holds every layer of its context")
        if hdr.decoded_bytes > self.settings.max_decoded_bytes:
            raise InvalidRequestError(
                f"segment [{segment.start}, {segment.end}) declares {hdr.decoded_bytes} bytes of "
                f"routing; the limit is {self.settings.max_decoded_bytes}"
            )
        _check_blocks(hdr)
        check_chunks(frame, hdr)  # every zstd chunk declares exactly what its shape allows
        self._check_rollout_size(rollout_id, hdr)
        return hdr, context

    def _check_rollout_size(self, rollout_id: str, hdr: FrameHeader) -> None:
        """Refuse a segment that would take the rollout past the rows or decoded bytes a
        reader is expected to hold (the segment's end is the rollout's rows from then on)."""
        assert hdr.segment is not None
        start, end = hdr.segment.start, hdr.segment.end
        where = f"segment [{start}, {end}) of rollout {rollout_id}"
        if end > self.settings.max_rollout_rows:
            raise InvalidRequestError(
                f"{where} ends past row {self.settings.max_rollout_rows}, the most one rollout "
                "may hold (R3_CACHE_MAX_ROLLOUT_ROWS)"
            )
        row_bytes = len(hdr.layer_ids) * hdr.topk * index_dtype(hdr.num_experts).itemsize
        if end * row_bytes > self.settings.max_rollout_bytes:
            raise InvalidRequestError(
                f"{where} would make the rollout decode to {end * row_bytes} bytes "
                f"({end} rows x {row_bytes}); the limit is {self.settings.max_rollout_bytes} "
                "(R3_CACHE_MAX_ROLLOUT_BYTES)"
            )

    def _put_refusal(
        self,
        status: str,
        res: Sequence[Any],
        rollout_id: str,
        hdr: FrameHeader,
        what: str = "segment",
    ) -> R3Error:
        """The error for a put the script refused (``status`` is its first reply; ``what``
        was put: a segment or a view)."""
        assert hdr.segment is not None
        start, end = hdr.segment.start, hdr.segment.end
        if status == "meta":
            e, k, layers = parse_meta(res[1])
            return SegmentConflictError(
                f"rollout {rollout_id} holds routing with E={e}, K={k}, "
                f"layers={quote_items(layers)}; this {what} has E={hdr.num_experts}, "
                f"K={hdr.topk}, layers={quote_items(hdr.layer_ids)}"
            )
        if status == "conflict":
            other, how = res[1].decode(), res[2].decode()
            a, b = other.split(":")
            detail = (
                "covers the same range with a different content digest: different routing or "
                "metadata, or the same rows written in the other format version (v2 and v3 "
                "digests differ; docs/format.md section 18.5)"
                if how == "differs"
                else "overlaps it; send only rows not yet stored (start at the stored end)"
            )
            return SegmentConflictError(
                f"segment [{start}, {end}) of rollout {rollout_id} conflicts "
                f"with stored segment [{a}, {b}): it {detail}"
            )
        if status == "nobase":
            return SegmentConflictError(self._no_base(rollout_id, hdr.base))
        if status == "gap":
            return InvalidRequestError(
                f"segment [{start}, {end}) of rollout {rollout_id} starts "
                f"{start - int(res[1])} rows past its stored rows [0, {int(res[1])}); "
                f"the limit is {self.settings.max_gap_rows} (R3_CACHE_MAX_GAP_ROWS)"
            )
        if status == "gaps":
            return InvalidRequestError(
                f"segment [{start}, {end}) of rollout {rollout_id} would leave {int(res[1])} "
                f"rows that no segment covers; the limit is "
                f"{self.settings.max_rollout_gap_rows} (R3_CACHE_MAX_ROLLOUT_GAP_ROWS: fill "
                "the gaps first)"
            )
        if status == "full":
            return InvalidRequestError(
                f"rollout {rollout_id} already has {int(res[1])} segments "
                f"(limit {self.settings.max_segments})"
            )
        return StoreError(f"unexpected put result {res!r}")

    @staticmethod
    def _no_base(rollout_id: str, base: str) -> str:
        return (
            f"rollout {rollout_id} holds no context {base[:12]}…: a continuation frame "
            "follows a segment that carries that context; put that segment first"
        )

    async def rewind(self, rollout_id: str, rows: int, *, ttl_s: int | None = None) -> int:
        """Drop every segment starting at or after row ``rows``; the number dropped.

        What a driver calls when it lost the answer to a turn the engine finished
        and stored (a timeout, an abort): it goes back to the ``rows`` it knows it
        holds and sends the turn again.  Idempotent (nothing past ``rows``: 0).
        Raises :class:`RolloutNotFoundError`, :class:`InvalidRequestError` for
        ``rows < 1`` (delete the rollout instead), and :class:`SegmentConflictError`
        when a stored segment covers rows on both sides of ``rows`` (a segment is
        kept or dropped whole: the service does not decode).  Resets the TTL.
        """
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InvalidRequestError(
                f"rewind needs rows >= 1 (the rows to keep), got {rows!r}; to drop all, delete"
            )
        key = self.key(rollout_id)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        async with self._guarded():
            res = await self._write(key, self._rewind, [rows, ttl * 1000], bool)
            if res and res[0] == b"ok":
                await self._release(res[2:])  # the dropped segments' shared blobs
        if not res:
            raise RolloutNotFoundError(f"rollout {rollout_id} not found")
        if res[0] == b"straddle":
            a, b = res[1].decode().split(":")
            raise SegmentConflictError(
                f"rollout {rollout_id} cannot be rewound to {rows} rows: its stored segment "
                f"[{a}, {b}) covers rows on both sides (rewind to {a} or {b})"
            )
        return int(res[1])

    async def touch(self, rollout_id: str, ttl_s: int | None = None) -> None:
        """Reset the rollout's TTL (default: ``settings.default_ttl_s``; 0 = never expire).

        Raises :class:`RolloutNotFoundError` if it does not exist.
        """
        key = self.key(rollout_id)
        ttl = self.settings.default_ttl_s if ttl_s is None else ttl_s
        if ttl < 0:
            raise InvalidRequestError(f"ttl must be >= 0 seconds, got {ttl}")
        async with self._guarded():
            res = await self._write(key, self._touch, [ttl * 1000], bool)
            if not res:
                raise RolloutNotFoundError(f"rollout {rollout_id} not found")
            await self._keep_blobs(res[1:], ttl * 1000)
