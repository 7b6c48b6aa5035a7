"""The cache service as a child process: started, waited for, stopped.

For whoever runs the service beside something else on one machine (the local stack of
``r3 demo``, the tests, the benchmarks): ``python -m cache_service serve`` on loopback
ports, its output in a log file, ready once ``/readyz`` answers 200.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from cache_service.redis_proc import free_port


@dataclass
class ServiceProcess:
    """A running ``python -m cache_service serve`` on 127.0.0.1."""

    http_port: int
    grpc_port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        """The HTTP base URL."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        """``host:port`` of the gRPC server (a channel's target)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def grpc_url(self) -> str:
        """The gRPC URL a :class:`r3_client.RoutingClient` takes."""
        return f"grpc://{self.grpc_target}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """Send ``sig`` (on SIGTERM it stops its embedded redis-server too), SIGKILL after
        ``timeout_s``; return once it has exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_service_process(
    serve_args: Sequence[str],
    *,
    log: Path,
    http_port: int | None = None,
    grpc_port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> ServiceProcess:
    """Start ``python -m cache_service serve --http-port P --grpc-port Q *serve_args``
    (free ports unless given; output to ``log``; ``env`` replaces the environment) and
    wait until it is ready.

    Raises ``RuntimeError`` with the log's tail if it exits or is not ready within
    ``timeout_s`` (it is then stopped: :func:`wait_ready`).
    """
    http_port = http_port or free_port()
    grpc_port = grpc_port or free_port()
    argv = [
        sys.executable, "-m", "cache_service", "serve",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), *serve_args,
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ if env is None else env)
        )
    service = ServiceProcess(http_port, grpc_port, proc, log)
    wait_ready(f"{service.url}/readyz", service, "cache service", timeout_s=timeout_s, poll_s=0.1)
    return service


class ManagedProcess(Protocol):
    """A started server process with a log file, as :func:`wait_ready` watches it."""

    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """Stop the process and wait for it."""


def wait_ready(
    url: str, server: ManagedProcess, what: str, *, timeout_s: float, poll_s: float
) -> None:
    """Poll ``url`` until it answers 200, while ``server`` runs.

    Raises ``RuntimeError`` naming ``what``, with the log's tail, if the process exits or
    is not ready within ``timeout_s``; ``server`` is then stopped, as on any exception
    (Ctrl-C included) while waiting, since nobody else holds it yet.
    """
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                tail = server.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{what} exited {server.proc.returncode}:\n{tail}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        tail = server.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s:\n{tail}")
    except BaseException:
        server.stop()
        raise
