"""Running the real cache service in a subprocess, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np

from cache_service.redis_proc import free_port
from cache_service.service_process import ServiceProcess, start_service_process
from r3_client._proto import r3_cache_pb2_grpc as pb_grpc
from tests.support.frames import frame_for

KEY_A = "key-tenant-a-0123456789abcdef"
KEY_B = "key-tenant-b-0123456789abcdef"
METRICS_KEY = "key-metrics-0123456789abcdef"
LIMITS = {
    "R3_CACHE_METRICS_API_KEY": METRICS_KEY,
    "R3_CACHE_MAX_BODY_BYTES": str(4 << 20),
    "R3_CACHE_MAX_TOKENS_PER_SEGMENT": "20000",
    "R3_CACHE_MAX_BATCH": "64",
}
#: Direct reads on, as the session's services run them; only over a Redis that asks
#: for a password (the service refuses any other), such as ``redis_single``'s.
DIRECT_READS = {
    "R3_CACHE_DIRECT_READS": "true",
    "R3_CACHE_DIRECT_READ_SECRET": secrets.token_urlsafe(32),
}


@dataclass
class Service(ServiceProcess):
    """A running ``r3 serve`` process and how to reach it."""

    redis_url: str = "embedded"
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        """The HTTP base URL."""
        return self.url

    def http(self, key: str | None = KEY_A, **kw: object) -> httpx.Client:
        """An httpx client with the tenant's key (None: no key)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Loopback http: no TLS.  httpx would load the CA bundle for each client (62 ms),
        # most of a fuzz case's time.
        kw.setdefault("verify", False)
        return httpx.Client(base_url=self.http_url, headers=headers, timeout=30, **kw)  # type: ignore[arg-type]

    def stub(self) -> pb_grpc.RoutingCacheStub:
        """A gRPC stub on a fresh channel."""
        channel = grpc.insecure_channel(
            self.grpc_target, options=[("grpc.max_receive_message_length", -1)]
        )
        return pb_grpc.RoutingCacheStub(channel)


def url_of(svc: Service, transport: str) -> str:
    """The client URL of ``svc`` over ``transport`` (``"http"`` or ``"grpc"``)."""
    return svc.http_url if transport == "http" else svc.grpc_url


def grpc_md(key: str | None = KEY_A) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the tenant's key."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def start_service(
    tmp: Path,
    redis_url: str | None,
    *,
    cluster: bool = False,
    env: dict[str, str] | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
) -> Service:
    """Start ``python -m cache_service serve`` and wait for /readyz."""
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: "tenant-a", KEY_B: "tenant-b"}))
    http_port = http_port or free_port()
    args = [
        "--auth", "on", "--api-keys-file", str(keys),
        "--data-dir", str(tmp / "data"), "--log-level", "WARNING",
    ]  # fmt: skip
    if redis_url:
        args += ["--redis-url", redis_url]
    if cluster:
        args.append("--redis-cluster")
    proc = start_service_process(
        args,
        log=tmp / f"service-{http_port}.log",
        http_port=http_port,
        grpc_port=grpc_port,
        env={**os.environ, **LIMITS, **(env or {})},
    )
    return Service(proc.http_port, proc.grpc_port, proc.proc, proc.log, redis_url or "embedded")


@dataclass
class WriteLoad:
    """Writers PUTting fresh rollouts over HTTP until ``stop`` is set, for fault tests.

    ``acked`` holds every frame the service answered 201 for; ``statuses`` every
    answer (-1: a connection-level failure, not acknowledged).
    """

    routing: np.ndarray
    prefix: str
    acked: dict[str, bytes] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def writer(self, client: httpx.AsyncClient, n: int) -> None:
        """Put ``<prefix>-<n>-<i>`` for i = 0, 1, … until stopped."""
        i = 0
        while not self.stop.is_set():
            r = f"{self.prefix}-{n}-{i}"
            frame = frame_for(np.roll(self.routing, i, axis=0), 0, digest=False)
            try:
                resp = await client.put(f"/v1/rollouts/{r}/segments", content=frame)
                self.statuses.append(resp.status_code)
                if resp.status_code == 201:
                    self.acked[r] = frame
            except httpx.HTTPError:
                self.statuses.append(-1)
            i += 1
