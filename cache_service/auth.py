"""API keys → tenant namespaces, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from r3_client import AuthError

__all__ = ["KeyRing", "MetricsAccess", "bearer_token"]

#: Namespace used when auth is off (single-tenant, loopback deployments).
OPEN_NAMESPACE = "default"


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    """Maps API keys to namespaces.  ``enabled=False`` admits everyone as ``default``.

    Keys are held as SHA-256 digests and every lookup compares the presented
    key's digest against *all* of them with :func:`hmac.compare_digest`, so the
    time taken does not reveal which key (or how much of one) matched.
    """

    def __init__(self, keys: dict[str, str], *, enabled: bool) -> None:
        if enabled and not keys:
            raise ValueError(
                "auth is on (the service binds a non-loopback address or auth=on) but no "
                "API keys are configured: set R3_CACHE_API_KEYS or --api-keys-file"
            )
        self.enabled = enabled
        self._entries = [(hashlib.sha256(k.encode()).digest(), ns) for k, ns in keys.items()]

    def namespace(self, presented: str | None) -> str:
        """The namespace of ``presented``; raises :class:`AuthError` when missing or unknown."""
        if not self.enabled:
            return OPEN_NAMESPACE
        if not presented:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(presented.encode()).digest()
        found: str | None = None
        for known, ns in self._entries:  # no early exit: constant work per request
            if hmac.compare_digest(known, digest):
                found = ns
        if found is None:
            raise AuthError("invalid API key")
        return found


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    """Who may read ``/metrics``.

    With auth off (loopback-only service) anyone may.  With auth on, only holders
    of a metrics key (``R3_CACHE_METRICS_API_KEY``): the figures there are
    store-wide, across tenants, so tenant API keys never open it, and with no
    metrics key configured nobody can read them.
    """

    required: bool
    keys: KeyRing | None = None

    def check(self, authorization: str | None) -> None:
        """Raise :class:`AuthError` unless the request may read the metrics."""
        if not self.required:
            return
        if self.keys is None:
            raise AuthError(
                "/metrics needs the metrics key, and this service has none configured "
                "(set R3_CACHE_METRICS_API_KEY or R3_CACHE_METRICS_API_KEY_FILE)"
            )
        self.keys.namespace(bearer_token(authorization))
