"""``--tokenizer-worker-num 2``: SGLang serves HTTP from two worker processes.

The launcher points ``SGLANG_HTTP_SERVER_APP_PATH`` at :mod:`sglang_r3.worker_app`,
which loads the plugin in each worker.  One real engine with two tokenizer workers
and ``--routing-lookup seen`` (each worker remembers only the rollouts it saw), next
to the session's reference engine (``qwen_engine``: one HTTP process).

Which worker serves a request is the kernel's choice at ``accept()``; an HTTP
keep-alive connection stays with the worker that accepted it.  So the tests hold
one connection per worker (found by asking ``/r3/info`` for its ``pid``) and check,
after each request, that it went over that same connection.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.config import EngineConfig
from sglang_r3.launch.startup import APP_PATH, APP_PATH_ENV, unsupported_options
from sglang_r3.tools.local_stack import EngineServer, start_engine
from tests.support.engine_requests import as_sets, inline_rows, rid, sp
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

QWEN_LAYERS = 3


@dataclass
class Worker:
    """A keep-alive connection to one HTTP worker."""

    pid: int
    client: httpx.Client
    local: Any  # the connection's local address: the same for every request on it

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST over this worker's connection (fails if it was not that connection)."""
        r = self.client.post(path, json=body)
        assert _local(r) == self.local, "the keep-alive connection to the worker was lost"
        return r

    def info(self) -> dict[str, Any]:
        r = self.client.get("/r3/info")
        assert _local(r) == self.local and r.json()["pid"] == self.pid
        return dict(r.json())


def _local(r: httpx.Response) -> Any:
    return r.extensions["network_stream"].get_extra_info("client_addr")


@pytest.fixture(scope="module")
def workers_engine(
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    server = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=tmp_path_factory.mktemp("tokenizer-workers") / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        extra_args=("--tokenizer-worker-num", "2", "--routing-lookup", "seen"),
        env={k: v for k, v in os.environ.items() if k != APP_PATH_ENV},
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workers(workers_engine: EngineServer) -> Iterator[tuple[Worker, Worker]]:
    """One connection to each of the two workers."""
    found: dict[int, Worker] = {}
    spare: list[httpx.Client] = []

    def connect() -> Worker:
        client = httpx.Client(
            base_url=workers_engine.url,
            timeout=120,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        r = client.get("/r3/info")
        return Worker(int(r.json()["pid"]), client, _local(r))

    try:
        with ThreadPoolExecutor(4) as pool:  # concurrent connects land on both workers
            for _ in range(10):
                for w in pool.map(lambda _: connect(), range(4)):
                    if w.pid in found:
                        spare.append(w.client)
                    else:
                        found[w.pid] = w
                if len(found) == 2:
                    break
        assert len(found) == 2, f"40 connections all reached worker(s) {sorted(found)}"
        a, b = found.values()
        yield a, b
    finally:
        for c in [*spare, *(w.client for w in found.values())]:
            c.close()


def _stored_total(url: str) -> float:
    text = httpx.get(f"{url}/r3/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('r3_engine_outputs_total{outcome="stored"}')
    )


def test_tagged_requests_on_both_workers_store_the_reference_rows(
    workers: tuple[Worker, Worker],
    workers_engine: EngineServer,
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
) -> None:
    before = {w.pid: w.info()["outputs"].get("stored", 0) for w in workers}
    total_before = _stored_total(workers_engine.url)
    for i in range(4):
        worker = workers[i % 2]
        prompt = list(range(20 + 7 * i, 44 + 7 * i))
        got, want = rid("workers"), rid("reference")
        r = worker.post("/generate", {"input_ids": prompt, "sampling_params": sp(got, 8)})
        assert r.status_code == 200, r.text[:600]
        out = r.json()
        assert out["meta_info"]["r3"]["stored"] is True, out["meta_info"]
        ref = httpx.post(
            f"{qwen_engine.url}/generate",
            json={"input_ids": prompt, "sampling_params": sp(want, 8)},
            timeout=120,
        )
        assert ref.status_code == 200, ref.text[:600]
        assert out["output_ids"] == ref.json()["output_ids"]
        stored, reference = cache_client.get(got), cache_client.get(want)
        assert stored.indices.shape == reference.indices.shape == (len(prompt) + 7, 3, 2)
        np.testing.assert_array_equal(as_sets(stored.indices), as_sets(reference.indices))
    # Each worker shipped its two; /r3/metrics sums the workers, whichever answers.
    after = {w.pid: w.info()["outputs"].get("stored", 0) for w in workers}
    assert {p: after[p] - before[p] for p in after} == {w.pid: 2 for w in workers}
    assert _stored_total(workers_engine.url) - total_before == 4


def _turns(post: Any, rollout: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Three turns of one rollout, turn ``k`` sent with ``post(k, body)``: the
    references and the final context."""
    context = list(range(60, 84))
    refs = []
    for turn in range(3):
        r = post(turn, {"input_ids": context, "sampling_params": sp(rollout, 6)})
        assert r.status_code == 200, r.text[:600]
        out = r.json()
        refs.append(out["meta_info"]["r3"])
        context = context + out["output_ids"] + [30 + turn, 31 + turn]  # the tool's answer
    return refs, context


def test_a_rollout_whose_turns_reach_different_workers_is_stitched_right(
    workers: tuple[Worker, Worker],
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
) -> None:
    """Turns on worker a, b, a under ``--routing-lookup seen``: b has not seen the
    rollout, generates it as new and stores only the rows past what a stored."""
    got, want = rid("across-workers"), rid("one-process")
    refs, tokens = _turns(lambda k, body: workers[k % 2].post("/generate", body), got)
    ref_refs, ref_tokens = _turns(
        lambda k, body: httpx.post(f"{qwen_engine.url}/generate", json=body, timeout=120), want
    )
    for prev, ref in itertools.pairwise(refs):
        assert ref["stored"] is True and ref["start"] == prev["end"], refs
    assert [(r["start"], r["end"]) for r in refs] == [(r["start"], r["end"]) for r in ref_refs]
    info = cache_client.stat(got)
    assert len(info.segments) == 3 and info.num_rows == refs[-1]["end"]
    assert tokens == ref_tokens
    stored, reference = cache_client.get(got), cache_client.get(want)
    np.testing.assert_array_equal(as_sets(stored.indices), as_sets(reference.indices))


def test_untagged_request_gets_upstreams_base64_rows_on_each_worker(
    workers: tuple[Worker, Worker],
) -> None:
    for worker in workers:
        body = {
            "input_ids": list(range(10, 30)),
            "sampling_params": sp(),
            "return_routed_experts": True,
        }
        r = worker.post("/generate", body)
        assert r.status_code == 200, r.text[:600]
        out = r.json()
        assert "r3" not in out["meta_info"]
        assert isinstance(out["meta_info"]["routed_experts"], str)
        assert inline_rows(out, QWEN_LAYERS).shape == (20 + 6 - 1, QWEN_LAYERS, 2)


def test_header_tagged_chat_on_each_worker_is_stored(
    workers: tuple[Worker, Worker], cache_client: RoutingClient
) -> None:
    """The OpenAI hook and header tagging (what a request behind sglang-router
    carries) in each worker."""
    model = workers[0].client.get("/v1/models").json()["data"][0]["id"]
    for worker in workers:
        rollout = rid("chat")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "w11 w12 w13 w14"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = worker.client.post(
            "/v1/chat/completions", json=body, headers={"X-SMG-Routing-Key": rollout}
        )
        assert _local(r) == worker.local and r.status_code == 200, r.text[:600]
        (ref,) = r.json()["sglext"]["r3"]
        assert ref["stored"] is True and ref["rollout_id"] == rollout, ref
        assert cache_client.stat(rollout).num_rows == ref["end"]


# ---------------------------------------------------------------- without an engine


def test_refused_when_the_workers_would_run_without_the_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``python -m sglang.launch_server --tokenizer-worker-num 2`` leaves SGLang's own app."""
    args = SimpleNamespace(enable_return_routed_experts=True, tokenizer_worker_num=2)
    config = EngineConfig(routing_cache="http://127.0.0.1:1")
    monkeypatch.delenv(APP_PATH_ENV, raising=False)
    (problem,) = unsupported_options(args, config)
    assert "--tokenizer-worker-num > 1" in problem and "http_server.py" in problem
    assert "python -m sglang_r3.launch_server" in problem and APP_PATH in problem
    monkeypatch.setenv(APP_PATH_ENV, "sglang.srt.entrypoints.http_server:app")
    assert len(unsupported_options(args, config)) == 1
    monkeypatch.setenv(APP_PATH_ENV, APP_PATH)
    assert unsupported_options(args, config) == []
    assert unsupported_options(args, EngineConfig()) == []  # shipping off: not ours to refuse


def test_a_worker_without_its_hooks_stops_the_server() -> None:
    """The worker app refuses to serve when the plugin's hooks are not in place
    (here: SGLANG_PLUGINS excludes it), with uvicorn's start-up failure status (3),
    on which uvicorn stops the server instead of restarting the worker."""
    env = {
        **os.environ,
        **EngineConfig(routing_cache="http://127.0.0.1:1").to_env(),
        "SGLANG_PLUGINS": "smg-zmq",
    }
    proc = subprocess.run(
        [sys.executable, "-c", "import sglang_r3.worker_app"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "stops the server" in proc.stderr and "hook not registered" in proc.stderr
