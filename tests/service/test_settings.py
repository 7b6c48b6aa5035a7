"""Settings, auth defaults and the keyring: unit tests plus one real refusal to start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cache_service.auth import KeyRing, bearer_token
from cache_service.settings import ServiceSettings
from r3_client import AuthError


def test_auth_is_on_whenever_a_listener_is_not_loopback() -> None:
    assert not ServiceSettings().auth_enabled()
    assert not ServiceSettings(http_host="::1", grpc_host="localhost").auth_enabled()
    assert ServiceSettings(http_host="0.0.0.0").auth_enabled()
    assert ServiceSettings(grpc_host="10.0.0.5").auth_enabled()
    assert ServiceSettings(auth="on").auth_enabled()
    assert not ServiceSettings(http_host="0.0.0.0", auth="off").auth_enabled()


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R3_CACHE_HTTP_PORT", "9999")
    monkeypatch.setenv("R3_CACHE_API_KEYS", json.dumps({"k" * 20: "team-x"}))
    s = ServiceSettings()
    assert s.http_port == 9999
    assert s.all_api_keys() == {"k" * 20: "team-x"}
    with pytest.raises(ValidationError, match="at least 16 characters"):
        ServiceSettings(api_keys={"short": "ns"})
    with pytest.raises(ValidationError):
        ServiceSettings(max_batch=0)


def test_keyring() -> None:
    ring = KeyRing({"a" * 20: "tenant-a", "b" * 20: "tenant-b"}, enabled=True)
    assert ring.namespace("b" * 20) == "tenant-b"
    with pytest.raises(AuthError, match="missing API key"):
        ring.namespace(None)
    with pytest.raises(AuthError, match="invalid API key"):
        ring.namespace("a" * 19)
    assert KeyRing({}, enabled=False).namespace(None) == "default"
    with pytest.raises(ValueError, match="no API keys are configured"):
        KeyRing({}, enabled=True)
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None


def test_public_bind_without_keys_refuses_to_start(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "cache_service",
            "serve",
            "--host",
            "0.0.0.0",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "r3 serve: error: auth is on" in res.stderr
    assert "no API keys are configured" in res.stderr
    assert "Traceback" not in res.stderr
