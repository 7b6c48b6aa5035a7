"""Cache-service benchmark: batch-get throughput against raw Redis, and a mixed load run.

Starts its own ``redis-server`` (loopback, free port, AOF *off*: this measures the
service path, not the disk) and its own service (``python -m cache_service serve``
with auth on, as ``tests/support/service_process.py`` starts it), and stops both by PID at
the end, also on Ctrl-C / SIGTERM.

1. **Batch get.**  Stores ``--rollouts`` rollouts of ``--tokens`` tokens, 48 MoE
   layers x 128 experts x top-8 (skewed synthetic routing, one segment starting at
   row 0 each, so the service returns the stored bytes untouched), PUT over HTTP.
   Only ``--distinct`` arrays are generated and reused under different rollout ids
   (same bytes, different keys: generating 256 is slow and changes nothing here).
   Then, best of ``--repeat`` runs, interleaved, the same bytes are fetched:

   * raw: redis-py asyncio ``HGET r3:tenant-a:{id} s:0:<tokens>`` for every key,
     (a) all in one non-transactional pipeline, (b) as concurrent single HGETs on a
     pool; the faster is the baseline;
   * the service's own read path (``SegmentStore.get_frame``) called in this
     process: information only, to split the service's overhead into store and
     transport;
   * HTTP ``POST /v1/batch/get`` streamed with httpx and decoded with StreamDecoder;
   * gRPC ``BatchGet`` server stream, grpc.aio and sync stubs.

   Every variant checks that each frame equals the bytes stored.  Target: each
   transport <= 1.3x the raw time.  For the fastest repetition the table also
   gives the CPU seconds this process, the service and redis-server used
   (/proc; Linux), which says who the time went to.

2. **Load run.**  ``--load-clients`` concurrent clients for ``--load-seconds``: each
   loops PUT a fresh segment (``--load-tokens`` tokens, pre-encoded, new rollout
   id) then GET the rollout back and compare bytes.  Requests, errors (non-2xx,
   exception or wrong bytes), req/s, MB/s, p50/p99 latency per operation, next
   to the service's own view (its ``r3_request_seconds`` histogram, scraped from
   /metrics before and after: handler time, without queueing in its event loop)
   and each process's CPU share.  Any error makes the script exit 1.
   ``--load-transports`` picks HTTP and/or gRPC.  httpx's idle keep-alive expiry
   (``--keepalive-expiry``) stays below the service's 75 s keep-alive timeout, so
   a request never races the server's close of an idle connection.

    python bench/service_bench.py [--rollouts 256] [--tokens 4096] [--repeat 5]
        [--load-seconds 60] [--load-clients 64] [--load-transports http,grpc]
        [--keepalive-expiry 2] [--json PATH]

MB are 10^6 bytes.  Client, service and Redis share the machine's cores, so the
ratios, not the absolute numbers, are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import httpx
import numpy as np
import redis.asyncio as aioredis

from cache_service.redis_proc import RedisProcess, free_port, redis_server_binary
from cache_service.store import SegmentStore, StoreSettings
from r3_client import Segment, encode_frame, stored
from r3_client.synthetic import synthetic_routing
from r3_client.wire import StreamDecoder
from r3_client.wire import r3_cache_pb2 as pb
from r3_client.wire import r3_cache_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)
from tests.support.service_process import KEY_A, METRICS_KEY, Service, grpc_md, start_service  # noqa: E402

L, E, K = 48, 128, 8
NAMESPACE = "tenant-a"  # KEY_A's namespace in tests/support/service_process.py
FRAME_TYPE = "application/x-r3-frame"
TARGET_RATIO = 1.3
GRPC_OPTS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


class BenchError(Exception):
    """A wrong answer (status, id or bytes) during the batch-get part."""


# ---- data -----------------------------------------------------------------------------------
def make_frames(n: int, tokens: int, seed0: int) -> list[bytes]:
    """``n`` distinct frames of ``tokens`` skewed rows, each one segment starting at row 0."""
    return [
        encode_frame(
            synthetic_routing(tokens, L, E, K, skew=1.0, rho=0.9, seed=seed0 + i),
            num_experts=E,
            layer_ids=range(L),
            segment=Segment(0, tokens, "bench", "v1"),
        )
        for i in range(n)
    ]


async def put_all(
    client: httpx.AsyncClient, frames: dict[str, bytes], concurrency: int = 8
) -> float:
    """PUT every ``rollout id -> frame`` over HTTP; seconds taken."""
    sem = asyncio.Semaphore(concurrency)

    async def one(rid: str, frame: bytes) -> None:
        async with sem:
            r = await client.put(
                f"/v1/rollouts/{rid}/segments",
                content=frame,
                headers={"content-type": FRAME_TYPE},
            )
            if r.status_code != 201:
                raise BenchError(f"PUT {rid}: {r.status_code} {r.text[:300]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(rid, f) for rid, f in frames.items()))
    return time.perf_counter() - t0


# ---- part 1: batch get ----------------------------------------------------------------------
def _check(rid: str, want_rid: str, got: bytes | None, want: bytes) -> int:
    if rid != want_rid:
        raise BenchError(f"item for {rid!r} where {want_rid!r} was expected (order)")
    if got is None or got != want:
        raise BenchError(f"{rid}: frame differs from the stored bytes")
    return len(got)


def _key(rid: str) -> str:
    return stored.rollout_key(f"r3:{NAMESPACE}:", rid)


async def raw_pipeline(
    r: aioredis.Redis, ids: Sequence[str], want: dict[str, bytes], field_: str
) -> int:
    """All HGETs in one non-transactional pipeline (one connection, one round trip)."""
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(_key(rid), field_)
    res = await pipe.execute()
    return sum(_check(rid, rid, got, want[rid]) for rid, got in zip(ids, res, strict=True))


async def raw_concurrent(
    r: aioredis.Redis, ids: Sequence[str], want: dict[str, bytes], field_: str, concurrency: int
) -> int:
    """Single HGETs, ``concurrency`` in flight over a pool, results in request order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(rid: str) -> bytes | None:
        async with sem:
            got = await r.hget(_key(rid), field_)
            return got if isinstance(got, bytes) else None

    res = await asyncio.gather(*(one(rid) for rid in ids))
    return sum(_check(rid, rid, got, want[rid]) for rid, got in zip(ids, res, strict=True))


async def store_path(
    store: SegmentStore, ids: Sequence[str], want: dict[str, bytes], concurrency: int
) -> int:
    """The service's own read path, in this process: ``SegmentStore.get_frame`` per rollout.

    Splits the service's overhead into "store + redis-py" and "transport".
    """
    sem = asyncio.Semaphore(concurrency)

    async def one(rid: str) -> bytes | None:
        async with sem:
            return await store.get_frame(rid)

    res = await asyncio.gather(*(one(rid) for rid in ids))
    return sum(_check(rid, rid, got, want[rid]) for rid, got in zip(ids, res, strict=True))


async def http_batch(client: httpx.AsyncClient, ids: Sequence[str], want: dict[str, bytes]) -> int:
    """``POST /v1/batch/get``, streamed and decoded incrementally."""
    dec = StreamDecoder()
    n = total = 0
    async with client.stream("POST", "/v1/batch/get", json={"rollout_ids": list(ids)}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise BenchError(f"batch get: {resp.status_code} {resp.text[:300]}")
        async for chunk in resp.aiter_raw():
            for item in dec.feed(chunk):
                if not item.ok:
                    raise BenchError(f"{item.rollout_id}: {item.error_code} {item.error_message}")
                total += _check(item.rollout_id, ids[n], item.frame, want[ids[n]])
                n += 1
    dec.close()
    if n != len(ids):
        raise BenchError(f"batch get returned {n} items for {len(ids)} ids")
    return total


async def grpc_aio_batch(
    stub: pb_grpc.RoutingCacheStub, ids: Sequence[str], want: dict[str, bytes]
) -> int:
    """``BatchGet`` on a grpc.aio channel."""
    n = total = 0
    call = stub.BatchGet(pb.BatchGetRequest(rollout_ids=list(ids)), metadata=grpc_md(KEY_A))
    async for item in call:
        if item.WhichOneof("result") != "frame":
            raise BenchError(f"{item.rollout_id}: {item.error.code} {item.error.message}")
        total += _check(item.rollout_id, ids[n], item.frame, want[ids[n]])
        n += 1
    if n != len(ids):
        raise BenchError(f"BatchGet returned {n} items for {len(ids)} ids")
    return total


def grpc_sync_batch(
    stub: pb_grpc.RoutingCacheStub, ids: Sequence[str], want: dict[str, bytes]
) -> int:
    """``BatchGet`` on a blocking channel (the C core reads on its own thread)."""
    n = total = 0
    for item in stub.BatchGet(pb.BatchGetRequest(rollout_ids=list(ids)), metadata=grpc_md(KEY_A)):
        if item.WhichOneof("result") != "frame":
            raise BenchError(f"{item.rollout_id}: {item.error.code} {item.error.message}")
        total += _check(item.rollout_id, ids[n], item.frame, want[ids[n]])
        n += 1
    if n != len(ids):
        raise BenchError(f"BatchGet returned {n} items for {len(ids)} ids")
    return total


@dataclass
class Variant:
    """One way of fetching the batch, and its timings."""

    name: str
    kind: str  # "raw", "info" or "service"
    run: Callable[[], Awaitable[int]]
    times: list[float] = field(default_factory=list)
    cpu: list[tuple[float, float, float]] = field(default_factory=list)  # client, service, redis
    nbytes: int = 0

    @property
    def best(self) -> float:
        return min(self.times) if self.times else math.nan

    @property
    def best_cpu(self) -> tuple[float, float, float]:
        """CPU seconds (client, service, redis) of the fastest repetition."""
        return self.cpu[self.times.index(self.best)] if self.cpu else (math.nan,) * 3


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc; NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: Sequence[int]) -> tuple[float, float, float]:
    """CPU seconds so far of this process and of ``pids`` (service, redis)."""
    return (time.process_time(), proc_cpu_s(pids[0]), proc_cpu_s(pids[1]))


async def batch_part(svc: Service, redis: RedisProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Store the rollouts, then time every variant, interleaved, best of ``--repeat``."""
    t0 = time.perf_counter()
    distinct = make_frames(args.distinct, args.tokens, seed0=0)
    gen_s = time.perf_counter() - t0
    ids = [f"bench-{i:04d}" for i in range(args.rollouts)]
    want = {rid: distinct[i % len(distinct)] for i, rid in enumerate(ids)}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    limits = httpx.Limits(
        max_connections=16, max_keepalive_connections=16, keepalive_expiry=args.keepalive_expiry
    )
    async with (
        httpx.AsyncClient(
            base_url=svc.http_url, headers=headers, timeout=120, limits=limits
        ) as client,
        aioredis.Redis.from_url(redis.url, max_connections=64) as r,
    ):
        put_s = await put_all(client, want)
        store = (await SegmentStore.connect(StoreSettings(redis_url=redis.url))).for_namespace(
            "tenant-a"
        )
        channel = grpc.aio.insecure_channel(svc.grpc_target, options=GRPC_OPTS)
        aio_stub = pb_grpc.RoutingCacheStub(channel)  # type: ignore[no-untyped-call]
        sync_channel = grpc.insecure_channel(svc.grpc_target, options=GRPC_OPTS)
        sync_stub = pb_grpc.RoutingCacheStub(sync_channel)  # type: ignore[no-untyped-call]
        c = args.raw_concurrency
        fld = stored.segment_field(0, args.tokens)
        bc = args.batch_concurrency or 8  # the service default
        variants = [
            Variant(
                "raw redis-py: pipeline of HGETs", "raw", lambda: raw_pipeline(r, ids, want, fld)
            ),
            Variant(
                f"raw redis-py: HGET x{c} concurrent",
                "raw",
                lambda: raw_concurrent(r, ids, want, fld, c),
            ),
            Variant(
                f"service read path in-process (SegmentStore.get_frame) x{bc}",
                "info",
                lambda: store_path(store, ids, want, bc),
            ),
            Variant(
                "HTTP POST /v1/batch/get (httpx)", "service", lambda: http_batch(client, ids, want)
            ),
            Variant(
                "gRPC BatchGet (grpc.aio)", "service", lambda: grpc_aio_batch(aio_stub, ids, want)
            ),
            Variant(
                "gRPC BatchGet (sync stub)",
                "service",
                lambda: asyncio.to_thread(grpc_sync_batch, sync_stub, ids, want),
            ),
        ]
        try:
            for v in variants:  # warm-up: connections, script cache, first-touch allocations
                v.nbytes = await v.run()
            pids = (svc.proc.pid, redis.pid)
            for _ in range(args.repeat):
                for v in variants:
                    c0 = cpu_snapshot(pids)
                    t = time.perf_counter()
                    nbytes = await v.run()
                    v.times.append(time.perf_counter() - t)
                    c1 = cpu_snapshot(pids)
                    v.cpu.append((c1[0] - c0[0], c1[1] - c0[1], c1[2] - c0[2]))
                    if nbytes != v.nbytes:
                        raise BenchError(f"{v.name}: {nbytes} bytes, first run {v.nbytes}")
        finally:
            await channel.close()
            await store.close()
            sync_channel.close()
    raw = min((v for v in variants if v.kind == "raw"), key=lambda v: v.best)
    rows = []
    for v in variants:
        ratio = v.best / raw.best
        rows.append(
            {
                "method": v.name,
                "kind": v.kind,
                "bytes": v.nbytes,
                "best_s": v.best,
                "times_s": v.times,
                "cpu_s_client_service_redis": v.best_cpu,
                "mb_per_s": v.nbytes / v.best / 1e6,
                "x_raw": ratio,
                "target_met": None if v.kind != "service" else ratio <= TARGET_RATIO,
            }
        )
    return {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "distinct_arrays": args.distinct,
        "frame_bytes": [len(f) for f in distinct],
        "generate_s": gen_s,
        "put_s": put_s,
        "baseline": raw.name,
        "rows": rows,
    }


# ---- part 2: load ---------------------------------------------------------------------------
@dataclass
class OpStats:
    """Latencies and counts of one operation in the load run."""

    lat: list[float] = field(default_factory=list)
    errors: int = 0
    nbytes: int = 0


@dataclass
class LoadResult:
    """What a load run measured."""

    transport: str
    seconds: float
    ops: dict[str, OpStats]
    first_errors: list[str]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transport": self.transport, "seconds": self.seconds}
        total_req = total_err = total_bytes = 0
        per_op: dict[str, Any] = {}
        for name, st in self.ops.items():
            n = len(st.lat) + st.errors
            total_req += n
            total_err += st.errors
            total_bytes += st.nbytes
            lat = np.array(st.lat) if st.lat else np.array([math.nan])
            per_op[name] = {
                "requests": n,
                "errors": st.errors,
                "req_per_s": n / self.seconds,
                "mb_per_s": st.nbytes / self.seconds / 1e6,
                "p50_ms": float(np.percentile(lat, 50) * 1e3),
                "p99_ms": float(np.percentile(lat, 99) * 1e3),
            }
        out.update(
            requests=total_req,
            errors=total_err,
            req_per_s=total_req / self.seconds,
            mb_per_s=total_bytes / self.seconds / 1e6,
            ops=per_op,
            first_errors=self.first_errors,
        )
        return out


Hist = dict[tuple[str, str], dict[str, Any]]
SERVER_OP = {"put": "put_segment", "get": "get_rollout"}


def scrape_latency(http_url: str) -> Hist:
    """The service's ``r3_request_seconds`` histogram: (transport, op) -> count, sum, buckets."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {METRICS_KEY}"}
    text = httpx.get(f"{http_url}/metrics", headers=headers, timeout=30).text
    out: Hist = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "r3_request_seconds":
            continue
        for smp in fam.samples:
            key = (smp.labels["transport"], smp.labels["op"])
            h = out.setdefault(key, {"count": 0.0, "sum": 0.0, "buckets": {}})
            if smp.name.endswith("_bucket"):
                h["buckets"][float(smp.labels["le"])] = smp.value
            elif smp.name.endswith("_count"):
                h["count"] = smp.value
            elif smp.name.endswith("_sum"):
                h["sum"] = smp.value
    return out


def server_latency(before: Hist, after: Hist, transport: str, op: str) -> dict[str, float]:
    """Server-side mean and histogram-bucket p50/p99 (upper bucket bounds) between scrapes."""
    key = (transport, SERVER_OP[op])
    a = after.get(key)
    if a is None:
        return {"mean_ms": math.nan, "p50_le_ms": math.nan, "p99_le_ms": math.nan}
    b = before.get(key, {"count": 0.0, "sum": 0.0, "buckets": {}})
    n = a["count"] - b["count"]
    out = {"mean_ms": (a["sum"] - b["sum"]) / n * 1e3 if n else math.nan}
    for q, name in ((0.5, "p50_le_ms"), (0.99, "p99_le_ms")):
        out[name] = math.nan
        for le in sorted(a["buckets"]):
            if a["buckets"][le] - b["buckets"].get(le, 0.0) >= q * n:
                out[name] = le * 1e3
                break
    return out


async def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception and of its causes (httpx hides ECONNRESET there)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {str(seen)[:150]}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)


async def _load_loop(
    seconds: float,
    clients: int,
    frames: Sequence[bytes],
    transport: str,
    put: Callable[[str, bytes], Awaitable[None]],
    get: Callable[[str], Awaitable[bytes]],
) -> LoadResult:
    ops = {"put": OpStats(), "get": OpStats()}
    first_errors: list[str] = []

    def fail(op: str, msg: str) -> None:
        ops[op].errors += 1
        if len(first_errors) < 10:
            first_errors.append(f"{op}: {msg}")

    async def worker(c: int, stop: float) -> None:
        i = 0
        while time.perf_counter() < stop:
            rid = f"load-{transport}-{c}-{i}"
            frame = frames[(c + i) % len(frames)]
            i += 1
            t = time.perf_counter()
            try:
                await put(rid, frame)
            except Exception as exc:
                fail("put", f"{rid} after {time.perf_counter() - t:.2f} s: {_describe(exc)}")
                continue
            ops["put"].lat.append(time.perf_counter() - t)
            ops["put"].nbytes += len(frame)
            t = time.perf_counter()
            try:
                got = await get(rid)
                if got != frame:
                    raise BenchError("GET returned different bytes")
            except Exception as exc:
                fail("get", f"{rid} after {time.perf_counter() - t:.2f} s: {_describe(exc)}")
                continue
            ops["get"].lat.append(time.perf_counter() - t)
            ops["get"].nbytes += len(got)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c, t0 + seconds) for c in range(clients)))
    return LoadResult(transport, time.perf_counter() - t0, ops, first_errors)


async def http_load(
    svc: Service, seconds: float, clients: int, frames: Sequence[bytes], keepalive: float
) -> LoadResult:
    """Mixed PUT/GET over HTTP, one httpx.AsyncClient with a connection per client."""
    limits = httpx.Limits(
        max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=keepalive
    )
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx.AsyncClient(
        base_url=svc.http_url, headers=headers, timeout=60, limits=limits
    ) as client:

        async def put(rid: str, frame: bytes) -> None:
            r = await client.put(
                f"/v1/rollouts/{rid}/segments", content=frame, headers={"content-type": FRAME_TYPE}
            )
            if r.status_code != 201:
                raise BenchError(f"PUT {r.status_code} {r.text[:200]}")

        async def get(rid: str) -> bytes:
            r = await client.get(f"/v1/rollouts/{rid}")
            if r.status_code != 200:
                raise BenchError(f"GET {r.status_code} {r.text[:200]}")
            return r.content

        return await _load_loop(seconds, clients, frames, "http", put, get)


async def grpc_load(
    svc: Service, seconds: float, clients: int, frames: Sequence[bytes], keepalive: float
) -> LoadResult:
    """Mixed PutSegment/GetRollout over one grpc.aio channel (HTTP/2 multiplexed)."""
    channel = grpc.aio.insecure_channel(svc.grpc_target, options=GRPC_OPTS)
    stub = pb_grpc.RoutingCacheStub(channel)  # type: ignore[no-untyped-call]
    md = grpc_md(KEY_A)

    async def put(rid: str, frame: bytes) -> None:
        res = await stub.PutSegment(pb.PutSegmentRequest(rollout_id=rid, frame=frame), metadata=md)
        if res.status != "stored":
            raise BenchError(f"PutSegment status {res.status!r}")

    async def get(rid: str) -> bytes:
        res = await stub.GetRollout(pb.GetRolloutRequest(rollout_id=rid), metadata=md)
        frame: bytes = res.frame
        return frame

    try:
        return await _load_loop(seconds, clients, frames, "grpc", put, get)
    finally:
        await channel.close()


# ---- output ---------------------------------------------------------------------------------
def batch_table(res: dict[str, Any]) -> str:
    """Markdown table of the batch-get part."""
    lines = [
        f"Batch get of {res['rollouts']} rollouts x {res['tokens']} tokens ({L}x{E}x{K}, "
        f"skewed; {res['distinct_arrays']} distinct arrays reused under different ids; "
        f"frames {min(res['frame_bytes']):,}-{max(res['frame_bytes']):,} B). "
        f"Baseline = {res['baseline']}.",
        "",
        "| method | bytes | best s | MB/s | x raw | target <= 1.3x "
        "| CPU s client / service / redis |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in res["rows"]:
        met = {None: "", True: "yes", False: "**no**"}[row["target_met"]]
        lines.append(
            f"| {row['method']} | {row['bytes']:,} | {row['best_s']:.4f} | "
            f"{row['mb_per_s']:.0f} | {row['x_raw']:.2f} | {met} | "
            + " / ".join(f"{x:.2f}" for x in row["cpu_s_client_service_redis"])
            + " |"
        )
    return "\n".join(lines)


def load_table(results: Sequence[dict[str, Any]], clients: int, frame_bytes: str) -> str:
    """Markdown table of the load runs."""
    lines = [
        f"Load: {clients} concurrent clients, each looping PUT a fresh segment "
        f"({frame_bytes} B frame, new rollout id), then GET it back (bytes compared). "
        "Latency is client-observed; server columns come from the service's "
        "r3_request_seconds histogram.",
        "",
        "| transport | op | requests | errors | req/s | MB/s | p50 ms | p99 ms "
        "| server mean ms | server p50 / p99 ms (bucket) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    cpu_notes = []
    for res in results:
        for op, st in res["ops"].items():
            srv = st["server"]
            lines.append(
                f"| {res['transport']} | {op} | {st['requests']:,} | {st['errors']} | "
                f"{st['req_per_s']:.1f} | {st['mb_per_s']:.1f} | {st['p50_ms']:.1f} | "
                f"{st['p99_ms']:.1f} | {srv['mean_ms']:.1f} | "
                f"<= {srv['p50_le_ms']:g} / <= {srv['p99_le_ms']:g} |"
            )
        lines.append(
            f"| {res['transport']} | **all** ({res['seconds']:.1f} s) | {res['requests']:,} | "
            f"{res['errors']} | {res['req_per_s']:.1f} | {res['mb_per_s']:.1f} |  |  |  |  |"
        )
        cpu = res["cpu_s_client_service_redis"]
        cpu_notes.append(
            f"{res['transport']}: "
            + " / ".join(f"{c / res['seconds']:.0%}" for c in cpu)
            + " of one core (client / service / redis)"
        )
    lines += ["", "CPU during the run: " + "; ".join(cpu_notes) + "."]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """Python, OS, cores, load and redis-server version."""
    ver = subprocess.run(
        [redis_server_binary(), "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "git": git or "?",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "redis_server": next((w[2:] for w in ver if w.startswith("v=")), "?"),
    }


# ---- main -----------------------------------------------------------------------------------
def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


async def run(svc: Service, redis: RedisProcess, args: argparse.Namespace) -> dict[str, Any]:
    """Both parts; returns the JSON report."""
    report: dict[str, Any] = {}
    if args.rollouts > 0:
        print(f"[1/2] batch get: {args.rollouts} rollouts x {args.tokens} tokens", flush=True)
        report["batch_get"] = batch = await batch_part(svc, redis, args)
        print(
            f"      generated {args.distinct} arrays in {batch['generate_s']:.1f} s, "
            f"PUT {args.rollouts} over HTTP in {batch['put_s']:.1f} s\n",
            flush=True,
        )
        print(batch_table(batch) + "\n", flush=True)
    transports = [t for t in args.load_transports.split(",") if t]
    if args.load_seconds > 0 and transports:
        frames = make_frames(args.load_distinct, args.load_tokens, seed0=1000)
        pids = (svc.proc.pid, redis.pid)
        loads = []
        for tr in transports:
            print(
                f"[2/2] load: {args.load_clients} {tr} clients for {args.load_seconds:g} s",
                flush=True,
            )
            fn = {"http": http_load, "grpc": grpc_load}[tr]
            hist0 = await asyncio.to_thread(scrape_latency, svc.http_url)
            cpu0 = cpu_snapshot(pids)
            res = await fn(svc, args.load_seconds, args.load_clients, frames, args.keepalive_expiry)
            cpu1 = cpu_snapshot(pids)
            hist1 = await asyncio.to_thread(scrape_latency, svc.http_url)
            summary = res.summary()
            summary["cpu_s_client_service_redis"] = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
            for op, st in summary["ops"].items():
                st["server"] = server_latency(hist0, hist1, tr, op)
            loads.append(summary)
            for msg in res.first_errors:
                print(f"      error: {msg}", flush=True)
        report["load"] = {
            "clients": args.load_clients,
            "tokens": args.load_tokens,
            "frame_bytes": [len(f) for f in frames],
            "runs": loads,
        }
        sizes = f"{min(map(len, frames)):,}-{max(map(len, frames)):,}"
        print("\n" + load_table(loads, args.load_clients, sizes) + "\n", flush=True)
    return report


def machine_line(info: dict[str, Any]) -> str:
    """The one-line summary of :func:`machine_info` every service benchmark prints first."""
    return (
        f"machine: Python {info['python']}, {info['cpu_count']} cores (os.cpu_count), "
        f"{info['platform']}, load avg {info['loadavg_at_start'][0]:.2f}, "
        f"redis-server {info['redis_server']} (AOF off), commit {info['git']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, start Redis and the service, run, stop both."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rollouts", type=int, default=256, help="batch size (0: skip part 1)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rollout in part 1")
    p.add_argument("--distinct", type=int, default=8, help="distinct arrays generated, reused")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (best is reported)")
    p.add_argument("--raw-concurrency", type=int, default=8, help="in-flight raw HGETs")
    p.add_argument("--batch-concurrency", type=int, help="service R3_CACHE_BATCH_CONCURRENCY")
    p.add_argument("--load-seconds", type=float, default=60.0, help="load run length (0: skip)")
    p.add_argument("--load-clients", type=int, default=64)
    p.add_argument("--load-tokens", type=int, default=512, help="tokens per PUT in the load run")
    p.add_argument("--load-distinct", type=int, default=8, help="distinct pre-encoded frames")
    p.add_argument("--load-transports", default="http,grpc", help="comma list of http, grpc")
    p.add_argument(
        "--keepalive-expiry",
        type=float,
        default=2.0,
        help="httpx idle keep-alive expiry, s; must stay below the service's 75 s keep-alive",
    )
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)

    signal.signal(signal.SIGTERM, _raise_interrupt)
    info = machine_info()
    print(machine_line(info), flush=True)
    env = {
        "R3_CACHE_MAX_BATCH": str(max(1024, args.rollouts)),
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
        # The whole layout (one field per segment): the raw-HGET baselines read exactly the
        # bytes the service answers from one field.  The chunked layout (issue 44, the
        # default) serves whole-rollout reads by joining head and chunks: measured by
        # bench/chunked_reads_bench.py, not here.
        "R3_CACHE_STORE_LAYOUT": "whole",
    }
    if args.batch_concurrency:
        env["R3_CACHE_BATCH_CONCURRENCY"] = str(args.batch_concurrency)
    report: dict[str, Any] = {"machine": info, "args": vars(args) | {"json": str(args.json)}}
    ok = True
    with tempfile.TemporaryDirectory(prefix="r3-service-bench-") as tmp_s:
        tmp = Path(tmp_s)
        redis = RedisProcess(free_port(), tmp / "redis", appendonly=False)
        svc: Service | None = None
        log_tail = ""
        try:
            redis.start()
            svc = start_service(tmp, redis.url, env=env)
            report.update(asyncio.run(run(svc, redis, args)))
        except KeyboardInterrupt:
            print("interrupted: stopping the service and redis-server", file=sys.stderr)
            return 130
        finally:
            if svc is not None:
                svc.stop()
                log_tail = svc.log.read_text(errors="replace")[-3000:]
            redis.stop()
    rows = report.get("batch_get", {}).get("rows", [])
    missed = [r["method"] for r in rows if r["target_met"] is False]
    errors = sum(r["errors"] for r in report.get("load", {}).get("runs", []))
    if missed:
        print(f"target missed (> {TARGET_RATIO}x raw): {', '.join(missed)}")
    if errors:
        print(f"load run had {errors} errors: FAIL\nservice log (tail):\n{log_tail}")
        ok = False
    elif "load" in report:
        print("load run: 0 errors")
    report["targets"] = {"batch_get_missed": missed, "load_errors": errors}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
