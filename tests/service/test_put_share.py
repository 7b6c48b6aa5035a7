"""A put's ``share`` (issue 52), end to end through the real service: HTTP's query parameter,
gRPC's ``PutSegmentRequest.share`` and both clients reach the store, whose answer says
whether the segment was kept in a shared blob; a share that is not a boolean, and a view
put as shared, are refused with a reason on both transports, storing nothing."""

from __future__ import annotations

import grpc
import pytest

from r3_client import AsyncRoutingClient, InvalidRequestError, RolloutNotFoundError, RoutingClient
from r3_client._proto import r3_cache_pb2 as pb
from tests.support.frames import TRAJ, frame_for, rid
from tests.support.service_process import KEY_A, Service, grpc_md, url_of


def _put_http(svc: Service, r: str, frame: bytes, params: dict[str, str]) -> dict:
    with svc.http(KEY_A) as c:
        resp = c.put(
            f"/v1/rollouts/{r}/segments",
            content=frame,
            params=params,
            headers={"Content-Type": "application/x-r3-frame"},
        )
    assert resp.status_code in (200, 201), resp.text
    return dict(resp.json())


def _put_grpc(svc: Service, r: str, frame: bytes, **share: bool) -> pb.PutSegmentResponse:
    req = pb.PutSegmentRequest(rollout_id=r, frame=frame, **share)
    return svc.stub().PutSegment(req, metadata=grpc_md())


def _cleanup(svc: Service, ids: list[str]) -> None:
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        c.delete_many(ids)


def test_share_over_http_reaches_the_store(svc: Service) -> None:
    prompt = frame_for(TRAJ[:40], 0, version=rid())  # a fresh share key
    a, b, c, d = (rid() for _ in range(4))
    assert _put_http(svc, a, prompt, {"share": "true"})["shared"] is True
    second = _put_http(svc, b, prompt, {"share": "1"})  # FastAPI's bool: 1 is true
    assert second["shared"] is True and second["dedupe_hit"] is True
    # share=false keeps a row-0 segment private, which the store's rule would have shared
    assert _put_http(svc, c, prompt, {"share": "false"})["shared"] is False
    assert _put_http(svc, d, prompt, {})["shared"] is True  # absent: the store's rule
    later = frame_for(TRAJ[40:80], 40, version=rid())
    assert _put_http(svc, a, later, {"share": "0"})["shared"] is False
    assert _put_http(svc, b, later, {})["shared"] is False  # the rule: row 0 only
    assert _put_http(svc, c, later, {"share": "true"})["shared"] is True  # the writer's say
    # a frame without a token digest has no share key: stored privately whatever is asked
    plain = frame_for(TRAJ[:40], 0, digest=False)
    e = rid()
    assert _put_http(svc, e, plain, {"share": "true"})["shared"] is False
    _cleanup(svc, [a, b, c, d, e])


def test_share_over_grpc_reaches_the_store(svc: Service) -> None:
    prompt = frame_for(TRAJ[:40], 0, version=rid())
    a, b, c, d = (rid() for _ in range(4))
    assert _put_grpc(svc, a, prompt, share=True).shared is True
    second = _put_grpc(svc, b, prompt, share=True)
    assert second.shared and second.dedupe_hit
    assert _put_grpc(svc, c, prompt, share=False).shared is False
    assert _put_grpc(svc, d, prompt).shared is True  # unset: the store's rule
    later = frame_for(TRAJ[40:80], 40, version=rid())
    assert _put_grpc(svc, c, later, share=True).shared is True
    assert _put_grpc(svc, d, later).shared is False
    _cleanup(svc, [a, b, c, d])


def test_both_clients_pass_share(svc: Service, transport: str) -> None:
    prompt = frame_for(TRAJ[:40], 0, version=rid())
    a, b = rid(), rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        assert c.put(a, prompt, share=False).shared is False
        assert c.put(b, prompt, share=True).shared is True
        assert [s.shared for s in c.stat(a).segments] == [False]
        assert [s.shared for s in c.stat(b).segments] == [True]
        later = frame_for(TRAJ[40:80], 40, version=rid())
        assert c.put(a, later, share=True).shared is True
        with pytest.raises(InvalidRequestError, match="share"):  # before any I/O
            c.put(rid(), prompt, share="false")  # type: ignore[arg-type]
    _cleanup(svc, [a, b])


async def test_the_async_client_passes_share(svc: Service, transport: str) -> None:
    prompt = frame_for(TRAJ[:40], 0, version=rid())
    a, b = rid(), rid()
    async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        assert (await c.put(a, prompt, share=False)).shared is False
        assert (await c.put(b, prompt, share=True)).shared is True
        later = frame_for(TRAJ[40:80], 40, version=rid())
        assert (await c.put(b, later)).shared is False
        with pytest.raises(InvalidRequestError, match="share"):
            await c.put(rid(), prompt, share=1)  # type: ignore[arg-type]
        await c.delete_many([a, b])


@pytest.mark.parametrize("value", ["maybe", "", "2", "truee", "null"])
def test_a_share_that_is_not_a_boolean_is_refused(svc: Service, value: str) -> None:
    r = rid()
    with svc.http(KEY_A) as c:
        resp = c.put(
            f"/v1/rollouts/{r}/segments",
            content=frame_for(TRAJ[:40], 0),
            params={"share": value},
            headers={"Content-Type": "application/x-r3-frame"},
        )
        assert resp.status_code == 422, resp.text
        body = resp.json()["error"]
        assert body["code"] == "invalid_request" and "share" in body["message"]
        assert c.get(f"/v1/rollouts/{r}/stat").status_code == 404  # nothing stored


def test_a_view_is_never_shared(svc: Service, transport: str) -> None:
    r = rid()
    view = frame_for(TRAJ[5:40], 5, version=rid())
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:40], 0))
        with pytest.raises(InvalidRequestError, match="never shared"):  # before any I/O
            c.put(r, view, view=40, share=True)
    with svc.http(KEY_A) as h:
        resp = h.put(
            f"/v1/rollouts/{r}/segments",
            content=view,
            params={"view": "40", "share": "true"},
            headers={"Content-Type": "application/x-r3-frame"},
        )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_request"
    assert "views are never shared" in resp.json()["error"]["message"]
    req = pb.PutSegmentRequest(rollout_id=r, frame=view, view=40, share=True)
    with pytest.raises(grpc.RpcError) as info:
        svc.stub().PutSegment(req, metadata=grpc_md())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "views are never shared" in info.value.details()  # type: ignore[attr-defined]
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        assert c.stat(r).views == ()  # nothing stored
        # share=False (or unset) on a view is what every view is: stored
        assert c.put(r, view, view=40, share=False).shared is False
        assert len(c.stat(r).views) == 1
        c.delete(r)
        with pytest.raises(RolloutNotFoundError):
            c.stat(r)
