"""Service settings: pydantic-settings, ``R3_CACHE_`` environment prefix, CLI overrides."""

from __future__ import annotations

import ipaddress
import json
import math
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_service.store.settings import StoreSettings, check_namespace
from r3_client import InvalidRequestError

__all__ = ["ServiceSettings", "check_read_secret", "get_settings", "is_loopback", "secret_bits"]

#: What a direct-read secret must have (docs/service.md, "Direct reads"): every
#: namespace's Redis reader password is HMAC-SHA256(secret, namespace), and one read
#: plan lets its holder test guesses of the secret offline, as fast as HMAC runs.
MIN_SECRET_CHARS = 32
MIN_SECRET_BITS = 128
MAKE_A_SECRET = (
    "python -c 'import secrets; print(secrets.token_urlsafe(32))' or openssl rand -base64 32"
)


def secret_bits(secret: str) -> float:
    """An estimate of ``secret``'s entropy in bits: its length times the Shannon entropy
    of its character frequencies.

    Low for short, repetitive or small-alphabet strings; a generated 32-byte secret
    scores about 180-250.  It cannot tell a generated string from a long phrase or a
    run like ``abcd…``: it refuses what is plainly guessable, it proves nothing random.
    """
    n = len(secret)
    return -sum(c * math.log2(c / n) for c in Counter(secret).values())


def check_read_secret(secret: str, source: str) -> str:
    """``secret``, or ``ValueError`` naming ``source`` and how to make a good one.

    Called when the settings are read, so a guessable secret stops the service at
    start-up.  The message never quotes the secret.
    """
    bits = secret_bits(secret)
    if len(secret) < MIN_SECRET_CHARS or bits < MIN_SECRET_BITS:
        raise ValueError(
            f"{source}: the direct-read secret has {len(secret)} characters and about "
            f"{bits:.0f} bits of entropy; it needs at least {MIN_SECRET_CHARS} characters "
            f"and {MIN_SECRET_BITS} bits, because every namespace's Redis reader password "
            "is HMAC-SHA256(secret, namespace) and one read plan is enough to test guesses "
            f"of it offline. Generate one: {MAKE_A_SECRET}"
        )
    return secret


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServiceSettings(BaseSettings):
    """Everything the cache service reads at start-up.

    Every field can be set as ``R3_CACHE_<FIELD>`` (e.g. ``R3_CACHE_HTTP_PORT``);
    ``api_keys`` as JSON ``{"<key>": "<namespace>"}``.
    """

    # hide_input_in_errors: a validation error must not echo API keys into logs.
    model_config = SettingsConfigDict(
        env_prefix="R3_CACHE_", frozen=True, extra="forbid", hide_input_in_errors=True
    )

    redis_url: str | None = Field(
        default=None, description="redis:// DSN; unset = start an embedded redis-server"
    )
    redis_cluster: bool = False
    data_dir: Path = Path("r3-data")
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(default=50051, ge=0, le=65535)
    auth: Literal["auto", "on", "off"] = "auto"
    api_keys: dict[str, str] = Field(default_factory=dict)
    api_keys_file: Path | None = None
    metrics_api_key: str | None = Field(default=None, min_length=16)
    metrics_api_key_file: Path | None = None
    max_body_bytes: int = Field(default=256 << 20, ge=1024)
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    max_tokens_per_segment: int = Field(default=1 << 20, ge=1)
    max_gap_rows: int = Field(
        default=1 << 17, ge=0, description="rows a segment may start past a rollout's stored end"
    )
    max_decoded_bytes: int = Field(
        default=1 << 30, ge=1024, description="decoded routing bytes one segment may declare"
    )
    max_rollout_rows: int = Field(
        default=1 << 20, ge=1, description="rows one rollout may reach (its longest context)"
    )
    max_rollout_gap_rows: int = Field(
        default=1 << 17, ge=0, description="rows of one rollout that no segment covers, in all"
    )
    max_rollout_bytes: int = Field(
        default=1 << 31,
        ge=1024,
        description="decoded bytes (rows x L x K x id size) one rollout may reach; "
        "the client's default read limit",
    )
    max_batch: int = Field(default=1024, ge=1)
    batch_concurrency: int = Field(default=8, ge=1, le=256)
    max_batch_stat_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description="bytes one batch stat's answer may hold; the items past it are "
        "answered limit_exceeded (ask for them in another request)",
    )
    drop_max_rollouts: int = Field(
        default=4096,
        ge=1,
        le=1 << 16,
        description="rollout keys one drop-by-weight-version call examines at most "
        "(the caller resumes with the answer's cursor)",
    )
    drop_cursor_secret: str | None = Field(
        default=None,
        min_length=16,
        repr=False,
        description="keys the tag on drop-by-weight-version cursors, so the service resumes "
        "only walks it answered; the same on every replica; unset = derived from the key "
        "prefix and the Redis URL (then whoever knows both can forge a cursor)",
    )
    drop_deadline_s: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="seconds one drop-by-weight-version call walks before it answers with a cursor",
    )
    default_ttl_s: int = Field(default=24 * 3600, ge=0)
    key_prefix: str = "r3"
    max_segments: int = Field(default=4096, ge=1)
    max_views: int = Field(
        default=256, ge=0, description="views (recomputed rows) one rollout may hold"
    )
    redis_max_connections: int = Field(default=64, ge=1)
    dedupe: bool = True
    store_layout: Literal["chunked", "whole"] = Field(
        default="chunked",
        description="how v3 segment frames are written: chunked (head and one field per "
        "chunk, so reads fetch only the chunks they need) or whole (one field, what "
        "services before issue 44 read); both are always read (docs/store.md)",
    )
    durability: Literal["ack", "replicas", "fsync"] = "ack"
    durability_replicas: int | None = Field(
        default=None, ge=0, description="replicas to wait for; unset = 1 (replicas), 0 (fsync)"
    )
    durability_timeout_ms: int = Field(default=1000, ge=1, le=5000)
    direct_reads: bool = Field(
        default=False,
        description="issue read plans: per-namespace read-only Redis credentials (ACL)",
    )
    direct_read_url: str | None = Field(
        default=None, description="the Redis URL trainers use for direct reads (default: redis_url)"
    )
    direct_read_secret: str | None = Field(
        default=None, description="random, >= 32 characters and >= 128 bits (check_read_secret)"
    )
    direct_read_secret_file: Path | None = None
    log_level: str = "INFO"

    @field_validator("api_keys")
    @classmethod
    def _keys_valid(cls, v: dict[str, str]) -> dict[str, str]:
        """Every key long enough and mapped to a legal namespace, or the service refuses to
        start naming the entry (only the key's first characters: it is a secret)."""
        for key, ns in v.items():
            shown = f"{key[:4]}…" if len(key) > 4 else "…"
            if len(key) < 16:
                raise ValueError(f"API key {shown!r} is shorter than 16 characters")
            try:
                check_namespace(ns)
            except InvalidRequestError:
                raise ValueError(
                    f"API key {shown!r} maps to namespace {ns!r}: a namespace is 1-64 "
                    "characters from a-z 0-9 _ -"
                ) from None
        return v

    @field_validator("direct_read_secret")
    @classmethod
    def _secret_strong(cls, v: str | None) -> str | None:
        """A secret nobody can guess, or the service refuses to start."""
        return None if v is None else check_read_secret(v, "R3_CACHE_DIRECT_READ_SECRET")

    def auth_enabled(self) -> bool:
        """Auth is on when asked, or (``auto``) whenever a listener is not loopback-only."""
        if self.auth == "auto":
            return not (is_loopback(self.http_host) and is_loopback(self.grpc_host))
        return self.auth == "on"

    def all_api_keys(self) -> dict[str, str]:
        """``api_keys`` merged with ``api_keys_file`` (JSON ``{"<key>": "<namespace>"}``).

        Raises ``ValueError`` naming the file and the bad entry; called at start-up,
        so a bad file stops the service instead of failing its requests.
        """
        keys = dict(self.api_keys)
        if self.api_keys_file is not None:
            try:
                data = json.loads(self.api_keys_file.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{self.api_keys_file}: cannot read API keys: {exc}") from None
            if not isinstance(data, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in data.items()
            ):
                raise ValueError(f"{self.api_keys_file}: expected a JSON object key -> namespace")
            try:
                keys.update(self._keys_valid(data))  # the same rules as api_keys
            except ValueError as exc:
                raise ValueError(f"{self.api_keys_file}: {exc}") from None
        return keys

    def metrics_key(self) -> str | None:
        """The key that opens ``/metrics`` with auth on (``metrics_api_key``, else the stripped
        contents of ``metrics_api_key_file``), or None."""
        if self.metrics_api_key is not None:
            return self.metrics_api_key
        if self.metrics_api_key_file is None:
            return None
        key = _read_stripped(self.metrics_api_key_file, "cannot read the metrics key")
        if len(key) < 16:
            raise ValueError(f"{self.metrics_api_key_file}: the metrics key needs 16+ characters")
        return key

    def read_secret(self) -> str | None:
        """The secret per-namespace Redis reader passwords derive from (``direct_reads``):
        ``direct_read_secret``, else the stripped contents of ``direct_read_secret_file``,
        which must pass :func:`check_read_secret` too."""
        if self.direct_read_secret is not None:
            return self.direct_read_secret
        if self.direct_read_secret_file is None:
            return None
        secret = _read_stripped(self.direct_read_secret_file, "cannot read")
        return check_read_secret(
            secret, f"R3_CACHE_DIRECT_READ_SECRET_FILE {self.direct_read_secret_file}"
        )

    def check_direct_reads(self) -> None:
        """Refuse to start (``ValueError``) with direct reads on and no readable secret,
        rather than fail every read plan later."""
        if self.direct_reads and self.read_secret() is None:
            raise ValueError(
                "R3_CACHE_DIRECT_READS is on but neither R3_CACHE_DIRECT_READ_SECRET nor "
                "R3_CACHE_DIRECT_READ_SECRET_FILE is set"
            )

    def store_settings(self, redis_url: str) -> StoreSettings:
        """The store's view of these settings, for the Redis at ``redis_url``."""
        return StoreSettings(
            redis_url=redis_url,
            cluster=self.redis_cluster,
            key_prefix=self.key_prefix,
            default_ttl_s=self.default_ttl_s,
            max_segments=self.max_segments,
            max_connections=self.redis_max_connections,
            dedupe=self.dedupe,
            layout=self.store_layout,
            durability=self.durability,
            durability_replicas=(
                self.durability_replicas
                if self.durability_replicas is not None
                else int(self.durability == "replicas")
            ),
            durability_timeout_ms=self.durability_timeout_ms,
            max_gap_rows=self.max_gap_rows,
            max_decoded_bytes=self.max_decoded_bytes,
            max_rollout_rows=self.max_rollout_rows,
            max_rollout_gap_rows=self.max_rollout_gap_rows,
            max_rollout_bytes=self.max_rollout_bytes,
            max_views=self.max_views,
            cursor_secret=self.drop_cursor_secret or "",
        )


def _read_stripped(path: Path, what: str) -> str:
    """``path``'s text without surrounding white space; ``ValueError`` (``<path>: <what>:
    <reason>``) when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{path}: {what}: {exc}") from None


@lru_cache(maxsize=1)
def get_settings() -> ServiceSettings:
    """Settings from the environment, read once."""
    return ServiceSettings()
