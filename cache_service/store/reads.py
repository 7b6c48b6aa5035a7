"""Reads of the segment store: frames (whole, sliced, stitched), stats, memory.

Run in the service's process, for every GET and stat of a rollout (HTTP and gRPC).  What
the hash fields are and how a stored segment is cut and put back together is
:mod:`r3_client.stored`'s (a direct reader reads the same layout); this module is the
Redis commands of a read and what the service answers from them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from redis.asyncio.cluster import RedisCluster

from cache_service.store.base import StoreBase
from cache_service.store.header_cache import HeaderCache
from r3_client import (
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    Routing,
    ShapeError,
    StoreError,
)
from r3_client.stored import (
    BLOB_FRAME,
    META,
    Chunked,
    Headers,
    Stored,
    chunk_wanted,
    context_digest,
    context_frame_at,
    contexts_of,
    cut,
    damaged,
    hash_segments,
    outside_rows,
    parse_chunk_field,
    parse_meta,
    parse_segment_info,
    parse_view,
    pointed,
    segment_field,
    segment_rows,
    uncarried_contexts,
    view_field,
)
from r3_client.wire import RolloutInfo, decode_rollout, is_frame_head, layer_positions

#: A rollout's meta: E, K, MoE layer ids.
Meta = tuple[int, int, tuple[int, ...]]


#: Parsed headers of stored frames, shared by every namespace (keyed by content).
_HEADERS = HeaderCache()


@dataclass
class _Fetched:
    """What a read fetched of a rollout (or view) hash: its meta, its stored end, the
    segments overlapping the read (by start; shared ones resolved), the stored contexts
    it read, and their headers (parsed once for the read, through the header cache)."""

    meta: Meta
    stored_end: int
    segments: list[tuple[int, int, Stored]]
    contexts: dict[str, bytes]
    headers: Headers


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
    ) -> _Fetched:
        """Meta, stored end, the segments overlapping ``[start, end)`` and the rollout's
        contexts.

        Sorted by start; shared segments resolved to their frames; contexts by digest.  A
        segment is a frame, or a :class:`~r3_client.stored.Chunked` frame's head and the
        chunks a read of ``spans`` (default ``[start, end)``) and ``layers`` needs (the
        chunked layout: only those leave Redis).  A whole-rollout read is one ``HGETALL``;
        a range asks a script for the field names it needs (segments' heads or frames,
        their wanted chunk fields, the context names) and then ``HMGET``s them (segments
        are never rewritten in place, so the two steps cannot mix versions; a rollout
        deleted in between reads as not found).
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
        headers = Headers(_HEADERS.header)
        async with self._guarded():
            # A view is read only while its rollout registers it (a view hash left behind by
            # an older service, or planted, is not the rollout's).
            if view is not None and not await self._r.hexists(
                self.key(rollout_id), view_field(view)
            ):
                raise missing
            if start == 0 and end is None and layers is None and spans is None:
                fields, stored_end, ctx_names = await self._whole_fields(key)
            else:
                fields, stored_end, ctx_names = await self._ranged_fields(
                    key, start, end, want, layers, missing
                )
            meta = fields.get(META.encode())
            if meta is None:
                raise missing
            segments = hash_segments(rollout_id, fields)
            for n, (a, b, v) in enumerate(segments):
                if pointed(v) is not None:  # shared segment: read in the blob's own slot
                    field = segment_field(a, b).encode()
                    segments[n] = (a, b, await self._blob(rollout_id, key, field, v, want, layers))
            contexts = contexts_of(fields)
            if ctx_names:
                contexts.update(
                    await self._contexts(key, ctx_names, segments, want, headers, missing)
                )
        return _Fetched(parse_meta(meta), stored_end, segments, contexts, headers)

    async def _whole_fields(self, key: str) -> tuple[dict[bytes, Any], int, list[bytes]]:
        """A whole read's fields (one ``HGETALL``): its meta, segments, chunks and
        contexts, and its stored end."""
        fields: dict[Any, Any] = await self._r.hgetall(key)
        ends = [rows[1] for f in fields if (rows := segment_rows(f))]
        return fields, max(ends, default=0), []

    async def _ranged_fields(
        self,
        key: str,
        start: int,
        end: int | None,
        want: Sequence[tuple[int, int | None]],
        layers: Sequence[int] | None,
        missing: RolloutNotFoundError,
    ) -> tuple[dict[bytes, Any], int, list[bytes]]:
        """A ranged read's fields: the meta, the segments overlapping it and the chunks
        its spans and layers need (``segment_fields.lua`` names them, one ``HMGET`` reads
        them), its stored end, and the names of the rollout's contexts, read later (only
        those a continuation frame read needs and no frame read carries: a first frame's
        head carries its own, ~6 KB at the Qwen3 shape, sent twice per read before)."""
        lids = [-1, -1] if not layers else [min(layers), max(layers)]
        flat = [x for a, b in want for x in (a, -1 if b is None else b)]
        res = await self._fields(keys=[key], args=[start, -1 if end is None else end, *lids, *flat])
        if not res:
            return {}, 0, []
        ctx_names = [n for n in res[2:] if context_digest(n) is not None]
        names = [n for n in res[2:] if context_digest(n) is None]
        values: list[Any] = await self._r.hmget(key, names) if names else []
        if any(v is None for v in values):
            raise missing
        return (
            {META.encode(): res[0], **dict(zip(names, values, strict=True))},
            int(res[1]),
            ctx_names,
        )

    async def _contexts(
        self,
        key: str,
        names: list[bytes],
        segments: list[tuple[int, int, Stored]],
        want: Sequence[tuple[int, int | None]],
        headers: Headers,
        missing: RolloutNotFoundError,
    ) -> dict[str, bytes]:
        """The stored contexts (of ``names``) that the continuation frames of each span's
        segments need and none of them carries: each range is answered from its own."""
        need: set[str] = set()
        for lo, hi in want:
            need |= uncarried_contexts(
                (v for a, b, v in segments if b > lo and (hi is None or a < hi)), headers
            )
        wanted = [n for n in names if context_digest(n) in need]
        got: list[Any] = await self._r.hmget(key, wanted) if wanted else []
        if any(v is None for v in got):
            raise missing
        return {str(context_digest(n)): v for n, v in zip(wanted, got, strict=True)}

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
        blob = (pointed(pointer) or b"").decode()
        pipe = self._r.pipeline(transaction=False)
        pipe.hget(blob, BLOB_FRAME)
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
        got = await self._fetch(rollout_id, start, end, view, layers=layers)
        return await self._answer(rollout_id, got, got.segments, start, end, layers)

    async def get_frames(
        self, rollout_id: str, spans: Sequence[tuple[int, int]], layers: Sequence[int] | None
    ) -> list[bytes | R3Error]:
        """:meth:`get_frame` for each ``(start, end)`` of ``spans``, the rollout read from
        Redis once (the segments overlapping their union): what a training rank's batch
        asks of one rollout (two zigzag chunks, say).  Each answer is the frames or the
        error :meth:`get_frame` would raise for that range."""
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        try:
            got = await self._fetch(rollout_id, lo, hi, spans=spans, layers=layers)
        except R3Error as exc:
            return [exc] * len(spans)
        out: list[bytes | R3Error] = []
        for a, b in spans:
            mine = [seg for seg in got.segments if seg[0] < b and seg[1] > a]
            try:
                out.append(await self._answer(rollout_id, got, mine, a, b, layers))
            except R3Error as exc:
                out.append(exc)
        return out

    async def _answer(
        self,
        rollout_id: str,
        got: _Fetched,
        segments: list[tuple[int, int, Stored]],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> bytes:
        """The frames :meth:`get_frame` answers from what :meth:`_fetch` read (``segments``:
        those of it the request overlaps)."""
        outside = outside_rows(rollout_id, start, end, got.stored_end)
        if outside is not None:
            raise outside
        if layers is not None:
            try:
                layer_positions(got.meta[2], layers)
            except ShapeError as exc:
                raise InvalidRequestError(str(exc)) from None
        planted = context_frame_at(segments)
        if planted is not None:  # decoded, it would be a gap of -1 rows
            raise StoreError(damaged(rollout_id, *planted, "it holds a context frame, no rows"))
        whole = start == 0 and end is None and layers is None and len(segments) == 1
        if whole and isinstance(segments[0][2], bytes):
            return segments[0][2]  # a single self-contained segment: the stored bytes
        parts = await asyncio.to_thread(
            cut, rollout_id, segments, got.contexts, start, end, layers, headers=got.headers
        )
        return b"".join(parts)

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
        e, k, layer_ids = parse_meta(res[0])
        nviews = int(res[4])
        mem = int(res[5])  # the rollout's hash and its views' (-1: MEMORY disabled)
        views = []
        pairs = res[6 : 6 + 2 * nviews]
        for serves, raw in zip(pairs[::2], pairs[1::2], strict=True):
            views.append(parse_view(int(serves), raw))
        views.sort(key=lambda v: v.serves)
        infos = [parse_segment_info(raw) for raw in res[6 + 2 * nviews :]]
        infos.sort(key=lambda i: i.segment.start)
        pttl = int(res[3])
        return RolloutInfo(
            rollout_id=rollout_id,
            num_experts=e,
            topk=k,
            layer_ids=layer_ids,
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
