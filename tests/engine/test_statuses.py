"""Every endpoint answers an r3 error with its documented status and our error body.

Upstream's OpenAI handlers catch ``ValueError`` (which our request error also is) and
answer 400 whatever the cause, and ``/generate`` streams answer 200 with an error
event; a retrying client must still see 409 (conflict), 413 (too big) and 503
(cache down) as such, streamed or not.  Real SGLang (CPU), real cache service.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import httpx
import pytest

from r3_client import RolloutNotFoundError, RoutingClient
from sglang_r3.tools.local_stack import EngineServer, words
from tests.support.engine_requests import MAX_SEGMENT_ROWS, restart_cache, rid, sp
from tests.support.service_process import Service

pytestmark = pytest.mark.timeout(600)

ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions"]


def body_for(
    path: str, rollout: str, tokens: list[int], *, stream: bool, max_tokens: int = 3, **tag: Any
) -> dict[str, Any]:
    """A request tagged with ``rollout`` whose prompt is ``tokens`` (as words for chat)."""
    if path == "/generate":
        return {
            "input_ids": tokens,
            "stream": stream,
            "sampling_params": sp(rollout, max_tokens, **tag),
        }
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "custom_params": {"r3": {"rollout_id": rollout, **tag}},
    }
    if path == "/v1/completions":
        body["prompt"] = tokens
    else:
        body["messages"] = [{"role": "user", "content": words(tokens)}]
    return body


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def events(r: httpx.Response) -> list[Any]:
    """The ``data:`` events of an SSE answer, ``[DONE]`` as the string."""
    out: list[Any] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def invalid_rows_trips(engine: EngineServer) -> float:
    """How often the engine's rows failed the format's validation after generation."""
    text = httpx.get(f"{engine.url}/r3/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('r3_engine_guard_trips_total{guard="invalid_rows"}'):
            return float(line.split()[-1])
    return 0.0


def assert_refused(r: httpx.Response, path: str, status: int, needle: str) -> None:
    """Status ``status`` with the endpoint's error body naming the cause (not a stream)."""
    assert r.status_code == status, (r.status_code, r.text[:600])
    assert not r.headers.get("content-type", "").startswith("text/event-stream"), r.text[:600]
    body = r.json()
    if path == "/generate":
        message = body["error"]["message"]
    else:  # SGLang's OpenAI error object
        assert body["object"] == "error" and body["code"] == status, body
        message = body["message"]
    assert message.startswith("r3: ") and needle in message, body


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_conflict_is_409(
    qwen_engine: EngineServer, cache_client: RoutingClient, path: str, stream: bool
) -> None:
    rollout = rid("conflict")
    r = post(qwen_engine.url, path, body_for(path, rollout, list(range(30, 40)), stream=False))
    assert r.status_code == 200, r.text
    before = cache_client.get_frame(rollout)
    # A next turn whose prompt does not start with the stored trajectory.
    r = post(qwen_engine.url, path, body_for(path, rollout, list(range(50, 70)), stream=stream))
    assert_refused(r, path, 409, "do not start with that trajectory")
    assert cache_client.get_frame(rollout) == before


def test_cache_down_is_503(
    qwen_engine: EngineServer,
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    engine_cache.stop(signal.SIGKILL)
    try:
        for path in ENDPOINTS:
            for stream in (False, True):
                body = body_for(path, rid("down"), list(range(60, 70)), stream=stream)
                r = post(qwen_engine.url, path, body)
                assert_refused(r, path, 503, "routing cache unreachable")
    finally:
        restart_cache(engine_cache, tmp_path_factory)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_error_after_the_stream_started_carries_the_status(
    qwen_engine: EngineServer, cache_client: RoutingClient, path: str
) -> None:
    """The cache refuses the segment (413) once generation is done: the stream had
    already answered 200, so the status travels in the final error event."""
    rollout = rid("big")
    prompt = [3 + (i % 1000) for i in range(MAX_SEGMENT_ROWS + 50)]
    r = post(qwen_engine.url, path, body_for(path, rollout, prompt, stream=True, max_tokens=4))
    assert r.status_code == 200, r.text[:600]
    got = events(r)
    assert got[-1] == "[DONE]"
    assert len(got) > 2, got  # output chunks went out before the error
    error = got[-2]["error"]
    assert error["code"] == 413, error
    assert "refused the segment" in error["message"]
    with pytest.raises(RolloutNotFoundError):
        cache_client.stat(rollout)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_non_printable_weight_version_is_400_before_generation(
    qwen_engine: EngineServer, cache_client: RoutingClient, path: str
) -> None:
    rollout = rid("wv")
    trips = invalid_rows_trips(qwen_engine)
    body = body_for(path, rollout, list(range(80, 90)), stream=False, weight_version="v1\x00")
    r = post(qwen_engine.url, path, body)
    assert_refused(r, path, 400, "weight_version must be printable")
    with pytest.raises(RolloutNotFoundError):
        cache_client.stat(rollout)
    # Refused by the tag check, not by the format's validation after generating.
    assert invalid_rows_trips(qwen_engine) == trips


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_custom_params_that_is_not_an_object_but_names_r3_is_400(
    qwen_engine: EngineServer, cache_client: RoutingClient, stream: bool
) -> None:
    rollout = rid("str")
    params = {
        "max_new_tokens": 3,
        "custom_params": json.dumps({"r3": {"rollout_id": rollout}}),
    }
    r = post(
        qwen_engine.url,
        "/generate",
        {"input_ids": list(range(90, 100)), "stream": stream, "sampling_params": params},
    )
    assert_refused(r, "/generate", 400, "custom_params must be an object")
    with pytest.raises(RolloutNotFoundError):
        cache_client.stat(rollout)
    # Untagged requests with other custom_params are not touched.
    params["custom_params"] = {"note": "no routing here"}
    r = post(qwen_engine.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": params})
    assert r.status_code == 200, r.text
