"""A rollout cannot be grown past what a reader can hold, by hopping the gap rule or
by plain rows, and a reader refuses an oversized result before allocating it.

Before issue 25 a segment had to start within ``R3_CACHE_MAX_GAP_ROWS`` of the stored
end, and nothing else: 4,096 one-row PUTs, each one gap further, made a rollout of
536,743,936 rows from 680 KB, and a whole-rollout read then allocated 8 GiB under the
client's 16 GiB default.  Now the service also bounds a rollout's rows, the rows no
segment covers, and its decoded size; the client's default limit is the service's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import (
    MAX_DECODED_BYTES,
    FrameError,
    RoutingClient,
    Segment,
    encode_frame,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, E, rid
from tests.support.service_process import KEY_A, Service, start_service

GAP = 1 << 17  # R3_CACHE_MAX_GAP_ROWS's default
ROW = synthetic_routing(1, len(LAYERS), E, 4, seed=3)


def _one_row(at: int) -> bytes:
    return encode_frame(ROW, num_experts=E, layer_ids=LAYERS, segment=Segment(at, at + 1))


def _put(svc: Service, r: str, frame: bytes) -> tuple[int, str]:
    with svc.http() as c:
        resp = c.put(f"/v1/rollouts/{r}/segments", content=frame)
    return resp.status_code, resp.text


def test_hopping_the_gap_rule_is_refused_once_the_gaps_add_up(service_single: Service) -> None:
    r = rid()
    assert _put(service_single, r, _one_row(0))[0] == 201
    assert _put(service_single, r, _one_row(1 + GAP))[0] == 201  # one gap of the limit: fine
    status, text = _put(service_single, r, _one_row(2 + 2 * GAP))  # a second: the total is over
    assert status == 400, text
    assert "R3_CACHE_MAX_ROLLOUT_GAP_ROWS" in text and f"rollout {r}" in text
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        assert client.stat(r).num_rows == 2 + GAP


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service with small rollout limits (rows, gap rows, decoded bytes)."""
    tmp = Path(tmp_path_factory.mktemp("growth"))
    redis_proc = RedisProcess(free_port(), tmp / "redis", appendonly=False).start()
    env = {
        "R3_CACHE_MAX_ROLLOUT_ROWS": "1000",
        "R3_CACHE_MAX_ROLLOUT_GAP_ROWS": "100",
        "R3_CACHE_MAX_ROLLOUT_BYTES": str(800 * len(LAYERS) * 4 * 2),  # 800 int16 rows
        "R3_CACHE_MAX_GAP_ROWS": "100",
    }
    svc = start_service(tmp, redis_proc.url, env=env)
    try:
        yield svc
    finally:
        svc.stop()
        redis_proc.stop()


def test_rows_gaps_and_decoded_size_of_a_rollout_are_bounded(small: Service) -> None:
    idx = synthetic_routing(600, len(LAYERS), E, 4, seed=5)
    r = rid()
    frame = encode_frame(idx, num_experts=E, layer_ids=LAYERS, segment=Segment(0, 600))
    assert _put(small, r, frame)[0] == 201
    assert _put(small, r, _one_row(649))[0] == 201  # 49 rows of gap
    # Gap rows add up over segments: 49 + 70 > 100.
    status, text = _put(small, r, _one_row(720))
    assert status == 400 and "R3_CACHE_MAX_ROLLOUT_GAP_ROWS" in text, text
    # Filling a gap lowers the total, so it is always allowed; then the hop fits.
    fill = encode_frame(idx[:49], num_experts=E, layer_ids=LAYERS, segment=Segment(600, 649))
    assert _put(small, r, fill)[0] == 201
    assert _put(small, r, _one_row(720))[0] == 201
    # 801 rows would decode past the byte limit (800 rows of 3 layers x top-4 int16).
    status, text = _put(small, r, _one_row(800))
    assert status == 400 and "R3_CACHE_MAX_ROLLOUT_BYTES" in text, text
    # Rows: a rollout of one-layer routing (small rows) still stops at 1,000 rows.
    thin = synthetic_routing(990, 1, E, 4, seed=6)
    r2 = rid()
    seg = Segment(0, 990)
    assert _put(small, r2, encode_frame(thin, num_experts=E, layer_ids=[1], segment=seg))[0] == 201
    one = encode_frame(thin[:20], num_experts=E, layer_ids=[1], segment=Segment(990, 1010))
    status, text = _put(small, r2, one)
    assert status == 400 and "R3_CACHE_MAX_ROLLOUT_ROWS" in text, text
    # The gRPC front end says the same.
    import grpc

    from r3_client._proto import r3_cache_pb2 as pb

    with pytest.raises(grpc.RpcError) as info:
        small.stub().PutSegment(
            pb.PutSegmentRequest(rollout_id=r2, frame=one),
            metadata=(("authorization", f"Bearer {KEY_A}"),),
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


def test_a_reader_refuses_a_result_over_its_limit_before_allocating(small: Service) -> None:
    idx = synthetic_routing(700, len(LAYERS), E, 4, seed=7)
    r = rid()
    for a in range(0, 700, 100):  # each segment decodes within the limit; the whole does not
        seg = Segment(a, a + 100)
        frame = encode_frame(idx[a : a + 100], num_experts=E, layer_ids=LAYERS, segment=seg)
        assert _put(small, r, frame)[0] == 201
    limit = 300 * len(LAYERS) * 4 * 2
    for url in (small.http_url, f"grpc://{small.grpc_target}"):
        with RoutingClient(url, api_key=KEY_A, max_bytes=limit) as client:
            # Refused from the headers, before any of the seven frames is decoded.
            with pytest.raises(
                FrameError, match=f"rollout {r}: its frames decode to .* over {limit}"
            ):
                client.get(r)
            assert client.get(r, start=0, end=100).indices.shape == (100, len(LAYERS), 4)
    assert MAX_DECODED_BYTES == 2 << 30  # the service's default R3_CACHE_MAX_ROLLOUT_BYTES
