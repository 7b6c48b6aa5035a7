"""Unauthenticated gRPC calls cost the service no memory that stays (issue 25, item 4).

Before: the servicer authenticated a call only once grpc had received its whole
message, so two concurrent 256 MiB PutSegment messages with no key took a
service from 95 to 1,347 MiB of RSS, and it kept 1,034 MiB afterwards.  Now the
key is checked from the metadata before the message is read, and what a large
call took is handed back to the system.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client._proto import r3_cache_pb2 as pb
from tests.support.service_process import KEY_A, Service, grpc_md, start_service

MAX_BODY = 64 << 20  # the test service's largest PutSegment frame
CALLS = 4  # concurrent max-size calls per round
KEPT_MIB = 100  # the bound: RSS afterwards within this of the start
PUT = "/r3.cache.v1.RoutingCache/PutSegment"


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(f"{field}:")) / 1024


@pytest.fixture
def big_service(tmp_path: Path) -> Iterator[Service]:
    """A fresh service process (its RSS is its own) that takes 64 MiB frames."""
    redis_proc = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    svc = start_service(tmp_path, redis_proc.url, env={"R3_CACHE_MAX_BODY_BYTES": str(MAX_BODY)})
    yield svc
    svc.stop()
    redis_proc.stop()


def _round(svc: Service, message: bytes, metadata: tuple[tuple[str, str], ...]) -> list[str]:
    """``CALLS`` concurrent PutSegment calls of ``message``; the status each ended with."""
    channel = grpc.insecure_channel(svc.grpc_target, options=[("grpc.max_send_message_length", -1)])
    put = channel.unary_unary(PUT)  # pre-serialised bytes: the client does not copy them

    def one(_: int) -> str:
        try:
            put(message, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            return exc.code().name  # type: ignore[attr-defined, no-any-return]
        return "OK"

    with channel, ThreadPoolExecutor(CALLS) as pool:
        return list(pool.map(one, range(CALLS)))


def _message() -> bytes:
    frame = bytes(MAX_BODY - (1 << 10))  # legal size, not a frame: refused once parsed
    return pb.PutSegmentRequest(rollout_id="victim", frame=frame).SerializeToString()


def _warm_rss(svc: Service) -> float:
    """The service's RSS once its gRPC machinery has served one (authenticated) call."""
    with pytest.raises(grpc.RpcError) as info:
        svc.stub().StatRollout(pb.RolloutRef(rollout_id="nothing"), metadata=grpc_md(KEY_A))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    return _status_mib(svc.proc.pid, "VmRSS")


def _growth(svc: Service, start: float) -> tuple[float, float]:
    time.sleep(1.0)  # the trim after the last call runs off the event loop
    pid = svc.proc.pid
    kept, peak = _status_mib(pid, "VmRSS") - start, _status_mib(pid, "VmHWM") - start
    print(f"RSS start {start:.0f} MiB, peak +{peak:.0f} MiB, kept +{kept:.0f} MiB")
    return kept, peak


def test_unauthenticated_max_size_puts_leave_no_memory_behind(big_service: Service) -> None:
    """Before: 4 x 64 MiB with no key, then with a wrong key: peak +714 MiB, kept +645 MiB."""
    message = _message()
    start = _warm_rss(big_service)
    for metadata in (grpc_md(None), grpc_md("wrong-key-0123456789abcdef")):
        assert _round(big_service, message, metadata) == ["UNAUTHENTICATED"] * CALLS
    kept, peak = _growth(big_service, start)
    assert kept < KEPT_MIB, f"kept {kept:.0f} MiB (peak +{peak:.0f} MiB)"
    assert peak < KEPT_MIB, f"peak +{peak:.0f} MiB: the messages were read"


def test_refused_authenticated_max_size_puts_leave_no_memory_behind(big_service: Service) -> None:
    """Memory a tenant's refused message took is handed back, not kept for good.

    Before: every refused 256 MiB message kept a copy alive (the abort's exception
    held the frames holding it, the request iterator its last message) and glibc's
    arenas kept grpc's receive buffers: 2 x 256 MiB left the service 1,838 MiB larger.
    """
    message = _message()
    start = _warm_rss(big_service)
    for _ in range(2):
        assert _round(big_service, message, grpc_md(KEY_A)) == ["INVALID_ARGUMENT"] * CALLS
    kept, peak = _growth(big_service, start)
    assert kept < KEPT_MIB, f"kept {kept:.0f} MiB (peak +{peak:.0f} MiB)"
