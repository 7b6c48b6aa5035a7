"""Format v1: one body over the whole frame (writing, header parsing, decoding).

A v1 ``set-zstd`` body is one zstd frame of [relabel table] + gap planes over all
rows; ``raw`` and ``set`` are :mod:`r3_client.codec.bodies`' coders as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3_client._exceptions import FormatError, FrameError
from r3_client._routing import Segment, check_layer_ids, check_params
from r3_client.codec.bodies import (
    gap_dtype,
    gap_payload,
    gaps_to_ids,
    planes_to_gaps,
    popularity,
    raw_decode,
    raw_encode,
    set_decode,
    set_encode,
    set_no_larger,
    set_ok,
    trial_rows,
)
from r3_client.codec.frame import (
    CODECS,
    CRC,
    CodecName,
    assemble_frame,
    check_decoded_size,
    expect_params,
    int_field,
    raw_dtype,
)
from r3_client.codec.header import (
    FrameHeader,
    check_provenance,
    inverse_order,
    read_provenance,
    write_provenance,
)
from r3_client.codec.inflate import inflate_exact

__all__ = ["decode_v1", "encode_v1", "parse_v1"]


def encode_v1(
    arr: npt.NDArray[Any],
    srt: npt.NDArray[Any],
    num_experts: int,
    layers: tuple[int, ...],
    start: int,
    segment: Segment | None,
    provenance: tuple[Segment, ...],
    codec: CodecName,
    level: int,
) -> bytes:
    """A format v1 frame: one body, the header listing the segment or the provenance."""
    k = arr.shape[2]
    end = start + arr.shape[0]
    chosen, params, body = (
        _auto_encode(arr, srt, num_experts, k, level)
        if codec == "auto"
        else (codec, *_encode_body(codec, arr, srt, num_experts, k, level))
    )
    header: dict[str, Any] = {
        "E": int(num_experts),
        "K": int(k),
        "layers": list(layers),
        "start": start,
        "end": end,
        "params": params,
    }
    if segment is not None:
        header["segment"] = segment.to_dict()
    elif provenance:
        header["segments"] = write_provenance(provenance, start, end)
    return assemble_frame(1, CODECS[chosen], header, (body,))


def _encode_body(
    codec: str, arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[dict[str, Any], bytes]:
    if codec == "raw":
        return raw_encode(arr, e)
    if codec == "set":
        return set_encode(srt, e, k)
    return _zset_encode(srt, e, k, level)


def _auto_encode(
    arr: npt.NDArray[Any], srt: npt.NDArray[Any], e: int, k: int, level: int
) -> tuple[str, dict[str, Any], bytes]:
    """``set`` or ``set-zstd``, whichever a trial says is smaller; ``raw`` if set cannot.

    The trial compresses the first :func:`~r3_client.codec.bodies.trial_rows` rows
    (contiguous tokens, all layers) with ``set-zstd`` and compares with ``set``'s exact
    fixed width.
    When the trial is the whole input its body is reused.
    """
    if not set_ok(e, k):
        return ("raw", *raw_encode(arr, e))
    rows, nl, _ = srt.shape
    trial = trial_rows(rows, nl)
    params, zbody = _zset_encode(srt[:trial], e, k, level)
    if set_no_larger(len(zbody), trial, nl, e, k):
        return ("set", *set_encode(srt, e, k))
    if trial == rows:
        return "set-zstd", params, zbody
    return ("set-zstd", *_zset_encode(srt, e, k, level))


def _zset_encode(srt: npt.NDArray[Any], e: int, k: int, level: int) -> tuple[dict[str, Any], bytes]:
    """v1 ``set-zstd``: one zstd frame of [relabel table] + gap planes over all rows."""
    relabel = srt.shape[0] >= e  # a popularity table pays for itself only with enough tokens
    order = popularity(srt, e) if relabel else None
    table_bytes = b"" if order is None else order.tobytes()
    payload = table_bytes + gap_payload(srt, e, k, None if order is None else inverse_order(order))
    return {"relabel": relabel}, zstandard.ZstdCompressor(level=level).compress(payload)


def _zset_decode(
    body: memoryview, shape: tuple[int, int, int], e: int, relabel: bool
) -> npt.NDArray[Any]:
    rows, nl, k = shape
    check_decoded_size(rows, nl * k, "set-zstd")
    gdt = gap_dtype(e, k)
    tdt = raw_dtype(e)
    table_len = nl * e * tdt.itemsize if relabel else 0
    want = table_len + rows * nl * k * gdt.itemsize
    payload = inflate_exact(body, want, "set-zstd body")
    assert payload is not None
    gaps = planes_to_gaps(payload, (nl, rows, k), gdt, offset=table_len)
    order = np.frombuffer(payload, dtype=tdt, count=nl * e).reshape(nl, e) if relabel else None
    return gaps_to_ids(gaps, e, k, order, check_order=True)


def parse_v1(hdr: object, codec: str, blen: int, total: int) -> FrameHeader:
    """A v1 frame's header, every field checked."""
    if not isinstance(hdr, dict):
        raise FrameError("frame header must be a map")
    required = {"E", "K", "layers", "start", "end", "params"}
    keys = set(hdr)
    if not required <= keys or not keys <= required | {"segment", "segments"}:
        raise FrameError(
            f"frame header keys {sorted(map(str, keys))} differ from {sorted(required)}"
            " (+ optional segment or segments)"
        )
    try:
        e, k, start, end = (int_field(hdr[n], n) for n in ("E", "K", "start", "end"))
        check_params(e, k)
        if not isinstance(hdr["layers"], list):
            raise FrameError("header layers must be a list")
        layers = check_layer_ids(hdr["layers"])
        seg = None if "segment" not in hdr else Segment.from_dict(hdr["segment"])
        segs = read_provenance(hdr)
    except FormatError as exc:
        raise FrameError(f"invalid frame header: {exc}") from None
    if not 0 <= start < end:
        raise FrameError(f"frame token range [{start}, {end}) is empty or negative")
    if seg is not None and (seg.start, seg.end) != (start, end):
        raise FrameError("frame segment range differs from its token range")
    check_provenance(seg, segs, start, end)
    params = hdr["params"]
    if not isinstance(params, dict):
        raise FrameError("header params must be a map")
    return FrameHeader(codec, e, k, layers, start, end, seg, segs, params, blen, total)


def decode_v1(view: memoryview, hdr: FrameHeader) -> npt.NDArray[Any]:
    """A checked v1 frame's body decoded to ``[R, L, K]`` ids (the caller checked the size)."""
    body_at = hdr.frame_length - CRC.size - hdr.body_length
    body = view[body_at : hdr.frame_length - CRC.size]
    shape = (hdr.num_rows, len(hdr.layer_ids), hdr.topk)
    if hdr.codec == "raw":
        expect_params(hdr.params, set())
        return raw_decode(body, shape, hdr.num_experts)
    if hdr.codec == "set":
        expect_params(hdr.params, set())
        return set_decode(body, shape, hdr.num_experts)
    expect_params(hdr.params, {"relabel"})
    relabel = hdr.params["relabel"]
    if not isinstance(relabel, bool):
        raise FrameError("set-zstd param relabel must be a bool")
    return _zset_decode(body, shape, hdr.num_experts, relabel)
