"""``r3_client.stored``, the stored layout's one owner, without Redis: a frame split as the
store keeps it and put back as both readers read it (the service's GET path and a
``DirectReader``'s ranged plan), each head's header parsed once per read."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from r3_client import Context, Segment, StoreError, decode_rollout, encode_frame, read_header
from r3_client.stored import (
    Chunked,
    Headers,
    context_field,
    contexts_of,
    cut,
    hash_segments,
    joined,
    meta_value,
    plan_ranged,
    read_stored_header,
    segment_field,
    split_frame,
    uncarried_contexts,
    whole_frames,
)
from r3_client.synthetic import synthetic_routing

E, K, LAYERS = 16, 2, (1, 3, 5, 7)
ROWS = synthetic_routing(3000, len(LAYERS), E, K, seed=5)
FIRST, NEXT = (0, 1200), (1200, 3000)


def _frames() -> tuple[bytes, bytes, Context]:
    first = encode_frame(
        ROWS[: FIRST[1]], num_experts=E, layer_ids=LAYERS, segment=Segment(*FIRST), block_rows=512
    )
    own = read_header(first).context
    assert own is not None
    cont = encode_frame(
        ROWS[NEXT[0] :],
        num_experts=E,
        layer_ids=LAYERS,
        segment=Segment(*NEXT),
        base=own,
        block_rows=512,
    )
    return first, cont, own


def _stored_hash() -> dict[bytes, Any]:
    """A rollout hash as the store writes it in the chunked layout."""
    first, cont, own = _frames()
    fields: dict[bytes, Any] = {
        b"m": meta_value(E, K, LAYERS),
        context_field(own.digest).encode(): own.raw,
    }
    for frame in (first, cont):
        hdr = read_header(frame, context=own)
        value, chunks = split_frame(frame, hdr, chunked=True)
        assert chunks, "a frame of several chunks is stored as head and chunks"
        assert hdr.segment is not None
        fields[segment_field(hdr.segment.start, hdr.segment.end).encode()] = value
        for name, piece in zip(chunks[::2], chunks[1::2], strict=True):
            assert isinstance(name, str)
            fields[name.encode()] = bytes(piece)
    return fields


class _Counting:
    """A header parse that counts what it parses."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, frame: Any, context: Context | None = None, *, head: bool = False) -> Any:
        self.calls.append((len(frame), context.digest if context else ""))
        return read_stored_header(frame, context, head=head)


def test_a_split_frame_joins_back_byte_for_byte() -> None:
    first, cont, _ = _frames()
    segments = hash_segments("r", _stored_hash())
    assert [(a, b) for a, b, _ in segments] == [FIRST, NEXT]
    assert all(isinstance(v, Chunked) for _, _, v in segments)
    assert [joined(v) for _, _, v in segments] == [first, cont]


@pytest.mark.parametrize(
    ("lo", "hi", "layers"), [(100, 700, None), (1500, 2600, [3, 7]), (0, 3000, None)]
)
def test_the_service_read_cuts_what_a_whole_read_decodes(
    lo: int, hi: int, layers: list[int] | None
) -> None:
    """The service's path: segments, the contexts to fetch, the cut; each head parsed once
    (a continuation's once more, against its context)."""
    fields = _stored_hash()
    parse = _Counting()
    headers = Headers(parse)
    segments = [s for s in hash_segments("r", fields) if s[1] > lo and s[0] < hi]
    need = uncarried_contexts((v for _, _, v in segments), headers)
    contexts = {d: v for d, v in contexts_of(fields).items() if d in need}
    parts = cut("r", segments, contexts, lo, hi, layers, headers=headers)
    got = decode_rollout(parts, start=lo, end=hi, layers=layers)
    cols = [LAYERS.index(x) for x in layers] if layers else slice(None)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(ROWS[lo:hi][:, cols], -1))
    continuations = sum(a >= NEXT[0] for a, _, _ in segments)
    assert len(parse.calls) == len(segments) + continuations, parse.calls


def test_a_direct_ranged_read_parses_each_head_once() -> None:
    """A DirectReader's path: the plan from the small fields names the chunks, the cut uses
    the same parses."""
    fields = _stored_hash()
    small = {f: v for f, v in fields.items() if f[:1] in (b"m", b"s", b"v")}
    parse = _Counting()
    headers = Headers(parse)
    lo, hi = 1300, 1900
    plan = plan_ranged(small, [(lo, hi)], None, headers)
    assert plan.chunks and not plan.contexts  # the first segment's head carries the context
    small.update((n, fields[n]) for n in plan.chunks)
    segments = hash_segments("r", small)
    parts = cut(
        "r", segments, {}, lo, hi, None, headers=headers, cut_whole=False, trim_contexts=False
    )
    got = decode_rollout(parts, start=lo, end=hi)
    assert np.array_equal(np.sort(got.indices, -1), np.sort(ROWS[lo:hi], -1))
    assert len(parse.calls) == 2 + 1, parse.calls  # two heads, the continuation resolved


def test_a_whole_read_sends_a_context_only_when_no_frame_carries_it() -> None:
    fields = _stored_hash()
    segments = hash_segments("r", fields)
    contexts = contexts_of(fields)
    assert whole_frames(segments, contexts, Headers()) == [v for _, _, v in segments]
    alone = whole_frames(segments[1:], contexts, Headers())
    assert len(alone) == 2 and read_header(alone[0]).codec == "context"  # type: ignore[arg-type]


def test_a_missing_chunk_is_a_store_error_naming_the_segment() -> None:
    fields = _stored_hash()
    segments = hash_segments("r", fields)
    a, b, head = segments[0]
    assert isinstance(head, Chunked)
    broken = [(a, b, Chunked(head.head, dict(list(head.pieces.items())[1:])))]
    with pytest.raises(StoreError, match=r"segment \[0, 1200\) are damaged"):
        cut("r", broken, {}, 0, 100, None, headers=Headers())
