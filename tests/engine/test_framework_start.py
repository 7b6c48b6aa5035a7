"""The plugin in SGLang started by a framework's own code, not by our launcher (issue 54).

verl 0.9.1 (SGLang 0.5.12) calls ``Engine._launch_subprocesses`` and serves SGLang's app
itself; slime starts ``http_server.launch_server`` in a child process before any plugin
is loaded.  Neither runs ``python -m sglang_r3.launch_server``, so the plugin is
configured only by the ``SGLANG_R3_*`` variables the framework's job passes on
(docs/integrations.md).  :mod:`tests.support.framework_start` makes each framework's
calls (the lines ``tests/integrations/test_framework_engine_startup.py`` pins); here each
start-up serves a tagged request whose rows reach the cache equal to upstream's inline
rows, with the HTTP process's start-up check and ``/r3`` routes in place and the
detokenizer handing rows over compact (so the plugin ran in all three processes).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from cache_service.service_process import wait_ready
from r3_client import RoutingClient
from sglang_r3.cpu import prepare_env
from sglang_r3.tools.local_stack import EngineServer, engine_port
from tests.support.engine_fixtures import release_env, release_python
from tests.support.engine_requests import as_sets, generate, inline_rows, rid, sp
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
# (framework, SGLang release): verl 0.9.1's pin; slime's images (0.5.12.post1, 0.5.15.post1)
# and the newest release, where the launch hook is missed all the same.
STARTS = [("verl", "0.5.12"), ("slime", "0.5.12"), ("slime", "0.5.23")]


@pytest.fixture(params=STARTS, ids=[f"{s}-{r}" for s, r in STARTS])
def framework_engine(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path: Path,
) -> Iterator[EngineServer]:
    style, release = request.param
    port = engine_port()
    env = prepare_env(release_env())
    env |= {"SGLANG_R3_ROUTING_CACHE": engine_cache.http_url, "SGLANG_R3_API_KEY": KEY_A}
    argv = [
        release_python(release),
        "-m",
        "tests.support.framework_start",
        style,
        "--model-path",
        str(tiny_models["qwen3_moe"]),
        "--port",
        str(port),
    ]
    log = tmp_path / "sglang.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    server = EngineServer(f"http://127.0.0.1:{port}", proc, log, argv)
    try:
        wait_ready(f"{server.url}/health", server, f"SGLang ({style})", timeout_s=240, poll_s=0.5)
        yield server
    finally:
        server.stop()


def test_a_frameworks_own_start_up_ships_rows(
    framework_engine: EngineServer, cache_client: RoutingClient
) -> None:
    url = framework_engine.url
    rollout = rid("fw")
    status, out = generate(
        url, {"input_ids": list(range(30, 46)), "sampling_params": sp(rollout, 6, inline=True)}
    )
    assert status == 200, out
    ref = out["meta_info"]["r3"]
    assert ref["stored"] and ref["rollout_id"] == rollout, ref
    stored = cache_client.get(rollout)
    assert stored.num_rows == 16 + len(out["output_ids"]) - 1
    np.testing.assert_array_equal(as_sets(stored.indices), as_sets(inline_rows(out, 3)))
    info = httpx.get(f"{url}/r3/info", timeout=10).json()  # routes added at start-up
    assert info["enabled"] and info["routing_cache"]
    metrics = httpx.get(f"{url}/r3/metrics", timeout=10).text
    assert 'r3_engine_routing_handover_total{form="compact"} 1.0' in metrics, metrics[-2000:]
