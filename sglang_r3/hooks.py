"""The hooks the plugin registers with SGLang's ``HookRegistry``, and their checks.

Every SGLang internal this extension touches is named in :data:`HOOKS` (and, for
attributes it reads, in :data:`UPSTREAM_FIELDS`); the canary test resolves all of
them against the installed SGLang, so an upgrade that moves one fails loudly.

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
- ``http_server.launch_server`` (BEFORE): verifies the hooks of this process,
  refuses unsupported options, adds ``/r3/metrics`` and ``/r3/info``.
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

from collections.abc import Callable
from typing import Any

from sglang_r3.http_server.generate_hooks import (
    around_generate_request,
    around_send_batch_request,
    around_send_one_request,
)
from sglang_r3.http_server.http_hooks import (
    around_openai_handle_request,
    around_serve_generate_request,
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
    T_OPENAI,
    T_RELEASE,
    T_SCHEDULER,
    T_SEND_BATCH,
    T_SEND_ONE,
    T_SERVE_GENERATE,
)

# ---------------------------------------------------------------- start-up checks
# (here, beside the table they verify: the table lists them too)


def check_process(targets: list[str], server_args: Any | None) -> None:
    """This process's start-up check: :data:`HOOKS` on ``targets`` took effect and the
    options are safe (:func:`sglang_r3.launch.startup.check_startup`)."""
    check_startup(targets, server_args, HOOKS)


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``http_server.launch_server``: verify, refuse, add the ``/r3`` routes."""
    check_process(HTTP_TARGETS, server_args)
    add_routes()
    return None


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


# (target, hook, HookType name).  The canary test walks this list.
HOOKS: list[tuple[str, Callable[..., Any], str]] = [
    (T_GENERATE, around_generate_request, "AROUND"),
    (T_SEND_ONE, around_send_one_request, "AROUND"),
    (T_SEND_BATCH, around_send_batch_request, "AROUND"),
    (T_OPENAI, around_openai_handle_request, "AROUND"),
    (T_SERVE_GENERATE, around_serve_generate_request, "AROUND"),
    (T_LAUNCH, before_launch_server, "BEFORE"),
    (T_SCHEDULER, around_scheduler_init, "AROUND"),
    (T_COLLECT, around_collect_routed_experts, "AROUND"),
    (T_DETOKENIZER, around_detokenizer_init, "AROUND"),
    (T_DETOKENIZE, around_detokenize, "AROUND"),
    (T_HICACHE_INIT, around_init_hicache, "AROUND"),
    (T_HICACHE_WRITE, around_controller_write, "AROUND"),
    (T_HICACHE_LOAD, around_controller_load, "AROUND"),
    (T_CAPTURE_END, around_capture_forward_end, "AROUND"),
    (T_CAPTURE_FINALIZE, around_capture_finalize, "AROUND"),
    (T_EXTEND, before_prepare_for_extend, "BEFORE"),
    (T_RELEASE, around_release_req, "AROUND"),
]


def register_hooks() -> None:
    """Register every hook in :data:`HOOKS` (SGLang applies them after all plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, kind in HOOKS:
        if hook not in [h for _, h, _ in HookRegistry._hooks.get(target, [])]:
            HookRegistry.register(target, hook, _hook_type(kind))
