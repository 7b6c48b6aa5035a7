"""Engine-side configuration of the extension, read from the environment.

SGLang calls the plugin before it parses its command line, in every process it
spawns, so the launcher (:mod:`sglang_r3.launch_server`) passes its flags down as
``SGLANG_R3_*`` environment variables, which spawned children inherit.  The same
variables configure a plain ``python -m sglang.launch_server`` run with the plugin
installed (``--enable-return-routed-experts`` must then be passed by hand).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

ENV_CACHE = "SGLANG_R3_ROUTING_CACHE"
ENV_API_KEY = "SGLANG_R3_API_KEY"
ENV_ON_CACHE_ERROR = "SGLANG_R3_ON_CACHE_ERROR"
ENV_ON_RETRACTION = "SGLANG_R3_ON_RETRACTION"
ENV_ATTEMPTS = "SGLANG_R3_PUT_ATTEMPTS"
ENV_TIMEOUT = "SGLANG_R3_PUT_TIMEOUT_S"
ENV_MODEL_ID = "SGLANG_R3_MODEL_ID"
ENV_MAX_OUTPUTS = "SGLANG_R3_MAX_OUTPUTS"
ENV_LOOKUP = "SGLANG_R3_LOOKUP"
ENV_TAG_HEADER = "SGLANG_R3_TAG_HEADER"
ENV_REQUIRE_TAG = "SGLANG_R3_REQUIRE_TAG"
ENV_SHARE_PROMPT = "SGLANG_R3_SHARE_PROMPT"
ENV_DP_AFFINITY = "SGLANG_R3_DP_AFFINITY"
ENV_FORMAT_VERSION = "SGLANG_R3_FORMAT_VERSION"

#: Routing frame versions an engine may write (docs/format.md section 18.5).
FORMAT_VERSION_CHOICES = (2, 3)

#: The header sglang-router's manual policy routes by (and forwards to the engine):
#: the rollout id, so one value both pins a rollout to its engine and tags it.
DEFAULT_TAG_HEADER = "x-smg-routing-key"
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")

CacheErrorPolicy = Literal["fail", "inline"]
RetractionPolicy = Literal["mark", "fail"]
LookupPolicy = Literal["always", "seen"]
SharePromptPolicy = Literal["auto", "always", "never"]
SHARE_PROMPT_CHOICES: tuple[str, ...] = ("auto", "always", "never")
DpAffinityPolicy = Literal["rollout", "off"]
DP_AFFINITY_CHOICES: tuple[str, ...] = ("rollout", "off")


class ConfigError(ValueError):
    """An ``SGLANG_R3_*`` variable has a value the extension cannot use."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the extension does with routing once a tagged request finishes.

    ``routing_cache``: the cache service URL (``http://`` or ``grpc://``); empty
    means the extension is off and tagged requests are refused with a 400.
    ``on_cache_error``: after ``put_attempts`` tries fail, ``fail`` answers 503,
    ``inline`` answers with upstream's base64 routing and ``stored: false``.
    ``lookup``: ``always`` looks every tagged rollout up in the cache before generation
    (conflicts and an unreachable cache are refused before any compute); ``seen``
    skips that round trip for rollout ids this process has not written or looked up,
    which are then generated from row 0 and checked against the cache when written
    (a stored trajectory they extend is continued; a conflict or an unreachable
    cache is then answered after generation, in a stream's final error event).
    ``on_retraction``: a request the scheduler retracted may carry re-prefilled
    rows (miles#3277); ``mark`` stores them and says so, ``fail`` answers 503.
    ``tag_header``: a request with no ``custom_params`` tag whose HTTP header of
    this name is set is tagged with ``{"rollout_id": <header value>}`` (the channel
    that survives sglang-router, which drops ``custom_params``); empty turns it off.
    ``require_tag``: refuse (400) every generation request that carries no tag,
    instead of generating it with no routing stored (engines behind a router,
    where a lost tag would otherwise go unnoticed until the trainer's fetch).
    ``share_prompt``: whether a first turn's prompt rows are stored as their own
    segment, which the cache keeps once for every rollout with the same prompt
    tokens, version and rows, when the request's tag does not say (header-tagged
    requests never can): ``auto`` for requests with ``n > 1``, ``always`` also for
    GRPO samples sent one request each (verl, slime, miles, AReaL), ``never``.
    ``dp_affinity``: with ``--dp-size > 1``, ``rollout`` sends a tagged request that
    names no DP rank of its own to the rank its rollout id hashes to, so a rollout's
    turns find their prefix KV (and its rows) in that rank's radix cache; ``off``
    leaves every request to SGLang's load balancing (round robin by default), which
    recomputes a later turn's prefix on whichever rank it lands on.
    ``format_version``: the routing frame version this engine writes: 3 (default), or 2
    while some reader (cache service, trainer) still predates format v3 and would refuse
    it; upgrade readers first, then set 3 (docs/format.md section 18.5).
    """

    routing_cache: str = ""
    api_key: str | None = None
    on_cache_error: CacheErrorPolicy = "fail"
    on_retraction: RetractionPolicy = "mark"
    put_attempts: int = 3
    put_timeout_s: float = 10.0
    model_id: str = ""
    max_outputs: int = 1024
    lookup: LookupPolicy = "always"
    tag_header: str = DEFAULT_TAG_HEADER
    require_tag: bool = False
    share_prompt: SharePromptPolicy = "auto"
    dp_affinity: DpAffinityPolicy = "rollout"
    format_version: int = 3

    @property
    def enabled(self) -> bool:
        """True when tagged requests are shipped to a cache."""
        return bool(self.routing_cache)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineConfig:
        """Read and check the ``SGLANG_R3_*`` variables."""
        env = os.environ if env is None else env
        url = env.get(ENV_CACHE, "").strip()
        if url and not url.startswith(("http://", "https://", "grpc://")):
            raise ConfigError(f"{ENV_CACHE}={url!r}: use an http://, https:// or grpc:// URL")
        on_err = env.get(ENV_ON_CACHE_ERROR, "fail")
        if on_err not in ("fail", "inline"):
            raise ConfigError(f"{ENV_ON_CACHE_ERROR}={on_err!r}: use fail or inline")
        on_ret = env.get(ENV_ON_RETRACTION, "mark")
        if on_ret not in ("mark", "fail"):
            raise ConfigError(f"{ENV_ON_RETRACTION}={on_ret!r}: use mark or fail")
        try:
            attempts = int(env.get(ENV_ATTEMPTS, "3"))
            timeout = float(env.get(ENV_TIMEOUT, "10"))
            max_outputs = int(env.get(ENV_MAX_OUTPUTS, "1024"))
        except ValueError as exc:
            raise ConfigError(f"bad number in SGLANG_R3_* settings: {exc}") from None
        lookup = env.get(ENV_LOOKUP, "always")
        if lookup not in ("always", "seen"):
            raise ConfigError(f"{ENV_LOOKUP}={lookup!r}: use always or seen")
        tag_header = env.get(ENV_TAG_HEADER, DEFAULT_TAG_HEADER).strip().lower()
        if tag_header and not _HEADER_NAME.match(tag_header):
            raise ConfigError(
                f"{ENV_TAG_HEADER}={tag_header!r}: use an HTTP header name (letters, digits, -)"
            )
        require = env.get(ENV_REQUIRE_TAG, "0").strip().lower()
        if require not in ("0", "1", "false", "true", ""):
            raise ConfigError(f"{ENV_REQUIRE_TAG}={require!r}: use 1 or 0")
        share = env.get(ENV_SHARE_PROMPT, "auto").strip().lower() or "auto"
        if share not in SHARE_PROMPT_CHOICES:
            raise ConfigError(f"{ENV_SHARE_PROMPT}={share!r}: use auto, always or never")
        affinity = env.get(ENV_DP_AFFINITY, "rollout").strip().lower() or "rollout"
        if affinity not in DP_AFFINITY_CHOICES:
            raise ConfigError(f"{ENV_DP_AFFINITY}={affinity!r}: use rollout or off")
        version = env.get(ENV_FORMAT_VERSION, "3").strip() or "3"
        if version not in {str(v) for v in FORMAT_VERSION_CHOICES}:
            raise ConfigError(f"{ENV_FORMAT_VERSION}={version!r}: use 2 or 3")
        if attempts < 1 or timeout <= 0 or max_outputs < 1:
            raise ConfigError("put attempts, timeout and max outputs must be positive")
        return cls(
            routing_cache=url,
            api_key=env.get(ENV_API_KEY) or None,
            on_cache_error=on_err,  # type: ignore[arg-type]
            on_retraction=on_ret,  # type: ignore[arg-type]
            put_attempts=attempts,
            put_timeout_s=timeout,
            model_id=env.get(ENV_MODEL_ID, ""),
            max_outputs=max_outputs,
            lookup=lookup,  # type: ignore[arg-type]
            tag_header=tag_header,
            require_tag=require in ("1", "true"),
            share_prompt=share,  # type: ignore[arg-type]
            dp_affinity=affinity,  # type: ignore[arg-type]
            format_version=int(version),
        )

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this configuration in a child process."""
        out = {
            ENV_CACHE: self.routing_cache,
            ENV_ON_CACHE_ERROR: self.on_cache_error,
            ENV_ON_RETRACTION: self.on_retraction,
            ENV_ATTEMPTS: str(self.put_attempts),
            ENV_TIMEOUT: str(self.put_timeout_s),
            ENV_MAX_OUTPUTS: str(self.max_outputs),
            ENV_LOOKUP: self.lookup,
            ENV_TAG_HEADER: self.tag_header,
            ENV_REQUIRE_TAG: "1" if self.require_tag else "0",
            ENV_SHARE_PROMPT: self.share_prompt,
            ENV_DP_AFFINITY: self.dp_affinity,
            ENV_FORMAT_VERSION: str(self.format_version),
        }
        if self.api_key:
            out[ENV_API_KEY] = self.api_key
        if self.model_id:
            out[ENV_MODEL_ID] = self.model_id
        return out


_PROCESS_CONFIG: EngineConfig | None = None


def engine_config() -> EngineConfig:
    """This process's configuration, read from the environment on first use.

    Every hook of a process reads this one value (the environment does not change
    once SGLang has started the process).
    """
    global _PROCESS_CONFIG
    if _PROCESS_CONFIG is None:
        _PROCESS_CONFIG = EngineConfig.from_env()
    return _PROCESS_CONFIG
