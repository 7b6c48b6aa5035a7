"""A fleet mid-upgrade against a real service and real Redis (both backends): old engines
write format v2, new ones v3, continuation frames of both versions extend one context, and
every reader (HTTP, gRPC, direct reads) gets the rollout back exactly.  docs/format.md 18.5.
"""

from __future__ import annotations

import pytest

from r3_client import (
    ChecksumError,
    Context,
    DirectReader,
    RolloutNotFoundError,
    RoutingClient,
    Segment,
    SegmentConflictError,
    encode_frame,
    read_header,
    token_digest,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import rid, same_sets
from tests.support.service_process import KEY_A, Service, url_of

E, LAYERS = 64, (1, 3, 5, 7)
ROWS = synthetic_routing(700, len(LAYERS), E, 4, skew=1.0, rho=0.9, seed=21)
TURNS = ((0, 160), (160, 300), (300, 520), (520, 700))


def _segment(lo: int, hi: int) -> Segment:
    return Segment(lo, hi, "tiny-moe", "w1", token_digest(range(hi)))


def _turns(versions: tuple[int, ...]) -> list[bytes]:
    """One agent's turns: the first carries the context (a relabel table), the rest continue it,
    each written by an engine of the given format version."""
    lo, hi = TURNS[0]
    first = encode_frame(
        ROWS[lo:hi], num_experts=E, layer_ids=LAYERS, segment=_segment(lo, hi),
        version=versions[0],
    )  # fmt: skip
    raw = read_header(first).context
    assert raw is not None and raw.has_table
    ctx = Context.parse(raw.raw)
    frames = [first]
    for (lo, hi), version in zip(TURNS[1:], versions[1:], strict=True):
        seg = _segment(lo, hi)
        kw = {"num_experts": E, "layer_ids": LAYERS, "segment": seg, "base": ctx}
        frames.append(encode_frame(ROWS[lo:hi], version=version, **kw))  # type: ignore[arg-type]
    return frames


@pytest.mark.parametrize("versions", [(2, 3, 2, 3), (3, 2, 3, 2)])
def test_a_rollout_of_v2_and_v3_turns_reads_back_everywhere(
    svc: Service, transport: str, versions: tuple[int, ...]
) -> None:
    r = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        for frame in _turns(versions):
            assert client.put(r, frame).status == "stored"
        whole = client.get(r)
        assert same_sets(whole.indices, ROWS)
        assert {s.end for s in whole.segments} == {hi for _, hi in TURNS}
        # ranges that cut frames of both versions (the service slices v2 and v3 chunks)
        for start, end, layers in ((150, 310, None), (290, 530, [3, 7]), (0, 700, [5])):
            got = client.get(r, start=start, end=end, layers=layers)
            want = ROWS[start:end]
            if layers is not None:
                want = want[:, [LAYERS.index(lid) for lid in layers]]
            assert same_sets(got.indices, want)
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        assert same_sets(reader.get(r).indices, ROWS)
        assert same_sets(reader.get(r, start=250, end=600).indices, ROWS[250:600])


def test_a_v3_frame_with_a_damaged_chunk_is_refused_and_nothing_is_stored(svc: Service) -> None:
    r = rid()
    frame = bytearray(_turns((3, 3, 3, 3))[0])
    hdr = read_header(bytes(frame))
    frame[hdr.frame_length - 4 - hdr.body_length + 5] ^= 0x10  # the trailer covers the header
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        with pytest.raises(ChecksumError, match="chunk checksum"):
            client.put(r, bytes(frame))
        with pytest.raises(RolloutNotFoundError):
            client.stat(r)


def test_the_same_rows_in_the_other_version_are_a_conflict_not_a_silent_duplicate(
    svc: Service,
) -> None:
    """Digests are compared as bytes, and v2's and v3's differ for the same rows (18.5)."""
    r = rid()
    lo, hi = TURNS[0]
    kw = {"num_experts": E, "layer_ids": LAYERS, "segment": _segment(lo, hi)}
    v2 = encode_frame(ROWS[lo:hi], version=2, **kw)  # type: ignore[arg-type]
    v3 = encode_frame(ROWS[lo:hi], **kw)  # type: ignore[arg-type]
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        assert client.put(r, v2).status == "stored"
        assert client.put(r, v2).status == "duplicate"
        with pytest.raises(SegmentConflictError, match="other format version"):
            client.put(r, v3)
        assert same_sets(client.get(r).indices, ROWS[lo:hi])  # the v2 rows stay
