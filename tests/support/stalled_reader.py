"""A batch reader that takes the first item and then stalls with its connection held open:
what the service's read-ahead bound is measured against (tests/adversarial/test_batch_bounds.py,
bench/readers_bounded_bench.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from r3_client.wire import r3_cache_pb2 as pb
from tests.support.service_process import Service, grpc_md


def stall_http(svc: Service, body: dict[str, object], item: int, hold_s: float) -> None:
    """``POST /v1/batch/get`` with ``body``; read ``item`` bytes (the first item), hold."""
    with svc.http() as c, c.stream("POST", "/v1/batch/get", json=body) as resp:
        resp.raise_for_status()
        # Held, not dropped: a dropped iterator closes the connection (a reader gone, not
        # a reader stalled), and the service stops fetching.
        chunks, got = resp.iter_raw(), 0
        while got < item:  # until the first item is in
            got += len(next(chunks))
        time.sleep(hold_s)


def stall_grpc(svc: Service, body: dict[str, object], item: int, hold_s: float) -> None:
    """gRPC ``BatchGet`` of ``body`` (the HTTP request's fields); take one item, hold."""
    ranges = body.get("ranges") or []
    request = pb.BatchGetRequest(
        rollout_ids=body["rollout_ids"],  # type: ignore[arg-type]
        ranges=[pb.RowRange(start=a, end=b) for a, b in ranges],  # type: ignore[attr-defined]
        start=int(body.get("start", 0)),  # type: ignore[call-overload]
        end=body.get("end"),  # type: ignore[arg-type]
    )
    stream = svc.stub().BatchGet(request, metadata=grpc_md())
    try:
        first = next(stream)
        if first.WhichOneof("result") != "frame":
            raise RuntimeError(f"the first item is an error: {first.error}")
        time.sleep(hold_s)
    finally:
        stream.cancel()


#: By transport.
STALL: dict[str, Callable[[Service, dict[str, object], int, float], None]] = {
    "http": stall_http,
    "grpc": stall_grpc,
}
