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


def test_help_lists_our_options_in_their_own_group_with_sglangs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_r3.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("usage: python -m sglang_r3.launch_server")
    title = "R3 routing capture (sglang_r3):"
    assert title in out and "\noptions:" in out
    ours = out[out.index(title) : out.index("\noptions:")]
    for flag in (
        "--return-routed-experts",
        "--routing-cache URL",
        "--routing-api-key KEY",
        "--routing-on-cache-error {fail,inline}",
        "--routing-on-retraction {mark,fail}",
        "--routing-put-attempts N",
        "--routing-put-timeout S",
    ):
        assert flag in ours, flag
    sglangs = out[out.index("\noptions:") :]
    for flag in ("--model-path", "--device", "--enable-return-routed-experts", "--config"):
        assert flag in sglangs, flag
    assert "--routing-cache" not in sglangs
