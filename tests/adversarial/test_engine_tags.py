"""Hostile rollout ids and tag fields through a real SGLang engine's tags.

Every id outside the rule (``r3_client.check_rollout_id``, the one rule the client,
the service and the engine apply) and every weight version outside the format's
text rule is answered 400 with a short, printable reason on ``/generate``,
``/v1/completions`` and ``/v1/chat/completions`` -- before any generation (no output
is generated: the engine's routing counters do not move) and with nothing
stored (the victim rollout every hostile id aims at is unchanged).  Legal ids made
of URL-special characters (``+ = : @ .``) work and are stored under exactly that id.

One session server (the engine tests' ``qwen_engine``, shared), ~1 s of requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from r3_client import RolloutNotFoundError, RoutingClient
from sglang_r3.tools.local_stack import EngineServer
from tests.support.engine_fixtures import (  # noqa: F401  (pytest finds fixtures by name in the module)
    engine_cache,
    qwen_engine,
    tiny_models,
)
from tests.support.engine_requests import rid
from tests.support.frames import TRICKY_LEGAL_IDS, hostile_ids
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(300)

ENDPOINTS = ["/generate", "/v1/completions", "/v1/chat/completions"]
PROMPT = list(range(40, 52))

VICTIM = f"victim-{rid('e')}"
HOSTILE_IDS: list[Any] = hostile_ids(VICTIM)
# JSON values a tag's rollout_id may not be (a list is legal: one id per output).
NOT_STRINGS: list[Any] = [None, 7, 7.5, True, {"id": VICTIM}, [[VICTIM]], [7]]
#: Legal by the rule, though URL-special: accepted, stored under exactly that id.
TRICKY_LEGAL = [*TRICKY_LEGAL_IDS, "v" * 200]
BAD_WEIGHT_VERSIONS: list[Any] = [
    "v1\x00",
    "v1\r\nX-Injected: 1",
    "v1\x1b[31m",
    "v\u202e1",
    "v" * 257,
    7,
    None,
    ["v1"],
]


def request_body(path: str, tag: dict[str, Any], n: int = 1) -> dict[str, Any]:
    if path == "/generate":
        params = {"max_new_tokens": 2, "temperature": 0, "n": n, "custom_params": {"r3": tag}}
        return {"input_ids": PROMPT, "sampling_params": params}
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 2,
        "temperature": 0,
        "n": n,
        "custom_params": {"r3": tag},
    }
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in PROMPT)}]
    return body


def engine_activity(engine: EngineServer) -> float:
    """Tagged outputs the engine generated: routing bytes it returned (counted before
    any check or write), outputs shipped or failed, guard trips."""
    text = httpx.get(f"{engine.url}/r3/metrics", timeout=10).text
    counters = (
        "r3_engine_bytes_engine_total ",
        "r3_engine_outputs_total{",
        "r3_engine_guard_trips_total{",
    )
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(counters))


def refused(engine: EngineServer, path: str, body: dict[str, Any], needle: str) -> None:
    r = httpx.post(f"{engine.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, (path, r.status_code, r.text[:500])
    assert len(r.content) < 2000, "the reason must not echo a huge id back"
    err = r.json()
    message = err["error"]["message"] if path == "/generate" else err["message"]
    assert message.startswith("r3: ") and needle in message, (path, message)
    assert message.isprintable(), repr(message)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> EngineServer:
    """The engine tests' Qwen3-MoE server (one per session, shared with tests/engine)."""
    server: EngineServer = request.getfixturevalue("qwen_engine")
    return server


@pytest.fixture(scope="module")
def cache(request: pytest.FixtureRequest) -> Iterator[RoutingClient]:
    """A client of the cache the engine ships to."""
    svc: Service = request.getfixturevalue("engine_cache")
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def victim(engine: EngineServer, cache: RoutingClient) -> bytes:
    """A stored rollout every hostile id aims at; its stored frame."""
    r = httpx.post(
        f"{engine.url}/generate",
        json=request_body("/generate", {"rollout_id": VICTIM}),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return cache.get_frame(VICTIM)


@pytest.fixture
def untouched(engine: EngineServer, cache: RoutingClient, victim: bytes) -> Iterator[None]:
    """After the test: nothing generated or shipped, the victim unchanged."""
    before = engine_activity(engine)
    yield
    assert engine_activity(engine) == before, "a hostile request reached generation"
    assert cache.get_frame(VICTIM) == victim


@pytest.mark.parametrize("path", ENDPOINTS)
def test_hostile_ids_are_400_before_generation(
    engine: EngineServer, untouched: None, path: str
) -> None:
    for bad in HOSTILE_IDS:
        refused(engine, path, request_body(path, {"rollout_id": bad}), "invalid rollout id")
        # in a list naming the outputs, next to a good id
        body = request_body(path, {"rollout_id": [rid("ok"), bad]}, n=2)
        refused(engine, path, body, "invalid rollout id")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_ids_that_are_not_strings_are_400(engine: EngineServer, untouched: None, path: str) -> None:
    for bad in NOT_STRINGS:
        refused(engine, path, request_body(path, {"rollout_id": bad}), "rollout")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_derived_ids_obey_the_rule(engine: EngineServer, untouched: None, path: str) -> None:
    """With several outputs, output k is f"{id}-{k}": both the id and what it makes."""
    refused(engine, path, request_body(path, {"rollout_id": "x" * 199}, n=2), "derived from")
    for dots in (".", ".."):
        refused(engine, path, request_body(path, {"rollout_id": dots}, n=2), "invalid rollout id")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_bad_weight_versions_are_400_before_generation(
    engine: EngineServer, untouched: None, path: str
) -> None:
    for bad in BAD_WEIGHT_VERSIONS:
        tag = {"rollout_id": rid("wv"), "weight_version": bad}
        refused(engine, path, request_body(path, tag), "weight_version must be")


def test_a_tag_hidden_in_a_string_is_400(engine: EngineServer, untouched: None) -> None:
    for hidden in (json.dumps({"r3": {"rollout_id": VICTIM}}), ["r3", VICTIM]):
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 2, "custom_params": hidden},
        }
        refused(engine, "/generate", body, "custom_params must be an object")


@pytest.mark.parametrize("path", ENDPOINTS)
def test_legal_url_special_ids_work(
    engine: EngineServer, victim: bytes, cache: RoutingClient, path: str
) -> None:
    activity = engine_activity(engine)
    for good in TRICKY_LEGAL:
        r = httpx.post(
            f"{engine.url}{path}", json=request_body(path, {"rollout_id": good}), timeout=60
        )
        assert r.status_code == 200, (good, r.text[:500])
        body = r.json()
        ref = body["meta_info"]["r3"] if path == "/generate" else body["sglext"]["r3"][0]
        try:
            assert ref["rollout_id"] == good and ref["stored"]
            assert cache.stat(good).num_rows == ref["end"] > 0
        finally:
            cache.delete(good)
        with pytest.raises(RolloutNotFoundError):
            cache.stat(good)
    assert cache.get_frame(VICTIM) == victim
    # The probe that says "nothing reached generation" sees generation when it happens.
    assert engine_activity(engine) > activity
