"""Settings, auth defaults and the keyring: unit tests plus one real refusal to start."""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cache_service.auth import KeyRing, bearer_token
from cache_service.settings import ServiceSettings, secret_bits
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
    with pytest.raises(ValidationError, match="shorter than 16 characters") as info:
        ServiceSettings(api_keys={"short": "ns"})
    assert "short'" not in str(info.value)  # the key itself is never echoed
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


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``r3 serve`` with ``args`` against a Redis nobody runs: only start-up checks answer."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cache_service",
            "serve",
            *args,
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_public_bind_without_keys_refuses_to_start(tmp_path: Path) -> None:
    res = _serve(tmp_path, "--host", "0.0.0.0")
    assert res.returncode == 2
    assert "r3 serve: error: auth is on" in res.stderr
    assert "no API keys are configured" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        ({"good-key-0123456789abcdef": "Bad:NS"}, "maps to namespace 'Bad:NS'"),
        ({"good-key-0123456789abcdef": ""}, "maps to namespace ''"),
        ({"good-key-0123456789abcdef": "x" * 65}, "a namespace is 1-64 characters"),
        ({"short": "tenant"}, "shorter than 16 characters"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_bad_api_keys_file_refuses_to_start_naming_the_entry(
    tmp_path: Path, keys: object, reason: str
) -> None:
    """Before: a namespace like 'Bad:NS' was accepted and every request with that key
    failed with 400.  Now ``r3 serve`` exits 2 naming the file and the entry."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(keys))
    res = _serve(tmp_path, "--auth", "on", "--api-keys-file", str(path))
    assert res.returncode == 2, res.stderr
    assert f"r3 serve: error: {path}" in res.stderr
    assert reason in res.stderr
    assert "0123456789abcdef" not in res.stderr  # the key is a secret: only its start is shown
    assert "Traceback" not in res.stderr


def test_direct_reads_without_a_secret_refuse_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("R3_CACHE_DIRECT_READS", "true")
    res = _serve(tmp_path)
    assert res.returncode == 2, res.stderr
    assert "R3_CACHE_DIRECT_READ_SECRET" in res.stderr and "Traceback" not in res.stderr
    monkeypatch.setenv("R3_CACHE_DIRECT_READ_SECRET_FILE", str(tmp_path / "missing"))
    res = _serve(tmp_path)
    assert res.returncode == 2 and "cannot read" in res.stderr, res.stderr


def test_direct_read_secret_needs_real_entropy() -> None:
    """What the documented generators make is accepted every time; a short, repeated,
    dictionary or 16-byte secret is refused, without the secret in the message."""
    makers = (
        lambda: secrets.token_urlsafe(32),
        lambda: base64.b64encode(secrets.token_bytes(32)).decode(),  # openssl rand -base64 32
        lambda: secrets.token_hex(32),  # openssl rand -hex 32
    )
    for make in makers:
        for _ in range(500):
            s = make()
            assert secret_bits(s) > 160
            assert ServiceSettings(direct_read_secret=s).read_secret() == s
    for weak in (
        "password12345678",
        "a" * 64,
        "dev-direct-read-secret-not-secret",
        secrets.token_hex(16),  # 128 random bits, but 32 hex characters score ~115
    ):
        with pytest.raises(ValidationError, match="token_urlsafe") as info:
            ServiceSettings(direct_read_secret=weak)
        assert weak not in str(info.value)


def test_the_drop_cursor_secret_is_a_store_setting_every_replica_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "redis://:pw@redis.r3.svc:6379/0"
    monkeypatch.setenv("R3_CACHE_DROP_CURSOR_SECRET", "s" * 24)
    s = ServiceSettings()
    assert s.store_settings(url).cursor_secret == "s" * 24
    assert "s" * 24 not in repr(s) and "s" * 24 not in repr(s.store_settings(url))
    monkeypatch.delenv("R3_CACHE_DROP_CURSOR_SECRET")
    # unset: derived from what the replicas of one deployment share, the same on each
    a, b = ServiceSettings().store_settings(url), ServiceSettings().store_settings(url)
    assert a.cursor_secret == b.cursor_secret and len(a.cursor_secret) == 64
    assert "pw" not in a.cursor_secret
    for other in (
        ServiceSettings(key_prefix="r3b").store_settings(url),
        ServiceSettings().store_settings("redis://:pw@other:6379/0"),
    ):
        assert other.cursor_secret != a.cursor_secret
    with pytest.raises(ValidationError, match="drop_cursor_secret"):
        ServiceSettings(drop_cursor_secret="short")
