"""Service settings: pydantic-settings, ``R3_CACHE_`` environment prefix, CLI overrides."""

from __future__ import annotations

import ipaddress
import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cache_service.store import StoreSettings

__all__ = ["ServiceSettings", "get_settings", "is_loopback"]


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

    model_config = SettingsConfigDict(env_prefix="R3_CACHE_", frozen=True, extra="forbid")

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
    max_body_bytes: int = Field(default=256 << 20, ge=1024)
    max_tokens_per_segment: int = Field(default=1 << 20, ge=1)
    max_batch: int = Field(default=1024, ge=1)
    batch_concurrency: int = Field(default=8, ge=1, le=256)
    default_ttl_s: int = Field(default=24 * 3600, ge=0)
    key_prefix: str = "r3"
    max_segments: int = Field(default=4096, ge=1)
    redis_max_connections: int = Field(default=64, ge=1)
    dedupe: bool = True
    log_level: str = "INFO"

    @field_validator("api_keys")
    @classmethod
    def _keys_nonempty(cls, v: dict[str, str]) -> dict[str, str]:
        for key, ns in v.items():
            if len(key) < 16:
                raise ValueError("API keys must be at least 16 characters")
            if not ns:
                raise ValueError("every API key needs a namespace")
        return v

    def auth_enabled(self) -> bool:
        """Auth is on when asked, or (``auto``) whenever a listener is not loopback-only."""
        if self.auth == "auto":
            return not (is_loopback(self.http_host) and is_loopback(self.grpc_host))
        return self.auth == "on"

    def all_api_keys(self) -> dict[str, str]:
        """``api_keys`` merged with ``api_keys_file`` (JSON ``{"<key>": "<namespace>"}``)."""
        keys = dict(self.api_keys)
        if self.api_keys_file is not None:
            data = json.loads(self.api_keys_file.read_text())
            if not isinstance(data, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in data.items()
            ):
                raise ValueError(f"{self.api_keys_file}: expected a JSON object key -> namespace")
            keys.update(type(self)(api_keys=data).api_keys)  # same validation
        return keys

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
        )


@lru_cache(maxsize=1)
def get_settings() -> ServiceSettings:
    """Settings from the environment, read once."""
    return ServiceSettings()
