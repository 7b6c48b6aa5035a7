"""Batch replies and batch read-ahead against the service's budgets (issue 42, defects 5, 6).

Two tables, each against a real service over its own ``redis-server`` (started as
``tests/support/service_process.py`` starts it, auth on):

**batch stat** — one rollout of ``--segments`` one-row segments (a large stat from a
small rollout; ``--wv-chars``: each segment's weight version that long) named
``--names`` times in one ``POST /v1/batch/stat`` / gRPC ``BatchStat``.  For each: the
request and reply bytes, how many items were answered with the stat (the rest are
``limit_exceeded``), the wall time, the service's peak RSS growth (VmHWM after
``clear_refs``), and the worst latency another tenant's single stat saw meanwhile.
Rows ``budget`` are the service as configured (``MAX_BATCH_STAT_BYTES``, default or
``--budget``); rows ``no budget`` the same run against a service whose budget is
1 GiB (the reply as large as the batch asks: the baseline).

**read-ahead** — one rollout stored as one segment of ``--blocks`` 2048-row blocks
(~2 MiB each), ``--items`` items over it in one batch get, each leaving out one block
(a fresh slice), the reader taking the first item and then stalling for ``--hold`` s
(connection held open): the service's peak RSS growth, with per-item ``ranges`` (a
training rank's request) and with the batch's one ``start``/``end`` (the baseline),
over HTTP and gRPC; and the bound the test asserts (docs/service.md:
``BATCH_CONCURRENCY`` items, each its answer and the stored bytes it is read from;
the item being written out, 4 copies at most; 48 MiB of heap slack).  A fresh service
per row, so each growth is its own.

    python bench/readers_bounded_bench.py [--segments 1024] [--wv-chars 256]
        [--names 1,64,256] [--budget BYTES] [--blocks 4] [--items 256] [--hold 3]
        [--only stat|read-ahead]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import Segment, encode_frame  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from r3_client.wire import r3_cache_pb2 as pb  # noqa: E402
from tests.support.service_process import KEY_A, KEY_B, Service, grpc_md, start_service  # noqa: E402
from tests.support.stalled_reader import STALL  # noqa: E402

CONCURRENCY = 8  # the service's default BATCH_CONCURRENCY
UNBUDGETED = 1 << 30


def _mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(f"{field}:")) / 1024


@contextlib.contextmanager
def _peak_growth(pid: int) -> Iterator[list[float]]:
    """Yields a list that holds, on exit, the process's peak RSS growth in MiB."""
    out: list[float] = []
    start = _mib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    yield out
    out.append(_mib(pid, "VmHWM") - start)


@contextlib.contextmanager
def _redis() -> Iterator[RedisProcess]:
    tmp = Path(tempfile.mkdtemp(prefix="readers-bounded-"))
    proc = RedisProcess(free_port(), tmp / "redis", appendonly=False).start()
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def _service(redis_url: str, env: dict[str, str]) -> Iterator[Service]:
    tmp = Path(tempfile.mkdtemp(prefix="readers-bounded-svc-"))
    svc = start_service(tmp, redis_url, env={"R3_CACHE_MAX_BATCH": "1024", **env})
    try:
        yield svc
    finally:
        svc.stop()


def _client(svc: Service, key: str = KEY_A) -> httpx.Client:
    """An HTTP client for the tenant's key that waits as long as a large reply takes."""
    auth = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=svc.http_url, headers=auth, timeout=600)


# ---- batch stat -------------------------------------------------------------------------------
def _store_big_stat(svc: Service, segments: int, wv_chars: int) -> str:
    rows = synthetic_routing(segments, 3, 64, 4, seed=3)
    wv = "w" * wv_chars if wv_chars else "v1"
    stub = svc.stub()
    r = "big-stat"
    for i in range(segments):
        seg = Segment(i, i + 1, "tiny-moe", wv, "")
        frame = encode_frame(rows[i : i + 1], num_experts=64, layer_ids=(1, 3, 5), segment=seg)
        stub.PutSegment(pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md())
    with svc.http() as c:  # the other tenant's rollout
        c.put(
            "/v1/rollouts/other/segments",
            content=encode_frame(rows[:4], num_experts=64, layer_ids=(1, 3, 5)),
            headers={"Authorization": f"Bearer {KEY_B}"},
        )
    return r


def _http_stat(svc: Service, ids: list[str]) -> tuple[int, int, int]:
    body = json.dumps({"rollout_ids": ids}).encode()
    with _client(svc) as c:
        resp = c.post("/v1/batch/stat", content=body, headers={"content-type": "application/json"})
    resp.raise_for_status()
    answered = sum(it["stat"] is not None for it in resp.json()["items"])
    return len(body), len(resp.content), answered


def _grpc_stat(svc: Service, ids: list[str]) -> tuple[int, int, int]:
    request = pb.BatchStatRequest(rollout_ids=ids)
    reply = svc.stub().BatchStat(request, metadata=grpc_md(), timeout=600)
    answered = sum(it.WhichOneof("result") == "stat" for it in reply.items)
    return request.ByteSize(), reply.ByteSize(), answered


def _other_tenant_worst_ms(svc: Service, stop: threading.Event, out: list[float]) -> None:
    with _client(svc, KEY_B) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get("/v1/rollouts/other/stat").raise_for_status()
            out.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)


def _bench_stat(args: argparse.Namespace) -> list[list[str]]:
    rows: list[list[str]] = []
    budget_env = {} if args.budget is None else {"R3_CACHE_MAX_BATCH_STAT_BYTES": str(args.budget)}
    with _redis() as redis_proc:
        for label, env in (
            ("no budget", {"R3_CACHE_MAX_BATCH_STAT_BYTES": str(UNBUDGETED)}),
            ("budget", budget_env),
        ):
            with _service(redis_proc.url, env) as svc:
                if not rows:
                    _store_big_stat(svc, args.segments, args.wv_chars)
                r = "big-stat"
                _http_stat(svc, [r])  # warm both transports
                _grpc_stat(svc, [r])
                if label == "no budget":  # the other tenant's latency with nothing else on
                    lat0: list[float] = []
                    stop0 = threading.Event()
                    idle = threading.Thread(target=_other_tenant_worst_ms, args=(svc, stop0, lat0))
                    idle.start()
                    time.sleep(1.0)
                    stop0.set()
                    idle.join()
                    rows.append(
                        ["idle", "-", "-", "-", "-", "-", "-", "-", "-", f"{max(lat0):.0f}"]
                    )
                for names in args.names:
                    for transport, fn in (("http", _http_stat), ("grpc", _grpc_stat)):
                        lat: list[float] = []
                        stop = threading.Event()
                        other = threading.Thread(
                            target=_other_tenant_worst_ms, args=(svc, stop, lat)
                        )
                        with _peak_growth(svc.proc.pid) as grown:
                            other.start()
                            time.sleep(0.1)
                            t0 = time.perf_counter()
                            req, reply, answered = fn(svc, [r] * names)
                            wall = time.perf_counter() - t0
                            stop.set()
                            other.join()
                        rows.append(
                            [
                                label,
                                f"x{names}",
                                transport,
                                f"{req:,}",
                                f"{reply / (1 << 20):.2f}",
                                f"{reply / req:,.0f}",
                                f"{answered}/{names}",
                                f"{wall:.2f}",
                                f"{grown[0]:+.0f}",
                                f"{max(lat, default=0):.0f}",
                            ]
                        )
                        time.sleep(0.5)
    return rows


# ---- read-ahead -------------------------------------------------------------------------------
BLOCK = 2048  # rows per block of a frame: the unit a range is cut to


def _big_rollout(svc: Service, blocks: int) -> tuple[str, int, int]:
    """One rollout stored as one segment of ``blocks`` 2048-row blocks (raw ids, 64 layers
    x top-8 of 256: ~2 MiB a block); its id, rows and stored bytes."""
    layers = tuple(range(64))
    rows = blocks * BLOCK
    idx = synthetic_routing(rows, len(layers), 256, 8, seed=5)
    frame = encode_frame(idx, num_experts=256, layer_ids=layers, codec="raw")
    r = "big-rollout"
    svc.stub().PutSegment(pb.PutSegmentRequest(rollout_id=r, frame=frame), metadata=grpc_md())
    return r, rows, len(frame)


def _request(r: str, n: int, rows: int, mode: str) -> dict[str, object]:
    """``n`` items over rollout ``r``, each leaving out one block (so each is a fresh
    slice, not the stored bytes): per-item ``ranges`` or the batch's ``start``/``end``."""
    if mode == "ranges":
        ranges = [[0, rows - BLOCK] if i % 2 else [BLOCK, rows] for i in range(n)]
        return {"rollout_ids": [r] * n, "ranges": ranges}
    return {"rollout_ids": [r] * n, "start": BLOCK, "end": rows}


def _bench_read_ahead(args: argparse.Namespace) -> list[list[str]]:
    out: list[list[str]] = []
    env = {
        "R3_CACHE_MAX_BODY_BYTES": str((args.blocks * 3) << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    with _redis() as redis_proc:
        for transport, fn in STALL.items():
            for mode in ("ranges", "start/end"):
                with _service(redis_proc.url, env) as svc:  # a fresh one: its RSS is its own
                    r, rows, stored = _big_rollout(svc, args.blocks)
                    with svc.http() as c:  # warm up with one item, which says its size
                        one = c.post("/v1/batch/get", json=_request(r, 1, rows, mode))
                        one.raise_for_status()
                    item = len(one.content)
                    fn(svc, _request(r, 1, rows, mode), item, 0.0)
                    time.sleep(0.5)
                    with _peak_growth(svc.proc.pid) as grown:
                        fn(svc, _request(r, args.items, rows, mode), item, args.hold)
                    # What tests/adversarial/test_batch_bounds.py asserts: BATCH_CONCURRENCY
                    # items, each its answer and the stored bytes it is read from
                    # (docs/service.md), the item being written out with its encoded
                    # copies (4 items), and 48 MiB of heap slack
                    bound = (CONCURRENCY * (stored + item) + 4 * item) / (1 << 20) + 48
                    out.append(
                        [transport, mode, f"{stored / (1 << 20):.1f}",
                         f"{item / (1 << 20):.1f}", f"{args.items}", f"{grown[0]:+.0f}",
                         f"{bound:.0f}"]
                    )  # fmt: skip
    return out


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=1024)
    ap.add_argument("--wv-chars", type=int, default=256, help="weight version length (0: 'v1')")
    ap.add_argument("--names", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    ap.add_argument(
        "--budget", type=int, default=None, help="MAX_BATCH_STAT_BYTES (default: the service's)"
    )
    ap.add_argument("--blocks", type=int, default=4, help="2048-row blocks of the big rollout")
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--hold", type=float, default=3.0)
    ap.add_argument("--only", choices=["stat", "read-ahead"], default=None)
    args = ap.parse_args()
    if args.only != "read-ahead":
        print(f"batch stat: one rollout of {args.segments} one-row segments "
              f"(weight version {args.wv_chars or 2} chars) named N times")  # fmt: skip
        head = ["service", "N", "transport", "request B", "reply MiB", "ratio", "answered",
                "wall s", "RSS MiB", "other ms"]  # fmt: skip
        print(_table(head, _bench_stat(args)), flush=True)
    if args.only != "stat":
        print(f"\nread-ahead: {args.items} items over one rollout, the reader stalled "
              f"{args.hold:g} s after the first item")  # fmt: skip
        head = ["transport", "items by", "stored MiB", "item MiB", "items", "RSS MiB",
                "bound MiB"]  # fmt: skip
        print(_table(head, _bench_read_ahead(args)), flush=True)


if __name__ == "__main__":
    main()
