"""Hostile rollout ids through every client method, on both transports, sync and async.

An id outside the rule (``r3_client.check_rollout_id``) is refused by the client
before any I/O — checked by pointing a client at a port nobody listens on: a
``ConnectError`` would mean it tried.  Against the live service, the victim
rollout every hostile id aims at is untouched afterwards.  Every legal id,
including the ones made of URL-special characters, round-trips on every transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest

from cache_service.redis_proc import free_port
from r3_client import (
    AsyncRoutingClient,
    InvalidRequestError,
    Retry,
    RolloutNotFoundError,
    RoutingClient,
    check_rollout_id,
)
from r3_client._proto import r3_cache_pb2 as pb
from tests.support.frames import (
    NOT_STRINGS,
    TRAJ,
    TRICKY_LEGAL_IDS,
    frame_for,
    hostile_ids,
    same_sets,
)
from tests.support.service_process import KEY_A, Service, grpc_md

VICTIM = "victim"
HOSTILE: list[Any] = [*hostile_ids(VICTIM), *NOT_STRINGS]
TRICKY_LEGAL = [*TRICKY_LEGAL_IDS, "v" * 200]
NOWHERE = Retry(attempts=1)


def _dead_urls() -> list[str]:
    port = free_port()
    return [f"http://127.0.0.1:{port}", f"grpc://127.0.0.1:{port}"]


def _sync_calls(c: RoutingClient, rid: Any) -> list[Callable[[], object]]:
    frame = frame_for(TRAJ[:4], 0)
    return [
        lambda: c.put(rid, frame),
        lambda: c.get(rid),
        lambda: c.get_frame(rid, start=1),
        lambda: c.stat(rid),
        lambda: c.delete(rid),
        lambda: c.touch(rid, 60),
        lambda: list(c.get_many([rid])),
        lambda: list(c.get_many(["ok-id", rid], return_errors=True)),
    ]


@pytest.mark.parametrize("url", _dead_urls(), ids=["http", "grpc"])
def test_sync_client_refuses_hostile_ids_before_any_io(url: str) -> None:
    with RoutingClient(url, retry=NOWHERE) as c:
        for rid in HOSTILE:
            for call in _sync_calls(c, rid):
                with pytest.raises(InvalidRequestError, match="invalid rollout id"):
                    call()


@pytest.mark.parametrize("url", _dead_urls(), ids=["http", "grpc"])
async def test_async_client_refuses_hostile_ids_before_any_io(url: str) -> None:
    frame = frame_for(TRAJ[:4], 0)
    async with AsyncRoutingClient(url, retry=NOWHERE) as c:
        for rid in HOSTILE:
            calls = [
                c.put(rid, frame),
                c.get(rid),
                c.stat(rid),
                c.delete(rid),
                c.touch(rid, 60),
            ]
            for coro in calls:
                with pytest.raises(InvalidRequestError, match="invalid rollout id"):
                    await coro
            with pytest.raises(InvalidRequestError):
                _ = [x async for x in c.get_many([rid])]


def test_a_single_string_is_not_a_list_of_ids() -> None:
    with RoutingClient(_dead_urls()[0], retry=NOWHERE) as c, pytest.raises(TypeError):
        list(c.get_many(VICTIM))


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_hostile_ids_leave_the_victim_untouched(service_single: Service, transport: str) -> None:
    url = service_single.http_url if transport == "http" else f"grpc://{service_single.grpc_target}"
    with RoutingClient(url, api_key=KEY_A, retry=NOWHERE) as c:
        c.put(VICTIM, frame_for(TRAJ[:30], 0))
        for rid in HOSTILE:
            for call in _sync_calls(c, rid):
                with pytest.raises(InvalidRequestError):
                    call()
        info = c.stat(VICTIM)
        assert info.num_rows == 30 and info.ttl_s is not None and info.ttl_s > 3000
        assert same_sets(c.get(VICTIM).indices, TRAJ[:30])


def test_raw_requests_with_hostile_ids_never_reach_another_rollout(
    service_single: Service,
) -> None:
    """Bypassing the client: what the service itself does with each hostile path."""
    with RoutingClient(service_single.http_url, api_key=KEY_A) as c:
        c.put(VICTIM, frame_for(TRAJ[:30], 0))
    with service_single.http() as h:
        for path in [
            f"/v1/rollouts/{VICTIM}%23junk",
            f"/v1/rollouts/{VICTIM}%3Flayers=3",
            "/v1/rollouts/%2E%2E",
            "/v1/rollouts/%2E",
            f"/v1/rollouts/{VICTIM}%00",
            f"/v1/rollouts/{VICTIM}%0D%0AX-Injected:%201",
            f"/v1/rollouts/{'v' * 10_000}",
        ]:
            resp = h.delete(path)
            assert resp.status_code in (400, 404, 414, 431), (path, resp.status_code)
            assert resp.status_code < 500
        assert h.get(f"/v1/rollouts/{VICTIM}/stat").status_code == 200
    stub = service_single.stub()
    for rid in [".", "..", f"../{VICTIM}", f"{VICTIM}#x", "v\x00", "v" * 10_000]:
        with pytest.raises(grpc.RpcError) as info:
            stub.DeleteRollout(pb.RolloutRef(rollout_id=rid), metadata=grpc_md())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rid  # type: ignore[attr-defined]


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_tricky_legal_ids_work_on_every_transport(service_single: Service, transport: str) -> None:
    url = service_single.http_url if transport == "http" else f"grpc://{service_single.grpc_target}"
    with RoutingClient(url, api_key=KEY_A) as c:
        for rid in TRICKY_LEGAL:
            assert check_rollout_id(rid) == rid
            name = f"{transport}{rid}" if len(rid) < 200 else rid
            c.delete(name)
            c.put(name, frame_for(TRAJ[:8], 0))
            assert c.stat(name).rollout_id == name
            assert same_sets(c.get(name, start=2).indices, TRAJ[2:8])
            c.touch(name, 120)
            assert [r for r, _ in c.get_many([name, name])] == [name, name]
            assert c.delete(name) is True
            with pytest.raises(RolloutNotFoundError):
                c.stat(name)


def test_non_json_success_answer_is_a_protocol_error(service_single: Service) -> None:
    """A 2xx body that is not JSON (a proxy's page, say) is an r3 error, not a raw decode error."""
    from r3_client import ProtocolError
    from r3_client._transports._http import _json

    for body in (b"\xff\xfe not json", b"<html>ok</html>", b"[1, 2]"):
        with pytest.raises(ProtocolError):
            _json(httpx.Response(200, content=body))
