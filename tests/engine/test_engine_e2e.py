"""End to end on a real SGLang server (CPU) with the extension: generate, ship, fetch, and
replay in HF what the engine recorded.

Every test here runs on each release in :data:`sglang_r3.releases.TESTED` (0.5.23, then
0.5.12: the ends of the supported range), each on its own engines, started once for the
module (an engine start is 1-3 minutes of CI, so what uses the same engines lives here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3_client import RolloutNotFoundError, RoutingClient, read_header, split_frames
from r3_client.replay import apply_routing_replay
from sglang_r3.tools.local_stack import EngineServer
from sglang_r3.tools.mismatch_report import (
    MisalignedLogprobsError,
    generate_rollouts,
    measure,
    output_logprobs,
)
from tests.support.engine_requests import (
    MAX_SEGMENT_ROWS,
    as_sets,
    generate,
    inline_rows,
    restart_cache,
    rid,
    sp,
    sse,
)
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen_engine(release_qwen_engine: EngineServer) -> EngineServer:
    """The session's Qwen engine on each tested release (:func:`sglang_release`)."""
    return release_qwen_engine


@pytest.fixture(scope="module")
def glm_engine(release_glm_engine: EngineServer) -> EngineServer:
    """The session's GLM engine on each tested release."""
    return release_glm_engine


QWEN_LAYERS = 3


def test_untagged_request_is_plain_upstream(qwen_engine: EngineServer) -> None:
    status, out = generate(
        qwen_engine.url,
        {"input_ids": list(range(10, 30)), "sampling_params": sp(), "return_routed_experts": True},
    )
    assert status == 200
    assert "r3" not in out["meta_info"]
    assert "prompt_token_ids" not in out
    assert inline_rows(out, QWEN_LAYERS).shape == (20 + 6 - 1, QWEN_LAYERS, 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_stored_routing_equals_upstream_inline(
    family: str,
    request: pytest.FixtureRequest,
    sglang_release: str,  # (the engines below are this release's)
    cache_client: RoutingClient,
    engine_cache: Service,
) -> None:
    engine: EngineServer = request.getfixturevalue(
        "qwen_engine" if family == "qwen3_moe" else "glm_engine"
    )
    rollout = rid(family)
    status, out = generate(
        engine.url,
        {"input_ids": list(range(40, 70)), "sampling_params": sp(rollout, 8, inline=True)},
    )
    assert status == 200, out
    ref = out["meta_info"]["r3"]
    assert ref["stored"] and ref["rollout_id"] == rollout
    assert (ref["start"], ref["end"]) == (0, 30 + 8 - 1)
    upstream = inline_rows(out, 3)
    got = cache_client.get(rollout)
    moe_layers = [0, 1, 2] if family == "qwen3_moe" else [1, 2]  # GLM: layer 0 is dense
    assert got.layer_ids == tuple(moe_layers)
    assert got.indices.shape == (37, len(moe_layers), 2)
    np.testing.assert_array_equal(as_sets(got.indices), as_sets(upstream[:, moe_layers]))
    if family == "glm4_moe":
        # The dense layer's column upstream is the never-written zero buffer.
        assert not upstream[:, 0].any()
    # A fleet mid-upgrade: the GLM engine runs with SGLANG_R3_FORMAT_VERSION=2 (an engine
    # whose readers predate format v3), the Qwen engine at the default, 3.
    with engine_cache.http() as c:
        stored = c.get(f"/v1/rollouts/{rollout}").content
    versions = {read_header(f, verify=False).version for f in split_frames(stored)}
    assert versions == ({3} if family == "qwen3_moe" else {2})


def test_response_carries_reference_not_blob(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid()
    status, out = generate(
        qwen_engine.url, {"input_ids": list(range(50, 70)), "sampling_params": sp(rollout)}
    )
    assert status == 200
    meta = out["meta_info"]
    assert "routed_experts" not in meta and "prompt_token_ids" not in out
    ref = meta["r3"]
    assert ref["nbytes"] > 0 and ref["segments"][0]["nbytes"] == ref["nbytes"]
    info = cache_client.stat(rollout)
    assert info.num_rows == ref["end"] == 25
    assert info.stored_bytes == ref["nbytes"]
    # A Qwen3-30B-A3B-sized int32 + base64 blob would be 4/3 * 4 bytes per id; here
    # the reference is a few hundred bytes whatever the length.
    assert len(str(ref)) < 400


def test_prefix_cache_hit_gives_identical_prefix_rows(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    prompt = list(range(600, 640))
    a, b = rid("pa"), rid("pb")
    s1, _ = generate(qwen_engine.url, {"input_ids": prompt, "sampling_params": sp(a)})
    s2, o2 = generate(
        qwen_engine.url,
        {"input_ids": prompt, "sampling_params": {**sp(b), "temperature": 1.0}},
    )
    assert s1 == s2 == 200
    assert o2["meta_info"]["cached_tokens"] >= len(prompt) - 1  # served from the radix cache
    ra, rb = cache_client.get(a), cache_client.get(b)
    np.testing.assert_array_equal(ra.indices[: len(prompt) - 1], rb.indices[: len(prompt) - 1])


def test_three_turns_in_three_segments_equal_one_request(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("agent")
    tokens = list(range(100, 120))
    refs = []
    for turn, version in enumerate(["v1", "v2", "v3"]):
        status, out = generate(
            qwen_engine.url,
            {"input_ids": tokens, "sampling_params": sp(rollout, 5, weight_version=version)},
        )
        assert status == 200, out
        refs.append(out["meta_info"]["r3"])
        # turn n asks the engine only for rows not stored yet
        assert refs[-1]["start"] == (refs[-2]["end"] if turn else 0)
        tokens = tokens + out["output_ids"] + [7, 8, 9]  # the "tool output"
    final = tokens[:-3]  # the trajectory through the last turn's answer
    stored = cache_client.get(rollout)
    info = cache_client.stat(rollout)
    assert [(s.segment.start, s.segment.end) for s in info.segments] == [
        (r["start"], r["end"]) for r in refs
    ]
    assert [s.segment.weight_version for s in info.segments] == ["v1", "v2", "v3"]
    assert stored.indices.shape[0] == len(final) - 1
    # One request over the final trajectory (the radix cache holds it): same array.
    status, single = generate(
        qwen_engine.url,
        {
            "input_ids": final,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_routed_experts": True,
        },
    )
    assert status == 200
    whole = inline_rows(single, QWEN_LAYERS)[: len(final) - 1]
    np.testing.assert_array_equal(as_sets(stored.indices), as_sets(whole))


def test_diverging_prefix_is_a_conflict_and_stores_nothing(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("fork")
    tokens = list(range(200, 220))
    status, out = generate(qwen_engine.url, {"input_ids": tokens, "sampling_params": sp(rollout)})
    assert status == 200
    before = cache_client.get_frame(rollout)
    forked = tokens + out["output_ids"] + [5]
    forked[3] += 1
    status, err = generate(qwen_engine.url, {"input_ids": forked, "sampling_params": sp(rollout)})
    assert status == 409
    assert "do not start with that trajectory" in err["error"]["message"]
    assert cache_client.get_frame(rollout) == before
    # The documented way out: a new rollout id is a new branch.
    status, _ = generate(qwen_engine.url, {"input_ids": forked, "sampling_params": sp(rid("br"))})
    assert status == 200


def test_grpo_group_samples_get_own_ids_and_share_prompt_rows(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    group = rid("grpo")
    # a prompt of its own (each release's run shares one cache: a prompt stored by the
    # other release's run would be a dedupe hit for all four samples)
    prompt = np.random.default_rng().integers(300, 1000, 40).tolist()
    status, outs = generate(
        qwen_engine.url,
        {"input_ids": prompt, "sampling_params": {**sp(group, 6), "n": 4, "temperature": 1.0}},
    )
    assert status == 200 and len(outs) == 4
    refs = [o["meta_info"]["r3"] for o in outs]
    assert [r["rollout_id"] for r in refs] == [f"{group}-{k}" for k in range(4)]
    # The prompt part is its own segment; the service keeps it once.
    assert [r["segments"][0]["end"] for r in refs] == [len(prompt) - 1] * 4
    assert sum(r["segments"][0]["dedupe_hit"] for r in refs) == 3
    routings = [cache_client.get(r["rollout_id"]) for r in refs]
    for r in routings[1:]:
        np.testing.assert_array_equal(r.indices[:39], routings[0].indices[:39])
    infos = [cache_client.stat(r["rollout_id"]) for r in refs]
    assert all(i.shared_bytes > 0 for i in infos)
    # A sample is continued on its own; continuing with n>1 is refused.
    status, err = generate(
        qwen_engine.url,
        {"input_ids": prompt + outs[0]["output_ids"], "sampling_params": {**sp(group), "n": 4}},
    )
    assert status == 409 and "n>1" in err["error"]["message"]


def test_batch_of_prompts(qwen_engine: EngineServer, cache_client: RoutingClient) -> None:
    ids = [rid("b0"), rid("b1"), rid("b2")]
    prompts = [list(range(400, 410)), list(range(420, 435)), list(range(440, 447))]
    status, outs = generate(
        qwen_engine.url, {"input_ids": prompts, "sampling_params": sp(ids, 4, inline=True)}
    )
    assert status == 200 and len(outs) == 3
    for out, rollout, prompt in zip(outs, ids, prompts, strict=True):
        assert out["meta_info"]["r3"]["rollout_id"] == rollout
        got = cache_client.get(rollout)
        assert got.num_rows == len(prompt) + 4 - 1
        np.testing.assert_array_equal(as_sets(got.indices), as_sets(inline_rows(out, 3)))
    # Per-prompt tags (a list of sampling_params) work too, and a continued turn in a batch.
    first = prompts[0] + outs[0]["output_ids"]
    status, outs2 = generate(
        qwen_engine.url,
        {"input_ids": [first, list(range(450, 460))], "sampling_params": [sp(ids[0]), sp(rid())]},
    )
    assert status == 200
    assert outs2[0]["meta_info"]["r3"]["start"] == len(prompts[0]) + 4 - 1
    assert outs2[1]["meta_info"]["r3"]["start"] == 0


def test_tagged_and_untagged_requests_in_one_batch_each_get_their_own_rows(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """Requests that ask for routing and requests that do not, decoded in one batch.

    SGLang 0.5.12 lists a batch's ``routed_experts`` only for the requests that asked
    and the tokenizer manager reads it by position: without the plugin's alignment
    (``row_hooks.around_stream_output_generation``) the tokenizer manager raised
    ``IndexError`` and every request of the batch hung (first seen under verl's own
    start-up, whose warm-up request ran beside a tagged one).  Here 6 requests, every
    other one tagged, start together and run 24 tokens side by side."""
    import concurrent.futures

    ids = [rid("mix") if i % 2 else None for i in range(6)]
    bodies = [
        {
            "input_ids": list(range(400 + 10 * i, 416 + 10 * i)),
            "sampling_params": sp(key, 24, inline=True) if key else sp(None, 24),
        }
        for i, key in enumerate(ids)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: generate(qwen_engine.url, b, timeout=120), bodies))
    for key, (status, out) in zip(ids, answers, strict=True):
        assert status == 200, out
        meta = out["meta_info"]
        if key is None:
            assert "routed_experts" not in meta and "r3" not in meta, meta.keys()
            continue
        assert meta["r3"]["rollout_id"] == key
        stored = cache_client.get(key)
        assert stored.num_rows == 16 + 24 - 1
        np.testing.assert_array_equal(
            as_sets(stored.indices), as_sets(inline_rows(out, QWEN_LAYERS))
        )


def test_generate_stream_reference_in_final_chunk(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("stream")
    events = sse(
        qwen_engine.url,
        "/generate",
        {"input_ids": list(range(500, 520)), "stream": True, "sampling_params": sp(rollout, 6)},
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("r3" not in c["meta_info"] for c in chunks[:-1])
    ref = chunks[-1]["meta_info"]["r3"]
    assert ref["stored"] and ref["end"] == 25
    assert cache_client.get(rollout).num_rows == 25


def test_openai_completions_reference_every_choice(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    base = rid("oai")
    r = httpx.post(
        f"{qwen_engine.url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": ["w5 w6 w7 w8", "w9 w10"],
            "n": 2,
            "max_tokens": 4,
            "temperature": 0.8,
            "custom_params": {"r3": {"rollout_id": base}},
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    refs = body["sglext"]["r3"]
    assert [x["index"] for x in refs] == [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for ref in refs:
        got = cache_client.get(ref["rollout_id"])
        assert got.num_rows == ref["end"] > 0


def test_openai_chat_stream_reference_in_final_chunk(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("chat")
    events = sse(
        qwen_engine.url,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "w5 w6 w7"}],
            "max_tokens": 4,
            "stream": True,
            "custom_params": {"r3": {"rollout_id": rollout}},
        },
    )
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["sglext"]["r3"][0]["rollout_id"] == rollout
    assert cache_client.get(rollout).num_rows == last["sglext"]["r3"][0]["end"]


@pytest.mark.parametrize(
    ("tag", "needle"),
    [
        ({"rollout_id": "has space"}, "invalid rollout id"),
        ({"rollout_id": "x" * 201}, "invalid rollout id"),
        ({"rollout_id": ""}, "invalid rollout id"),
        ({"rollout_id": 7}, "must be a string"),
        ({"rollout_id": ["a", "b"]}, "2 rollout ids for 1 outputs"),
        ({"rollout_id": "ok", "colour": 1}, "unknown field"),
        ({"weight_version": "v"}, "rollout_id is required"),
        ({"rollout_id": "ok", "inline": "yes"}, "inline must be true or false"),
        ({"rollout_id": "ok", "on_cache_error": "ignore"}, "on_cache_error must be one of"),
    ],
)
def test_bad_tags_are_400_with_reason(
    qwen_engine: EngineServer, cache_client: RoutingClient, tag: dict[str, object], needle: str
) -> None:
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 2, "custom_params": {"r3": tag}},
    }
    status, err = generate(qwen_engine.url, body)
    assert status == 400 and needle in err["error"]["message"], err
    r = httpx.post(
        f"{qwen_engine.url}/v1/completions",
        json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2, "custom_params": {"r3": tag}},
        timeout=60,
    )
    assert r.status_code == 400 and needle in r.text
    if isinstance(tag.get("rollout_id"), str) and tag["rollout_id"] == "ok":
        with pytest.raises(RolloutNotFoundError):
            cache_client.stat("ok")


def test_duplicate_ids_in_one_request_are_400(qwen_engine: EngineServer) -> None:
    status, err = generate(
        qwen_engine.url,
        {"input_ids": [[11, 12], [13, 14]], "sampling_params": sp(["same", "same"])},
    )
    assert status == 400 and "names two outputs" in err["error"]["message"]


def test_oversize_routing_is_413(qwen_engine: EngineServer, cache_client: RoutingClient) -> None:
    rollout = rid("big")
    prompt = [3 + (i % 1000) for i in range(MAX_SEGMENT_ROWS + 50)]
    status, err = generate(qwen_engine.url, {"input_ids": prompt, "sampling_params": sp(rollout)})
    assert status == 413, err
    assert "refused the segment" in err["error"]["message"]
    with pytest.raises(RolloutNotFoundError):
        cache_client.stat(rollout)


def test_cache_down_policies(
    qwen_engine: EngineServer,
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Cache unreachable: default policy fails the request (503); inline falls back, loudly."""
    engine_cache.stop(signal.SIGKILL)
    try:
        status, err = generate(
            qwen_engine.url, {"input_ids": list(range(700, 720)), "sampling_params": sp(rid())}
        )
        assert status == 503, err
        assert "routing cache unreachable" in err["error"]["message"]
        rollout = rid("fallback")
        status, out = generate(
            qwen_engine.url,
            {
                "input_ids": list(range(700, 720)),
                "sampling_params": sp(rollout, on_cache_error="inline"),
            },
        )
        # Inline policy: generated from row 0, every row returned inline, flagged unstored.
        assert status == 200, out
        ref = out["meta_info"]["r3"]
        assert ref["stored"] is False and ref["inline"] is True and ref["start"] == 0
        assert inline_rows(out, QWEN_LAYERS).shape[0] == 20 + 6 - 1
        metrics = httpx.get(f"{qwen_engine.url}/r3/metrics", timeout=10).text
        assert 'r3_engine_cache_errors_total{error="ConnectError"}' in metrics
    finally:
        restart_cache(engine_cache, tmp_path_factory)
    status, out = generate(
        qwen_engine.url, {"input_ids": list(range(700, 720)), "sampling_params": sp(rid())}
    )
    assert status == 200 and out["meta_info"]["r3"]["stored"]


GENERATING = 400  # each request's tokens: decoding well past the cache's death


def test_cache_write_failure_after_generation_follows_policy(
    qwen_engine: EngineServer, engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The cache dies while the request generates: fail -> 503; inline -> routing inline."""
    import threading
    import time

    results: dict[str, object] = {}

    def run(name: str, policy: str) -> None:
        try:
            results[name] = generate(
                qwen_engine.url,
                {
                    "input_ids": list(range(800, 820)),
                    "sampling_params": {
                        **sp(rid(name), GENERATING, on_cache_error=policy),
                        "ignore_eos": True,
                    },
                },
                timeout=500,
            )
        except Exception as exc:  # reported below instead of dying in the thread
            results[name] = exc

    threads = [
        threading.Thread(target=run, args=("fail", "fail")),
        threading.Thread(target=run, args=("inline", "inline")),
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)  # both looked up their rollout and are decoding
    engine_cache.stop(signal.SIGKILL)
    # Both still generating when the cache died, or this would test nothing: 400 tokens
    # each took 6-8 s on 2 quiet cores (1,200 took 18-21 s quiet, 158 s in a busy make test).
    alive = [t.is_alive() for t in threads]
    for t in threads:
        t.join(300)
    try:  # (the cache restarted however this ends: the module's later tests ship to it)
        assert all(alive), f"a request ended before the cache died: {results}"
        assert isinstance(results["fail"], tuple), results["fail"]
        status, err = results["fail"]
        assert status == 503 and "policy: fail" in str(err), err
        assert isinstance(results["inline"], tuple), results["inline"]
        status, out = results["inline"]
        assert status == 200, out
        assert isinstance(out, dict)
        ref = out["meta_info"]["r3"]
        assert ref["stored"] is False and ref["inline"] is True and "failed" in ref["error"]
        rows = inline_rows(out, QWEN_LAYERS)
        assert rows.shape[0] == 20 + len(out["output_ids"]) - 1
        metrics = httpx.get(f"{qwen_engine.url}/r3/metrics", timeout=10).text
        assert 'r3_engine_outputs_total{outcome="inline_fallback"}' in metrics
    finally:
        restart_cache(engine_cache, tmp_path_factory)


def test_retraction_is_marked_or_refused(
    glm_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """Upstream retracts one of >= 2 running requests every few steps in this test mode.

    The engine runs the overlap scheduler (SGLang's default, kept on CPU): the rows kept at
    each retraction pass ``row_hooks.retraction_problem`` (no token kept past them), and
    what the last tokens attended to equals the latest view."""
    info = httpx.get(f"{glm_engine.url}/server_info", timeout=10).json()
    assert info["disable_overlap_schedule"] is False
    ids = [rid("retract") for _ in range(3)]
    prompts = [list(range(30 + 40 * i, 60 + 40 * i)) for i in range(3)]
    status, outs = generate(
        glm_engine.url, {"input_ids": prompts, "sampling_params": sp(ids, 16, inline=True)}
    )
    assert status == 200, outs
    retracted = [o for o in outs if o["meta_info"]["num_retractions"] > 0]
    assert retracted, "SGLANG_TEST_RETRACT retracted nothing"
    for out, rollout in zip(outs, ids, strict=True):
        ref = out["meta_info"]["r3"]
        assert ref["stored"]
        assert ref.get("retractions", 0) == out["meta_info"]["num_retractions"]
        # What the last tokens attended to (the KV at the end: inline) is the latest view;
        # where the re-prefill recomputed rows, the first computation is kept beside it.
        inline = as_sets(inline_rows(out, 3)[:, 1:])
        latest = as_sets(cache_client.get(rollout, view="latest").indices)
        np.testing.assert_array_equal(latest, inline)
        if not ref.get("views"):
            np.testing.assert_array_equal(as_sets(cache_client.get(rollout).indices), inline)
        else:  # each view is what the KV held at the end, where no later epoch redid it
            info = cache_client.stat(rollout)
            assert [v.serves for v in info.views] == [v["serves"] for v in ref["views"]]
    # Measured on 0.5.23: the re-prefill after a retraction matches the radix one position
    # short of what was computed, so it recomputes at least one row: the view path runs.
    assert any(o["meta_info"]["r3"].get("views") for o in retracted)
    status, err = generate(
        glm_engine.url,
        {
            "input_ids": prompts,
            "sampling_params": sp([rid() for _ in range(3)], 16, on_retraction="fail"),
        },
    )
    assert status == 503 and "retracted" in err["error"]["message"]


def test_metrics_and_info_endpoints(qwen_engine: EngineServer, sglang_release: str) -> None:
    generate(qwen_engine.url, {"input_ids": [21, 22, 23], "sampling_params": sp(rid())})
    text = httpx.get(f"{qwen_engine.url}/r3/metrics", timeout=10).text
    assert 'r3_engine_outputs_total{outcome="stored"}' in text
    assert "r3_engine_bytes_shipped_total" in text
    info = httpx.get(f"{qwen_engine.url}/r3/info", timeout=10).json()
    assert info["enabled"] and info["sglang"] == sglang_release
    assert os.environ.get("SGLANG_R3_API_KEY") is None or "api_key" not in info
    assert KEY_A not in str(info)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_tag = st.one_of(
    _json,
    st.fixed_dictionaries(
        {"rollout_id": _json | st.text(max_size=30)},
        optional={
            "weight_version": _json,
            "inline": _json,
            "share_prompt": _json,
            "on_cache_error": _json,
            "on_retraction": _json,
        },
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(tag=_tag, n=st.integers(1, 3), batch=st.booleans())
def test_fuzzed_tags_never_500(qwen_engine: EngineServer, tag: object, n: int, batch: bool) -> None:
    """Random ``r3`` tags: answered 200 or a 4xx with a reason; never a 500 or a crash."""
    ids = [[11, 12, 13], [14, 15]] if batch else [11, 12, 13]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 2, "n": n, "custom_params": {"r3": tag}},
    }
    status, out = generate(qwen_engine.url, body)
    assert status == 200 or 400 <= status < 500, out
    if status != 200:
        assert out["error"]["message"]


# ------------------------------------------------------- replay of what the engine recorded
# Routing recorded by the real SGLang, fetched through the service, replayed in HF: replay
# must give 0 % routing disagreement with the engine; without replay the disagreement is
# measured and printed (run with ``-s`` to see it).  (Until issue 56 these were
# tests/engine/test_replay_e2e.py, which started each release's two engines again.)


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_engine_routing_replays_with_zero_disagreement(
    family: str,
    request: pytest.FixtureRequest,
    sglang_release: str,  # (the engines below are this release's)
    tiny_models: dict[str, Path],
    cache_client: RoutingClient,
) -> None:
    engine: EngineServer = request.getfixturevalue(
        "qwen_engine" if family == "qwen3_moe" else "glm_engine"
    )
    rollouts = generate_rollouts(
        engine.url, count=4, prompt_len=24, new_tokens=12, temperature=1.0, vocab=1024, seed=5
    )
    for r in rollouts:
        r.routing = cache_client.get(r.rollout_id)
        assert r.routing.num_rows == len(r.tokens) - 1
    tf: Any = transformers
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.bfloat16)
    apply_routing_replay(model.eval())
    results = measure(model, rollouts)
    replay, native = results["replay"], results["native"]
    assert replay["n_routers"] == native["n_routers"] > 0
    assert replay["router_disagreement"] == 0.0
    assert replay["token_disagreement"] == 0.0
    # SGLang 0.5.12 returns log-probs that do not line up with the output tokens of a
    # request it retracted (the GLM engine forces retractions); 0.5.23 does not.  Those
    # rollouts count for routing above, not for the log-prob measures.
    if sglang_release != "0.5.12":
        assert results["n_without_logprobs"] == 0
    print(
        f"\n{family}: native routing disagrees on {native['router_disagreement']:.2%} of routers "
        f"({native['token_disagreement']:.2%} of tokens); replay 0 %. "
        f"k3 KL native {native['k3_kl']:.2e}, replay {replay['k3_kl']:.2e} "
        f"({results['n_without_logprobs']} of 4 rollouts without aligned log-probs)"
    )


def test_output_logprobs_refuses_logprobs_that_name_other_tokens() -> None:
    """Log-probs are paired with output tokens only when each names its token."""
    item = {"output_ids": [7, 8, 9], "meta_info": {"output_token_logprobs": []}}
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]]
    assert output_logprobs(item) == [-0.5, -1.0, -2.0]
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 9, None]]
    with pytest.raises(
        MisalignedLogprobsError, match=r"2 log-probs for 3 output tokens.*differs at 1"
    ):
        output_logprobs(item)
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 8, None]]
    with pytest.raises(MisalignedLogprobsError, match=r"2 log-probs for 3 output tokens$"):
        output_logprobs(item)


def test_mismatch_report_command(
    qwen_engine: EngineServer, engine_cache: Any, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """`r3 mismatch-report` against running servers writes its table, JSON and plots."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable, "-m", "sglang_r3.tools.mismatch_report",
            "--engine-url", qwen_engine.url, "--cache-url", engine_cache.http_url,
            "--api-key", KEY_A, "--model-path", str(tiny_models["qwen3_moe"]),
            "--rollouts", "3", "--prompt-len", "10", "--new-tokens", "8", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| router-level disagreement |" in proc.stdout
    summary = json.loads((out / "mismatch.json").read_text())
    assert summary["replay"]["router_disagreement"] == 0.0
    assert summary["native"]["n_tokens"] == 3 * 8
    for png in ("p_infer_vs_p_train.png", "f_tau.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
