"""Start-up checks of every SGLang process, and the ``/r3/*`` routes.

The hooks that run these checks are in :mod:`sglang_r3.hooks`, beside the table of
hooks they verify; this module takes that table as an argument.
"""

from __future__ import annotations

import copy
import logging
import os
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

from sglang_r3 import releases
from sglang_r3.config import EngineConfig, engine_config
from sglang_r3.errors import StartupError
from sglang_r3.http_server import metrics
from sglang_r3.http_server.loop_probe import LOOP_PROBE
from sglang_r3.scheduler.hicache import unsupported_hicache_options
from sglang_r3.targets import HTTP_TARGETS

log = logging.getLogger("sglang_r3")

#: What SGLang's HTTP workers import as the app under ``--tokenizer-worker-num > 1``
#: (:mod:`sglang_r3.worker_app`), named by the variable SGLang reads it from
#: (``environ.py:343``, ``http_server.py:2790, 3052``).
APP_PATH = "sglang_r3.worker_app:app"
APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"

# ---------------------------------------------------------------- checks


def unsupported_options(server_args: Any, config: EngineConfig) -> list[str]:
    """Options under which shipped routing could be wrong; empty when all is well."""
    if not config.enabled:
        return []

    def on(name: str) -> Any:
        return getattr(server_args, name, None)

    problems = []
    if not on("enable_return_routed_experts"):
        problems.append(
            "--enable-return-routed-experts is off, so the engine records nothing "
            "(the sglang_r3 launcher adds it)"
        )
    # HiCache's host tier loads KV without a forward pass (sglang#26975);
    # sglang_r3.scheduler.hicache
    # moves the routing rows with it where that is verified, and refuses the rest.
    problems += unsupported_hicache_options(server_args)
    if on("enable_lmcache") or on("enable_flexkv"):
        problems.append(
            "--enable-lmcache / --enable-flexkv restore KV without recomputing it; "
            "routing rows of restored tokens would be stale"
        )
    # --disaggregation-mode decode is supported: its prompt KV comes from the prefill
    # node, so its prompt rows are never computed here, and a tagged request there
    # ships only rows [P, P+N-1) (sglang_r3.http_server.pd); the prefill server ships [stored, P).
    # A decode-side radix cache changes only where prompt KV comes from, never those
    # rows.  Retractions there restore KV without a forward: refused per request.
    worker_app = worker_app_problem(server_args)
    if worker_app:
        problems.append(worker_app)
    speculation = speculation_problem(server_args)
    if speculation:
        problems.append(speculation)
    if on("enable_hisparse"):
        problems.append("--enable-hisparse restores KV without recomputing it")
    return problems + release_problems(server_args)


def release_problems(server_args: Any) -> list[str]:
    """Options the installed SGLang release cannot serve with routing right: each refused
    in one sentence naming the release that can (:mod:`sglang_r3.releases`)."""
    release = releases.current()

    def on(name: str) -> Any:
        return getattr(server_args, name, None)

    checks = [
        (
            on("enable_hierarchical_cache"),
            release.missing("unified_hicache", "--enable-hierarchical-cache"),
        ),
        (
            (on("tokenizer_worker_num") or 1) > 1,
            release.missing("http_server_app_path", "--tokenizer-worker-num > 1"),
        ),
        (
            on("disaggregation_mode") not in (None, "null"),
            release.not_verified(f"--disaggregation-mode {on('disaggregation_mode')}"),
        ),
        (on("speculative_algorithm"), release.not_verified("speculative decoding")),
    ]
    return [problem for applies, problem in checks if applies and problem]


def worker_app_problem(server_args: Any) -> str | None:
    """Why SGLang's HTTP workers would serve without this extension, or None.

    Under ``--tokenizer-worker-num > 1`` the workers import the app named by
    ``$SGLANG_HTTP_SERVER_APP_PATH`` and load no plugins themselves, so only
    :data:`APP_PATH` (which loads them) stores their routing.
    """
    if (getattr(server_args, "tokenizer_worker_num", None) or 1) <= 1:
        return None
    current = os.environ.get(APP_PATH_ENV)
    if current == APP_PATH:
        return None
    return (
        "--tokenizer-worker-num > 1 serves HTTP from worker processes that import "
        f"${APP_PATH_ENV} (now {current!r}) and load no SGLang "
        "plugins themselves (sglang 0.5.23 http_server.py:242, 298-308, 3052-3077), so "
        "their routing would not be stored; start the server with "
        f"`python -m sglang_r3.launch_server` and {APP_PATH_ENV} unset (it sets the "
        f"variable), or set {APP_PATH_ENV}={APP_PATH}"
    )


# Speculative algorithms whose verify path keeps one routing row per accepted token when
# the draft is a chain (topk 1): EAGLE-family workers (NEXTN resolves to EAGLE).
CHAIN_SPECULATION = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
_USE_CHAIN = (
    "use EAGLE, EAGLE3, NEXTN (MTP) or STANDALONE with --speculative-eagle-topk 1 "
    "(a chain: --speculative-num-draft-tokens = --speculative-num-steps + 1)"
)


def resolved_server_args(server_args: Any) -> Any:
    """``server_args`` as SGLang's argument resolution decides it (a read-only view).

    SGLang 0.5.23 never writes resolved values back to the record: handlers declare them
    in a stash (``arg_groups/overrides.py`` ``declare_resolution``) read through
    ``resolved_view``; raw fields keep what the command line said (``NEXTN``, topk
    ``None``).  Before SGLang resolves the record (our launcher checks it first), a copy
    is resolved here; if that fails, the raw record is returned and SGLang reports its own
    error when it resolves.
    """
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view
    except ImportError:  # not SGLang's record (unit tests pass a namespace)
        return server_args
    if not getattr(server_args, "_resolution_finished", False):
        if not callable(getattr(server_args, "resolve_once", None)):
            return server_args
        try:
            server_args = copy.deepcopy(server_args)
            server_args.resolve_once()
        except Exception as exc:  # SGLang raises its own error on its own resolution
            log.debug("resolving a copy of server_args failed: %s", exc)
            return server_args
    return resolved_view(server_args)


def speculation_problem(server_args: Any) -> str | None:
    """Why routing rows would be wrong under the configured speculative decoding, or None.

    What SGLang 0.5.23 does (docs/notes/sglang-0.5.23-fleet-configs.md, "Speculative
    decoding"): verify is a target forward over every draft slot and is captured
    (``model_executor/model_runner.py:1876-1886``); draft models opt out of capture
    (``model_runner.py:722-723``, ``state_capturer/routed_experts.py:177-190``); rows of
    accepted tokens are read through ``req_to_token`` at finish, rejected drafts' slots
    are freed.  With a chain (``topk == 1``) the accepted tokens already sit at the front
    of the verify window, so each has its own row.  A tree moves the accepted path's KV
    to the front instead, and the rows stay behind.
    """
    if not getattr(server_args, "speculative_algorithm", None):
        return None
    view = resolved_server_args(server_args)
    algorithm = str(view.speculative_algorithm).upper()
    if algorithm == "NGRAM":
        return (
            "--speculative-algorithm NGRAM: its draft trees move accepted tokens' KV "
            "(sglang/srt/speculative/ngram_worker.py:510 -> spec_utils.py:859-910, "
            "move_accept_tokens_to_target_kvcache) without the routing rows recorded at "
            "those KV slots, and under the overlap scheduler (the GPU default) its batch "
            "result drops the target forward's routed_experts_output "
            "(speculative/ngram_worker.py:567-577), so no row is written at all; " + _USE_CHAIN
        )
    if algorithm not in CHAIN_SPECULATION:
        return (
            f"--speculative-algorithm {algorithm}: routing capture under it is not "
            f"verified by sglang_r3; {_USE_CHAIN}"
        )
    topk = view.speculative_eagle_topk
    if topk is None or int(topk) != 1:
        return (
            f"speculative decoding with --speculative-eagle-topk {topk} (a draft tree) "
            "moves the accepted path's KV to the front of the verify window "
            "(sglang/srt/speculative/spec_utils.py:859-910, "
            "move_accept_tokens_to_target_kvcache, called at "
            "speculative/eagle_worker_common.py:508 when topk > 1, :772) but not the "
            "routing rows recorded at those KV slots, so accepted tokens would be stored "
            f"with rejected drafts' rows; {_USE_CHAIN}"
        )
    return None


def resolve_target(target: str) -> Any:
    """The attribute a hook target names (``package.module.Class.method``), imported."""
    owner, _, attr = target.rpartition(".")
    return getattr(pkgutil.resolve_name(owner), attr)


#: ``(target, hook, HookType name)``: the table :data:`sglang_r3.hooks.HOOKS`.
HookTable = Sequence[tuple[str, Callable[..., Any], str]]


def verify_hooks(targets: list[str], hooks: HookTable) -> list[str]:
    """Problems with the ``hooks`` on ``targets`` in this process (empty: all took effect)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    problems = []
    ours = {t: h for t, h, _ in hooks}
    for target in targets:
        registered = [h for _, h, _ in HookRegistry._hooks.get(target, [])]
        if ours[target] not in registered:
            problems.append(f"{target}: hook not registered")
            continue
        if target not in HookRegistry._patched:
            problems.append(f"{target}: SGLang did not apply the hook (see its log for why)")
            continue
        try:
            fn = resolve_target(target)
        except (AttributeError, ImportError, ValueError) as exc:
            problems.append(f"{target}: cannot resolve ({exc})")
            continue
        if getattr(fn, "__wrapped__", None) is None:
            problems.append(f"{target}: attribute is not the patched wrapper")
    return problems


def check_startup(targets: list[str], server_args: Any | None, hooks: HookTable) -> None:
    """Raise :class:`StartupError` listing every problem, if any (only a warning when
    routing shipping is off: the plugin is then merely installed)."""
    config = engine_config()
    problem = releases.range_problem(releases.current())
    problems = [problem] if problem else verify_hooks(targets, hooks)
    if server_args is not None:
        problems += unsupported_options(server_args, config)
        if str(getattr(server_args, "device", "")) == "cpu":
            from sglang_r3.cpu.allocator import allocator_installed

            if not allocator_installed():
                problems.append("--device cpu without the CPU host allocator (plugin not loaded?)")
    if not problems:
        return
    message = (
        "sglang_r3 cannot start:\n  - "
        + "\n  - ".join(problems)
        + f"\n(sglang_r3 supports SGLang {releases.SUPPORTED}; this is SGLang "
        f"{releases.current().version})"
    )
    if not config.enabled:
        # Installed but not asked to ship routing: do not stop someone else's server;
        # tagged requests will be refused anyway.
        log.warning("%s\n(routing shipping is off, so the server starts)", message)
        return
    raise StartupError(message)


class _SummedR3:
    """The ``r3_*`` metrics summed over every process writing to
    ``PROMETHEUS_MULTIPROC_DIR`` (SGLang's own metrics may live there too)."""

    def collect(self) -> Any:
        from prometheus_client import multiprocess

        summed = multiprocess.MultiProcessCollector(None).collect()  # type: ignore[no-untyped-call]
        return [m for m in summed if m.name.startswith("r3_")]


def add_routes(*, aggregate_metrics: bool = False) -> None:
    """Add ``/r3/metrics``, ``/r3/loop`` and ``/r3/info`` to SGLang's app (once).

    ``aggregate_metrics``: answer ``/r3/metrics`` summed over every process writing
    to ``PROMETHEUS_MULTIPROC_DIR`` (the tokenizer workers,
    :mod:`sglang_r3.worker_app`);
    else this process's own counters.
    """
    from fastapi import Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    if any(getattr(r, "path", None) == "/r3/metrics" for r in app.router.routes):
        return
    registry = metrics.REGISTRY
    if aggregate_metrics:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_SummedR3())

    async def r3_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def r3_info() -> dict[str, Any]:
        config = engine_config()
        outputs = {
            s.labels["outcome"]: s.value
            for m in metrics.OUTPUTS.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }
        return {
            "enabled": config.enabled,
            "routing_cache": config.routing_cache,
            "on_cache_error": config.on_cache_error,
            "on_retraction": config.on_retraction,
            "share_prompt": config.share_prompt,
            "dp_affinity": config.dp_affinity,
            "format_version": config.format_version,
            "sglang": releases.current().version,
            "hooks": HTTP_TARGETS,
            # The answering process (one of several under --tokenizer-worker-num > 1)
            # and its own tagged outputs by outcome.
            "pid": os.getpid(),
            "outputs": outputs,
        }

    async def r3_loop() -> dict[str, Any]:
        LOOP_PROBE.ensure_started()
        return LOOP_PROBE.take()

    app.add_api_route("/r3/metrics", r3_metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/r3/loop", r3_loop, methods=["GET"], include_in_schema=False)
    app.add_api_route("/r3/info", r3_info, methods=["GET"], include_in_schema=False)
