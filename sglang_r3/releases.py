"""The SGLang releases this extension supports, and what differs between them.

The one place that knows releases apart: every hook target, upstream field and
capability that is not the same in every supported release is listed here with the
first release that has it, read from each release's wheel (docs/notes/
sglang-release-range.md; ``tests/engine/test_release_wheels.py`` resolves this table
against every release's own wheel).  The hooks, the launcher and the CPU recipe ask
:func:`current` what the installed release has; none of them compares versions itself.

A release outside :data:`SUPPORTED` is refused at start-up with the range in the message
(:func:`check_supported`).  A capability a supported release lacks is refused by name,
with the first release that has it (:func:`missing`); nothing is approximated.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import metadata

from sglang_r3.targets import (
    DETOKENIZER_TARGETS,
    HTTP_TARGETS,
    SCHEDULER_TARGETS,
    T_COLLECT,
    T_LAUNCH_DETOKENIZER,
    T_RELEASE,
    T_SERVE_GENERATE,
    T_STREAM_OUTPUT,
    UPSTREAM_FIELDS,
)

Version = tuple[int, int, int]

#: The supported releases, as pip writes them (``pyproject.toml``'s ``sglang`` extra).
SUPPORTED = ">=0.5.12,<0.5.24"
FIRST: Version = (0, 5, 12)
PAST: Version = (0, 5, 24)  # the first release not supported

#: Releases whose engines the test suite runs end to end (``make test``).
TESTED = ("0.5.12", "0.5.23")
#: The release the options verified on one release only were verified on.
VERIFIED_ON = "0.5.23"

#: Where the collect hook's target was before 0.5.13 (a Scheduler mixin method, the
#: same ``(self, req)``; 0.5.12 ``managers/scheduler_output_processor_mixin.py:110``).
T_COLLECT_MIXIN = (
    "sglang.srt.managers.scheduler_output_processor_mixin."
    "SchedulerOutputProcessorMixin.maybe_collect_routed_experts"
)
#: Where the retraction hook's target was before 0.5.13: a ``ScheduleBatch`` method
#: ``(self, idx, remaing_req_count, server_args)`` (0.5.12 ``schedule_batch.py:2242``).
T_RELEASE_METHOD = "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req"


#: Targets hooked only on releases that lack a capability (the hook stands in for it),
#: whether or not the target exists later: target -> the capability.
WORKAROUNDS: dict[str, str] = {
    # the detokenizer loads the plugins itself from 0.5.22
    T_LAUNCH_DETOKENIZER: "detokenizer_plugins",
    # a batch's routed_experts are aligned from 0.5.13
    T_STREAM_OUTPUT: "aligned_routed_experts",
}


@dataclass(frozen=True)
class Capability:
    """Something the extension relies on that appeared in ``since`` (``what``: one
    phrase, for a refusal)."""

    since: Version
    what: str


#: What not every supported release has, by the first release that has it.
CAPABILITIES: dict[str, Capability] = {
    "batch_result_processor": Capability(
        (0, 5, 13), "the scheduler's SchedulerBatchResultProcessor (where rows are collected)"
    ),
    # 0.5.12's stream_output_generation lists routed_experts only for requests that asked
    # (scheduler_output_processor_mixin.py:1237-1240) while the tokenizer manager reads it
    # by batch position (tokenizer_manager.py:1726-1727): a batch mixing requests that
    # asked and requests that did not gets an IndexError or another request's rows.
    # 0.5.13 lists None for the others (output_streamer).
    "aligned_routed_experts": Capability(
        (0, 5, 13), "routed_experts listed for every request of a streamed batch"
    ),
    "release_req_function": Capability(
        (0, 5, 13), "schedule_batch.release_req as a module function"
    ),
    "return_prompt_token_ids": Capability((0, 5, 13), "GenerateReqInput.return_prompt_token_ids"),
    "pool_host_package": Capability(
        (0, 5, 14), "the sglang.srt.mem_cache.pool_host package (ALLOC_MEMORY_FUNCS)"
    ),
    "cuda_graph_backend_args": Capability(
        (0, 5, 14), "--cuda-graph-backend-decode / --cuda-graph-backend-prefill"
    ),
    "pickle_ipc_switch": Capability((0, 5, 15), "SGLANG_USE_PICKLE_IPC (msgpack IPC)"),
    # Before 0.5.19 a model that is not hybrid gets HiRadixCache + HiCacheController
    # (0.5.18 mem_cache/registry.py), which sglang_r3.scheduler.hicache does not hook.
    "unified_hicache": Capability(
        (0, 5, 19), "UnifiedRadixCache for every model under --enable-hierarchical-cache"
    ),
    "resolved_view": Capability((0, 5, 19), "ServerArgs.resolve_once / resolved_view"),
    "weight_version_spans": Capability(
        (0, 5, 19), 'meta_info["weight_versions"] (where the weights changed in an output)'
    ),
    # Req's KV bookkeeping moved into Req.kv (a ReqKvInfo) in 0.5.19; before, the
    # request held req_pool_idx and kv_committed_len itself (0.5.18 schedule_batch.py).
    "req_kv_info": Capability((0, 5, 19), "Req.kv (ReqKvInfo)"),
    # Before 0.5.22 a prefill's radix hit is len(req.prefix_indices).
    "req_prefix_len": Capability((0, 5, 22), "Req.prefix_len"),
    "async_send": Capability(
        (0, 5, 20), "TokenizerManager._send_one_request / _send_batch_request as async def"
    ),
    "capturer_alloc_funcs": Capability(
        (0, 5, 20), "the routed-experts host buffer allocated through ALLOC_MEMORY_FUNCS"
    ),
    "serve_generate_request": Capability(
        (0, 5, 22), "http_server.serve_generate_request (the /generate handler's body)"
    ),
    "detokenizer_plugins": Capability(
        (0, 5, 22), "SGLang's plugin loader in the detokenizer process"
    ),
    "http_server_app_path": Capability(
        (0, 5, 23), "SGLANG_HTTP_SERVER_APP_PATH (the app --tokenizer-worker-num workers import)"
    ),
}

#: Upstream fields (:data:`sglang_r3.targets.UPSTREAM_FIELDS`) missing from some
#: supported releases: ``(owner, field) -> [(first, past), ...]``, the releases that
#: lack it (``past`` exclusive).
FIELD_GAPS: dict[tuple[str, str], tuple[tuple[Version, Version], ...]] = {
    ("sglang.srt.managers.io_struct.GenerateReqInput", "return_prompt_token_ids"): (
        ((0, 5, 12), (0, 5, 13)),
    ),
    # a deprecated alias again from 0.5.18 (io_struct.py:275)
    ("sglang.srt.managers.io_struct.GenerateReqInput", "data_parallel_rank"): (
        ((0, 5, 15), (0, 5, 18)),
    ),
    ("sglang.srt.managers.io_struct", "_USE_PICKLE_IPC"): (((0, 5, 12), (0, 5, 15)),),
    ("sglang.srt.server_args.ServerArgs", "radix_cache_backend"): (((0, 5, 12), (0, 5, 13)),),
    ("sglang.srt.server_args.ServerArgs", "dcp_size"): (((0, 5, 12), (0, 5, 15)),),
    ("sglang.srt.server_args.ServerArgs", "enable_unified_memory"): (((0, 5, 12), (0, 5, 15)),),
    ("sglang.srt.server_args.ServerArgs", "enable_flexkv"): (((0, 5, 12), (0, 5, 16)),),
    ("sglang.srt.server_args.ServerArgs", "hicache_host_memory_mode"): (((0, 5, 12), (0, 5, 19)),),
    ("sglang.srt.environ.Envs", "SGLANG_HTTP_SERVER_APP_PATH"): (((0, 5, 12), (0, 5, 23)),),
}


class UnsupportedReleaseError(RuntimeError):
    """The installed SGLang is outside :data:`SUPPORTED`."""


def parse(version: str) -> Version:
    """``"0.5.12.post1"`` -> ``(0, 5, 12)`` (a ``.postN`` never differs from its base on
    anything this module lists; docs/notes/sglang-release-range.md)."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        raise UnsupportedReleaseError(f"cannot read SGLang's version {version!r}")
    return int(m[1]), int(m[2]), int(m[3])


def _dotted(v: Version) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class Release:
    """One SGLang release, as far as this extension cares."""

    version: str

    @property
    def key(self) -> Version:
        """The release as ``(major, minor, patch)``."""
        return parse(self.version)

    @property
    def supported(self) -> bool:
        """Inside :data:`SUPPORTED`."""
        return FIRST <= self.key < PAST

    def has(self, capability: str) -> bool:
        """True when this release has ``capability`` (a :data:`CAPABILITIES` key)."""
        return self.key >= CAPABILITIES[capability].since

    def missing(self, capability: str, option: str) -> str | None:
        """One sentence refusing ``option`` on this release when it lacks ``capability``
        (naming the first release that has it), else None."""
        if self.has(capability):
            return None
        cap = CAPABILITIES[capability]
        return (
            f"{option} needs {cap.what}, which SGLang has from {_dotted(cap.since)} on; "
            f"this is SGLang {self.version}"
        )

    def not_verified(self, option: str) -> str | None:
        """One sentence refusing ``option`` (verified on :data:`VERIFIED_ON` only) on
        any other release, else None."""
        if self.key == parse(VERIFIED_ON):
            return None
        return (
            f"{option} with sglang_r3 is verified on SGLang {VERIFIED_ON} only "
            f"(docs/engine.md, support matrix); this is SGLang {self.version}"
        )

    def target(self, name: str) -> str | None:
        """Where hook target ``name`` (a ``sglang_r3.targets`` ``T_*``) is in this
        release, or None where it does not exist."""
        if name == T_COLLECT and not self.has("batch_result_processor"):
            return T_COLLECT_MIXIN
        if name == T_RELEASE and not self.has("release_req_function"):
            return T_RELEASE_METHOD
        if name == T_SERVE_GENERATE and not self.has("serve_generate_request"):
            return None
        if name in WORKAROUNDS and self.has(WORKAROUNDS[name]):
            return None
        return name

    def targets(self, names: list[str]) -> list[str]:
        """:meth:`target` of each of ``names`` that exists here."""
        return [t for t in (self.target(n) for n in names) if t is not None]

    def fields(self) -> dict[str, tuple[str, ...]]:
        """:data:`~sglang_r3.targets.UPSTREAM_FIELDS` less what this release lacks."""
        return {
            owner: tuple(f for f in names if not self._lacks(owner, f))
            for owner, names in UPSTREAM_FIELDS.items()
        }

    def _lacks(self, owner: str, field: str) -> bool:
        gaps = FIELD_GAPS.get((owner, field), ())
        return any(first <= self.key < past for first, past in gaps)


def installed_version() -> str:
    """The installed SGLang's version (from its package metadata; nothing imported)."""
    return metadata.version("sglang")


@functools.cache
def current() -> Release:
    """The installed SGLang release."""
    return Release(installed_version())


def range_problem(release: Release) -> str | None:
    """Why ``release`` cannot be used (outside :data:`SUPPORTED`), or None."""
    if release.supported:
        return None
    return (
        f"sglang_r3 supports SGLang {SUPPORTED} (pip's spelling); this is SGLang "
        f"{release.version}. Install a release in that range: "
        f"`pip install 'sglang{SUPPORTED}'` (docs/engine.md, \"Supported SGLang releases\")"
    )


def check_supported(release: Release | None = None) -> Release:
    """The installed release (or ``release``), or :class:`UnsupportedReleaseError`."""
    release = release or current()
    problem = range_problem(release)
    if problem:
        raise UnsupportedReleaseError(problem)
    return release


# Every target the plugin hooks, process by process (the hook table is in this order).
ALL_TARGETS = [*HTTP_TARGETS, *SCHEDULER_TARGETS, *DETOKENIZER_TARGETS]


# ---------------------------------------------------------------- Req fields by release


def req_kv(req: object) -> object:
    """Where a scheduler ``Req`` keeps ``req_pool_idx`` and ``kv_committed_len``: its
    ``kv`` (a ``ReqKvInfo``, 0.5.19 on), else the request itself."""
    return getattr(req, "kv") if current().has("req_kv_info") else req  # noqa: B009


def req_prefix_len(req: object) -> int:
    """A scheduler ``Req``'s radix-cache hit before its prefill: ``prefix_len`` (0.5.22
    on), else ``len(prefix_indices)``."""
    if current().has("req_prefix_len"):
        return int(getattr(req, "prefix_len", 0) or 0)
    indices = getattr(req, "prefix_indices", None)
    return 0 if indices is None else len(indices)


def pickle_ipc() -> bool:
    """True when io_struct objects cross processes by pickle (always before 0.5.15,
    which has no msgpack IPC; from then on, ``io_struct._USE_PICKLE_IPC``)."""
    if not current().has("pickle_ipc_switch"):
        return True
    from sglang.srt.managers import io_struct

    return bool(io_struct._USE_PICKLE_IPC)
