"""What the manifests hand to our software is accepted by the real software.

The cache service's ConfigMap goes through ``ServiceSettings``; SGLang's ConfigMap and
the container arguments through SGLang's own parser and our launcher's; the Redis
configs run in a real ``redis-server``; the Redis Cluster init script forms a real
6-node cluster on loopback; the dev init container's command builds the model the dev
config serves.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cache_service.redis_proc import free_port
from cache_service.settings import ServiceSettings
from sglang_r3 import launch_server
from sglang_r3.tools.local_stack import CPU_ARGS
from tests.support.kustomize import Obj, container_env, containers, find, pod_spec, render

PASSWORD = "test-password-0123456789"


@pytest.fixture(scope="module")
def dev() -> list[Obj]:
    return render("dev")


@pytest.fixture(scope="module")
def prod() -> list[Obj]:
    return render("prod")


def _cache_settings(
    objs: list[Obj], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> ServiceSettings:
    """``ServiceSettings`` from what the cache container sees: the ConfigMap (envFrom) and
    its ``env`` as the kubelet resolves it, with the Secret files written under tmp_path."""
    data = find(objs, "ConfigMap", "r3-cache-config")["data"]
    fields = {f"R3_CACHE_{name.upper()}" for name in ServiceSettings.model_fields}
    assert set(data) <= fields, f"not settings: {set(data) - fields}"
    dep = find(objs, "Deployment", "r3-cache")
    (c,) = pod_spec(dep)["containers"]
    env = container_env(dep, c, secrets={"redis-auth/password": "pw"})
    assert {k for k in env if k.startswith("R3_CACHE_")} <= fields
    keys = tmp_path / "api-keys.json"
    keys.write_text(json.dumps({"k" * 24: "rl"}))
    # The Secret's keys, from the rendered (dev) Secret where there is one.
    rendered = [
        o
        for o in objs
        if o["kind"] == "Secret" and o["metadata"]["name"].startswith("r3-cache-api-keys")
    ]
    secret = (
        base64.b64decode(rendered[0]["data"]["direct-read-secret"]).decode()
        if rendered
        else secrets.token_urlsafe(32)  # what docs/deploy.md has prod generate
    )
    secret_file = tmp_path / "direct-read-secret"
    secret_file.write_text(secret + "\n")
    for k in [k for k in os.environ if k.startswith("R3_CACHE_")]:
        monkeypatch.delenv(k)
    for k, v in {**data, **env}.items():  # env wins over envFrom, as in Kubernetes
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("R3_CACHE_API_KEYS_FILE", str(keys))  # the Secret's mount, here
    monkeypatch.setenv("R3_CACHE_DIRECT_READ_SECRET_FILE", str(secret_file))
    return ServiceSettings()


@pytest.mark.parametrize("variant", ["dev", "prod"])
def test_cache_configmap_is_valid_service_settings(
    variant: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    objs = render(variant)
    s = _cache_settings(objs, monkeypatch, tmp_path)
    assert s.auth_enabled() and s.all_api_keys() == {"k" * 24: "rl"}
    assert s.http_port == 8080 and s.grpc_port == 50051
    assert s.redis_cluster is (variant == "prod")
    # Direct reads on, with a secret good enough for the service and a namespaced URL.
    ns = find(objs, "Deployment", "r3-cache")["metadata"]["namespace"]
    host = "redis-cluster" if variant == "prod" else "redis"
    assert s.direct_reads and s.read_secret() is not None
    assert s.direct_read_url == f"redis://{host}.{ns}.svc:6379/0"
    assert s.redis_url == f"redis://:pw@{host}:6379/0"


def _sglang_argv(objs: list[Obj], tmp_path: Path) -> tuple[list[str], Path]:
    """The SGLang container's arguments, with --config pointing at a copy of the ConfigMap."""
    dep = find(objs, "Deployment", "sglang")
    (c,) = pod_spec(dep)["containers"]
    args = list(c["args"])
    config = tmp_path / "config.yaml"
    config.write_text(find(objs, "ConfigMap", "sglang-config")["data"]["config.yaml"])
    args[args.index("--config") + 1] = str(config)
    return args, config


@pytest.mark.parametrize("variant", ["dev", "prod"])
def test_sglang_arguments_parse(variant: str, tmp_path: Path) -> None:
    """Our launcher takes its flags; SGLang's own parser takes the rest and the config file."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    args, _ = _sglang_argv(render(variant), tmp_path)
    ours, rest = launch_server._parser().parse_known_args(args)
    assert ours.return_routed_experts and ours.routing_cache.startswith("grpc://")
    assert ours.routing_require_tag and ours.routing_tag_header == "x-smg-routing-key"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    merged = ConfigArgumentMerger(parser).merge_config_with_args(rest)
    parsed = parser.parse_args([*merged, "--enable-return-routed-experts"])
    assert parsed.host == "0.0.0.0" and parsed.port == 30000
    assert parsed.enable_metrics
    if variant == "prod":
        assert parsed.tp_size == 2 and parsed.model_path.startswith("/models/")
        assert launch_server._device(rest) is None
    else:
        assert parsed.device == "cpu"
        # The launcher sees the device in the config file and runs the CPU recipe.
        assert launch_server._device(rest) == "cpu"


def test_dev_config_is_the_tested_cpu_recipe(dev: list[Obj]) -> None:
    config = yaml.safe_load(find(dev, "ConfigMap", "sglang-config")["data"]["config.yaml"])
    flags = [a for a in CPU_ARGS if a.startswith("--")]
    for i, arg in enumerate(CPU_ARGS):
        if not arg.startswith("--"):
            continue
        key = arg[2:]
        has_value = i + 1 < len(CPU_ARGS) and not CPU_ARGS[i + 1].startswith("--")
        expected = CPU_ARGS[i + 1] if has_value else True
        assert key in config, f"dev config lacks {arg}"
        assert str(config[key]).lower() == str(expected).lower(), key
    assert flags


def test_dev_init_container_builds_the_served_model(dev: list[Obj], tmp_path: Path) -> None:
    dep = find(dev, "Deployment", "sglang")
    (init,) = pod_spec(dep)["initContainers"]
    config = yaml.safe_load(find(dev, "ConfigMap", "sglang-config")["data"]["config.yaml"])
    cmd = list(init["command"])
    assert cmd[-1] == config["model-path"], "the init container writes what SGLang loads"
    model_mount = next(m for m in init["volumeMounts"] if cmd[-1].startswith(m["mountPath"]))
    (main,) = pod_spec(dep)["containers"]
    assert any(m["name"] == model_mount["name"] for m in main["volumeMounts"])
    cmd[-1] = str(tmp_path / "model")
    assert cmd[0] == "python"  # the image's venv python; here, this interpreter
    out = subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert (tmp_path / "model" / "tokenizer.json").exists()


# --- Redis ------------------------------------------------------------------------------


def _redis_cli(port: int, *args: str) -> str:
    env = {**os.environ, "REDISCLI_AUTH": PASSWORD}
    out = subprocess.run(
        [shutil.which("redis-cli") or "redis-cli", "-p", str(port), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=10,
    )
    return out.stdout.strip()


def _start_redis(conf: Path, port: int, data: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``redis-server <rendered conf>`` with this test's port, dir and password."""
    data.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            str(conf),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data),
            "--requirepass",
            PASSWORD,
            "--logfile",
            str(data / "redis.log"),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    while _redis_cli(port, "ping") != "PONG":
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.fail(f"redis-server rejected {conf.name}: {err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("redis-server did not answer")
        time.sleep(0.05)
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.terminate()
    for p in started:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_single_redis_config_runs(
    dev: list[Obj], tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    conf = tmp_path / "redis.conf"
    conf.write_text(find(dev, "ConfigMap", "redis-config")["data"]["redis.conf"])
    port = free_port()
    procs.append(_start_redis(conf, port, tmp_path / "data"))
    assert _redis_cli(port, "config", "get", "appendonly").split() == ["appendonly", "yes"]
    policy = _redis_cli(port, "config", "get", "maxmemory-policy").split()
    assert policy == ["maxmemory-policy", "noeviction"]
    assert _redis_cli(port, "set", "k", "v") == "OK"
    assert (tmp_path / "data" / "appendonlydir").is_dir()
    # Without the password nothing is served.
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "get", "k"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"},
    )
    assert "NOAUTH" in out.stdout + out.stderr


def test_read_plan_on_the_rendered_redis(
    dev: list[Obj],
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deployed settings issue a read plan on a redis-server running the rendered config:
    the trainer's user reads its namespace and nothing else (the service stays the writer)."""
    import redis

    from cache_service.metrics import Metrics
    from cache_service.routing_service import RoutingService
    from cache_service.store import SegmentStore

    conf = tmp_path / "redis.conf"
    conf.write_text(find(dev, "ConfigMap", "redis-config")["data"]["redis.conf"])
    port = free_port()
    procs.append(_start_redis(conf, port, tmp_path / "data"))
    settings = _cache_settings(dev, monkeypatch, tmp_path)
    local = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"

    async def plan() -> dict[str, object]:
        store = await SegmentStore.connect(settings.store_settings(local))
        try:
            return await RoutingService(store, settings, Metrics()).read_plan("rl")
        finally:
            await store.close()

    got = asyncio.run(plan())
    ns = find(dev, "Deployment", "r3-cache")["metadata"]["namespace"]
    assert got["redis_url"] == f"redis://redis.{ns}.svc:6379/0" and got["cluster"] is False
    assert got["username"] == "r3-read-rl" and got["key_prefix"] == "r3:rl:"
    assert _redis_cli(port, "hset", "r3:rl:{a}", "m", "x") == "1"
    assert _redis_cli(port, "hset", "r3:other:{a}", "m", "x") == "1"
    # What a trainer's DirectReader does with the plan, against this Redis.
    trainer = redis.Redis(port=port, username=str(got["username"]), password=str(got["password"]))
    try:
        assert trainer.hgetall("r3:rl:{a}") == {b"m": b"x"}
        for refused in (
            lambda: trainer.hgetall("r3:other:{a}"),
            lambda: trainer.hset("r3:rl:{a}", "m", "y"),
            lambda: trainer.execute_command("KEYS", "*"),
            lambda: trainer.execute_command("CONFIG", "GET", "*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        trainer.close()


def _cluster_files(prod: list[Obj], tmp_path: Path) -> tuple[Path, Path]:
    """The rendered Redis Cluster config and init script, written where redis can read them."""
    conf = tmp_path / "redis.conf"
    conf.write_text(find(prod, "ConfigMap", "redis-cluster-config")["data"]["redis.conf"])
    script = tmp_path / "init-cluster.sh"
    script.write_text(find(prod, "ConfigMap", "redis-cluster-init")["data"]["init-cluster.sh"])
    return conf, script


def test_cluster_init_job_forms_the_cluster_once(
    prod: list[Obj], tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    conf, script = _cluster_files(prod, tmp_path)
    job = find(prod, "Job", "redis-cluster-init")
    (c,) = pod_spec(job)["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    n = len(env["REDIS_NODES"].split())
    ports = [free_port(cluster_bus=True) for _ in range(n)]
    for i, port in enumerate(ports):
        procs.append(
            _start_redis(
                conf,
                port,
                tmp_path / f"node{i}",
                "--masterauth",
                PASSWORD,
                "--cluster-announce-hostname",
                "localhost",
            )
        )
    run_env = {
        **os.environ,
        "REDIS_NODES": " ".join(f"localhost:{p}" for p in ports),
        "REDIS_REPLICAS": env["REDIS_REPLICAS"],
        "REDISCLI_AUTH": PASSWORD,
    }
    first = subprocess.run(
        ["/bin/sh", str(script)], capture_output=True, text=True, env=run_env, timeout=120
    )
    assert first.returncode == 0, first.stdout + first.stderr
    assert "cluster formed" in first.stdout
    info = _redis_cli(ports[0], "cluster", "info")
    assert "cluster_state:ok" in info and f"cluster_known_nodes:{n}" in info
    # Masters are the nodes that own slot ranges (fields 9..); the rest replicate them.
    nodes = [ln.split() for ln in _redis_cli(ports[0], "cluster", "nodes").splitlines()]
    masters = [f for f in nodes if "master" in f[2] and len(f) > 8]
    assert len(masters) == n // (1 + int(env["REDIS_REPLICAS"]))
    # Clients are redirected by name (cluster-preferred-endpoint-type hostname).
    assert "localhost" in _redis_cli(ports[0], "cluster", "shards")
    again = subprocess.run(
        ["/bin/sh", str(script)], capture_output=True, text=True, env=run_env, timeout=120
    )
    assert again.returncode == 0 and "already formed" in again.stdout, again.stdout + again.stderr


def test_cluster_init_refuses_a_half_formed_cluster(
    prod: list[Obj], tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A node that knows others but is not ok is left for a human, not re-created."""
    conf, script = _cluster_files(prod, tmp_path)
    ports = [free_port(cluster_bus=True) for _ in range(2)]
    for i, port in enumerate(ports):
        procs.append(
            _start_redis(
                conf,
                port,
                tmp_path / f"n{i}",
            )
        )
    assert _redis_cli(ports[0], "cluster", "meet", "127.0.0.1", str(ports[1])) == "OK"
    deadline = time.monotonic() + 10
    while "cluster_known_nodes:2" not in _redis_cli(ports[0], "cluster", "info"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    run_env = {
        **os.environ,
        "REDIS_NODES": " ".join(f"127.0.0.1:{p}" for p in ports),
        "REDIS_REPLICAS": "0",
        "REDISCLI_AUTH": PASSWORD,
    }
    out = subprocess.run(
        ["/bin/sh", str(script)], capture_output=True, text=True, env=run_env, timeout=60
    )
    assert out.returncode == 1 and "not re-creating" in out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("variant", ["dev", "prod"])
def test_router_arguments_parse(variant: str) -> None:
    """The router container's arguments go through sglang-router's own parser (the
    pinned release), and mean what sglang_r3.launch.fleet says they mean."""
    from sglang_router.launch_router import parse_router_args

    (c,) = pod_spec(find(render(variant), "Deployment", "sglang-router"))["containers"]
    assert c["command"] == ["python", "-m", "sglang_router.launch_router"]
    args = parse_router_args(c["args"])
    assert args.policy == "manual"
    assert args.disable_circuit_breaker and args.disable_retries
    assert args.service_discovery and args.selector == {"app.kubernetes.io/name": "sglang"}
    assert args.health_check_endpoint == "/health"
    assert args.request_timeout_secs == 3600


def test_every_workload_container_is_checked(dev: list[Obj], prod: list[Obj]) -> None:
    """Guard for the tests above: they cover every container the overlays run."""
    names = {
        where.rsplit("/", 1)[1]
        for objs in (dev, prod)
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet", "Job")
        for where, _ in containers(o)
    }
    assert names == {"sglang", "build-model", "cache", "redis", "init", "router"}
