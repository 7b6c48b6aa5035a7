"""The plugin where it ships nothing: plain ``python -m sglang.launch_server`` in a venv
where the package is installed (SGLang loads every installed plugin) behaves as upstream.

Upstream's own routed-experts tests send ``custom_params`` as they like; a JSON string
naming ``r3`` is only a mistake where r3 ships routing, so only there is it refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_service.redis_proc import free_port
from sglang_r3.tools.local_stack import EngineServer, start_engine
from tests.support.engine_requests import generate, inline_rows

pytestmark = pytest.mark.timeout(600)

QWEN_LAYERS = 3


@pytest.fixture(scope="module")
def upstream_engine(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """Upstream's launcher with its own ``--enable-return-routed-experts``; no r3 flags."""
    server = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=tmp_path_factory.mktemp("upstream-engine") / "sglang.log",
        launcher="sglang.launch_server",
        extra_args=("--enable-return-routed-experts",),
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "custom_params",
    [json.dumps({"r3": {"rollout_id": "upstream-json"}}), {"note": "not ours"}],
    ids=["json-string-naming-r3", "object"],
)
def test_untagged_generate_with_custom_params_is_answered_as_upstream(
    upstream_engine: EngineServer, custom_params: object
) -> None:
    prompt = list(range(60, 80))
    status, out = generate(
        upstream_engine.url,
        {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": 0,
                "custom_params": custom_params,
            },
            "return_routed_experts": True,
        },
    )
    assert status == 200, out
    assert "r3" not in out["meta_info"]
    rows = inline_rows(out, QWEN_LAYERS)
    assert rows.shape == (len(prompt) + len(out["output_ids"]) - 1, QWEN_LAYERS, 2)
