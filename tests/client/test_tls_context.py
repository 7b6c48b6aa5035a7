"""Clients share one certificate-verifying TLS context per CA bundle.

httpx builds a context per client and loads the whole CA bundle each time (62 ms a
client on this machine, measured: docs/benchmarks.md, "Client"); ours is
built once per process for the bundle the environment names, and it still verifies.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import certifi
import pytest

from r3_client import AsyncRoutingClient, RoutingClient


def _context(client: RoutingClient | AsyncRoutingClient) -> ssl.SSLContext:
    ctx = client._t._http._transport._pool._ssl_context  # type: ignore[union-attr]
    assert isinstance(ctx, ssl.SSLContext)
    return ctx


def _contexts(url: str) -> list[ssl.SSLContext]:
    with RoutingClient(url) as a, RoutingClient(url, api_key="k") as b:
        got = [_context(a), _context(b)]
    aclient = AsyncRoutingClient(url)
    got.append(_context(aclient))
    asyncio.run(aclient.aclose())
    return got


def test_clients_share_one_verifying_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    first, *others = _contexts("https://r3.example:8443")
    assert all(ctx is first for ctx in others)
    assert first.verify_mode == ssl.CERT_REQUIRED and first.check_hostname
    assert first.cert_store_stats()["x509_ca"] > 0  # the CA bundle loaded


def test_another_bundle_named_gets_its_own_context(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    default, *others = _contexts("https://r3.example")
    assert all(ctx is default for ctx in others)
    bundle = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), bundle)
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    named = _contexts("https://r3.example")
    assert all(ctx is named[0] for ctx in named)
    assert named[0] is not default
    assert named[0].cert_store_stats() == default.cert_store_stats()
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "absent.pem"))
    with pytest.raises((FileNotFoundError, ssl.SSLError)):  # as httpx itself would
        RoutingClient("https://r3.example")
