"""The test helpers users are told to use work: every model family the builder offers
starts in SGLang (CPU), and the CPU recipe starts on a busy machine.

Each real start costs ~1 min on 2 cores, so every family is started once: Qwen3-MoE
and GLM-4-MoE by the session's engines (their checkpoint is byte-identical to what
``build-model`` writes, checked here), OLMoE and Mixtral here.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.tools.local_stack import FAMILIES, EngineServer, start_engine
from tests.support.engine_requests import rid, sp
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

# Families a session engine already runs, and that engine's fixture.
RUNNING = {"qwen3_moe": "qwen_engine", "glm4_moe": "glm_engine"}
MOE_LAYERS = {"qwen3_moe": 3, "glm4_moe": 2, "olmoe": 3, "mixtral": 3}  # of 3 (GLM: 0 dense)


def build_model(out: Path, family: str) -> None:
    """``python -m sglang_r3.tools.local_stack build-model OUT --family FAMILY``, as documented."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_r3.tools.local_stack",
            "build-model",
            str(out),
            "--family",
            family,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(out)


def digest(path: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_the_builder_offers_starts(
    family: str,
    tmp_path: Path,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    cache_client: RoutingClient,
    request: pytest.FixtureRequest,
) -> None:
    out = tmp_path / family
    build_model(out, family)
    started: EngineServer | None = None
    if family in RUNNING:
        # The session's engine serves this very checkpoint (same builder, same defaults).
        assert digest(out) == digest(tiny_models[family])
        engine: EngineServer = request.getfixturevalue(RUNNING[family])
    else:
        engine = started = start_engine(
            out,
            port=free_port(),
            log=tmp_path / "sglang.log",
            routing_cache=engine_cache.http_url,
            api_key=KEY_A,
        )
    try:
        rollout = rid(family)
        r = httpx.post(
            f"{engine.url}/generate",
            json={"input_ids": list(range(10, 30)), "sampling_params": sp(rollout, 4)},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["r3"]["stored"]
        got = cache_client.get(rollout)
        assert got.indices.shape == (20 + 4 - 1, MOE_LAYERS[family], 2)
    finally:
        if started is not None:
            started.stop()


def _server_pid(port: int) -> int | None:
    """The launcher process serving ``port`` (its process group holds all of SGLang)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "sglang_r3.launch_server" in cmd and str(port) in cmd:
            return int(p.pid)
    return None


def test_cpu_recipe_starts_on_a_busy_machine(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """Other processes take memory while SGLang starts; the recipe must not care.

    SGLang 0.5.23 budgets the KV pool (on CPU too) as free memory after loading the
    model minus ``(1 - mem_fraction_static)`` x free memory before it.  On a busy
    machine free memory moves while a server starts (other servers and tests
    allocating).  Reproduced deterministically: as soon as SGLang has taken its
    "before" reading, its whole process group is stopped, this test allocates and
    touches a few GB, and the group continues.  With the old recipe's fraction of
    0.05, a drop of more than 5% of free memory failed the start with "no GPU
    memory for the KV cache"; the pool must be what --max-total-tokens says.
    """
    log = tmp_path / "sglang.log"
    port = free_port()
    grab = min(4 << 30, psutil.virtual_memory().available // 3)
    held: list[Any] = []
    seen: dict[str, float] = {}
    errors: list[BaseException] = []

    def squeeze() -> None:
        try:
            deadline = time.monotonic() + 240
            while "Memory baseline taken" not in (
                log.read_text(errors="replace") if log.exists() else ""
            ):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)
            pid = _server_pid(port)
            assert pid is not None, "launcher process not found"
            os.killpg(pid, signal.SIGSTOP)
            try:
                seen["before"] = psutil.virtual_memory().available / (1 << 30)
                block = np.ones(grab // 8)  # allocated and touched
                held.append(block)
                seen["after"] = psutil.virtual_memory().available / (1 << 30)
            finally:
                os.killpg(pid, signal.SIGCONT)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=squeeze, daemon=True)
    thread.start()
    try:
        server = start_engine(
            tiny_models["qwen3_moe"],
            port=port,
            log=log,
            max_total_tokens=4096,
            extra_args=("--log-level", "info"),  # for the "Memory baseline taken" line
        )
        server.stop()
    finally:
        thread.join(60)
        held.clear()
    assert not errors, errors
    assert "after" in seen, "the squeeze never ran"
    assert seen["before"] - seen["after"] > 0.5 * grab / (1 << 30)
    text = log.read_text(errors="replace")
    # SGLang saw the drop before sizing the pool, and the pool is the token count.
    m = re.search(r"Load weight begin\. avail mem=([\d.]+) GB", text)
    assert m and float(m.group(1)) < seen["before"] - 0.5 * grab / (1 << 30), m
    assert "max_total_num_tokens=4096," in text
