"""GRPO samples sent one request each share their prompt's rows (real SGLang, CPU).

verl, slime, miles and AReaL send one ``/generate`` per sample; behind sglang-router
each is tagged by the header ``X-SMG-Routing-Key`` alone, which carries no options.
``--routing-share-prompt always`` makes such a request store its prompt's rows as
their own segment, which the cache keeps once for every sample whose rows are the
same (docs/engine.md, "GRPO groups"); the default (``auto``) does that for ``n > 1``
requests only.  Every rollout reads back the rows the engine computed for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.tools.local_stack import EngineServer, start_engine, start_router
from tests.support.engine_requests import as_sets, inline_rows, rid
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(900)

KEY = "X-SMG-Routing-Key"
GROUP = 4  # prompts per group
PROMPT_LEN = 24
SAMPLES = 4
NEW = 8
LAYERS = 3


@dataclass
class Sharing:
    engine: EngineServer  # --routing-share-prompt always
    router: EngineServer  # in front of it


@pytest.fixture(scope="module")
def sharing(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sharing]:
    logs = tmp_path_factory.mktemp("sharing")
    engine = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=logs / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        extra_args=("--routing-share-prompt", "always"),
    )
    try:
        router = start_router(
            [engine.url], port=free_port(), metrics_port=free_port(), log=logs / "router.log"
        )
    except BaseException:
        engine.stop()
        raise
    yield Sharing(engine, router)
    router.stop()
    engine.stop()


Send = Callable[[list[int], str], dict[str, Any]]
Outs = dict[tuple[int, int], tuple[str, list[int], dict[str, Any]]]


def _header_tagged(url: str) -> Send:
    """One sample of prompt ``i`` as a rollout driver sends it: its own request,
    tagged by the header only."""

    def send(prompt: list[int], rollout: str) -> dict[str, Any]:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 1.0},
        }
        r = httpx.post(f"{url}/generate", json=body, headers={KEY: rollout}, timeout=120)
        assert r.status_code == 200, r.text[:600]
        out: dict[str, Any] = r.json()
        return out

    return send


def _body_tagged(url: str, **tag: Any) -> Send:
    """The same, tagged in ``custom_params`` (with ``inline``: the engine's rows come back)."""

    def send(prompt: list[int], rollout: str) -> dict[str, Any]:
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": NEW,
                "temperature": 1.0,
                "custom_params": {"r3": {"rollout_id": rollout, "inline": True, **tag}},
            },
        }
        r = httpx.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text[:600]
        out: dict[str, Any] = r.json()
        return out

    return send


def _group(send: Send) -> Outs:
    """``GROUP`` new prompts' samples, one request each, all sent at once (as verl does);
    ``(prompt, sample) -> (rollout id, prompt, answer)``."""
    group = rid("grpo1")
    # Prompts no other test sent: the cache shares prompt rows across every rollout.
    rng = np.random.default_rng(int(group.rsplit("-", 1)[1], 16))
    prompts = [[int(t) for t in rng.integers(10, 1000, PROMPT_LEN)] for _ in range(GROUP)]
    keys = [(i, j) for i in range(GROUP) for j in range(SAMPLES)]

    def one(k: tuple[int, int]) -> tuple[str, list[int], dict[str, Any]]:
        rollout = f"{group}-p{k[0]}-s{k[1]}"
        return rollout, prompts[k[0]], send(prompts[k[0]], rollout)

    with ThreadPoolExecutor(8) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def _computed(engine: EngineServer, tokens: list[int]) -> Any:
    """The rows the engine holds for ``tokens`` (untagged upstream request: its radix
    cache still holds the trajectory, so these are the rows recorded when it ran)."""
    r = httpx.post(
        f"{engine.url}/generate",
        json={
            "input_ids": tokens,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_routed_experts": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text[:600]
    return inline_rows(r.json(), LAYERS)[: len(tokens) - 1]


def _shared_prompts(outs: Outs, client: RoutingClient) -> list[int]:
    """Per prompt: how many of its samples found its prompt rows already stored."""
    hits = [0] * GROUP
    for (i, _), (rollout, prompt, out) in outs.items():
        ref = out["meta_info"]["r3"]
        assert ref["stored"] is True and ref["rollout_id"] == rollout, ref
        prompt_end = len(prompt) - 1
        info = client.stat(rollout)
        ranges = [(s.segment.start, s.segment.end) for s in info.segments]
        if (0, prompt_end) in ranges:
            seg = ref["segments"][0]
            assert (seg["start"], seg["end"]) == (0, prompt_end), ref
            hits[i] += bool(seg["dedupe_hit"])
    return hits


def _report(name: str, outs: Outs, hits: list[int]) -> None:
    refs = [out["meta_info"]["r3"] for _, _, out in outs.values()]
    shipped = sum(r["nbytes"] for r in refs)
    saved = sum(
        s["nbytes"] for r in refs for s in r["segments"] if s["dedupe_hit"]
    )  # bytes a dedupe hit did not add to the cache
    print(
        f"\n{name}: {len(refs)} rollouts, segments {sum(len(r['segments']) for r in refs)}, "
        f"prompt dedupe hits {hits}, bytes shipped {shipped}, kept once {shipped - saved}"
    )


def test_header_tagged_samples_through_the_router_share_their_prompt_rows(
    sharing: Sharing, cache_client: RoutingClient
) -> None:
    info = httpx.get(f"{sharing.engine.url}/r3/info", timeout=10).json()
    assert info["share_prompt"] == "always"
    outs = _group(_header_tagged(sharing.router.url))
    hits = _shared_prompts(outs, cache_client)
    _report("router, header tags, --routing-share-prompt always", outs, hits)
    # Every sample's prompt rows are a segment of their own, and all but the first
    # sample of each prompt found them stored.
    for rollout, prompt, _ in outs.values():
        ranges = [(s.segment.start, s.segment.end) for s in cache_client.stat(rollout).segments]
        assert ranges[0] == (0, len(prompt) - 1), ranges
    assert hits == [SAMPLES - 1] * GROUP, hits
    # Every rollout reads back the rows the engine computed for its trajectory.
    for rollout, prompt, out in outs.values():
        tokens = prompt + out["output_ids"]
        got = cache_client.get(rollout)
        assert got.indices.shape[0] == len(tokens) - 1
        np.testing.assert_array_equal(
            as_sets(got.indices), as_sets(_computed(sharing.engine, tokens))
        )


def test_a_tag_decides_for_its_request(
    sharing: Sharing, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """``share_prompt`` in a body tag overrides the server's policy either way; the rows
    read back are those the engine returned inline."""
    cases = [
        ("tag true on an auto server", _body_tagged(qwen_engine.url, share_prompt=True), True),
        (
            "tag false on an always server",
            _body_tagged(sharing.engine.url, share_prompt=False),
            False,
        ),
        ("no tag option on an always server", _body_tagged(sharing.engine.url), True),
    ]
    for name, send, shared in cases:
        outs = _group(send)
        hits = _shared_prompts(outs, cache_client)
        _report(name, outs, hits)
        assert hits == ([SAMPLES - 1] * GROUP if shared else [0] * GROUP), name
        for rollout, _, out in outs.values():
            want = len(out["meta_info"]["r3"]["segments"])
            assert want == (2 if shared else 1), (name, out["meta_info"]["r3"])
            np.testing.assert_array_equal(
                as_sets(cache_client.get(rollout).indices), as_sets(inline_rows(out, LAYERS))
            )


def test_a_later_turn_is_not_split(sharing: Sharing, cache_client: RoutingClient) -> None:
    """Under ``always`` only a first turn's prompt is its own segment: a later turn's
    new prompt part (the tool's answer) could not match another rollout's segment."""
    send = _header_tagged(sharing.router.url)
    rollout = rid("turns")
    prompt = [int(t) for t in np.random.default_rng(7).integers(10, 1000, PROMPT_LEN)]
    first = send(prompt, rollout)
    context = prompt + first["output_ids"] + [41, 42, 43]
    second = send(context, rollout)
    p1, e1 = len(prompt) - 1, first["meta_info"]["r3"]["end"]
    e2 = second["meta_info"]["r3"]["end"]
    ranges = [(s.segment.start, s.segment.end) for s in cache_client.stat(rollout).segments]
    assert sorted(ranges) == [(0, p1), (p1, e1), (e1, e2)], ranges


def test_without_sharing_per_sample_requests_store_no_prompt_segment(
    qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """The default policy (``auto``): a header-tagged sample is one segment, nothing shared."""
    info = httpx.get(f"{qwen_engine.url}/r3/info", timeout=10).json()
    assert info["share_prompt"] == "auto", json.dumps(info)
    outs = _group(_header_tagged(qwen_engine.url))
    hits = _shared_prompts(outs, cache_client)
    _report("header tags, --routing-share-prompt auto (default)", outs, hits)
    assert hits == [0] * GROUP
    for rollout, prompt, out in outs.values():
        tokens = prompt + out["output_ids"]
        ranges = [(s.segment.start, s.segment.end) for s in cache_client.stat(rollout).segments]
        assert ranges == [(0, len(tokens) - 1)], ranges
        np.testing.assert_array_equal(
            as_sets(cache_client.get(rollout).indices), as_sets(_computed(qwen_engine, tokens))
        )
