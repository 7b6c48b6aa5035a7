"""Reads of the segment store: frames (whole, sliced, stitched), stats, memory."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NoReturn

import msgpack
from redis.asyncio.cluster import RedisCluster

from cache_service.store.base import StoreBase
from cache_service.store.header_cache import HeaderCache
from r3_client import (
    FormatError,
    FrameError,
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    Routing,
    Segment,
    ShapeError,
    StoreError,
)
from r3_client.wire import (
    Chunked,
    Context,
    RolloutInfo,
    SegmentInfo,
    ViewInfo,
    chunk_wanted,
    decode_rollout,
    encode_context,
    is_context_frame,
    is_frame_head,
    layer_positions,
    parse_chunk_field,
    slice_context,
    slice_frame,
    uncarried_contexts,
)

#: A segment as read: its frame, or its head and chunks (the chunked layout).
Stored = bytes | Chunked
#: A rollout's meta: E, K, MoE layer ids.
Meta = tuple[int, int, tuple[int, ...]]


#: Parsed headers of stored frames, shared by every namespace (keyed by content).
_HEADERS = HeaderCache()


def _damaged(rollout_id: str, a: int, b: int, why: str) -> str:
    """The message of a read refused because a stored segment's bytes fail a check."""
    return (
        f"rollout {rollout_id}: the stored bytes of segment [{a}, {b}) are damaged ({why}); "
        "no rows are answered from them (delete the rollout and write it again)"
    )


class StoreReads(StoreBase):
    """Frames of a rollout as stored (the service never decodes), its stat, Redis memory."""

    # ---- reads -------------------------------------------------------------------------
    async def _fetch(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        view: int | None = None,
        *,
        spans: Sequence[tuple[int, int]] | None = None,
        layers: Sequence[int] | None = None,
    ) -> tuple[
        tuple[int, int, tuple[int, ...]], int, list[tuple[int, int, Stored]], dict[str, bytes]
    ]:
        """Meta, stored end, ``(start, end, stored)`` of segments overlapping ``[start, end)``,
        and the rollout's contexts.

        Sorted by start; shared segments resolved to their frames; contexts by digest.
        ``stored`` is a frame, or a :class:`Chunked` frame's head and the chunks a read of
        ``spans`` (default ``[start, end)``) and ``layers`` needs (the chunked layout:
        only those leave Redis).  A whole-rollout read is one ``HGETALL``; a range asks a
        script for the field names it needs (segments' heads or frames, their wanted chunk
        fields, the context names) and then ``HMGET``s them (segments are never rewritten
        in place, so the two steps cannot mix versions; a rollout deleted in between reads
        as not found).
        """
        key = self.key(rollout_id) if view is None else self.view_key(rollout_id, view)
        if start < 0 or (end is not None and end <= start):
            raise InvalidRequestError(f"token range [{start}, {end}) is empty or negative")
        missing = RolloutNotFoundError(
            f"rollout {rollout_id} not found"
            if view is None
            else f"rollout {rollout_id} has no view serving row {view} (its stat lists views)"
        )
        want = list(spans) if spans is not None else [(start, end)]
        async with self._guarded():
            # A view is read only while its rollout registers it (a view hash left behind by
            # an older service, or planted, is not the rollout's).
            if view is not None and not await self._r.hexists(self.key(rollout_id), f"v:{view}"):
                raise missing
            ctx_names: list[bytes] = []  # contexts a ranged read asks for after the frames
            if start == 0 and end is None and layers is None and spans is None:
                fields: dict[Any, Any] = await self._r.hgetall(key)
                meta = fields.get(b"m")
                named = [(f, v) for f, v in fields.items() if f[:2] in (b"s:", b"c:", b"k:")]
                stored_end = max(
                    (int(f.split(b":")[2]) for f, _ in named if f[:2] == b"s:"), default=0
                )
            else:
                lids = [-1, -1] if not layers else [min(layers), max(layers)]
                flat = [x for a, b in want for x in (a, -1 if b is None else b)]
                res = await self._fields(
                    keys=[key], args=[start, -1 if end is None else end, *lids, *flat]
                )
                meta = res[0] if res else None
                stored_end = int(res[1]) if res else 0
                # contexts later, and only those a continuation frame read needs and no
                # frame read carries (a first frame's head carries its own: ~6 KB at the
                # Qwen3 shape, sent twice per read before)
                ctx_names = [n for n in res[2:] if n[:2] == b"c:"]
                names = [n for n in res[2:] if n[:2] != b"c:"]
                values: list[Any] = await self._r.hmget(key, names) if names else []
                if any(v is None for v in values):
                    raise missing
                named = list(zip(names, values, strict=True))
            if meta is None:
                raise missing
            contexts = {f[2:].decode(): v for f, v in named if f[:2] == b"c:"}
            pieces: dict[tuple[int, int], dict[int, bytes]] = {}
            for f, v in named:
                got = parse_chunk_field(f) if f[:2] == b"k:" else None
                if got is not None:
                    pieces.setdefault((got.seg_start, got.seg_end), {})[got.index] = v
            segments: list[tuple[int, int, Stored]] = []
            for f, v in sorted(
                ((f, v) for f, v in named if f[:2] == b"s:"),
                key=lambda fv: int(fv[0].split(b":")[1]),
            ):
                _, a, b = f.split(b":")
                seg_start, seg_end = int(a), int(b)
                value: Stored = v
                if v[:1] == b"@":  # shared segment: read in the blob's own slot
                    value = await self._blob(rollout_id, key, f, v, want, layers)
                elif is_frame_head(v):
                    value = Chunked(v, pieces.get((seg_start, seg_end), {}))
                segments.append((seg_start, seg_end, value))
            if ctx_names:
                need: set[str] = set()
                for lo, hi in want:  # each range is answered from its own segments
                    need |= uncarried_contexts(
                        (v.head, True) if isinstance(v, Chunked) else (v, False)
                        for a, b, v in segments
                        if b > lo and (hi is None or a < hi)
                    )
                wanted = [n for n in ctx_names if n[2:].decode() in need]
                got_ctx = await self._r.hmget(key, wanted) if wanted else []
                if any(v is None for v in got_ctx):
                    raise missing
                contexts.update((n[2:].decode(), v) for n, v in zip(wanted, got_ctx, strict=True))
        e, k, layer_ids = msgpack.unpackb(meta)
        return (e, k, tuple(layer_ids)), stored_end, segments, contexts

    async def _blob(
        self,
        rollout_id: str,
        key: str,
        field: bytes,
        pointer: bytes,
        spans: Sequence[tuple[int, int | None]],
        layers: Sequence[int] | None,
    ) -> Stored:
        """A shared segment's frame (or its head and the chunks ``spans`` and ``layers``
        need), read from its blob: the frame field and the field names in one round trip,
        the wanted chunks in a second.

        A blob is deleted only after the last rollout pointing at it is gone, so a blob
        missing here means the rollout was deleted (or dropped, or rewound) while this
        read ran: :class:`RolloutNotFoundError`, not damage.  Only a rollout that still
        points at a missing blob (it outlived the blob's TTL) is a :class:`StoreError`.
        """
        blob = pointer[1:].decode()
        pipe = self._r.pipeline(transaction=False)
        pipe.hget(blob, "f")
        pipe.hkeys(blob)
        value, names = await pipe.execute()
        if not isinstance(value, bytes):
            await self._blob_gone(rollout_id, key, field, pointer)
        if not is_frame_head(value):
            return value
        wanted = [
            (f, got.index)
            for f in names
            if (got := parse_chunk_field(f)) is not None and chunk_wanted(got, spans, layers)
        ]
        got_values: list[Any] = await self._r.hmget(blob, [f for f, _ in wanted]) if wanted else []
        if any(v is None for v in got_values):
            await self._blob_gone(rollout_id, key, field, pointer)
        return Chunked(value, {i: v for (_, i), v in zip(wanted, got_values, strict=True)})

    async def _blob_gone(self, rollout_id: str, key: str, field: bytes, pointer: bytes) -> NoReturn:
        """Raise what a missing blob means: the rollout left the store mid-read (it no
        longer points at the blob), or the blob expired under it."""
        if await self._r.hget(key, field) != pointer:
            raise RolloutNotFoundError(
                f"rollout {rollout_id} not found (deleted while it was being read)"
            )
        raise StoreError(f"rollout {rollout_id}: a shared segment's data has expired")

    async def get_frame(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
        view: int | None = None,
    ) -> bytes:
        """The rollout's stored frames overlapping the request, concatenated: nothing decoded.

        ``view``: the frames of the rollout's view serving row ``view`` instead (rows
        outside the view's range read as a gap).

        Whole segments come back byte for byte; a segment the range or ``layers``
        cuts comes back as a :func:`~r3_client.slice_frame` of it (the blocks and
        layer groups that cover the request; the reader trims).  Context frames for
        the continuation frames returned come first.  Decode with
        :func:`r3_client.decode_rollout` using the same ``start``/``end``/``layers``.
        Raises :class:`RolloutNotFoundError`, or :class:`InvalidRequestError` for a
        range outside ``[0, num_rows)`` or an unknown layer id.
        """
        (_, _, layer_ids), stored_end, segments, contexts = await self._fetch(
            rollout_id, start, end, view, layers=layers
        )
        return await self._answer(
            rollout_id, layer_ids, stored_end, segments, contexts, start, end, layers
        )

    async def get_frames(
        self, rollout_id: str, spans: Sequence[tuple[int, int]], layers: Sequence[int] | None
    ) -> list[bytes | R3Error]:
        """:meth:`get_frame` for each ``(start, end)`` of ``spans``, the rollout read from
        Redis once (the segments overlapping their union): what a training rank's batch
        asks of one rollout (two zigzag chunks, say).  Each answer is the frames or the
        error :meth:`get_frame` would raise for that range."""
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        try:
            (_, _, layer_ids), stored_end, segments, contexts = await self._fetch(
                rollout_id, lo, hi, spans=spans, layers=layers
            )
        except R3Error as exc:
            return [exc] * len(spans)
        out: list[bytes | R3Error] = []
        for a, b in spans:
            mine = [seg for seg in segments if seg[0] < b and seg[1] > a]
            try:
                out.append(
                    await self._answer(
                        rollout_id, layer_ids, stored_end, mine, contexts, a, b, layers
                    )
                )
            except R3Error as exc:
                out.append(exc)
        return out

    async def _answer(
        self,
        rollout_id: str,
        layer_ids: tuple[int, ...],
        stored_end: int,
        segments: list[tuple[int, int, Stored]],
        contexts: dict[str, bytes],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> bytes:
        """The frames :meth:`get_frame` answers from what :meth:`_fetch` read."""
        if end is None and start >= stored_end:
            raise InvalidRequestError(
                f"start {start} is past the last stored row of rollout {rollout_id} "
                f"(it holds rows [0, {stored_end}))"
            )
        hi = stored_end if end is None else end
        if not start < hi <= stored_end:
            raise InvalidRequestError(
                f"token range [{start}, {end}) is outside rollout {rollout_id}'s rows "
                f"[0, {stored_end})"
            )
        if layers is not None:
            try:
                layer_positions(layer_ids, layers)
            except ShapeError as exc:
                raise InvalidRequestError(str(exc)) from None
        for a, b, frame in segments:
            raw = frame.head if isinstance(frame, Chunked) else frame
            if is_context_frame(raw):  # decoded, it would be a gap of -1 rows
                raise StoreError(_damaged(rollout_id, a, b, "it holds a context frame, no rows"))
        whole = start == 0 and end is None and layers is None and len(segments) == 1
        if whole and isinstance(segments[0][2], bytes):
            return segments[0][2]  # a single self-contained segment: the stored bytes
        return await asyncio.to_thread(
            self._cut, rollout_id, segments, contexts, start, end, layers
        )

    @staticmethod
    def _cut(
        rollout_id: str,
        segments: list[tuple[int, int, Stored]],
        contexts: dict[str, bytes],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> bytes:
        """Frames (or slices) for the request plus the contexts they continue from.

        Every stored frame's header is verified first (its trailing CRC, through the
        header cache) and must hold its field's rows; a slice is cut only from chunks
        whose CRCs match (``slice_frame(verify=True)``), since the slice's new trailer
        would vouch for whatever it copied.  A check that fails is a :class:`StoreError`
        naming the rollout and segment: a row is either right or refused.  Uncut frames
        go out as stored (their bodies are the reader's to verify).  A chunked segment's
        head is verified the same way (its trailer covers its header) and its chunks, cut
        or whole, go out only with their CRCs checked (``verify=True``): the frame the
        reader gets is put together here.
        """
        parts: list[bytes] = []
        bases: dict[str, Context] = {}
        carried: set[str] = set()  # contexts a returned frame carries itself
        # A read by layer answers each frame with its context trimmed to the layers it keeps
        # (a pipeline stage's share of the ~6 KB relabel table, not all of it, in each answer);
        # the trimmed contexts continuation frames name, sent before them.
        trim = layers is not None
        named: dict[str, Context] = {}  # what the continuation frames returned name
        sent: set[str] = set()  # what the self-contained frames returned carry
        for a, b, stored in segments:
            cut = (start > a or (end is not None and end < b)) or layers is not None
            head = isinstance(stored, Chunked)
            frame = stored.head if isinstance(stored, Chunked) else stored
            pieces = stored.pieces if isinstance(stored, Chunked) else None
            try:
                hdr = _HEADERS.header(frame, head=head)
                ctx = None
                if hdr.context is not None and not hdr.base:
                    carried.add(hdr.context.digest)
                    # a later continuation frame of this read resolves against it (a ranged
                    # read fetches the stored context only when no frame read carries it)
                    bases.setdefault(hdr.context.digest, hdr.context)
                if hdr.version == 1:  # stored before format v2: whole, the reader trims
                    parts.append(frame)
                    continue
                if hdr.base:
                    ctx = bases.get(hdr.base)
                    if ctx is None:
                        raw = contexts.get(hdr.base)
                        if raw is None:
                            raise StoreError(
                                f"rollout {rollout_id}: the context of segment [{a}, {b}) "
                                "is missing"
                            )
                        ctx = Context.parse(raw, tables=False)
                    bases[hdr.base] = ctx
                    hdr = _HEADERS.header(frame, ctx, head=head)
                if (hdr.start, hdr.end) != (a, b):
                    raise FrameError(f"the frame holds rows [{hdr.start}, {hdr.end})")
                if trim:
                    own = ctx if hdr.base else hdr.context
                    assert own is not None and layers is not None
                    sliced = slice_context(hdr, own, layers)
                    if hdr.base:
                        named[sliced.digest] = sliced
                    else:
                        sent.add(sliced.digest)
                if pieces is not None:  # chunked: the frame is put together (and cut) here
                    parts.append(
                        slice_frame(
                            frame,
                            start=start if cut else None,
                            end=end if cut else None,
                            layers=layers,
                            context=ctx,
                            parsed=hdr,
                            verify=True,
                            pieces=pieces,
                            trim_context=trim,
                        )
                    )
                    continue
                # verify: the slice's new trailer vouches only for the chunks checked here
                parts.append(
                    slice_frame(
                        frame,
                        start=start,
                        end=end,
                        layers=layers,
                        context=ctx,
                        parsed=hdr,
                        verify=True,
                        trim_context=trim,
                    )
                    if cut
                    else frame
                )
            except (FormatError, FrameError) as exc:
                # Damaged at rest (a bad disk, a bug, a tenant's write path): never sliced,
                # signed anew and answered as rows.
                raise StoreError(_damaged(rollout_id, a, b, str(exc))) from None
        if not parts and contexts:  # the range lies in a gap: the context says E, K, layers
            d, raw = next(iter(contexts.items()))
            try:
                gap = Context.parse(raw, tables=False)
            except FrameError as exc:
                raise StoreError(
                    f"rollout {rollout_id}: its stored context is damaged ({exc})"
                ) from None
            if gap.digest != d:
                raise StoreError(f"rollout {rollout_id}: its stored context {d[:12]}… is damaged")
            bases = {d: gap}
        if trim and parts:
            extra = [encode_context(c) for d, c in named.items() if d not in sent]
        else:
            extra = [encode_context(c) for d, c in bases.items() if d not in carried]
        return b"".join([*extra, *parts])

    async def get(
        self,
        rollout_id: str,
        *,
        start: int = 0,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> Routing:
        """:meth:`get_frame` decoded (a convenience for tests and tools: it decodes in
        this process; the service's request paths never call it)."""
        data = await self.get_frame(rollout_id, start=start, end=end, layers=layers)
        return await asyncio.to_thread(
            decode_rollout, data, start=start, end=end, layers=layers, rollout_id=rollout_id
        )

    async def stat(self, rollout_id: str) -> RolloutInfo:
        """Meta, segments, sizes and TTL of a rollout; :class:`RolloutNotFoundError` if absent."""
        key = self.key(rollout_id)
        async with self._guarded():
            res = await self._stat(keys=[key], args=[])
            if not res:
                raise RolloutNotFoundError(f"rollout {rollout_id} not found")
        e, k, layer_ids = msgpack.unpackb(res[0])
        nviews = int(res[4])
        mem = int(res[5])  # the rollout's hash and its views' (-1: MEMORY disabled)
        views = []
        pairs = res[6 : 6 + 2 * nviews]
        for serves, raw in zip(pairs[::2], pairs[1::2], strict=True):
            a, b, wv, nbytes = msgpack.unpackb(raw)
            views.append(ViewInfo(int(serves), a, b, wv, nbytes))
        views.sort(key=lambda v: v.serves)
        infos = []
        for raw in res[6 + 2 * nviews :]:
            seg, codec, nbytes, shared = msgpack.unpackb(raw)
            infos.append(SegmentInfo(Segment.from_dict(seg), codec, nbytes, shared))
        infos.sort(key=lambda i: i.segment.start)
        pttl = int(res[3])
        return RolloutInfo(
            rollout_id=rollout_id,
            num_experts=e,
            topk=k,
            layer_ids=tuple(layer_ids),
            num_rows=max((i.segment.end for i in infos), default=0),
            stored_bytes=int(res[1]),
            shared_bytes=int(res[2]),
            memory_bytes=None if mem < 0 else mem,
            ttl_s=None if pttl < 0 else pttl / 1000,
            segments=tuple(infos),
            views=tuple(views),
        )

    async def memory(self) -> dict[str, float]:
        """Store-wide accounting, from one ``INFO memory`` per primary: ``used_memory``,
        ``maxmemory`` (0: no limit) and ``keys`` summed over primaries, and
        ``fullest_ratio``, the highest ``used_memory / maxmemory`` of a primary (0 for
        one without a limit): a cluster fills up at its fullest primary, not on average."""
        async with self._guarded():
            if isinstance(self._r, RedisCluster):
                nodes = RedisCluster.PRIMARIES
                per_node: Any = await self._r.info("memory", target_nodes=nodes)
                infos = list(per_node.values())
                nkeys = int(await self._r.dbsize(target_nodes=nodes))  # summed by redis-py
            else:
                infos = [await self._r.info("memory")]
                nkeys = int(await self._r.dbsize())
        used = [int(i["used_memory"]) for i in infos]
        limit = [int(i.get("maxmemory", 0)) for i in infos]
        return {
            "used_memory": sum(used),
            "maxmemory": sum(limit),
            "fullest_ratio": max((u / m for u, m in zip(used, limit, strict=True) if m), default=0),
            "keys": nkeys,
        }
