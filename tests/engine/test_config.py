"""sglang_r3.config: the engine configuration read from the environment."""

from __future__ import annotations

import pytest

from sglang_r3.config import ConfigError, EngineConfig


def test_config_from_env() -> None:
    assert not EngineConfig.from_env({}).enabled
    cfg = EngineConfig.from_env(
        {"SGLANG_R3_ROUTING_CACHE": "grpc://h:1", "SGLANG_R3_ON_CACHE_ERROR": "inline"}
    )
    assert cfg.enabled and cfg.on_cache_error == "inline"
    assert EngineConfig.from_env(cfg.to_env()) == cfg
    assert cfg.format_version == 3  # writers default to format v3 (docs/format.md 18)
    v2 = EngineConfig.from_env({"SGLANG_R3_FORMAT_VERSION": "2"})
    assert v2.format_version == 2 and EngineConfig.from_env(v2.to_env()) == v2
    for bad in (
        {"SGLANG_R3_ROUTING_CACHE": "redis://x"},
        {"SGLANG_R3_ON_CACHE_ERROR": "drop"},
        {"SGLANG_R3_ON_RETRACTION": "ignore"},
        {"SGLANG_R3_PUT_ATTEMPTS": "0"},
        {"SGLANG_R3_PUT_TIMEOUT_S": "soon"},
        {"SGLANG_R3_SHARE_PROMPT": "sometimes"},
        {"SGLANG_R3_FORMAT_VERSION": "1"},
        {"SGLANG_R3_FORMAT_VERSION": "v3"},
    ):
        with pytest.raises(ConfigError):
            EngineConfig.from_env(bad)
