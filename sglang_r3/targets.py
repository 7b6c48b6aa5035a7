"""The SGLang internals this extension hooks or reads, by dotted path.

The canary test resolves every one against the installed SGLang.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sglang_r3")


_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
T_GENERATE = f"{_TM}.generate_request"
# The HTTP process's start-up check and /r3 routes, on every start-up path (a framework
# calling Engine._launch_subprocesses itself never calls launch_server).
T_TOKENIZER_INIT = f"{_TM}.__init__"
T_SEND_ONE = f"{_TM}._send_one_request"
T_SEND_BATCH = f"{_TM}._send_batch_request"
T_OPENAI = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"
T_LAUNCH = "sglang.srt.entrypoints.http_server.launch_server"
# Before SGLang 0.5.22 the detokenizer loads no plugins: it is started through
# sglang_r3.hooks.run_detokenizer instead (sglang_r3.releases).
T_LAUNCH_DETOKENIZER = "sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses"
T_SERVE_GENERATE = "sglang.srt.entrypoints.http_server.serve_generate_request"
T_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler.__init__"
T_COLLECT = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_routed_experts"
)
_DETOK = "sglang.srt.managers.detokenizer_manager.DetokenizerManager"
T_DETOKENIZE = f"{_DETOK}.handle_batch_token_id_out"
T_DETOKENIZER = f"{_DETOK}.__init__"
# HiCache: routing rows follow KV between the device and the host tier
# (sglang_r3.scheduler.hicache).
T_HICACHE_INIT = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_hicache"
_HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
T_HICACHE_WRITE = f"{_HCC}.write"
T_HICACHE_LOAD = f"{_HCC}.load"
T_CAPTURE_END = "sglang.srt.state_capturer.base.BaseTopkCapturer.on_forward_end"
T_CAPTURE_FINALIZE = "sglang.srt.state_capturer.base.TopkCaptureOutput.finalize"
# Where each prefill starts computing, and the rows kept at a retraction (views).
T_EXTEND = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
T_RELEASE = "sglang.srt.managers.schedule_batch.release_req"
# Before 0.5.13 only: a streamed batch's routed_experts listed for every request
# (sglang_r3.scheduler.row_hooks.around_stream_output_generation).
T_STREAM_OUTPUT = (
    "sglang.srt.managers.scheduler_output_processor_mixin."
    "SchedulerOutputProcessorMixin.stream_output_generation"
)

# Attributes of upstream objects the hooks read or write (canary-tested).
UPSTREAM_FIELDS: dict[str, tuple[str, ...]] = {
    "sglang.srt.managers.io_struct.GenerateReqInput": (
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "stream",
        "return_routed_experts",
        "routed_experts_start_len",
        "return_prompt_token_ids",
        # --routing-dp-affinity: a request naming its DP rank (or a PD bootstrap room)
        # is left alone; otherwise the rollout's rank is set (generate_hooks).
        "routed_dp_rank",
        "data_parallel_rank",
        "bootstrap_room",
    ),
    "sglang.srt.managers.io_struct.TokenizedGenerateReqInput": (
        "rid",
        "input_ids",
        "routed_experts_start_len",
        "return_routed_experts",
        "routed_dp_rank",  # a tagged batch's prompts are pinned one by one
    ),
    "sglang.srt.managers.io_struct.BatchTokenIDOutput": ("rids", "routed_experts"),
    "sglang.srt.managers.io_struct.BatchStrOutput": ("rids", "routed_experts"),
    # The IPC mode: compact rows only cross pickle IPC (msgpack types the field as str).
    "sglang.srt.managers.io_struct": ("_USE_PICKLE_IPC",),
    # Health checks generate through generate_request under this rid prefix; an engine
    # that requires tags must still answer them.
    "sglang.srt.constants": ("HEALTH_CHECK_RID_PREFIX",),
    # ... and warm up over HTTP while the server is Starting.
    "sglang.srt.managers.tokenizer_manager.ServerStatus": ("Starting", "Up"),
    # Both OpenAI requests carry custom_params, copied into sampling_params.
    "sglang.srt.entrypoints.openai.protocol.CompletionRequest": ("custom_params",),
    "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest": ("custom_params",),
    "sglang.srt.server_args.ServerArgs": (
        "enable_return_routed_experts",
        "enable_hierarchical_cache",
        "hicache_storage_backend",
        "hicache_host_memory_mode",
        "hicache_io_backend",
        "hicache_mem_layout",
        "hicache_write_policy",
        "enable_unified_memory",
        "dcp_size",
        "radix_cache_backend",
        "enable_lmcache",
        "enable_flexkv",
        "disaggregation_mode",
        "tokenizer_worker_num",
        "speculative_algorithm",
        "enable_hisparse",
        "device",
        "served_model_name",
        "model_path",
    ),
    # --tokenizer-worker-num > 1: the app SGLang's HTTP workers import
    # (sglang_r3.worker_app).
    "sglang.srt.environ.Envs": ("SGLANG_HTTP_SERVER_APP_PATH",),
}


HTTP_TARGETS = [
    T_GENERATE,
    T_TOKENIZER_INIT,
    T_SEND_ONE,
    T_SEND_BATCH,
    T_OPENAI,
    T_SERVE_GENERATE,
    T_LAUNCH,
    T_LAUNCH_DETOKENIZER,
]
SCHEDULER_TARGETS = [
    T_SCHEDULER,
    T_COLLECT,
    T_HICACHE_INIT,
    T_HICACHE_WRITE,
    T_HICACHE_LOAD,
    T_CAPTURE_END,
    T_CAPTURE_FINALIZE,
    T_EXTEND,
    T_RELEASE,
    T_STREAM_OUTPUT,
]
DETOKENIZER_TARGETS = [T_DETOKENIZER, T_DETOKENIZE]
