"""A driver whose turn timed out goes on: rewind, then send the turn again (issue 26).

Through the real sglang-router in front of a real CPU engine, tagged by the header
as a driver behind the router does.  Turn 2 is sampled with ``max_new_tokens=400``
and the driver gives up after 0.3 s; the engine finishes anyway and stores the
turn's rows, which the driver never saw.  Before issue 26 every retry of that turn
was a 409 and nothing let the driver recover.  Now it rewinds the rollout to the
rows it holds and the retry is stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.tools.local_stack import EngineServer, start_router
from tests.support.engine_requests import rid

pytestmark = pytest.mark.timeout(600)

KEY = "X-SMG-Routing-Key"
PROMPT = [11, 12, 13, 14, 15, 16]


@pytest.fixture(scope="module")
def router(qwen_engine: EngineServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs: Path = tmp_path_factory.mktemp("lost-answer")
    server = start_router(
        [qwen_engine.url], port=free_port(), metrics_port=free_port(), log=logs / "router.log"
    )
    try:
        yield server.url
    finally:
        server.stop()


def _turn(
    url: str, rollout: str, tokens: list[int], *, timeout: float, seed: int
) -> httpx.Response:
    body = {
        "input_ids": tokens,
        "sampling_params": {
            "max_new_tokens": 400,
            "temperature": 1.0,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
    }
    return httpx.post(f"{url}/generate", json=body, headers={KEY: rollout}, timeout=timeout)


def _first_turn(url: str, rollout: str, client: RoutingClient) -> tuple[list[int], int]:
    """Turn 1; the next turn's context and the rows the driver knows it holds."""
    first = httpx.post(
        f"{url}/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        headers={KEY: rollout},
        timeout=120,
    )
    assert first.status_code == 200, first.text[:500]
    out = first.json()["output_ids"]
    held = len(PROMPT) + len(out) - 1
    assert client.stat(rollout).num_rows == held
    return PROMPT + out + [40, 41], held  # + the tool's answer


def _recover(url: str, rollout: str, context: list[int], held: int, client: RoutingClient) -> None:
    """The documented recipe: rewind to the rows held, send the turn again; stored."""
    assert client.rewind(rollout, held).num_rows == held
    again = _turn(url, rollout, context, timeout=300, seed=2)
    assert again.status_code == 200, again.text[:500]
    out = again.json()
    assert out["meta_info"]["r3"]["stored"] is True, out["meta_info"]["r3"]
    final = client.stat(rollout)
    assert final.num_rows == len(context) + len(out["output_ids"]) - 1
    assert [(s.segment.start, s.segment.end) for s in final.segments] == [
        (0, held),
        (held, final.num_rows),
    ]


def test_a_turn_whose_answer_was_lost_is_rewound_and_sent_again(
    router: str, cache_client: RoutingClient
) -> None:
    """The engine finished and stored the turn; the driver never read the answer."""
    rollout = rid("lost")
    context, held = _first_turn(router, rollout, cache_client)
    lost = _turn(router, rollout, context, timeout=300, seed=1)
    assert lost.status_code == 200  # ... and the answer never reaches the driver
    assert cache_client.stat(rollout).num_rows == len(context) + 400 - 1
    retry = _turn(router, rollout, context, timeout=300, seed=2)  # other tokens: a conflict
    assert retry.status_code == 409, retry.text[:500]
    _recover(router, rollout, context, held, cache_client)


def test_a_turn_that_timed_out_is_recovered_the_same_way(
    router: str, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """The driver gives up after 0.3 s.  SGLang aborts a request whose client went away
    when it next checks (seconds later), and an aborted request stores nothing; a turn
    that finished first was stored.  Either way the same recipe recovers."""
    rollout = rid("timeout")
    context, held = _first_turn(router, rollout, cache_client)
    aborts = qwen_engine.log.read_text(errors="replace").count("Abort request")
    with pytest.raises(httpx.TimeoutException):
        _turn(router, rollout, context, timeout=0.3, seed=1)
    deadline = time.monotonic() + 120
    while cache_client.stat(rollout).num_rows == held:  # stored, or aborted: then go on
        if qwen_engine.log.read_text(errors="replace").count("Abort request") > aborts:
            break
        assert time.monotonic() < deadline, "the engine neither stored nor aborted the turn"
        time.sleep(0.5)
    _recover(router, rollout, context, held, cache_client)
