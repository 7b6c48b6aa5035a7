"""The shipping path in the HTTP process, on the real hook code against the real cache
service: nothing proportional to rows on the event loop, compact hand-over, rollouts
the process has not seen (no lookup before generation), segments written together."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from cache_service.redis_proc import free_port
from r3_client import AsyncRoutingClient
from r3_client.synthetic import synthetic_routing
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server import metrics, output_rows, shipping
from sglang_r3.http_server.shipping import Shipper
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import moe_shape
from sglang_r3.scheduler.row_transport import EngineRows, TaggedRows, compact_rows
from tests.support.service_process import KEY_A, METRICS_KEY, Service

# 6 layers, the first dense (GLM-style), 32 experts, top-4.
SHAPE = moe_shape(
    SimpleNamespace(
        num_hidden_layers=6,
        num_experts_per_tok=4,
        n_routed_experts=32,
        first_k_dense_replace=1,
        model_type="glm4_moe",
    )
)


def rows_for(n: int, seed: int = 0) -> np.ndarray:
    """Engine rows ``[n, all layers, K]`` (dense layer rows zero, as upstream's buffer)."""
    moe = synthetic_routing(n, len(SHAPE.moe_layer_ids), 32, 4, skew=1.0, seed=seed)
    out = np.zeros((n, SHAPE.num_layers, 4), np.int32)
    out[:, list(SHAPE.moe_layer_ids)] = moe
    return out


def tag(rollout: str, share_prompt: bool = False) -> OutputTag:
    return OutputTag(0, 0, rollout, "", False, share_prompt)


def shipper(svc: Service) -> Shipper:
    return Shipper(EngineConfig(routing_cache=svc.http_url, api_key=KEY_A), SHAPE, "tiny")


def stat_calls(svc: Service) -> int:
    text = httpx.get(
        f"{svc.http_url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}
    ).text
    return sum(
        int(float(m.group(1)))
        for m in re.finditer(r'^r3_requests_total\{[^}]*op="stat_rollout"[^}]*\} (\S+)', text, re.M)
    )


def test_moe_shape_of_the_fixture() -> None:
    assert SHAPE.moe_layer_ids == (1, 2, 3, 4, 5)


@pytest.mark.parametrize(
    ("hi", "dtype"), [(31, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16)]
)
def test_compact_rows_are_lossless_and_narrow(hi: int, dtype: type) -> None:
    rows = np.random.default_rng(1).integers(0, hi + 1, size=(50, 6, 4)).astype(np.int32)
    rows[0, 0, 0] = hi
    compact = compact_rows(TaggedRows(torch.from_numpy(rows)))
    assert compact.array.dtype == dtype
    np.testing.assert_array_equal(compact.array, rows)
    # The inline fallback rebuilds upstream's base64 int32 byte for byte.
    assert compact.to_base64() == base64.b64encode(rows.tobytes()).decode()
    assert compact.array.size * 4 == rows.nbytes  # upstream's int32 bytes


def test_compact_rows_keep_out_of_range_ids_as_int32() -> None:
    rows = np.ones((4, 6, 4), np.int32)
    rows[2, 3, 1] = -1
    compact = compact_rows(TaggedRows(torch.from_numpy(rows)))
    assert compact.array.dtype == np.int32
    np.testing.assert_array_equal(compact.array, rows)
    empty = compact_rows(TaggedRows(torch.zeros((0, 6, 4), dtype=torch.int32)))
    assert empty.array.shape == (0, 6, 4)


def test_tagged_rows_still_read_as_upstream_tensor() -> None:
    """A detokenizer without our hook base64-encodes ``item.numpy()``: still upstream's bytes."""
    rows = rows_for(7)
    assert TaggedRows(torch.from_numpy(rows)).numpy().tobytes() == rows.tobytes()


def _record_threads(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []
    for name in names:
        for module in (shipping, output_rows):  # wherever the name is looked up
            if not hasattr(module, name):
                continue
            fn: Callable[..., Any] = getattr(module, name)

            def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _n: str = name, **k: Any) -> Any:
                calls.append((_n, threading.get_ident()))
                return _fn(*a, **k)

            monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("form", ["compact", "tensor", "base64"])
async def test_no_row_work_on_the_event_loop(
    engine_cache: Service, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Decoding, checks, gathers, digests, encoding and the inline base64 all run off the
    loop's thread (judged by which thread called them, not by timing)."""
    calls = _record_threads(
        monkeypatch,
        ["engine_rows_of", "decode_rows", "check_engine_rows", "token_digest", "encode_frame"],
    )
    loop_thread = threading.get_ident()
    rows = rows_for(300, seed=2)
    routing: Any = {
        "compact": compact_rows(TaggedRows(torch.from_numpy(rows))),
        "tensor": TaggedRows(torch.from_numpy(rows)),
        "base64": base64.b64encode(rows.tobytes()).decode(),
    }[form]
    s = shipper(engine_cache)
    rollout = f"offloop-{form}-{np.random.default_rng().integers(1 << 30)}"
    prompt, output = list(range(3, 203)), list(range(203, 304))
    ref = await s.ship(tag(rollout, share_prompt=True), 0, routing, prompt, output, {})
    assert ref["stored"] and [(g["start"], g["end"]) for g in ref["segments"]] == [
        (0, 199),
        (199, 300),
    ]
    names = {n for n, _ in calls}
    assert {"engine_rows_of", "check_engine_rows", "token_digest", "encode_frame"} <= names
    assert all(t != loop_thread for _, t in calls), calls
    inline = await asyncio.to_thread(output_rows.to_base64, routing, SHAPE, 10)
    assert inline == base64.b64encode(rows[10:].tobytes()).decode()
    async with AsyncRoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        stored = await client.get(rollout)
    np.testing.assert_array_equal(np.sort(stored.indices, axis=-1), np.sort(rows[:, 1:], axis=-1))
    await s.client.aclose()


async def test_unseen_rollout_is_not_looked_up_and_resolves_at_write(
    engine_cache: Service,
) -> None:
    """A rollout this process has not seen is generated from row 0 without a lookup;
    when the cache already holds it (another engine wrote turn 1), only the rows past
    the stored trajectory are stored, and a diverging or n>1 output is a 409."""
    rollout = f"unseen-{np.random.default_rng().integers(1 << 30)}"
    rows = rows_for(120, seed=4)
    tokens = list(range(5, 126))  # 121 tokens -> 120 rows
    other = shipper(engine_cache)  # "another engine" writes the first 60 rows
    assert not other.seen(rollout)
    calls0 = stat_calls(engine_cache)
    ref = await other.ship(
        tag(rollout), 0, EngineRows(rows[:60]), tokens[:50], tokens[50:61], {}, assumed_new=True
    )
    assert ref["stored"] and (ref["start"], ref["end"]) == (0, 60)
    assert stat_calls(engine_cache) == calls0  # new rollout: no lookup at all
    assert other.seen(rollout)

    ours = shipper(engine_cache)
    assert not ours.seen(rollout)
    bad = [*tokens[:10], 999, *tokens[11:100]]
    with pytest.raises(R3RequestError) as err:  # a diverging trajectory
        await ours.ship(tag(rollout), 0, EngineRows(rows), bad, tokens[100:], {}, assumed_new=True)
    assert err.value.status_code == 409 and "do not start with that trajectory" in str(err.value)
    with pytest.raises(R3RequestError) as err:  # n>1 samples never continue a rollout
        await ours.ship(
            tag(rollout),
            0,
            EngineRows(rows),
            tokens[:100],
            tokens[100:],
            {},
            assumed_new=True,
            may_continue=False,
        )
    assert err.value.status_code == 409 and "n>1" in str(err.value)
    ref = await ours.ship(
        tag(rollout), 0, EngineRows(rows), tokens[:100], tokens[100:], {}, assumed_new=True
    )
    assert ref["stored"] and (ref["start"], ref["end"]) == (60, 120)
    assert [(g["start"], g["end"]) for g in ref["segments"]] == [(60, 120)]
    async with AsyncRoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        stored = await client.get(rollout)
    assert (stored.start, stored.end) == (0, 120)
    np.testing.assert_array_equal(np.sort(stored.indices, axis=-1), np.sort(rows[:, 1:], axis=-1))
    await other.client.aclose()
    await ours.client.aclose()


def _count(name: str, **labels: str) -> float:
    """A counter of the extension's registry, in this process (0 before its first count)."""
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_view_rows_and_lost_rows_are_counted(engine_cache: Service) -> None:
    """``r3_engine_view_rows_total`` counts the rows shipped in views; a write the cache
    never acknowledged counts its output's rows in ``r3_engine_rows_lost_total``, by the
    error class ``r3_engine_cache_errors_total`` names."""
    rollout = f"counted-{np.random.default_rng().integers(1 << 30)}"
    rows = rows_for(90, seed=5)
    tokens = list(range(5, 96))  # 91 tokens -> 90 rows
    s = shipper(engine_cache)
    views0, view_rows0 = _count("r3_engine_views_total"), _count("r3_engine_view_rows_total")
    ref = await s.ship(tag(rollout), 0, EngineRows(rows[:60]), tokens[:40], tokens[40:61], {})
    assert ref["stored"]
    # Turn 2 recomputed turn 1's 60 rows (a flushed radix cache): one view of rows [0, 60).
    turn2 = EngineRows(rows_for(90, seed=6), first=0, epochs=(0,))
    ref = await s.ship(tag(rollout), 60, turn2, tokens[:70], tokens[70:], {})
    assert ref["stored"] and [(v["start"], v["end"]) for v in ref["views"]] == [(0, 60)]
    assert _count("r3_engine_views_total") - views0 == 1
    assert _count("r3_engine_view_rows_total") - view_rows0 == 60
    await s.client.aclose()

    nowhere = Shipper(
        EngineConfig(
            routing_cache=f"http://127.0.0.1:{free_port()}",
            api_key=KEY_A,
            put_attempts=1,
            on_cache_error="inline",
        ),
        SHAPE,
        "tiny",
    )
    errors0 = _count("r3_engine_cache_errors_total", error="ConnectError")
    lost0 = _count("r3_engine_rows_lost_total", error="ConnectError")
    ref = await nowhere.ship(
        tag(f"lost-{rollout}"), 0, EngineRows(rows), tokens[:40], tokens[40:], {}, assumed_new=True
    )
    assert ref["stored"] is False and ref["inline"] is True
    assert _count("r3_engine_cache_errors_total", error="ConnectError") - errors0 == 1
    assert _count("r3_engine_rows_lost_total", error="ConnectError") - lost0 == 90
    await nowhere.client.aclose()
