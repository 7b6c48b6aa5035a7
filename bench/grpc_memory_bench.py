"""The service's RSS around concurrent maximum-size gRPC PutSegment calls (issue 25, item 4).

For each kind of caller (no key, a wrong key, a tenant's key with a message that
is not a frame) starts a fresh service (``--mib`` MiB frame limit, auth on, as
``tests/support/service_process.py`` starts it) over its own ``redis-server``, makes one
small authenticated call to warm gRPC up, reads its RSS (the baseline), sends
``--calls`` concurrent PutSegment messages of the largest legal size, waits 2 s,
and prints RSS at the start, the peak (VmHWM) and RSS afterwards, in MiB
(/proc; Linux).  Every call must be refused (UNAUTHENTICATED, INVALID_ARGUMENT);
anything else makes the script exit 1.

    python bench/grpc_memory_bench.py [--mib 256] [--calls 2]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client.wire import r3_cache_pb2 as pb  # noqa: E402
from tests.support.service_process import KEY_A, grpc_md, start_service  # noqa: E402

PUT = "/r3.cache.v1.RoutingCache/PutSegment"
CALLERS = {
    "no key": (None, "UNAUTHENTICATED"),
    "wrong key": ("wrong-key-0123456789abcdef", "UNAUTHENTICATED"),
    "tenant key, not a frame": (KEY_A, "INVALID_ARGUMENT"),
}


def _mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(f"{field}:")) / 1024


def _measure(
    key: str | None, message: bytes, calls: int, limit: int
) -> tuple[list[str], list[str]]:
    """The status of each call, and the service's RSS at the start, its peak and after."""
    tmp = Path(tempfile.mkdtemp(prefix="grpc-memory-"))
    redis_proc = RedisProcess(free_port(), tmp / "redis", appendonly=False).start()
    svc = start_service(tmp, redis_proc.url, env={"R3_CACHE_MAX_BODY_BYTES": str(limit)})
    try:
        pid = svc.proc.pid
        with contextlib.suppress(grpc.RpcError):  # not found; the machinery is warm
            svc.stub().StatRollout(pb.RolloutRef(rollout_id="warm-up"), metadata=grpc_md(KEY_A))
        start = _mib(pid, "VmRSS")
        with grpc.insecure_channel(
            svc.grpc_target, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            put: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(PUT)

            def one(_: int) -> str:
                try:
                    put(message, metadata=grpc_md(key), timeout=300)
                except grpc.RpcError as exc:
                    return str(exc.code().name)
                return "OK"

            with ThreadPoolExecutor(calls) as pool:
                codes = list(pool.map(one, range(calls)))
        time.sleep(2)
        figures = [f"{start:.0f}", f"{_mib(pid, 'VmHWM'):.0f}", f"{_mib(pid, 'VmRSS'):.0f}"]
        return codes, figures
    finally:
        svc.stop()
        redis_proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="the frame limit, and each message")
    ap.add_argument("--calls", type=int, default=2, help="concurrent calls per caller")
    args = ap.parse_args()
    limit = args.mib << 20
    frame = bytes(limit - (1 << 10))
    message = pb.PutSegmentRequest(rollout_id="victim", frame=frame).SerializeToString()
    print(f"{args.calls} concurrent PutSegment calls of {len(message) / 2**20:.0f} MiB each")
    print(f"{'caller':26s} {'status':18s} {'RSS start':>9s} {'peak':>7s} {'after':>7s}  MiB")
    ok = True
    for name, (key, expected) in CALLERS.items():
        codes, (start, peak, after) = _measure(key, message, args.calls, limit)
        ok &= codes == [expected] * args.calls
        print(f"{name:26s} {','.join(sorted(set(codes))):18s} {start:>9s} {peak:>7s} {after:>7s}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
