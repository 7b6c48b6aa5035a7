"""Format v2 and v3 reading: header validation, context resolution, chunk checks, decoding.

v3 differs from v2 only in its checksums and digest (docs/format.md section 18), so one
reader serves both; ``version`` picks the chunk checksum.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ChecksumError, FormatError, FrameError
from r3_client._kernels import native as _native
from r3_client._routing import Segment, check_layer_ids, index_dtype
from r3_client.codec.bodies import (
    chunk_body_size,
    raw_decode,
    set_decode,
    set_ok,
    zset_chunk_decode,
    zset_chunk_payload,
)
from r3_client.codec.frame import (
    CHUNKED_VERSIONS,
    CODEC_NAMES,
    CODECS,
    CONTEXT_CODEC,
    CRC,
    chunk_crc,
    expect_params,
    int_field,
)
from r3_client.codec.header import (
    SEGMENT_TEXT,
    Context,
    FrameHeader,
    check_provenance,
    read_provenance,
)
from r3_client.codec.inflate import inflate_exact
from r3_client.codec.setrank import ranker

__all__ = ["check_chunks", "decode_v2", "parse_v2"]

_V2_KEYS = {"start", "end", "params", "ctx", "base", "layers", "blocks", "groups", "chunks"}


_V2_OPTIONAL = {"segment", "segments", "digest"}


def parse_v2(
    hdr: dict[Any, Any],
    codec_id: int,
    blen: int,
    total: int,
    context: Context | None,
    *,
    version: int = 2,
) -> FrameHeader:
    """A v2 or v3 frame's header, every field checked (``context``: the caller's, if any)."""
    if codec_id == CONTEXT_CODEC:
        if set(hdr) != {"ctx"} or blen:
            raise FrameError("a context frame has exactly the header key ctx and no body")
        own = _ctx_field(hdr["ctx"])
        return FrameHeader(
            "context", own.num_experts, own.topk, own.layer_ids, 0, 0, None, (), {}, 0, total,
            version=2, context=own,
        )  # fmt: skip
    keys = set(hdr)
    required = {"start", "end", "params", "blocks", "groups", "chunks"}
    if not required <= keys or not keys <= _V2_KEYS | _V2_OPTIONAL:
        raise FrameError(f"frame header keys {sorted(map(str, keys))} are not a v2 header's")
    if ("ctx" in keys) == ("base" in keys):
        raise FrameError("a v2 frame carries exactly one of ctx (its context) or base")
    codec = CODEC_NAMES[codec_id]
    start, end, seg, segs, digest = _v2_rows(hdr)
    ctx, base = _v2_context(hdr, context)
    layer_subset = _v2_layers(hdr.get("layers"))
    blocks, groups, chunks = _v2_chunks(hdr, end - start, blen)
    params = hdr["params"]
    if not isinstance(params, dict):
        raise FrameError("header params must be a map")
    expect_params(params, {"relabel"} if codec == "set-zstd" else set())
    if codec == "set-zstd" and not isinstance(params["relabel"], bool):
        raise FrameError("set-zstd param relabel must be a bool")
    out = FrameHeader(
        codec, 0, 0, layer_subset or (), start, end, seg, segs, params, blen, total,
        version=version, context=ctx, base=base, digest=digest, blocks=blocks, groups=groups,
        chunks=chunks,
    )  # fmt: skip
    return out if ctx is None else _resolve(out, ctx, layer_subset)


def _v2_rows(
    hdr: dict[Any, Any],
) -> tuple[int, int, Segment | None, tuple[Segment, ...], str]:
    """The frame's token range, its segment and provenance, and its content digest."""
    try:
        start, end = int_field(hdr["start"], "start"), int_field(hdr["end"], "end")
        seg = None
        if "segment" in hdr:
            fields = hdr["segment"]
            if not isinstance(fields, dict) or not set(fields) <= set(SEGMENT_TEXT):
                raise FrameError(f"a v2 segment is a map of some of {list(SEGMENT_TEXT)}")
            seg = Segment(start, end, **fields) if end > start else None
        segs = read_provenance(hdr)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None
    if not 0 <= start < end:
        raise FrameError(f"frame token range [{start}, {end}) is empty or negative")
    if end > 2**40:
        raise FrameError(f"frame end {end} is implausibly large")
    check_provenance(seg, segs, start, end)  # (a v2 segment's rows are the frame's)
    digest = _sha_field(hdr.get("digest", b""), "digest")
    if digest and (seg is None or (seg.start, seg.end) != (start, end)):
        raise FrameError("a content digest belongs to a whole segment frame")
    return start, end, seg, segs, digest


def _v2_context(hdr: dict[Any, Any], context: Context | None) -> tuple[Context | None, str]:
    """``(context, base)``: the frame's own context, or the one it names (``base``)."""
    if "ctx" in hdr:
        ctx = _ctx_field(hdr["ctx"])
        if context is not None:
            if context.digest != ctx.digest:
                raise FrameError("frame carries a different context than the one given")
            ctx = context  # the caller's copy may hold the inflated table
        return ctx, ""
    base = _sha_field(hdr["base"], "base")
    if not base:
        raise FrameError("header base must name a context (its 32-byte SHA-256)")
    if context is not None and context.digest != base:
        raise FrameError(f"frame needs context {base[:12]}…, not {context.digest[:12]}…")
    return context, base


def _v2_layers(field: object) -> tuple[int, ...] | None:
    """The layer subset a sliced frame holds (None: all of its context's)."""
    if field is None:
        return None
    if not isinstance(field, list):
        raise FrameError("header layers must be a list")
    try:
        return check_layer_ids(field)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None


def _v2_chunks(
    hdr: dict[Any, Any], rows: int, blen: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Block rows, layer groups and each chunk's ``(length, crc32)``, checked to add up."""
    blocks, groups = _int_list(hdr["blocks"], "blocks"), _int_list(hdr["groups"], "groups")
    chunks_field = hdr["chunks"]
    if not isinstance(chunks_field, list) or len(chunks_field) != len(blocks) * len(groups):
        raise FrameError("header chunks must list one [length, crc32] per block and group")
    # Thousands of entries per header, parsed on every read: checked with C-level iteration
    # (map, set, min/max) rather than a Python loop per entry.
    if set(map(type, chunks_field)) != {list} or set(map(len, chunks_field)) != {2}:
        raise FrameError("each chunk entry is [length, crc32]")
    lengths = tuple(map(operator.itemgetter(0), chunks_field))
    crcs = tuple(map(operator.itemgetter(1), chunks_field))
    if set(map(type, lengths)) | set(map(type, crcs)) != {int}:
        raise FrameError("header field chunk length and chunk crc32 must be ints")
    if min(lengths) < 0 or min(crcs) < 0 or max(crcs) >= 1 << 32:
        raise FrameError("chunk length or crc32 out of range")
    chunks = tuple(zip(lengths, crcs, strict=True))
    if sum(blocks) != rows:
        raise FrameError(f"blocks cover {sum(blocks)} rows; the frame holds {rows}")
    if sum(lengths) != blen:
        raise FrameError("chunk lengths do not add up to the body length")
    return blocks, groups, chunks


def _resolve(hdr: FrameHeader, ctx: Context, subset: tuple[int, ...] | None) -> FrameHeader:
    """Check a v2 header against its context: layers, groups, relabel, declared sizes."""
    layers = ctx.layer_ids if subset is None else subset
    if subset is not None and not set(subset) <= set(ctx.layer_ids):
        raise FrameError(f"frame layers {list(subset)} are not all layers of its context")
    if sum(hdr.groups) != len(layers):
        raise FrameError(f"groups cover {sum(hdr.groups)} layers; the frame holds {len(layers)}")
    if hdr.codec == "set-zstd" and hdr.params["relabel"] and not ctx.has_table:
        raise FrameError("frame asks for relabel but its context has no table")
    e, k = ctx.num_experts, ctx.topk
    if hdr.codec == "set" and not set_ok(e, k):
        raise FrameError(f"codec set cannot code E={e}, K={k}")
    if hdr.num_rows * len(layers) * k > (1 << 40):
        raise FrameError(f"frame declares {hdr.num_rows} rows, too many to decode")
    if hdr.codec != "set-zstd":  # (a set-zstd chunk's length is its compressed size)
        sizes = {
            (br, lg): chunk_body_size(hdr.codec, br, lg, e, k)
            for br in set(hdr.blocks)
            for lg in set(hdr.groups)
        }
        for (br, lg), (length, _) in zip(
            itertools.product(hdr.blocks, hdr.groups), hdr.chunks, strict=True
        ):
            if length != sizes[br, lg]:
                want = sizes[br, lg]
                raise FrameError(
                    f"a {hdr.codec} chunk of {br}x{lg} rows is {length} bytes, not {want}"
                )
    return FrameHeader(
        hdr.codec,
        e,
        k,
        layers,
        hdr.start,
        hdr.end,
        hdr.segment,
        hdr.segments,
        hdr.params,
        hdr.body_length,
        hdr.frame_length,
        version=hdr.version,
        context=ctx,
        base=hdr.base,
        digest=hdr.digest,
        blocks=hdr.blocks,
        groups=hdr.groups,
        chunks=hdr.chunks,
    )


def _ctx_field(value: object, *, tables: bool = False) -> Context:
    if not isinstance(value, bytes):
        raise FrameError("header ctx must be bin (the context's msgpack bytes)")
    return Context.parse(value, tables=tables)


def _int_list(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or len(value) > 1 << 20:
        raise FrameError(f"header {name} must be a non-empty list")
    out = tuple(value)
    if set(map(type, out)) != {int}:
        raise FrameError(f"header field {name} must be an int")
    if min(out) < 1:
        raise FrameError(f"header {name} entries must be >= 1")
    return out


def _sha_field(value: object, name: str) -> str:
    """A 32-byte SHA-256 header field as lowercase hex ("" when absent/empty)."""
    if not isinstance(value, bytes) or len(value) not in (0, 32):
        raise FrameError(f"header {name} must be a 32-byte SHA-256 (bin)")
    return value.hex()


def check_chunks(data: bytes | bytearray | memoryview, hdr: FrameHeader) -> None:
    """What the service checks of a v2/v3 body without decoding it: each set-zstd chunk's
    zstd frame declares exactly the payload its shape allows (bombs refused at PUT), and
    in v3, whose trailing CRC covers only the header, each chunk's CRC-32C (raises
    :class:`ChecksumError`)."""
    if hdr.version not in CHUNKED_VERSIONS or (hdr.version < 3 and hdr.codec != "set-zstd"):
        return
    view = memoryview(data).cast("B")
    at = hdr.frame_length - CRC.size - hdr.body_length
    for (br, lg), (length, crc) in zip(
        itertools.product(hdr.blocks, hdr.groups), hdr.chunks, strict=True
    ):
        if hdr.version >= 3 and chunk_crc(hdr.version, view[at : at + length]) != crc:
            raise ChecksumError("chunk checksum mismatch: the bytes were corrupted")
        if hdr.codec != "set-zstd":
            at += length
            continue
        inflate_exact(
            view[at : at + length],
            zset_chunk_payload(br, lg, hdr.num_experts, hdr.topk),
            "set-zstd chunk",
            check_only=True,
        )
        at += length


def decode_v2(
    view: memoryview, hdr: FrameHeader, max_bytes: int, verify_chunks: bool
) -> npt.NDArray[Any]:
    """A resolved v2/v3 frame's chunks decoded to ``[R, L, K]`` ids (``verify_chunks``:
    check each chunk's CRC too); refused before allocating when over ``max_bytes``."""
    assert hdr.context is not None
    ctx = hdr.context
    e, k, nl = hdr.num_experts, hdr.topk, len(hdr.layer_ids)
    if hdr.decoded_bytes > max_bytes:
        raise FrameError(
            f"frame decodes to {hdr.decoded_bytes} bytes; this decoder's limit is {max_bytes}"
        )
    relabel = hdr.codec == "set-zstd" and bool(hdr.params["relabel"])
    if relabel and ctx.table is None:
        raise FrameError("frame needs its context's relabel table: parse the context with tables")
    ctx_pos = [ctx.layer_ids.index(lid) for lid in hdr.layer_ids]
    out = np.empty((hdr.num_rows, nl, k), dtype=index_dtype(e))
    gbounds = list(itertools.accumulate(hdr.groups, initial=0))
    at = hdr.frame_length - CRC.size - hdr.body_length
    at_once = _decoded_at_once(view, hdr, out, at, ctx_pos if relabel else None, verify_chunks)
    if at_once:
        return out
    r0, i = 0, 0
    for br in hdr.blocks:
        for g in range(len(hdr.groups)):
            length, crc = hdr.chunks[i]
            i += 1
            chunk = view[at : at + length]
            at += length
            if verify_chunks and chunk_crc(hdr.version, chunk) != crc:
                raise ChecksumError("chunk checksum mismatch: the bytes were corrupted")
            lo, hi = gbounds[g], gbounds[g + 1]
            shape = (br, hi - lo, k)
            dest = out[r0 : r0 + br, lo:hi]  # each decoder writes its chunk in place
            if hdr.codec == "raw":
                raw_decode(chunk, shape, e, dest)
            elif hdr.codec == "set":
                set_decode(chunk, shape, e, dest)
            else:
                order = ctx.table[ctx_pos[lo:hi]] if relabel else None  # type: ignore[index]
                zset_chunk_decode(chunk, shape, e, order, dest)
        r0 += br
    if at_once is False:  # refused by the compiled call, yet every chunk decodes: its bug
        _native.disagreed("a frame's chunks")
    return out


def chunk_table(hdr: FrameHeader, at: int, *, crcs: bool) -> npt.NDArray[np.int64]:
    """A v2/v3 frame's chunks as the compiled calls take them (int64 ``[n, 7]``, body order):
    each chunk's offset in the frame (its body starts at ``at``) and length, its rows and
    first row, its first layer position and layers, and its CRC (-1 unless ``crcs``)."""
    chunks = np.array(hdr.chunks, np.int64).reshape(-1, 2)
    lengths = chunks[:, 0]
    nb, ng = len(hdr.blocks), len(hdr.groups)
    desc = np.empty((nb * ng, 7), np.int64)
    desc[:, 0] = at + np.cumsum(lengths) - lengths
    desc[:, 1] = lengths
    blocks = np.asarray(hdr.blocks, np.int64)
    groups = np.asarray(hdr.groups, np.int64)
    desc[:, 2] = np.repeat(blocks, ng)
    desc[:, 3] = np.repeat(np.cumsum(blocks) - blocks, ng)
    desc[:, 4] = np.tile(np.cumsum(groups) - groups, nb)
    desc[:, 5] = np.tile(groups, nb)
    desc[:, 6] = chunks[:, 1] if crcs else -1
    return desc


def _decoded_at_once(
    view: memoryview,
    hdr: FrameHeader,
    out: npt.NDArray[Any],
    at: int,
    ctx_pos: list[int] | None,
    verify_chunks: bool,
) -> bool | None:
    """Every chunk of the frame decoded into ``out`` by one compiled call (the GIL released
    from the first chunk to the last: per chunk, the Python path hands it over twice, and
    a training loop beside a fetch loses it each time), v3's chunk CRCs checked in the same
    call.  True when it did; False when the compiled call refused a chunk and None when it
    cannot take the frame (nothing checked or built then): either way the caller decodes
    chunk by chunk, which raises the exact error."""
    if not _native.decodes_chunks(hdr.codec == "set-zstd", out):
        return None
    if verify_chunks and hdr.version < 3:  # v2's CRC-32 (zlib releases the GIL over each)
        offsets = itertools.accumulate(hdr.chunks, lambda a, c: a + c[0], initial=at)
        for off, (length, crc) in zip(offsets, hdr.chunks, strict=False):
            if chunk_crc(hdr.version, view[off : off + length]) != crc:
                raise ChecksumError("chunk checksum mismatch: the bytes were corrupted")
    # v3's CRC-32C: checked by the compiled call itself, with the rest (-1: not there)
    desc = chunk_table(hdr, at, crcs=verify_chunks and hdr.version >= 3)
    order = None
    if ctx_pos is not None:
        assert hdr.context is not None and hdr.context.table is not None
        order = hdr.context.table[ctx_pos]
    bits = ranker(hdr.num_experts, hdr.topk).bits if hdr.codec == "set" else 0
    code = _native.decode_chunks(view, desc, out, hdr.num_experts, CODECS[hdr.codec], order, bits)
    return code == 0
