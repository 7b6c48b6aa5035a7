"""HiCache (``--enable-hierarchical-cache``): routing rows follow their KV to the host
tier and back (:mod:`sglang_r3.scheduler.hicache`).

The engine has a 300-token KV pool and a host tier twice that size, so three 100-token
fillers evict a 100-token prefix from the device; the next prompt over that prefix
loads its KV back from the host (``cached_tokens_details["host"]``) into new device
slots, whose upstream rows belong to the fillers (sglang#26975).  Stored rows are
compared, as sets per (token, layer), with the rows the session's ``qwen_engine`` (no
HiCache, same model) computes for the same tokens, and the greedy tokens must agree.

The overlap-scheduling order of row moves (a move issued while a forward is in flight
waits for that forward's ``finalize()``) is checked without an engine, on SGLang's own
``BaseTopkCapturer``/``TopkCaptureOutput``: the race it guards against (a slot freed and
reused within one overlapped step) is not reproducible on demand in a real engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.scheduler import hicache
from sglang_r3.tools.local_stack import EngineServer, start_engine
from tests.support.engine_requests import as_sets, generate, inline_rows, rid, shim_env, sp
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

LAYERS = 3
PROMPT = 100
NEW = 8
# The verified configuration (sglang_r3.scheduler.hicache): direct io into a layer-first host pool.
HICACHE_ARGS = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
    "--hicache-ratio",
    "2",
)


@pytest.fixture(scope="module")
def hicache_engine(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """The plugin on the tiny Qwen3-MoE with HiCache and a 300-token device pool."""
    server = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=tmp_path_factory.mktemp("hicache-engine") / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        extra_args=HICACHE_ARGS,
        max_total_tokens=300,
        env={**os.environ, **shim_env("hicache_cpu_io")},
    )
    try:
        yield server
    finally:
        server.stop()


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids (3..1002), distinct per ``seed``."""
    return [3 + (seed * 7919 + 31 * k) % 1000 for k in range(n)]


def _run(url: str, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
    status, out = generate(url, {"input_ids": ids, "sampling_params": params})
    assert status == 200, out
    return out


def _evict_to_host(url: str, seed: int) -> None:
    """Three untagged 100-token prompts: together they need the whole device pool."""
    for f in range(3):
        _run(url, _tokens(seed * 10 + f, PROMPT), sp(None, NEW))


def _reference(qwen_engine: EngineServer, turns: list[list[int]]) -> tuple[list[int], Any]:
    """The same turns on the engine without HiCache, untagged: the last turn's greedy
    tokens and its rows ``[0, len + NEW - 1)``.  Each turn's prefix stays on that
    engine's device, so every row is computed in the same forward shape as on the
    HiCache engine (a single prefill of the whole sequence would differ on bf16
    near-ties)."""
    out: dict[str, Any] = {}
    for i, ids in enumerate(turns):
        status, out = generate(
            qwen_engine.url,
            {"input_ids": ids, "sampling_params": sp(None, NEW), "return_routed_experts": True},
        )
        assert status == 200, out
        if i:
            assert out["meta_info"]["cached_tokens"] >= len(turns[i - 1]) + NEW - 1
    return out["output_ids"], inline_rows(out, LAYERS)


def _stale(stored: Any, ref: Any) -> list[int]:
    """Positions whose stored rows differ from the reference's (as sets)."""
    assert stored.shape == ref.shape
    return np.flatnonzero((as_sets(stored) != as_sets(ref)).any(axis=(1, 2))).tolist()


def _host_hit(out: dict[str, Any]) -> int:
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0))


def test_episode_with_prefix_loaded_from_host_stores_reference_rows(
    hicache_engine: EngineServer, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("hc-episode")
    turn1 = _tokens(1, PROMPT)
    out1 = _run(hicache_engine.url, turn1, sp(rollout, NEW))
    _evict_to_host(hicache_engine.url, seed=2)
    turn2 = turn1 + out1["output_ids"] + _tokens(3, 20)
    out2 = _run(hicache_engine.url, turn2, sp(rollout, NEW))
    assert _host_hit(out2) >= PROMPT, out2["meta_info"]  # the prefix came back from host

    tokens, ref = _reference(qwen_engine, [turn1, turn2])
    assert out2["output_ids"] == tokens
    stored = cache_client.get(rollout)
    assert [(s.start, s.end) for s in stored.segments] == [
        (0, PROMPT + NEW - 1),
        (PROMPT + NEW - 1, len(turn2) + NEW - 1),
    ]
    stale = _stale(stored.indices, ref)
    assert not stale, f"{len(stale)} stale positions: {stale[:12]}"


def test_new_rollout_on_host_tier_prefix_stores_reference_rows(
    hicache_engine: EngineServer, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    """A GRPO sibling or shared system prompt: a *new* rollout whose prompt hits a
    prefix loaded back from the host tier asks for every row, those of the prefix too
    (before sglang_r3.scheduler.hicache, all of them were the fillers' rows, and stored)."""
    first = _tokens(4, PROMPT)
    out1 = _run(hicache_engine.url, first, sp(rid("hc-first"), NEW))
    _evict_to_host(hicache_engine.url, seed=5)
    prompt = first + out1["output_ids"] + _tokens(6, 20)
    rollout = rid("hc-sibling")
    out2 = _run(hicache_engine.url, prompt, sp(rollout, NEW))
    assert _host_hit(out2) >= PROMPT, out2["meta_info"]

    tokens, ref = _reference(qwen_engine, [first, prompt])
    assert out2["output_ids"] == tokens
    stale = _stale(cache_client.get(rollout).indices, ref)
    assert not stale, f"{len(stale)} stale positions: {stale[:12]}"


# ---------------------------------------------------------------- ordering (no engine)


@pytest.fixture
def capturer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's own BaseTopkCapturer on CPU (16 device slots, 3 layers, top-2) as the
    process's routed-experts capturer, and a fresh row mover."""
    import torch
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    from sglang_r3.cpu.allocator import install_allocator

    install_allocator()
    cap = BaseTopkCapturer(
        num_tokens=16, max_batch_size=4, num_layers=LAYERS, topk_size=2, device="cpu", name="t"
    )
    monkeypatch.setattr(hicache, "_capturer", lambda: cap)
    monkeypatch.setattr(hicache, "_MOVER", hicache._RowMover())
    monkeypatch.setattr(hicache, "_ACTIVE", True)  # as after init_hicache gave rows
    cap.forward = lambda slot, expert, overlap: _forward(cap, torch, slot, expert, overlap)
    return cap


def _forward(cap: Any, torch: Any, slot: int, expert: int, overlap: bool) -> Any:
    """One forward writing expert ``expert`` (every layer) at device slot ``slot``;
    under ``overlap`` its rows land at ``finalize()``, as in SGLang's overlap scheduler."""
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    for layer in range(LAYERS):
        cap.capture(layer, torch.tensor([[expert, expert + 1]], dtype=torch.int32))
    batch = SimpleNamespace(out_cache_loc=torch.tensor([slot]), out_cache_loc_virtual=None)
    return hicache.around_capture_forward_end(
        BaseTopkCapturer.on_forward_end,
        cap,
        forward_batch=batch,
        can_run_graph=False,
        cuda_graph_batch=None,
        no_copy_to_cpu=overlap,
    )


def _finalize(out: Any) -> None:
    from sglang.srt.state_capturer.base import TopkCaptureOutput

    hicache.around_capture_finalize(TopkCaptureOutput.finalize, out)


def _move(cap: Any, to_host: bool, rows: Any, host: int, device: int) -> None:
    import torch

    hicache._MOVER.issue(
        hicache._Move(
            hicache._MOVER.launched, to_host, rows, torch.tensor([host]), torch.tensor([device])
        )
    )


def test_load_back_waits_for_the_forward_in_flight(capturer: Any) -> None:
    """Overlap: a freed slot handed to a load-back while the forward in flight still
    writes it.  SGLang orders the KV copy after that forward; the rows must follow it,
    or the loaded token keeps the in-flight token's row."""
    import torch

    rows = torch.zeros((8, LAYERS, 2), dtype=torch.int32)
    rows[2] = 6  # the host tier holds the prefix token's row at host slot 2
    out = capturer.forward(slot=5, expert=1, overlap=True)  # in flight, writes slot 5
    _move(capturer, False, rows, host=2, device=5)  # load-back into slot 5
    _finalize(out)
    assert capturer.host_cache.buffer[5].tolist() == [[6, 6]] * LAYERS


def test_back_up_waits_for_the_forward_in_flight(capturer: Any) -> None:
    """Overlap: a finished request's last token is cached (and backed up) while the
    forward computing it is in flight: its row must be the one that forward writes."""
    import torch

    rows = torch.zeros((8, LAYERS, 2), dtype=torch.int32)
    out = capturer.forward(slot=7, expert=3, overlap=True)
    _move(capturer, True, rows, host=4, device=7)
    assert not rows[4].any()  # not yet: the row is still on its way
    _finalize(out)
    assert rows[4].tolist() == [[3, 4]] * LAYERS


def test_moves_apply_at_once_without_a_forward_in_flight(capturer: Any) -> None:
    import torch

    rows = torch.zeros((8, LAYERS, 2), dtype=torch.int32)
    assert capturer.forward(slot=1, expert=2, overlap=False) is None  # rows written inline
    _move(capturer, True, rows, host=0, device=1)
    assert rows[0].tolist() == [[2, 3]] * LAYERS
    _move(capturer, False, rows, host=0, device=9)
    assert capturer.host_cache.buffer[9].tolist() == [[2, 3]] * LAYERS
