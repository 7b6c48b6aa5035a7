"""R3 behind the real sglang-router (``sglang-router==0.3.2`` from PyPI).

Two CPU engines with the extension (the session's ``qwen_engine``, shipping over
HTTP, and a second one on the same checkpoint and cache, shipping over gRPC as
``deploy/`` does) behind the router started with :mod:`sglang_r3.launch.fleet`'s settings,
plus a third engine (gRPC) with ``--routing-require-tag``.  The router drops
``custom_params``, so every request here names its rollout the way a rollout driver
does behind the router: the header
``X-SMG-Routing-Key: <rollout id>``, which is also the key the router's manual
policy keeps a rollout on one engine by.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.http_hooks import openai_error
from sglang_r3.launch.fleet import DEAD_ENGINE_WINDOW_S, classify_failure
from sglang_r3.tools.local_stack import EngineServer, start_engine, start_router, words
from tests.support.engine_requests import as_sets, restart_cache, rid
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(900)

KEY = "X-SMG-Routing-Key"
PROMPT = [11, 12, 13, 14, 15, 16]


@dataclass
class Fleet:
    router: EngineServer
    engines: tuple[EngineServer, EngineServer]
    strict: EngineServer  # --routing-require-tag, not behind the router
    model: str  # the served model name (OpenAI requests must name it at the router)


@pytest.fixture(scope="module")
def fleet(
    qwen_engine: EngineServer,
    engine_cache: Service,
    tiny_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    model = tiny_models["qwen3_moe"]
    logs = tmp_path_factory.mktemp("fleet")

    def engine(name: str, *extra: str) -> EngineServer:
        # Over gRPC (what deploy/ runs), while qwen_engine ships over HTTP: the fleet
        # mixes both transports.
        return start_engine(
            model,
            port=free_port(),
            log=logs / f"{name}.log",
            routing_cache=f"grpc://{engine_cache.grpc_target}",
            api_key=KEY_A,
            extra_args=extra,
        )

    started: list[EngineServer] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(engine, "second"),
                pool.submit(engine, "strict", "--routing-require-tag"),
            ]
            errors = []
            for f in futures:
                try:
                    started.append(f.result())
                except Exception as exc:  # stop the other one too
                    errors.append(exc)
            if errors:
                raise errors[0]
        second, strict = started
        router = start_router(
            [qwen_engine.url, second.url],
            port=free_port(),
            metrics_port=free_port(),
            log=logs / "router.log",
        )
        started.append(router)
        served = httpx.get(f"{qwen_engine.url}/v1/models", timeout=10).json()["data"][0]["id"]
        yield Fleet(router, (qwen_engine, second), strict, served)
    finally:
        for server in reversed(started):
            server.stop()


def _request(path: str, form: str, model: str, tokens: list[int]) -> dict[str, Any]:
    """An untagged request of ``form`` on ``path`` (the tag travels in the header)."""
    stream = form.endswith("stream")
    if path == "/generate":
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        if form.startswith("text"):
            body["text"] = words(tokens)
        else:
            body["input_ids"] = tokens
        if form == "n2":
            body["sampling_params"]["n"] = 2
        body["stream"] = stream
        return body
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = words(tokens)  # the router answers 422 to token-id prompts
    else:
        body["messages"] = [{"role": "user", "content": words(tokens)}]
    return body


def _post(url: str, path: str, body: dict[str, Any], key: str | None) -> httpx.Response:
    headers = {KEY: key} if key is not None else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def _ok(r: httpx.Response) -> None:
    """200, and for a stream: no error event, ends with [DONE]."""
    assert r.status_code == 200, (r.status_code, r.text[:600])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]", data[-3:]
        for d in data[:-1]:
            assert "error" not in json.loads(d), d


def _metric(engine: EngineServer, name: str) -> float:
    text = httpx.get(f"{engine.url}/r3/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


FORMS = [
    ("/generate", "ids"),
    ("/generate", "ids-stream"),
    ("/generate", "text"),
    ("/generate", "n2"),
    ("/v1/completions", "text"),
    ("/v1/completions", "text-stream"),
    ("/v1/chat/completions", "chat"),
    ("/v1/chat/completions", "chat-stream"),
]


@pytest.mark.parametrize(("path", "form"), FORMS)
def test_every_endpoint_stores_through_the_router_as_directly(
    fleet: Fleet, cache_client: RoutingClient, path: str, form: str
) -> None:
    """Through the router, tagged by the header: stored, and equal to a direct request."""
    via, direct = rid("via-router"), rid("direct")
    body = _request(path, form, fleet.model, PROMPT)
    _ok(_post(fleet.router.url, path, body, via))
    # Directly at one engine, tagged the documented direct way (custom_params).
    tagged = json.loads(json.dumps(body))
    tag = {"r3": {"rollout_id": direct}}
    if path == "/generate":
        tagged["sampling_params"]["custom_params"] = tag
    else:
        tagged["custom_params"] = tag
    _ok(_post(fleet.engines[0].url, path, tagged, None))
    suffixes = ["-0", "-1"] if form == "n2" else [""]
    for s in suffixes:
        got = cache_client.get(via + s)
        want = cache_client.get(direct + s)
        assert got.indices.shape == want.indices.shape and got.indices.shape[0] > len(PROMPT)
        np.testing.assert_array_equal(as_sets(got.indices), as_sets(want.indices))


def test_a_rollouts_turns_stay_on_one_engine_and_ship_new_rows_once(
    fleet: Fleet, cache_client: RoutingClient
) -> None:
    rollout = rid("turns")
    before = [_metric(e, "r3_engine_rows_total") for e in fleet.engines]
    context = list(PROMPT)
    last: list[int] = []
    for turn in range(3):
        last = context
        r = _post(fleet.router.url, "/generate", _request("/generate", "ids", "", context), rollout)
        _ok(r)
        out = r.json()
        assert out["meta_info"]["r3"]["stored"] is True, out["meta_info"]["r3"]
        context = context + out["output_ids"] + [40 + turn, 41 + turn]  # the tool's answer
    after = [_metric(e, "r3_engine_rows_total") for e in fleet.engines]
    shipped = [a - b for a, b in zip(after, before, strict=True)]
    info = cache_client.stat(rollout)
    assert len(info.segments) == 3
    # Every row shipped once, all by one engine (the other shipped nothing).
    assert sorted(shipped) == [0, info.num_rows], shipped
    # A driver's retry of a turn that was stored (its answer lost) is a 409, not a
    # second copy (docs/engine.md: timeouts and retries belong to the driver).
    retry = _post(fleet.router.url, "/generate", _request("/generate", "ids", "", last), rollout)
    assert retry.status_code == 409, (retry.status_code, retry.text[:300])
    assert cache_client.stat(rollout).num_rows == info.num_rows


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_untagged_request_is_refused_under_require_tag(
    fleet: Fleet, path: str, stream: bool
) -> None:
    body = _request(path, "text-stream" if stream else "text", fleet.model, PROMPT)
    r = _post(fleet.strict.url, path, body, None)
    assert r.status_code == 400, (r.status_code, r.text[:600])
    assert not r.headers.get("content-type", "").startswith("text/event-stream")
    assert "--routing-require-tag" in r.text and "x-smg-routing-key" in r.text.lower()


def test_require_tag_still_answers_health_checks_and_header_tags(
    fleet: Fleet, cache_client: RoutingClient
) -> None:
    for probe in ("/health", "/health_generate"):
        assert httpx.get(f"{fleet.strict.url}{probe}", timeout=60).status_code == 200
    rollout = rid("strict")
    _ok(_post(fleet.strict.url, "/generate", _request("/generate", "ids", "", PROMPT), rollout))
    assert cache_client.stat(rollout).num_rows > len(PROMPT)


def test_a_grpc_shipping_engine_continues_a_rollout(
    fleet: Fleet, cache_client: RoutingClient
) -> None:
    """The gRPC transport end to end: a second turn stores only its new rows."""
    rollout = rid("grpc")
    first = _post(fleet.strict.url, "/generate", _request("/generate", "ids", "", PROMPT), rollout)
    _ok(first)
    context = PROMPT + first.json()["output_ids"] + [50, 51]
    second = _post(
        fleet.strict.url, "/generate", _request("/generate", "ids", "", context), rollout
    )
    _ok(second)
    ref = second.json()["meta_info"]["r3"]
    assert ref["stored"] is True and ref["start"] == first.json()["meta_info"]["r3"]["end"]
    info = cache_client.stat(rollout)
    assert len(info.segments) == 2 and info.num_rows == ref["end"]


def test_header_and_body_naming_different_rollouts_is_400(fleet: Fleet) -> None:
    body = _request("/generate", "ids", "", PROMPT)
    body["sampling_params"]["custom_params"] = {"r3": {"rollout_id": rid("body")}}
    r = _post(fleet.engines[0].url, "/generate", body, rid("header"))
    assert r.status_code == 400 and "send one rollout id" in r.text, r.text[:600]


def _untagged_all_ok(fleet: Fleet, n: int = 12) -> None:
    for path in ("/generate", "/v1/chat/completions"):
        for _ in range(n // 2):
            _ok(_post(fleet.router.url, path, _request(path, "text", fleet.model, PROMPT), None))


def test_r3_refusals_and_a_cache_outage_leave_engines_in_rotation(
    fleet: Fleet,
    engine_cache: Service,
    cache_client: RoutingClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    rollout = rid("stale")
    _ok(_post(fleet.router.url, "/generate", _request("/generate", "ids", "", PROMPT), rollout))
    # 20 stale turns: a prompt that does not extend the stored trajectory.
    stale = _request("/generate", "ids", "", [90, 91, 92])
    for _ in range(20):
        r = _post(fleet.router.url, "/generate", stale, rollout)
        assert r.status_code == 409, (r.status_code, r.text[:300])
    _untagged_all_ok(fleet)
    # A 10 s cache outage while tagged requests keep coming: each is refused (503).
    engine_cache.stop(signal.SIGKILL)
    try:
        t0, refused = time.monotonic(), 0
        while time.monotonic() - t0 < 10:
            path = ("/generate", "/v1/chat/completions")[refused % 2]
            body = _request(path, "text", fleet.model, PROMPT)
            r = _post(fleet.router.url, path, body, rid("down"))
            assert r.status_code == 503, (r.status_code, r.text[:300])
            refused += 1
        assert refused >= 5
        for engine in fleet.engines:  # each transport answers the outage the same way
            body = _request("/generate", "ids", "", PROMPT)
            r = _post(engine.url, "/generate", body, rid("down-direct"))
            assert r.status_code == 503, (engine.url, r.status_code, r.text[:300])
        _untagged_all_ok(fleet)
    finally:
        restart_cache(engine_cache, tmp_path_factory)
    workers = httpx.get(f"{fleet.router.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(
        e.url for e in fleet.engines
    ), workers
    _untagged_all_ok(fleet, 16)
    after = rid("after")
    _ok(_post(fleet.router.url, "/generate", _request("/generate", "ids", "", PROMPT), after))
    assert cache_client.stat(after).num_rows > len(PROMPT)


def _rows_shipped(engine: EngineServer) -> float:
    return _metric(engine, "r3_engine_rows_total")


def test_a_killed_engines_keys_move_to_a_live_engine(
    qwen_engine: EngineServer,
    engine_cache: Service,
    tiny_models: dict[str, Path],
    cache_client: RoutingClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``kill -9`` of an engine behind the router: until the router's health checks
    take it out, its keys are answered 500 ``call_upstream_*`` by the router (which
    :func:`sglang_r3.launch.fleet.classify_failure` tells from an r3 500); then the rollout's
    next turn continues on the live engine."""
    logs = tmp_path_factory.mktemp("dies")
    victim = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=logs / "victim.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
    )
    router = None
    try:
        router = start_router(
            [qwen_engine.url, victim.url],
            port=free_port(),
            metrics_port=free_port(),
            log=logs / "router.log",
        )
        # A rollout whose key the router sends to the victim (a new key goes to a
        # random engine; the manual policy then keeps it there).
        for _ in range(20):
            rollout = rid("dies")
            before = _rows_shipped(victim)
            first = _post(
                router.url, "/generate", _request("/generate", "ids", "", PROMPT), rollout
            )
            _ok(first)
            if _rows_shipped(victim) > before:
                break
        else:
            pytest.fail("20 new keys all went to the live engine")
        end = first.json()["meta_info"]["r3"]["end"]
        context = PROMPT + first.json()["output_ids"] + [60, 61]
        body = _request("/generate", "ids", "", context)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        failures: list[tuple[float, int, str]] = []
        while True:
            r = _post(router.url, "/generate", body, rollout)
            if r.status_code == 200:
                break
            failures.append((time.monotonic() - t0, r.status_code, r.text))
            assert time.monotonic() - t0 < 120, failures[-3:]
            time.sleep(0.2)
        window = time.monotonic() - t0
        print(f"dead engine's key refused for {window:.1f} s ({len(failures)} answers)")
        # The router's own 500s, told apart from an r3 500 (rows failed validation).
        assert failures, "the router answered the dead engine's key at once"
        for _, status, text in failures:
            assert (status, classify_failure(status, text)) == (500, "engine_unreachable"), text
        # Not a timing claim: a bound from the settings, with a generous margin.
        assert window < DEAD_ENGINE_WINDOW_S + 10, (window, failures[-1])
        workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
        healthy = [w["url"] for w in workers if w.get("is_healthy")]
        assert healthy == [qwen_engine.url], workers
        # The turn continued on the live engine, from the stored trajectory.
        ref = r.json()["meta_info"]["r3"]
        assert ref["stored"] is True and ref["start"] == end, ref
    finally:
        if router is not None:
            router.stop()
        victim.stop()


ROUTER_500 = (
    '{"error":{"type":"Internal Server Error","code":"call_upstream_request_error",'
    '"message":"error sending request for url (http://127.0.0.1:1/generate). '
    'URL: http://127.0.0.1:1/generate"}}'
)


def test_classify_failure_tells_the_routers_500_from_an_r3_500() -> None:
    """The router's body is the one the killed-engine test receives; the r3 bodies
    are built by the code that answers them (SGLang's /generate error response,
    its stream error event, and the extension's OpenAI error object)."""
    from sglang.srt.entrypoints.http_server import _create_error_response

    err = R3RequestError(500, "r3: engine routing failed validation, not stored: x")
    generate = _create_error_response(err).body
    stream_event = {"error": {"message": str(err), "code": 500, "retryable": False}}
    openai = json.dumps(openai_error(err))
    assert classify_failure(500, ROUTER_500) == "engine_unreachable"
    for body in (generate, stream_event, openai):
        assert classify_failure(500, body) == "r3", body
    upstream = _create_error_response(ValueError("Input length exceeds the limit")).body
    for body in (upstream, "Internal Server Error", b"", "[]"):
        assert classify_failure(500, body) == "other", body
