"""Error replies stay bounded by their request, on both transports (issue 25, item 3).

Before: every error item of a batch quoted the request's whole layer list, so a
batch naming one rollout 64 times with a 100,000-entry layer list turned a
0.7 MB request into 44 MB of errors; a single gRPC GetRollout with such a list
carried a 0.7 MB status message, over the client's 16 KiB metadata limit, so the
caller saw RESOURCE_EXHAUSTED with no ``r3-error-code`` instead of the
INVALID_ARGUMENT the service meant.  Now messages quote a few items and a count,
and what reaches the wire is capped, so a reply is a small multiple of its request.
"""

from __future__ import annotations

import json

import grpc
import pytest

from r3_client._proto import r3_cache_pb2 as pb
from tests.support.frames import LAYERS, TRAJ, frame_for, rid
from tests.support.service_process import Service, grpc_md

MAX_RATIO = 4
BATCH = 64  # the test service's R3_CACHE_MAX_BATCH: one rollout named that many times
LAYER_LISTS = {
    # One id repeated: invalid whatever the rollout holds.
    "repeated": [7] * 100_000,
    # Every other id a layer may have: none is stored (LAYERS is 1, 3, 5), each is distinct.
    "unknown": [i for i in range(65_536) if i not in LAYERS],
}


@pytest.fixture(scope="module")
def stored(service_single: Service) -> str:
    """A rollout that exists, so the layer list is what the request trips over."""
    r = rid()
    with service_single.http() as c:
        resp = c.put(f"/v1/rollouts/{r}/segments", content=frame_for(TRAJ[:20], 0))
    assert resp.status_code == 201, resp.text
    return r


@pytest.mark.parametrize("layers", LAYER_LISTS.values(), ids=LAYER_LISTS.keys())
def test_http_batch_error_reply_is_bounded_by_its_request(
    service_single: Service, stored: str, layers: list[int]
) -> None:
    body = json.dumps({"rollout_ids": [stored] * BATCH, "layers": layers}).encode()
    with service_single.http() as c:
        resp = c.post("/v1/batch/get", content=body, headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400), resp.text[:500]
    ratio = len(resp.content) / len(body)
    assert ratio <= MAX_RATIO, f"{len(body):,} B request -> {len(resp.content):,} B reply"


@pytest.mark.parametrize("layers", LAYER_LISTS.values(), ids=LAYER_LISTS.keys())
def test_grpc_batch_error_reply_is_bounded_by_its_request(
    service_single: Service, stored: str, layers: list[int]
) -> None:
    request = pb.BatchGetRequest(rollout_ids=[stored] * BATCH, layers=layers)
    got, status = 0, grpc.StatusCode.OK
    try:
        for item in service_single.stub().BatchGet(request, metadata=grpc_md()):
            assert item.WhichOneof("result") == "error"
            got += item.ByteSize()
    except grpc.RpcError as exc:
        call: grpc.Call = exc  # type: ignore[assignment]
        got, status = got + len(call.details() or ""), call.code()
    assert status in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), status
    ratio = got / request.ByteSize()
    assert ratio <= MAX_RATIO, f"{request.ByteSize():,} B request -> {got:,} B reply"


@pytest.mark.parametrize("layers", LAYER_LISTS.values(), ids=LAYER_LISTS.keys())
def test_grpc_get_with_a_huge_layer_list_is_invalid_argument_with_its_code(
    service_single: Service, stored: str, layers: list[int]
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        service_single.stub().GetRollout(
            pb.GetRolloutRequest(rollout_id=stored, layers=layers), metadata=grpc_md()
        )
    exc: grpc.Call = info.value  # type: ignore[assignment]
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.details()[:300]
    assert dict(exc.trailing_metadata() or ())["r3-error-code"] == "invalid_request"
    assert len(exc.details()) <= 1024


def test_put_conflicting_with_many_layers_keeps_its_status_small(
    service_single: Service,
) -> None:
    """A conflict message naming both layer lists once listed every id of each."""
    many = tuple(range(0, 2 * 4096, 2))  # 4,096 layers: an 8 KiB-per-list message before
    r = rid()
    with service_single.http() as c:
        assert (
            c.put(f"/v1/rollouts/{r}/segments", content=frame_for(TRAJ[:4], 0)).status_code == 201
        )
    row = TRAJ[4:5, :1].repeat(len(many), axis=1)
    frame = frame_for(row, 4, layers=many, digest=False)
    with pytest.raises(grpc.RpcError) as info:
        service_single.stub().PutSegment(
            pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md()
        )
    exc: grpc.Call = info.value  # type: ignore[assignment]
    assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc.details()[:300]
    assert dict(exc.trailing_metadata() or ())["r3-error-code"] == "conflict"
    assert len(exc.details()) <= 1024
