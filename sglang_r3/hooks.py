"""The hooks the plugin registers with SGLang's ``HookRegistry``, and their checks.

Every SGLang internal this extension touches is named in :data:`HOOKS` (and, for
attributes it reads, in ``sglang_r3.targets.UPSTREAM_FIELDS``); the canary test resolves
all of them against the installed SGLang, so an upgrade that moves one fails loudly.
:func:`hook_table` builds the table for one release: where a target moved or changed
form between SGLang 0.5.12 and 0.5.23 (:mod:`sglang_r3.releases`), the hook fits that
release's target.

Where the work happens (all in SGLang's HTTP process unless noted):

- ``TokenizerManager.generate_request`` (AROUND): every ``/generate`` and OpenAI
  request passes here.  Tagged requests get capture switched on, their rollouts
  looked up in the cache, and each finished output's rows shipped before the
  output is released.  Untagged requests go straight to upstream (or are refused
  under ``--routing-require-tag``, SGLang's warm-up and health probes excepted).
- ``TokenizerManager._send_one_request`` / ``_send_batch_request`` (AROUND): the
  tokenized prompt is known here, so a continued rollout's prefix is checked
  against the stored trajectory and ``routed_experts_start_len`` set per request
  (and, with ``--dp-size > 1``, each prompt of a tagged batch pinned to its
  rollout's DP rank; a single request is pinned in ``generate_request``).
- ``OpenAIServingBase.handle_request`` (AROUND): tags a request from the routing-key
  header (``X-SMG-Routing-Key``) when its body has no tag; puts the references into the
  OpenAI response (``sglext.r3``), streaming or not, and gives an r3 error its own
  status (upstream's handlers answer every ``ValueError`` with 400).
- ``http_server.serve_generate_request`` (AROUND): the same header tagging for
  ``/generate``; a tagged ``/generate`` stream
  refused before generation is answered with the error's status, not a 200 stream
  holding an error event.
- ``http_server.launch_server`` (BEFORE): verifies the hooks of this process and
  refuses unsupported options before any subprocess starts (our launcher's path).
- ``TokenizerManager.__init__`` (AROUND): the same verification on every start-up path
  (a framework's own too), then adds ``/r3/metrics``, ``/r3/loop`` and ``/r3/info``
  (and, before SGLang 0.5.22, puts the ``/generate`` hook on the route itself).
- ``Engine._launch_detokenizer_subprocesses`` (AROUND, before SGLang 0.5.22 only): each
  detokenizer process loads the plugins first (:func:`sglang_r3.hooks.run_detokenizer`).
- ``Scheduler.__init__`` (AROUND, scheduler process): the same verification and
  refusal there, and the CPU allocator check.
- ``SchedulerBatchResultProcessor._maybe_collect_routed_experts`` (AROUND, scheduler
  process): marks a tagged request's rows (:class:`~sglang_r3.scheduler.row_transport.TaggedRows`);
  O(1)
  unless a prefill recomputed stored rows (then gathered from there: a view).
- ``ScheduleBatch.prepare_for_extend`` (BEFORE, scheduler process): notes where each
  tagged request's prefill starts computing (its radix hit), per retraction epoch.
- ``schedule_batch.release_req`` (AROUND, scheduler process): on a retraction, keeps the
  rows a tagged request's tokens so far were sampled with (:mod:`sglang_r3.http_server.views`).
- ``DetokenizerManager.handle_batch_token_id_out`` (AROUND, detokenizer process):
  marked rows become compact :class:`~sglang_r3.scheduler.row_transport.EngineRows`
  instead of base64.
- ``DetokenizerManager.__init__`` (AROUND, detokenizer process): verification there.
- HiCache (scheduler process, :mod:`sglang_r3.scheduler.hicache`):
  ``UnifiedRadixCache.init_hicache``
  gives the host tier a routing-row buffer; ``HybridCacheController.write`` / ``load``
  move rows with the KV backed up to / loaded from it; ``BaseTopkCapturer.on_forward_end``
  and ``TopkCaptureOutput.finalize`` order those moves after the rows of the forward in
  flight (overlap scheduling).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any

from sglang_r3 import releases
from sglang_r3.http_server.generate_hooks import (
    around_generate_request,
    around_send_batch_request,
    around_send_batch_request_sync,
    around_send_one_request,
    around_send_one_request_sync,
)
from sglang_r3.http_server.http_hooks import (
    around_openai_handle_request,
    around_serve_generate_request,
    wrap_generate_route,
)
from sglang_r3.launch.startup import add_routes, check_startup
from sglang_r3.scheduler.hicache import (
    around_capture_finalize,
    around_capture_forward_end,
    around_controller_load,
    around_controller_write,
    around_init_hicache,
)
from sglang_r3.scheduler.row_hooks import (
    around_collect_routed_experts,
    around_detokenize,
    around_release_req,
    around_release_req_method,
    around_stream_output_generation,
    before_prepare_for_extend,
)
from sglang_r3.targets import (
    DETOKENIZER_TARGETS,
    HTTP_TARGETS,
    SCHEDULER_TARGETS,
    T_CAPTURE_END,
    T_CAPTURE_FINALIZE,
    T_COLLECT,
    T_DETOKENIZE,
    T_DETOKENIZER,
    T_EXTEND,
    T_GENERATE,
    T_HICACHE_INIT,
    T_HICACHE_LOAD,
    T_HICACHE_WRITE,
    T_LAUNCH,
    T_LAUNCH_DETOKENIZER,
    T_OPENAI,
    T_RELEASE,
    T_SCHEDULER,
    T_SEND_BATCH,
    T_SEND_ONE,
    T_SERVE_GENERATE,
    T_STREAM_OUTPUT,
    T_TOKENIZER_INIT,
)

# ---------------------------------------------------------------- start-up checks
# (here, beside the table they verify: the table lists them too)


def check_process(targets: list[str], server_args: Any | None) -> None:
    """This process's start-up check: the installed release's hooks on ``targets`` took
    effect and the options are safe (:func:`sglang_r3.launch.startup.check_startup`)."""
    check_startup(releases.current().targets(targets), server_args, HOOKS)


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``http_server.launch_server`` (``python -m sglang_r3.launch_server``, and any
    caller that loaded the plugins first): verify and refuse before any subprocess starts."""
    check_process(HTTP_TARGETS, server_args)
    return None


def around_tokenizer_init(
    original: Callable[..., Any], self: Any, server_args: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``TokenizerManager.__init__``: the HTTP process's start-up check, the ``/r3``
    routes (and, before SGLang 0.5.22, the ``/generate`` hook on the route itself).

    Every start-up path builds the tokenizer manager after SGLang loaded the plugins,
    including a framework's own (verl 0.9.1 calls ``Engine._launch_subprocesses`` and
    serves ``http_server.app`` itself; slime starts ``launch_server`` before any plugin
    is loaded, so the launch hook never runs there: docs/notes/framework-engine-startup.md).
    """
    check_process(HTTP_TARGETS, server_args)
    out = original(self, server_args, *args, **kwargs)
    add_routes()
    if not releases.current().has("serve_generate_request"):
        wrap_generate_route()
    return out


def around_launch_detokenizer(
    original: Callable[..., Any],
    cls: Any,
    server_args: Any,
    port_args: Any,
    run_detokenizer_process_func: Callable[..., Any],
) -> Any:
    """AROUND ``Engine._launch_detokenizer_subprocesses`` before SGLang 0.5.22, whose
    detokenizer loads no plugins: each detokenizer process runs
    :func:`run_detokenizer` around the function it was given (upstream's, or a
    framework's), which loads them there first.  Every start-up path starts the
    detokenizer here, after loading the plugins in this process."""
    func = functools.partial(run_detokenizer, run_detokenizer_process_func)
    return original(cls, server_args, port_args, func)


def run_detokenizer(run: Callable[..., object], *args: object, **kwargs: object) -> object:
    """A detokenizer process's function ``run`` (upstream's ``run_detokenizer_process``, or
    a framework's), with the plugins loaded in that process first (before SGLang 0.5.22,
    :func:`around_launch_detokenizer`).  Module-level, so that a spawned process finds it
    by name."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return run(*args, **kwargs)


def around_scheduler_init(
    original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``Scheduler.__init__``: the scheduler process's start-up check."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    check_process(SCHEDULER_TARGETS, server_args)
    return original(self, *args, **kwargs)


def around_detokenizer_init(
    original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``DetokenizerManager.__init__``: the start-up check of that process."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    check_process(DETOKENIZER_TARGETS, server_args)
    return original(self, *args, **kwargs)


# ---------------------------------------------------------------- the table


def _hook_type(name: str) -> Any:
    from sglang.srt.plugins.hook_registry import HookType

    return getattr(HookType, name)


def hook_table(release: releases.Release) -> list[tuple[str, Callable[..., Any], str]]:
    """``(target, hook, HookType name)`` for ``release``: each target where that release
    has it (:meth:`releases.Release.target`), the hook fitting its form there.  The
    canary test walks it."""
    new_send = release.has("async_send")
    rows: list[tuple[str, Callable[..., Any], str]] = [
        (T_GENERATE, around_generate_request, "AROUND"),
        (T_TOKENIZER_INIT, around_tokenizer_init, "AROUND"),
        (
            T_SEND_ONE,
            around_send_one_request if new_send else around_send_one_request_sync,
            "AROUND",
        ),
        (
            T_SEND_BATCH,
            around_send_batch_request if new_send else around_send_batch_request_sync,
            "AROUND",
        ),
        (T_OPENAI, around_openai_handle_request, "AROUND"),
        (T_SERVE_GENERATE, around_serve_generate_request, "AROUND"),
        (T_LAUNCH, before_launch_server, "BEFORE"),
        (T_LAUNCH_DETOKENIZER, around_launch_detokenizer, "AROUND"),
        (T_SCHEDULER, around_scheduler_init, "AROUND"),
        (T_COLLECT, around_collect_routed_experts, "AROUND"),
        (T_HICACHE_INIT, around_init_hicache, "AROUND"),
        (T_HICACHE_WRITE, around_controller_write, "AROUND"),
        (T_HICACHE_LOAD, around_controller_load, "AROUND"),
        (T_CAPTURE_END, around_capture_forward_end, "AROUND"),
        (T_CAPTURE_FINALIZE, around_capture_finalize, "AROUND"),
        (T_EXTEND, before_prepare_for_extend, "BEFORE"),
        (
            T_RELEASE,
            around_release_req
            if release.has("release_req_function")
            else around_release_req_method,
            "AROUND",
        ),
        (T_STREAM_OUTPUT, around_stream_output_generation, "AROUND"),
        (T_DETOKENIZER, around_detokenizer_init, "AROUND"),
        (T_DETOKENIZE, around_detokenize, "AROUND"),
    ]
    table = []
    for name, hook, kind in rows:
        target = release.target(name)
        if target is not None:
            table.append((target, hook, kind))
    return table


def _installed_table() -> list[tuple[str, Callable[..., Any], str]]:
    try:
        return hook_table(releases.current())
    except metadata.PackageNotFoundError:  # no SGLang here (a trainer's environment)
        return hook_table(releases.Release(releases.TESTED[-1]))


#: The installed release's :func:`hook_table`: what is registered and verified.
HOOKS = _installed_table()


def register_hooks() -> None:
    """Register every hook in :data:`HOOKS` (SGLang applies them after all plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, kind in HOOKS:
        if hook not in [h for _, h, _ in HookRegistry._hooks.get(target, [])]:
            HookRegistry.register(target, hook, _hook_type(kind))
