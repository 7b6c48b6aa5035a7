"""Unauthenticated and oversized bodies on every endpoint, over raw sockets and gRPC.

Raw sockets, because the point is *when* the service answers: a 401 must come
back after the headers alone, and a 413 while a chunked body is still
streaming in — not after the service has buffered hundreds of megabytes.
"""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import grpc
import pytest

from r3_client._proto import r3_cache_pb2 as pb
from tests.support.frames import TRAJ, frame_for
from tests.support.service_process import KEY_A, LIMITS, Service, grpc_md

#: (method, path) of every route that takes or could be sent a body.
ENDPOINTS = [
    ("PUT", "/v1/rollouts/body-test/segments"),
    ("GET", "/v1/rollouts/body-test"),
    ("GET", "/v1/rollouts/body-test/stat"),
    ("DELETE", "/v1/rollouts/body-test"),
    ("POST", "/v1/rollouts/body-test/touch"),
    ("POST", "/v1/batch/get"),
    ("POST", "/v1/no-such-route"),
]
FRAME_LIMIT = int(LIMITS["R3_CACHE_MAX_BODY_BYTES"])
REQUEST_LIMIT = 1 << 20  # the default max_request_bytes
CHUNK = b"x" * (64 << 10)


def _connect(svc: Service) -> socket.socket:
    u = urlsplit(svc.http_url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # keep kernel buffering small
    return s


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(s: socket.socket, timeout: float) -> int:
    s.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        got = s.recv(4096)
        if not got:
            raise AssertionError("connection closed without an answer")
        data += got
    return int(data.split(b" ", 2)[1])


def _stream_until_answered(s: socket.socket, budget: int) -> tuple[int, int]:
    """Send chunked body data until the service answers; (status, bytes sent)."""
    sent = 0
    pending = b""
    s.setblocking(False)
    while sent < budget:
        try:
            if s.recv(1, socket.MSG_PEEK):
                break
        except BlockingIOError:
            pass
        if not pending:
            pending = b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n"
        try:
            n = s.send(pending)  # may be partial: keep the rest for the next round
            pending = pending[n:]
            sent += n
        except BlockingIOError:
            time.sleep(0.005)
        except (BrokenPipeError, ConnectionResetError):
            break
    s.setblocking(True)
    return _status(s, 10), sent


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("key", [None, "wrong-key-0123456789abcdef"])
def test_no_key_is_refused_before_the_body_is_read(
    service_single: Service, method: str, path: str, key: str | None
) -> None:
    """Before: batch/get and touch read and parsed the whole body, then said 401."""
    headers = {"Content-Length": str(256 << 20), "Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    with _connect(service_single) as s:
        s.sendall(_head(method, path, headers) + CHUNK)  # 64 KiB of a declared 256 MiB
        assert _status(s, 5) == 401


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_declared_oversized_body_is_413_at_once(
    service_single: Service, method: str, path: str
) -> None:
    limit = FRAME_LIMIT if path.endswith("/segments") else REQUEST_LIMIT
    headers = {"Content-Length": str(limit + 1), "Authorization": f"Bearer {KEY_A}"}
    with _connect(service_single) as s:
        s.sendall(_head(method, path, headers))
        assert _status(s, 5) == 413


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_chunked_oversized_body_is_413_while_streaming(
    service_single: Service, method: str, path: str
) -> None:
    """No Content-Length: counted as it arrives, refused once past the limit.  Routes that
    take no body answer without reading it (404 here: the rollout does not exist)."""
    limit = FRAME_LIMIT if path.endswith("/segments") else REQUEST_LIMIT
    headers = {"Transfer-Encoding": "chunked", "Authorization": f"Bearer {KEY_A}"}
    with _connect(service_single) as s:
        s.sendall(_head(method, path, headers))
        status, sent = _stream_until_answered(s, 64 * limit)
    assert status == (413 if method in ("PUT", "POST") and "no-such" not in path else 404)
    assert sent < limit + (16 << 20), f"answered only after {sent} bytes"


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_eight_concurrent_hostile_bodies_do_not_grow_the_service(service_single: Service) -> None:
    """Before: eight 256 MiB bodies without a key took the service from 0.1 to 3.7 GiB."""
    pid = service_single.proc.pid
    peak_before = _rss_peak_kib(pid)
    results: list[int] = []

    def attack(i: int) -> None:
        unauth = i % 2 == 0
        headers = {"Transfer-Encoding": "chunked"}
        if not unauth:
            headers["Authorization"] = f"Bearer {KEY_A}"
        path = "/v1/batch/get" if i % 4 < 2 else "/v1/rollouts/x/segments"
        with _connect(service_single) as s:
            s.sendall(_head("POST" if "batch" in path else "PUT", path, headers))
            results.append(_stream_until_answered(s, 256 << 20)[0])

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [401] * 4 + [413] * 4
    grown_mib = (_rss_peak_kib(pid) - peak_before) / 1024
    assert grown_mib < 64, f"peak RSS grew by {grown_mib:.0f} MiB"


def test_the_service_still_serves_after_the_attacks(service_single: Service) -> None:
    with service_single.http() as c:
        r = c.put("/v1/rollouts/after-attack/segments", content=frame_for(TRAJ[:5], 0))
        assert r.status_code in (200, 201)
        assert c.get("/v1/rollouts/after-attack/stat").json()["num_rows"] == 5


# ---- gRPC -----------------------------------------------------------------------------------
def test_grpc_refuses_before_parsing_and_bounds_every_message(service_single: Service) -> None:
    stub = service_single.stub()
    big_ids = [f"id-{i:07d}" for i in range(200_000)]  # ~2.4 MB: over max_request_bytes
    calls = [
        (stub.PutSegment, pb.PutSegmentRequest(rollout_id="x", frame=b"\0" * (FRAME_LIMIT + 8192))),
        (stub.BatchGet, pb.BatchGetRequest(rollout_ids=big_ids)),
        (stub.TouchRollout, pb.TouchRequest(rollout_id="x" * (REQUEST_LIMIT + 10))),
        (stub.GetRollout, pb.GetRolloutRequest(rollout_id="x" * (REQUEST_LIMIT + 10))),
        (stub.StatRollout, pb.RolloutRef(rollout_id="x" * (REQUEST_LIMIT + 10))),
        (stub.DeleteRollout, pb.RolloutRef(rollout_id="x" * (REQUEST_LIMIT + 10))),
    ]
    for method, request in calls:
        with pytest.raises(grpc.RpcError) as no_key:
            _drain(method(request, timeout=30))
        assert no_key.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as big:
            _drain(method(request, metadata=grpc_md(), timeout=30))
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, big.value.details()  # type: ignore[attr-defined]
        # PutSegment's limit is the server's own receive limit, worded by grpc.
        details = big.value.details() or ""  # type: ignore[attr-defined]
        assert "limit" in details or "larger than max" in details, details


def _drain(result: object) -> None:
    if hasattr(result, "__iter__"):
        for _ in result:  # type: ignore[attr-defined]
            pass


def test_grpc_touch_with_a_huge_ttl_is_the_clients_mistake(service_single: Service) -> None:
    """Before: ttl_s = 2**62 answered UNAVAILABLE/store_error (a server-class status)."""
    stub = service_single.stub()
    stub.PutSegment(
        pb.PutSegmentRequest(rollout_id="ttl-victim", frame=frame_for(TRAJ[:5], 0)),
        metadata=grpc_md(),
    )
    for ttl in (2**62, 2**63 - 1, 10 * 365 * 24 * 3600 + 1):
        with pytest.raises(grpc.RpcError) as info:
            stub.TouchRollout(
                pb.TouchRequest(rollout_id="ttl-victim", ttl_s=ttl), metadata=grpc_md()
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "ttl_s must be between 0 and" in (info.value.details() or "")  # type: ignore[attr-defined]
    stub.TouchRollout(pb.TouchRequest(rollout_id="ttl-victim", ttl_s=600), metadata=grpc_md())
    with service_single.http() as c:
        assert c.post("/v1/rollouts/ttl-victim/touch", json={"ttl_s": 2**62}).status_code == 422
        ttl = c.get("/v1/rollouts/ttl-victim/stat").json()["ttl_s"]
        assert 590 < ttl <= 600
