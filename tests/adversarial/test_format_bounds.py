"""Far-gap segments, decompression bombs and damaged stored bodies against the real service.

Format v2 (issue 14): the service never decodes routing.  A segment may start at
most ``R3_CACHE_MAX_GAP_ROWS`` past a rollout's stored rows (refused at PUT, so no
reader is ever asked to allocate a huge gap); every zstd chunk declares exactly the
size its header shape allows (checked at PUT without inflating, and by every
decoder before inflating, with output capped at that size); and a stored body that
does not decode reaches the reader as an error naming the rollout and segment,
without failing the other rollouts of a batch.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
import zstandard

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    ChecksumError,
    CodecError,
    RoutingClient,
    Segment,
    decode_frame,
    decode_rollout,
    encode_frame,
    read_header,
)
from r3_client._proto import r3_cache_pb2 as pb
from r3_client.codec.frame import assemble_frame, chunk_crc
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, frame_for, frame_parts, rid
from tests.support.service_process import KEY_A, Service, grpc_md, start_service
from tests.support.stored import read_stored, write_stored

ROW = synthetic_routing(1, len(LAYERS), E, 4, seed=3)
GAP_LIMIT = 1 << 17  # the service default, R3_CACHE_MAX_GAP_ROWS


def _put(svc: Service, r: str, frame: bytes) -> tuple[int, dict[str, object]]:
    with svc.http() as c:
        resp = c.put(f"/v1/rollouts/{r}/segments", content=frame)
    return resp.status_code, resp.json()


def test_far_gap_segment_is_refused_at_put_on_both_transports(service_single: Service) -> None:
    """Before: a 1-row segment at row 2**40 was stored; every GET then tried to allocate
    rows x L x K (a 500 with "Unable to allocate 4.00 TiB")."""
    for row, limit in ((GAP_LIMIT + 1, "_MAX_GAP_ROWS"), (2**40 - 1, "_MAX_ROLLOUT_ROWS")):
        r = rid()
        frame = encode_frame(ROW, num_experts=E, layer_ids=LAYERS, segment=Segment(row, row + 1))
        status, body = _put(service_single, r, frame)
        assert status == 400, body
        assert body["error"]["code"] == "invalid_request"  # type: ignore[index]
        assert f"R3_CACHE{limit}" in body["error"]["message"]  # type: ignore[index]
        with pytest.raises(grpc.RpcError) as info:
            service_single.stub().PutSegment(
                pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md()
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


def test_a_gap_within_the_limit_is_read_without_allocating_it(service_single: Service) -> None:
    r = rid()
    frame = encode_frame(
        ROW, num_experts=E, layer_ids=LAYERS, segment=Segment(GAP_LIMIT, GAP_LIMIT + 1)
    )
    assert _put(service_single, r, frame)[0] == 201
    with service_single.http() as c:
        resp = c.get(f"/v1/rollouts/{r}")
    assert resp.status_code == 200
    assert resp.content == frame  # the stored bytes, nothing allocated for the gap
    got = decode_rollout(resp.content)
    assert got.end == GAP_LIMIT + 1 and (got.indices[:GAP_LIMIT] == -1).all()


def _rebuild(frame: bytes, chunk_index: int, chunk: bytes) -> bytes:
    """``frame`` with one chunk replaced (index length and CRC fixed, outer CRC recomputed):
    a well-formed frame whose chunk claims whatever ``chunk`` claims."""
    header, chunks = frame_parts(frame)
    chunks[chunk_index] = chunk
    header["chunks"] = [[len(c), chunk_crc(frame[4], c)] for c in chunks]
    return assemble_frame(frame[4], frame[5], header, chunks)  # the frame's own version


def _bomb(frame: bytes, inflated: int) -> bytes:
    """Replace chunk 0 with a tiny zstd frame that inflates to ``inflated`` zero bytes."""
    return _rebuild(frame, 0, zstandard.ZstdCompressor(level=19).compress(bytes(inflated)))


def test_a_chunk_that_inflates_past_its_declared_size_is_refused_everywhere(
    service_single: Service,
) -> None:
    frame = frame_for(TRAJ[:50], 0, codec="set-zstd")
    bomb = _bomb(frame, 256 << 20)  # declares 256 MiB for a 50-row chunk
    assert len(bomb) < 64 << 10
    status, body = _put(service_single, rid(), bomb)
    assert status == 400, body
    assert body["error"]["code"] == "codec_error"  # type: ignore[index]
    assert "declares" in body["error"]["message"]  # type: ignore[index]
    with pytest.raises(CodecError, match="declares"):  # every decoder, before inflating
        decode_frame(bomb)


def test_a_chunk_hiding_its_size_is_refused_without_inflating(service_single: Service) -> None:
    """A zstd frame without a declared content size: the decoder never streams it open."""
    frame = frame_for(TRAJ[:50], 0, codec="set-zstd")
    cobj = zstandard.ZstdCompressor(level=19, write_content_size=False)
    hidden = _rebuild(frame, 0, cobj.compress(bytes(64 << 20)))
    status, body = _put(service_single, rid(), hidden)
    assert status == 400 and body["error"]["code"] == "codec_error"  # type: ignore[index]
    with pytest.raises(CodecError, match="unknown"):
        decode_frame(hidden)


def test_small_frame_that_inflates_is_not_decoded_by_the_service(tmp_path: Path) -> None:
    """Before (v1): the service decoded every PUT in full, so a small frame that inflates
    to many MiB cost that much memory.  Now it is stored unread."""
    # 20,000 identical rows (the test service's row limit) x 64 layers x top-8: zstd
    # turns 10 MB of gaps into a few KB.
    layers = tuple(range(64))
    one = synthetic_routing(1, len(layers), 128, 8, seed=4)
    idx = np.broadcast_to(one, (20_000, len(layers), 8)).copy()
    frame = encode_frame(idx, num_experts=128, layer_ids=layers, codec="set-zstd")
    assert len(frame) < 64 << 10
    redis_proc = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    svc = start_service(tmp_path, redis_proc.url)  # a fresh process: its peak RSS is its own
    try:
        pid = svc.proc.pid

        def peak_kib() -> int:
            with open(f"/proc/{pid}/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))

        before = peak_kib()
        r = rid()
        with svc.http() as c:
            for _ in range(8):
                assert c.put(f"/v1/rollouts/{r}/segments", content=frame).status_code in (200, 201)
            assert c.get(f"/v1/rollouts/{r}").content == frame
        assert (peak_kib() - before) < 8 << 10, "the service inflated the body"
    finally:
        svc.stop()
        redis_proc.stop()


def _corrupt_stored_segment(svc: Service, r: str, seg: tuple[int, int]) -> None:
    """Flip a body byte of a stored frame *and* forge its CRCs: only decoding can tell."""
    conn = redis.Redis.from_url(svc.redis_url)
    key = f"r3:tenant-a:{{{r}}}"
    field = f"s:{seg[0]}:{seg[1]}"
    frame, where = read_stored(conn, key, field)
    assert frame[:1] != b"@"
    hdr = read_header(frame)
    at = hdr.frame_length - 4 - hdr.body_length
    body = bytearray(frame[at : at + hdr.chunks[0][0]])
    body[len(body) // 2] ^= 0x5A
    write_stored(conn, key, field, _rebuild(frame, 0, bytes(body)), where)


def test_a_corrupted_stored_body_is_a_clear_per_rollout_error(service_single: Service) -> None:
    ids = [rid() for _ in range(3)]
    for r in ids:
        for a, b in ((0, 40), (40, 90), (90, 130)):
            status, _ = _put(service_single, r, frame_for(TRAJ[a:b], a, codec="raw", digest=False))
            assert status == 201
    _corrupt_stored_segment(service_single, ids[1], (40, 90))
    with service_single.http() as c:  # the service still answers: it does not decode
        assert c.get(f"/v1/rollouts/{ids[1]}").status_code == 200
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        got = dict(client.get_many(ids, return_errors=True))
        assert set(got) == set(ids)
        for r in (ids[0], ids[2]):
            assert not isinstance(got[r], Exception)
        err = got[ids[1]]
        assert isinstance(err, CodecError | ChecksumError), err
        assert ids[1] in str(err) and "[40, 90)" in str(err)
        with pytest.raises(CodecError, match=r"segment \[40, 90\)"):
            client.get(ids[1])
        assert client.get(ids[1], start=90).end == 130  # the undamaged rows still read
