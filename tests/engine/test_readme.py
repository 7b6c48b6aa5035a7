"""The README's Python quick starts run, in order, against a real SGLang + cache service."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_r3.tools.local_stack import EngineServer
from tests.support.service_process import KEY_A, Service

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_python_snippets_run(
    qwen_engine: EngineServer,
    engine_cache: Service,
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Worker (GRPO group, agent turns), trainer (HTTP, gRPC, every layout), HF replay."""
    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) >= 3, "README lost its quick starts"
    monkeypatch.setenv("SGLANG_URL", qwen_engine.url)
    monkeypatch.setenv("R3_URL", engine_cache.http_url)
    monkeypatch.setenv("R3_GRPC_URL", f"grpc://{engine_cache.grpc_target}")
    monkeypatch.setenv("R3_KEY", KEY_A)
    monkeypatch.setenv("MODEL_PATH", str(tiny_models["qwen3_moe"]))
    namespace: dict[str, object] = {"__name__": "readme"}
    for code in snippets:
        exec(compile(code, "README.md", "exec"), namespace)
    # The snippets' own asserts ran; check that they reached the end of each role.
    for name in ("refs", "second", "verl", "slime", "megatron", "hf", "logits"):
        assert name in namespace, f"the README snippets no longer define {name}"
