"""The extension's pure parts: tags, configuration, MoE layers, row guards, the CPU stub."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_r3.config import ConfigError, EngineConfig
from sglang_r3.cpu import build_cuda_stub
from sglang_r3.errors import R3RequestError
from sglang_r3.layers import moe_shape
from sglang_r3.output_rows import check_engine_rows, decode_rows
from sglang_r3.shipping import Shipper, version_at, version_runs
from sglang_r3.tagging import OutputTag, output_tags, request_shape
from tests.support.service_process import KEY_A, Service


def tags(sp: object, batch: int = 1, n: int = 1) -> list[OutputTag] | None:
    return output_tags(sp, batch_size=batch, n=n, max_outputs=16)


def test_untagged_requests_have_no_tags() -> None:
    assert tags(None) is None
    assert tags({"max_new_tokens": 3}) is None
    assert tags({"custom_params": {"other": 1}}) is None
    assert tags([{"max_new_tokens": 1}, {}], batch=2) is None


def test_output_ids_follow_sglang_order() -> None:
    got = tags({"custom_params": {"r3": {"rollout_id": "g"}}}, batch=2, n=3)
    assert got is not None
    assert [(t.index, t.prompt_index, t.rollout_id) for t in got] == [
        (0, 0, "g-0"),
        (1, 0, "g-1"),
        (2, 0, "g-2"),
        (3, 1, "g-3"),
        (4, 1, "g-4"),
        (5, 1, "g-5"),
    ]
    assert all(t.share_prompt for t in got)
    one = tags({"custom_params": {"r3": {"rollout_id": "solo", "weight_version": "v7"}}})
    assert one is not None and one[0].rollout_id == "solo" and one[0].weight_version == "v7"
    assert not one[0].share_prompt
    per_prompt = tags(
        [
            {"custom_params": {"r3": {"rollout_id": "a"}}},
            {"custom_params": {"r3": {"rollout_id": ["b0", "b1"]}}},
        ],
        batch=2,
        n=2,
    )
    assert per_prompt is not None
    assert [t.rollout_id for t in per_prompt] == ["a-0", "a-1", "b0", "b1"]


@pytest.mark.parametrize(
    ("sp", "batch", "needle"),
    [
        ({"custom_params": {"r3": "x"}}, 1, "must be an object"),
        ([{"custom_params": {"r3": {"rollout_id": "a"}}}, {}], 2, "tag every prompt"),
        ({"custom_params": {"r3": {"rollout_id": [f"i{k}" for k in range(20)]}}}, 20, "exceed"),
        ({"custom_params": {"r3": {"rollout_id": "a/b"}}}, 1, "invalid rollout id"),
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": 3}}}, 1, "weight_version"),
        # the format's rules, applied before generation (one rule, in r3_client)
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "v\x07"}}}, 1, "printable"),
        ({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "v" * 257}}}, 1, "256"),
        ({"custom_params": {"r3": {"rollout_id": ".."}}}, 1, "invalid rollout id"),
        ({"custom_params": {"r3": {"rollout_id": ["ok", "."]}}}, 2, "invalid rollout id"),
        # ids derived as f"{id}-{k}" obey the rule too
        ({"custom_params": {"r3": {"rollout_id": "x" * 199}}}, 2, "derived from"),
        ({"custom_params": {"r3": {"rollout_id": "."}}}, 2, "invalid rollout id"),
    ],
)
def test_bad_tags(sp: object, batch: int, needle: str) -> None:
    with pytest.raises(R3RequestError) as err:
        tags(sp, batch=batch)
    assert err.value.status_code == 400 and needle in str(err.value)


def test_weight_version_rule_is_the_formats() -> None:
    """Up to 256 printable characters, as ``r3_client.check_text`` (and Segment) allow."""
    got = tags({"custom_params": {"r3": {"rollout_id": "a", "weight_version": "é" * 256}}})
    assert got is not None and got[0].weight_version == "é" * 256


def test_output_count_is_checked_before_ids_are_derived(monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge ``n`` is refused before one id is derived (not after building them all)."""
    import sglang_r3.tagging as tagging

    derived: list[object] = []
    real = tagging._check_id
    monkeypatch.setattr(
        tagging, "_check_id", lambda i, *a, **k: derived.append(i) or real(i, *a, **k)
    )
    with pytest.raises(R3RequestError, match="exceed"):
        output_tags(
            {"custom_params": {"r3": {"rollout_id": "g"}}}, batch_size=1, n=10**4, max_outputs=16
        )
    assert derived == []


def test_request_shape() -> None:
    assert request_shape("w1 w2", None, {"n": 1}) == (1, 1, True)
    assert request_shape(None, [1, 2, 3], {"n": 4}) == (1, 4, False)
    assert request_shape(["a", "b"], None, None) == (2, 1, False)
    assert request_shape(None, [[1], [2], [3]], [{}, {}, {}]) == (3, 1, False)
    with pytest.raises(R3RequestError, match="embeddings"):
        request_shape(None, None, {})


def test_config_from_env() -> None:
    assert not EngineConfig.from_env({}).enabled
    cfg = EngineConfig.from_env(
        {"SGLANG_R3_ROUTING_CACHE": "grpc://h:1", "SGLANG_R3_ON_CACHE_ERROR": "inline"}
    )
    assert cfg.enabled and cfg.on_cache_error == "inline"
    assert EngineConfig.from_env(cfg.to_env()) == cfg
    for bad in (
        {"SGLANG_R3_ROUTING_CACHE": "redis://x"},
        {"SGLANG_R3_ON_CACHE_ERROR": "drop"},
        {"SGLANG_R3_ON_RETRACTION": "ignore"},
        {"SGLANG_R3_PUT_ATTEMPTS": "0"},
        {"SGLANG_R3_PUT_TIMEOUT_S": "soon"},
        {"SGLANG_R3_SHARE_PROMPT": "sometimes"},
    ):
        with pytest.raises(ConfigError):
            EngineConfig.from_env(bad)


def test_the_server_policy_decides_prompt_sharing_when_the_tag_does_not() -> None:
    def share(n: int, policy: str, **tag: object) -> bool:
        sp = {"custom_params": {"r3": {"rollout_id": "g", **tag}}}
        got = output_tags(sp, batch_size=1, n=n, max_outputs=16, share_prompt=policy)
        assert got is not None
        return got[0].share_prompt

    assert EngineConfig.from_env({}).share_prompt == "auto"
    assert EngineConfig.from_env({"SGLANG_R3_SHARE_PROMPT": "always"}).share_prompt == "always"
    assert [share(1, "auto"), share(2, "auto")] == [False, True]
    assert [share(1, "always"), share(2, "always")] == [True, True]
    assert [share(1, "never"), share(2, "never")] == [False, False]
    assert share(1, "never", share_prompt=True) and not share(2, "always", share_prompt=False)


def test_moe_shape_rules() -> None:
    qwen = SimpleNamespace(
        model_type="qwen3_moe",
        num_hidden_layers=4,
        num_experts_per_tok=2,
        num_experts=8,
        mlp_only_layers=[1],
    )
    assert moe_shape(qwen).moe_layer_ids == (0, 1, 2, 3)  # SGLang ignores mlp_only_layers
    glm = SimpleNamespace(
        model_type="glm4_moe",
        num_hidden_layers=4,
        num_experts_per_tok=2,
        n_routed_experts=8,
        first_k_dense_replace=1,
    )
    assert moe_shape(glm).moe_layer_ids == (1, 2, 3)
    ds = SimpleNamespace(
        model_type="deepseek_v3",
        num_hidden_layers=6,
        num_experts_per_tok=2,
        n_routed_experts=8,
        first_k_dense_replace=1,
        moe_layer_freq=2,
    )
    assert moe_shape(ds).moe_layer_ids == (2, 4)
    mix = SimpleNamespace(
        model_type="mixtral", num_hidden_layers=2, num_experts_per_tok=2, num_local_experts=8
    )
    assert moe_shape(mix).num_experts == 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        moe_shape(SimpleNamespace(num_hidden_layers=2))


SHAPE = moe_shape(SimpleNamespace(num_hidden_layers=3, num_experts_per_tok=2, num_experts=8))


def b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode()


def test_row_guards() -> None:
    rows = np.tile(np.array([1, 2], np.int32), (5, 3, 1))
    assert decode_rows(b64(rows), SHAPE).shape == (5, 3, 2)
    check_engine_rows(decode_rows(b64(rows), SHAPE), 5)
    with pytest.raises(R3RequestError, match="5 routing rows for 6 token positions"):
        check_engine_rows(rows, 6)
    with pytest.raises(R3RequestError, match="not a whole number"):
        decode_rows(base64.b64encode(b"\0" * 20).decode(), SHAPE)


@pytest.mark.parametrize("bad", ["zeros", "duplicate", "out_of_range"])
async def test_invalid_engine_rows_are_refused_not_stored(engine_cache: Service, bad: str) -> None:
    """A never-written slot (all zeros), a repeated expert or an id >= E: 500, nothing stored.

    The real engine does not produce these on demand, so the rows are crafted here.
    """
    from r3_client import AsyncRoutingClient, RolloutNotFoundError

    cfg = EngineConfig(routing_cache=engine_cache.http_url, api_key=KEY_A)
    shipper = Shipper(cfg, SHAPE, "tiny")
    rows = np.tile(np.array([1, 2], np.int32), (9, 3, 1))
    if bad == "zeros":
        rows[4] = 0
    elif bad == "duplicate":
        rows[4, 1] = [3, 3]
    else:
        rows[4, 2] = [1, 8]
    tag = OutputTag(0, 0, f"guard-{bad}", "", False, False)
    with pytest.raises(R3RequestError) as err:
        await shipper.ship(tag, 0, b64(rows), list(range(3, 8)), list(range(8, 13)), {})
    assert err.value.status_code == 500 and "failed validation" in str(err.value)
    async with AsyncRoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        with pytest.raises(RolloutNotFoundError):
            await client.stat(f"guard-{bad}")
    await shipper.client.aclose()


def test_cuda_stub_builds_and_exports_the_symbol(tmp_path: Path) -> None:
    lib = build_cuda_stub(tmp_path) / "libcuda.so.1"
    assert lib.exists()
    assert build_cuda_stub(tmp_path) == lib.parent  # cached
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    assert "cuPointerGetAttribute" in syms.stdout


def test_rows_are_labelled_by_the_weight_version_that_computed_them() -> None:
    # No span, or one version: the default (the tag's version, else the engine's).
    assert version_runs({}, 10, "tag") == ((0, "tag"),)
    one = [{"version": "e1", "start": 0, "end": 5}]
    assert version_runs({"weight_versions": one}, 10, "tag") == ((0, "tag"),)
    # Output token a was sampled from position P + a - 1: that row starts the next run.
    spans = [
        {"version": "e1", "start": 0, "end": 3},
        {"version": "e2", "start": 3, "end": 7},
        {"version": "e3", "start": 7, "end": 9},
    ]
    runs = version_runs({"weight_versions": spans}, 10, "tag")
    assert runs == ((0, "e1"), (12, "e2"), (16, "e3"))
    assert [version_at(runs, r) for r in (0, 11, 12, 15, 16, 40)] == [
        "e1",
        "e1",
        "e2",
        "e2",
        "e3",
        "e3",
    ]
    shipper_tag = OutputTag(0, 0, "r", "", False, True)
    # Cuts: the prompt's end (shared) and each version boundary inside [start, end).
    assert Shipper._cuts(shipper_tag, 0, 9, 18, runs) == [0, 9, 12, 16, 18]
    assert Shipper._cuts(shipper_tag, 13, 9, 15, runs) == [13, 15]
    # A later turn's new prompt part is not split off (only a first turn's prompt is).
    assert Shipper._cuts(shipper_tag, 5, 9, 11, runs) == [5, 11]
