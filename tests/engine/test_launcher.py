"""The launcher refuses unsafe or broken configurations before SGLang starts (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _service import Service

from cache_service.redis_proc import free_port


def launch(
    model: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "sglang_r3.launch_server",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--port",
        str(free_port()),
        *args,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def test_return_routed_experts_needs_a_cache(tiny_models: dict[str, Path]) -> None:
    proc = launch(tiny_models["qwen3_moe"], "--return-routed-experts")
    assert proc.returncode == 2
    assert "--return-routed-experts needs --routing-cache" in proc.stderr


def test_refuses_hicache(tiny_models: dict[str, Path], engine_cache: Service) -> None:
    proc = launch(
        tiny_models["qwen3_moe"],
        "--return-routed-experts",
        "--routing-cache",
        engine_cache.http_url,
        "--routing-api-key",
        "key-tenant-a-0123456789abcdef",
        "--enable-hierarchical-cache",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "HiCache" in proc.stderr and "sglang#26975" in proc.stderr


def test_refuses_wrong_api_key(tiny_models: dict[str, Path], engine_cache: Service) -> None:
    proc = launch(
        tiny_models["qwen3_moe"],
        "--return-routed-experts",
        "--routing-cache",
        engine_cache.http_url,
        "--routing-api-key",
        "not-a-key",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refused the API key" in proc.stderr


@pytest.mark.parametrize("target", ["sglang.srt.managers.scheduler.NoSuchThing.nope"])
def test_hook_that_did_not_apply_stops_the_launch(
    tiny_models: dict[str, Path], engine_cache: Service, target: str
) -> None:
    proc = launch(
        tiny_models["qwen3_moe"],
        "--return-routed-experts",
        "--routing-cache",
        engine_cache.http_url,
        "--routing-api-key",
        "key-tenant-a-0123456789abcdef",
        env={"SGLANG_R3_TEST_BOGUS_HOOK": target},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{target}: SGLang did not apply the hook" in proc.stderr


def test_plugin_excluded_by_sglang_plugins(tiny_models: dict[str, Path]) -> None:
    proc = launch(tiny_models["qwen3_moe"], env={"SGLANG_PLUGINS": "smg-zmq"})
    assert proc.returncode == 2 and "excludes this extension's plugin" in proc.stderr
