"""On a real SGLang server: routing is handed over compact, and shipping a finished
output does not hold the HTTP process's event loop (judged by the order of events)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from r3_client import RoutingClient
from sglang_r3.tools.local_stack import EngineServer
from tests.support.engine_fixtures import _engine, _shared
from tests.support.engine_requests import rid, shim_env, sp
from tests.support.service_process import Service

pytestmark = pytest.mark.timeout(600)

#: Seconds the extension's worker-thread step sleeps per output on this engine.
DELAY = 8.0


@pytest.fixture(scope="module")
def slow_ship_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """SGLang + extension whose off-loop shipping step is slowed down on purpose."""

    def make() -> EngineServer:
        return _engine(
            tmp_path_factory,
            tiny_models["qwen3_moe"],
            engine_cache,
            "slow-ship-engine",
            env=shim_env(
                "ship_delay", R3_SHIM_SHIP_DELAY_S=str(DELAY), SGLANG_R3_LOOP_PROBE_MS="2"
            ),
        )

    with _shared("slow_ship_engine", make, lambda s: s.stop()) as server:
        yield server


def test_streams_keep_flowing_while_an_output_is_shipped(
    slow_ship_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """A stream started before a tagged request finishes all its chunks while that
    request's routing is being shipped; routing work on the event loop would hold the
    stream until the tagged response went out."""
    url = slow_ship_engine.url
    events: list[str] = []
    lock = threading.Lock()
    first_chunk = threading.Event()

    def log(event: str) -> None:
        with lock:
            events.append(event)

    def stream() -> None:
        body = {
            "input_ids": list(range(30, 40)),
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    log("chunk")
                    first_chunk.set()
                elif line.startswith("data: [DONE]"):
                    log("stream done")

    rollout = rid("hot")
    tagged_status: list[int] = []

    def tagged() -> None:
        body = {"input_ids": list(range(50, 60)), "sampling_params": sp(rollout, 2)}
        log("tagged sent")
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        tagged_status.append(r.status_code)
        log("tagged answered")

    s = threading.Thread(target=stream)
    s.start()
    assert first_chunk.wait(60)
    t0 = time.monotonic()
    t = threading.Thread(target=tagged)
    t.start()
    s.join(120)
    t.join(120)
    assert tagged_status == [200]
    assert time.monotonic() - t0 >= DELAY  # the slow step did run
    sent, answered = events.index("tagged sent"), events.index("tagged answered")
    assert "stream done" in events
    assert events.index("stream done") < answered, events
    assert events[sent:answered].count("chunk") >= 10, events
    assert cache_client.stat(rollout).num_rows == 11
    # The loop probe saw no stall anywhere near the shipping step's length.
    probe = httpx.get(f"{url}/r3/loop", timeout=10).json()
    assert probe["enabled"] and probe["samples"] > 0
    assert probe["max_s"] < DELAY / 2, probe


def test_tagged_rows_arrive_compact(slow_ship_engine: EngineServer) -> None:
    """The detokenizer hands tagged rows over as compact arrays, not base64."""

    def handovers() -> dict[str, float]:
        text = httpx.get(f"{slow_ship_engine.url}/r3/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("r3_engine_routing_handover_total{"):
                form = line.split('form="')[1].split('"')[0]
                out[form] = float(line.rsplit(" ", 1)[1])
        return out

    before = handovers()
    body = {"input_ids": [[61, 62, 63], [64, 65]], "sampling_params": sp([rid(), rid()], 2)}
    r = httpx.post(f"{slow_ship_engine.url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert all(o["meta_info"]["r3"]["stored"] for o in r.json())
    after = handovers()
    assert after.get("compact", 0) - before.get("compact", 0) == 2, (before, after)
    assert after.get("base64", 0) == before.get("base64", 0)
