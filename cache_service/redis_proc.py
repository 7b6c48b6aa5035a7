"""Start and stop ``redis-server`` processes: the embedded store and the test fixtures.

Used when the service runs without ``--redis-url`` (one command gives a working
service on a laptop) and by the tests, which never rely on a Redis already
running.  Each process is started on a loopback port, waited for with
``PING``, and stopped by PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RedisProcess", "free_port", "redis_server_binary", "start_cluster"]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    With ``cluster_bus``, ``port + 10000`` (Redis Cluster's bus port) is free too.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus or (port + 10000 <= 65535 and _bindable(port + 10000)):
            return port


def redis_server_binary() -> str:
    """Path of ``redis-server`` (``$R3_REDIS_SERVER`` overrides); clear error when missing."""
    path = os.environ.get("R3_REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        raise FileNotFoundError(
            "redis-server not found: install Debian's redis-server package "
            "(`make bootstrap` does) or set R3_REDIS_SERVER"
        )
    return path


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisProcess:
    """One ``redis-server`` child process on ``127.0.0.1:port`` with files under ``data_dir``."""

    port: int
    data_dir: Path
    appendonly: bool = True
    cluster: bool = False
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """``redis://`` DSN of this server."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """PID of the running server."""
        if self.proc is None:
            raise RuntimeError("redis-server is not running")
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> RedisProcess:
        """Start the server and wait until it answers PING (or raise ``RuntimeError``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always" if self.appendonly else "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if _ping(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout}s")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Signal the server by PID and wait for it to exit (SIGKILL after ``timeout``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the crash the AOF must survive."""
        self.stop(signal.SIGKILL)


def start_cluster(base_dir: Path, masters: int = 3, timeout: float = 30.0) -> list[RedisProcess]:
    """Start ``masters`` cluster-enabled servers and join them with ``redis-cli --cluster create``.

    Returns the processes once every node reports ``cluster_state:ok``.
    """
    nodes: list[RedisProcess] = []
    try:
        for i in range(masters):
            node = RedisProcess(
                free_port(cluster_bus=True), base_dir / f"node{i}", appendonly=False, cluster=True
            )
            nodes.append(node)
            node.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    [cli, "-p", str(n.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                for n in nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                return nodes
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
    except BaseException:
        for n in nodes:
            n.stop()
        raise
