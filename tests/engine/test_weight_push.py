"""What an RL loop relies on when it pushes new weights to SGLang (real server, CPU).

* ``/update_weights_from_disk`` flushes the radix cache by default, so a prompt the
  engine served before returns rows computed with the new weights; with
  ``flush_cache: false`` it returns the old weights' rows for the cached prefix
  (shown here, so the hazard and what protects against it are both on record);
* the pushed ``weight_version`` reaches every segment stored after the push, and a
  multi-turn rollout whose turns straddle a push keeps each turn's version.

On each tested SGLang release (:func:`tests.support.engine_fixtures.sglang_release`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from r3_client import RolloutNotFoundError, RoutingClient
from sglang_r3.releases import Release
from sglang_r3.tools.local_stack import EngineServer, build_tiny_model, engine_port, start_engine
from tests.support.engine_fixtures import release_env, release_python
from tests.support.engine_requests import as_sets, inline_rows, rid
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

PROMPT = [21 + i for i in range(24)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of the same shape with different random weights."""
    root = tmp_path_factory.mktemp("weights")
    return {
        name: build_tiny_model("qwen3_moe", root / name, seed=seed, init_std=0.2)
        for name, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def engine(
    weights: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
    sglang_release: str,
) -> Iterator[EngineServer]:
    """Its own engine: the tests change its weights."""
    server = start_engine(
        weights["a"],
        port=engine_port(),
        log=tmp_path_factory.mktemp("push") / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        env=release_env(),
        python=release_python(sglang_release),
    )
    yield server
    server.stop()


def _push(engine: EngineServer, path: Path, version: str, **extra: Any) -> None:
    r = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": version, **extra},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    info = httpx.get(f"{engine.url}/model_info", timeout=30).json()
    assert info["weight_version"] == version


def _generate(engine: EngineServer, tokens: list[int], rollout: str, new: int) -> Any:
    """A greedy tagged ``/generate``; its JSON."""
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": tokens,
            "sampling_params": {
                "max_new_tokens": new,
                "temperature": 0,
                "custom_params": {"r3": {"rollout_id": rollout}},
            },
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_rows(engine: EngineServer, client: RoutingClient, tokens: list[int]) -> Any:
    """Generate one token for ``tokens`` under a fresh rollout; its stored prompt rows."""
    rollout = rid("push")
    _generate(engine, tokens, rollout, 1)
    return as_sets(client.get(rollout).indices[: len(tokens) - 1])


def test_a_push_flushes_the_prefix_cache_and_without_a_flush_rows_go_stale(
    engine: EngineServer, weights: dict[str, Path], cache_client: RoutingClient
) -> None:
    _push(engine, weights["a"], "a-0")
    rows_a = _prompt_rows(engine, cache_client, PROMPT)
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_a)  # a cache hit
    # Without the flush, the cached prefix keeps the rows the old weights produced.
    _push(engine, weights["b"], "b-stale", flush_cache=False)
    stale = _prompt_rows(engine, cache_client, PROMPT)
    httpx.post(f"{engine.url}/flush_cache", timeout=60)
    rows_b = _prompt_rows(engine, cache_client, PROMPT)
    assert not np.array_equal(rows_b, rows_a), "the two checkpoints route alike"
    assert np.array_equal(stale, rows_a), "SGLang recomputed the prefix without a flush"
    # The default push flushes: a prompt served under b is served fresh under a.
    _push(engine, weights["a"], "a-1")
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_a)
    _push(engine, weights["b"], "b-1")
    assert np.array_equal(_prompt_rows(engine, cache_client, PROMPT), rows_b)


def test_turns_straddling_a_push_keep_their_versions(
    engine: EngineServer, weights: dict[str, Path], cache_client: RoutingClient
) -> None:
    _push(engine, weights["a"], "v1")
    rollout = rid("straddle")

    first = _generate(engine, PROMPT, rollout, 4)
    first_rows = cache_client.get(rollout).indices.copy()
    _push(engine, weights["b"], "v2")
    second = _generate(engine, PROMPT + first["output_ids"] + [7, 8], rollout, 4)
    assert second["meta_info"]["r3"]["weight_version"] == "v2"
    info = cache_client.stat(rollout)
    assert [s.segment.weight_version for s in info.segments] == ["v1", "v2"]
    assert info.segments[1].segment.start == first["meta_info"]["r3"]["end"]
    # The first turn's rows are those of the weights that generated it.
    now = cache_client.get(rollout).indices
    np.testing.assert_array_equal(now[: len(first_rows)], first_rows)


def _computed_rows(engine: EngineServer, tokens: list[int]) -> Any:
    """What the engine's KV holds for rows ``[0, len(tokens) - 1)`` right after a call that
    ended on ``tokens``: an untagged upstream request of the whole trajectory, a full
    radix-cache hit (the oracle for "what that call computed or reused")."""
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_routed_experts": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["cached_tokens"] >= len(tokens) - 1, "not a full cache hit"
    return as_sets(inline_rows(out, 3)[: len(tokens) - 1])


def _evict(engine: EngineServer) -> None:
    """Push a rollout's KV out of the radix cache the way load does: fill the 4096-token
    pool with other prompts (least recently used goes first)."""
    rng = np.random.default_rng(0)
    for _ in range(7):
        r = httpx.post(
            f"{engine.url}/generate",
            json={
                "input_ids": rng.integers(5, 1000, size=700).tolist(),
                "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("between", ["push", "flush", "evict"])
def test_a_turn_that_recomputed_its_prefix_stores_it_as_a_view(
    engine: EngineServer,
    weights: dict[str, Path],
    cache_client: RoutingClient,
    between: str,
) -> None:
    """Turn 2 after a weight push (or a radix flush, or an LRU eviction by other traffic,
    at the same weights) recomputes turn 1's rows: they are stored as a view serving turn
    2, equal to what turn 2 computed."""
    _push(engine, weights["a"], "v1")
    rollout = rid(f"view-{between}")
    first = _generate(engine, PROMPT, rollout, 4)
    end1 = first["meta_info"]["r3"]["end"]
    first_rows = as_sets(cache_client.get(rollout).indices)
    if between == "push":
        _push(engine, weights["b"], "v2")
    elif between == "flush":
        assert httpx.post(f"{engine.url}/flush_cache", timeout=60).status_code == 200
    else:
        _evict(engine)
    version = "v2" if between == "push" else "v1"
    tokens2 = PROMPT + first["output_ids"] + [7, 8]
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": tokens2,
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0,
                "custom_params": {"r3": {"rollout_id": rollout, "inline": True}},
            },
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    second = r.json()
    trajectory = tokens2 + second["output_ids"]
    oracle = _computed_rows(engine, trajectory)
    ref = second["meta_info"]["r3"]
    assert ref["start"] == end1 and [v["serves"] for v in ref["views"]] == [end1]
    # inline: what this call computed, from where it recomputed.
    assert ref["inline_start"] == 0
    np.testing.assert_array_equal(as_sets(inline_rows(second, 3)), oracle)

    info = cache_client.stat(rollout)
    assert [(v.serves, v.start, v.end, v.weight_version) for v in info.views] == [
        (end1, 0, end1, version)
    ]
    # generated: turn 1's rows untouched; latest / exact: what turn 2 attended to.
    generated = as_sets(cache_client.get(rollout).indices)
    np.testing.assert_array_equal(generated[:end1], first_rows)
    np.testing.assert_array_equal(as_sets(cache_client.get(rollout, view="latest").indices), oracle)
    served = cache_client.get_served(rollout)
    assert [(s.serves_start, s.serves_end) for s in served] == [(0, end1), (end1, len(oracle))]
    np.testing.assert_array_equal(as_sets(served[0].routing.indices), first_rows)
    np.testing.assert_array_equal(as_sets(served[1].routing.indices), oracle)
    if between == "push":
        changed = (oracle[:end1] != first_rows).any(axis=-1).sum()
        assert changed > 0, "the two checkpoints route turn 1 alike: the test shows nothing"

    # Turn 3, a full cache hit: no view, nothing recomputed is shipped.
    tokens3 = [*trajectory, 9]
    third = _generate(engine, tokens3, rollout, 2)
    assert "views" not in third["meta_info"]["r3"]
    assert len(cache_client.stat(rollout).views) == 1


def _read_events(response: httpx.Response, on_tokens: Any) -> list[dict[str, Any]]:
    """Every ``data:`` event of a ``/generate`` stream (``on_tokens(n)`` after each)."""
    events: list[dict[str, Any]] = []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        events.append(json.loads(line[len("data: ") :]))
        on_tokens(len(events[-1].get("output_ids") or []))
    return events


def _read_stream(response: httpx.Response, on_tokens: Any) -> dict[str, Any]:
    """Read a ``/generate`` stream to its end; ``on_tokens(n)`` after each chunk; the last chunk."""
    last: dict[str, Any] = {}
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        assert "error" not in chunk, chunk
        last = chunk
        on_tokens(len(chunk.get("output_ids") or []))
    return last


def test_a_generation_aborted_for_a_push_and_resumed_continues_its_rollout(
    engine: EngineServer, weights: dict[str, Path], cache_client: RoutingClient
) -> None:
    """AReaL's interrupted rollout: ``/pause_generation`` aborts the in-flight
    generation, the weights are pushed, generation continues, and the driver resumes
    with the same rollout, ``input_ids`` = prompt + the output so far (areal
    ``RemoteSGLangEngine.agenerate``).  The rollout holds one row per token, the
    aborted part under v1, the rest under v2, each row shipped once."""
    _push(engine, weights["a"], "v1")
    rollout = rid("resume")
    paused = False

    def pause_after(tokens: int) -> None:
        nonlocal paused
        if tokens >= 8 and not paused:
            paused = True
            r = httpx.post(f"{engine.url}/pause_generation", json={"mode": "abort"}, timeout=120)
            assert r.status_code == 200, r.text

    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {
                "r3": {"rollout_id": rollout, "weight_version": "v1", "inline": True}
            },
        },
        "stream": True,
    }
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=300) as response:
        assert response.status_code == 200
        aborted = _read_stream(response, pause_after)
    assert paused
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
    partial = aborted["output_ids"]
    assert 8 <= len(partial) < 2000
    boundary = len(PROMPT) + len(partial) - 1  # rows of the aborted call: [0, boundary)
    ref = meta["r3"]
    assert ref["stored"] is True and (ref["start"], ref["end"]) == (0, boundary), ref
    assert ref["weight_version"] == "v1"
    computed_v1 = inline_rows(aborted, 3)
    assert computed_v1.shape[0] == boundary

    _push(engine, weights["b"], "v2")
    r = httpx.post(f"{engine.url}/continue_generation", json={}, timeout=60)
    assert r.status_code == 200, r.text

    resumed_ids = PROMPT + partial
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": resumed_ids,
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "custom_params": {
                    "r3": {"rollout_id": rollout, "weight_version": "v2", "inline": True}
                },
            },
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    resumed = r.json()
    final = resumed_ids + resumed["output_ids"]
    ref2 = resumed["meta_info"]["r3"]
    assert ref2["stored"] is True and ref2["weight_version"] == "v2"
    assert (ref2["start"], ref2["end"]) == (boundary, len(final) - 1), ref2  # only new rows

    info = cache_client.stat(rollout)
    segs = sorted(info.segments, key=lambda s: s.segment.start)
    ranges = [(s.segment.start, s.segment.end) for s in segs]
    assert ranges == [(0, boundary), (boundary, len(final) - 1)], ranges
    assert [s.segment.weight_version for s in segs] == ["v1", "v2"]
    assert info.num_rows == len(final) - 1
    stored = cache_client.get(rollout)
    assert stored.indices.shape[0] == len(final) - 1 and (stored.indices >= 0).all()
    # The rows before the boundary are the ones the aborted call computed under v1;
    # after it, the resumed call's (under v2).
    np.testing.assert_array_equal(as_sets(stored.indices[:boundary]), as_sets(computed_v1))
    # The push flushed the radix cache: the resumed call recomputed the prefix under v2
    # (a view serving its rows), and its inline answer starts where it recomputed.
    assert ref2["inline_start"] == 0
    resumed_rows = as_sets(inline_rows(resumed, 3))
    np.testing.assert_array_equal(as_sets(stored.indices[boundary:]), resumed_rows[boundary:])
    assert [(v.serves, v.start, v.end, v.weight_version) for v in info.views] == [
        (boundary, 0, boundary, "v2")
    ]
    latest = cache_client.get(rollout, view="latest").indices
    np.testing.assert_array_equal(as_sets(latest), resumed_rows)
    by_version = {s.weight_version: (s.start, s.end) for s in stored.segments}
    assert by_version == {"v1": (0, boundary), "v2": (boundary, len(final) - 1)}


def test_a_generation_paused_in_place_across_a_push_labels_each_part(
    engine: EngineServer,
    weights: dict[str, Path],
    cache_client: RoutingClient,
    sglang_release: str,
) -> None:
    """miles/slime fully-async: ``/pause_generation`` ``in_place`` keeps the request and
    its KV, the weights change under it, generation continues.  One output, rows from
    two weight versions: stored as two segments split where SGLang's
    ``meta_info["weight_versions"]`` says the version changed, each labelled with its
    own version (not one label for both)."""
    _push(engine, weights["a"], "w1")
    rollout = rid("inplace")
    paused = False

    def push_after(tokens: int) -> None:
        nonlocal paused
        if tokens >= 8 and not paused:
            paused = True
            r = httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}, timeout=120)
            assert r.status_code == 200, r.text
            _push(engine, weights["b"], "w2", flush_cache=False)
            r = httpx.post(f"{engine.url}/continue_generation", json={}, timeout=60)
            assert r.status_code == 200, r.text

    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"r3": {"rollout_id": rollout, "inline": True}},
        },
        "stream": True,
    }
    if not Release(sglang_release).has("weight_version_spans"):
        # No spans before 0.5.19: which rows are whose cannot be told, so nothing is
        # stored under one label; the stream ends with r3's 503 naming the release.
        with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=300) as response:
            assert response.status_code == 200
            events = _read_events(response, push_after)
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 503, events[-2:]
        assert "weights changed from 'w1' to 'w2'" in errors[0]["message"], errors
        assert f"SGLang {sglang_release} does not say" in errors[0]["message"], errors
        with pytest.raises(RolloutNotFoundError):
            cache_client.stat(rollout)
        return
    with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=300) as response:
        assert response.status_code == 200
        last = _read_stream(response, push_after)
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["w1", "w2"], spans
    n = len(last["output_ids"])
    # Output token i was sampled from the forward pass of position P + i - 1, so the
    # rows of the first span's tokens (and the prompt's) are [0, P + a - 1).
    boundary = len(PROMPT) + spans[1]["start"] - 1
    end = len(PROMPT) + n - 1
    info = cache_client.stat(rollout)
    segs = sorted(info.segments, key=lambda s: s.segment.start)
    got = [(s.segment.start, s.segment.end, s.segment.weight_version) for s in segs]
    assert got == [(0, boundary, "w1"), (boundary, end, "w2")], got
    ref = meta["r3"]
    assert [(s["start"], s["end"], s["weight_version"]) for s in ref["segments"]] == got
    stored = cache_client.get(rollout)
    np.testing.assert_array_equal(as_sets(stored.indices), as_sets(inline_rows(last, 3)))
    # The rows labelled w1 are what w1 computes: generating the first span's tokens
    # again under w1 gives the same tokens and the same rows.
    _push(engine, weights["a"], "w1-again")
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": spans[1]["start"], "temperature": 0},
            "return_routed_experts": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["output_ids"] == last["output_ids"][: spans[1]["start"]]
    np.testing.assert_array_equal(
        as_sets(stored.indices[:boundary]), as_sets(inline_rows(again, 3))
    )
