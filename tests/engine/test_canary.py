"""Canary: the SGLang internals the extension touches are where it expects them.

If an SGLang upgrade moves any of these, this file fails with the name of what moved,
before a server ever runs with a hook that silently did not apply.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from collections import defaultdict
from importlib.metadata import entry_points, version

import pytest

from sglang_r3.hooks import HOOKS
from sglang_r3.launch.startup import resolve_target
from sglang_r3.targets import UPSTREAM_FIELDS

# Parameters each hooked callable must still take, in order.
SIGNATURES = {
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": [
        "self",
        "obj",
        "request",
    ],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_one_request": [
        "self",
        "tokenized_obj",
    ],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._send_batch_request": [
        "self",
        "tokenized_objs",
    ],
    "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request": [
        "self",
        "request",
        "raw_request",
    ],
    "sglang.srt.entrypoints.http_server.serve_generate_request": ["obj", "request"],
    "sglang.srt.entrypoints.http_server.launch_server": ["server_args"],
    "sglang.srt.managers.scheduler.Scheduler.__init__": ["self", "server_args", "port_args"],
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_routed_experts": ["self", "req"],
    "sglang.srt.managers.detokenizer_manager.DetokenizerManager.__init__": [
        "self",
        "server_args",
        "port_args",
    ],
    "sglang.srt.managers.detokenizer_manager.DetokenizerManager.handle_batch_token_id_out": [
        "self",
        "recv_obj",
    ],
    # HiCache (sglang_r3.scheduler.hicache)
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.init_hicache": [
        "self",
        "server_args",
        "params",
    ],
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.write": [
        "self",
        "device_indices",
    ],
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.load": [
        "self",
        "host_indices",
    ],
    "sglang.srt.state_capturer.base.BaseTopkCapturer.on_forward_end": ["self", "forward_batch"],
    "sglang.srt.state_capturer.base.TopkCaptureOutput.finalize": ["self"],
    # Views (sglang_r3.scheduler.row_hooks): where prefills start, rows kept at a retraction.
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend": ["self"],
    "sglang.srt.managers.schedule_batch.release_req": [
        "req",
        "remaing_req_count",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "hisparse_coordinator",
        "offload_kv",
    ],
}


def test_sglang_is_the_pinned_version() -> None:
    assert version("sglang") == "0.5.23", "sglang_r3 is built against sglang==0.5.23 exactly"


def test_plugin_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("r3") == "sglang_r3.plugin:register"


@pytest.mark.parametrize("target", [t for t, _, _ in HOOKS])
def test_hook_target_resolves_with_expected_signature(target: str) -> None:
    fn = resolve_target(target)
    params = list(inspect.signature(fn).parameters)
    assert params[: len(SIGNATURES[target])] == SIGNATURES[target], f"{target} moved: {params}"
    if target.endswith("TokenizerManager.generate_request"):
        assert inspect.isasyncgenfunction(inspect.unwrap(fn))
    if "send_" in target or target.endswith(("handle_request", "serve_generate_request")):
        assert inspect.iscoroutinefunction(inspect.unwrap(fn))


@pytest.mark.parametrize("owner", sorted(UPSTREAM_FIELDS))
def test_upstream_fields_exist(owner: str) -> None:
    cls = pkgutil.resolve_name(owner)
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    elif hasattr(cls, "model_fields"):  # pydantic models (the OpenAI requests)
        names = set(cls.model_fields)
    else:  # msgspec structs, enums, modules
        names = set(getattr(cls, "__struct_fields__", ())) or set(dir(cls))
    missing = [f for f in UPSTREAM_FIELDS[owner] if f not in names]
    assert not missing, f"{owner} lost {missing}"


def test_capture_internals() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    # The CPU allocator is a key of this dict; rows come from get_topk with start_len.
    assert isinstance(common.ALLOC_MEMORY_FUNCS, dict)
    assert "start_len" in inspect.signature(BaseTopkCapturer.get_topk).parameters
    # return_prompt_token_ids puts the prompt ids in each output (we check prefixes on them).
    assert GenerateReqInput(input_ids=[1], return_prompt_token_ids=True).return_prompt_token_ids


def test_routing_handover_internals() -> None:
    """Where the compact hand-over (``scheduler.row_transport``) plugs in, as read in 0.5.23."""
    from sglang.srt.managers import detokenizer_manager, tokenizer_manager
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components import batch_result_processor, output_streamer

    # The scheduler gathers the rows onto req.routed_experts, which the output
    # accumulator forwards per request, untouched, to the detokenizer.
    collect = inspect.getsource(
        batch_result_processor.SchedulerBatchResultProcessor._maybe_collect_routed_experts
    )
    assert "req.routed_experts = capturer.get_topk(" in collect
    assert "req.routed_experts if req.return_routed_experts else None" in inspect.getsource(
        output_streamer
    )
    assert "self.sampling_params = sampling_params" in inspect.getsource(Req.__init__)
    # The detokenizer base64-encodes exactly that list, then builds BatchStrOutput with it.
    detok = inspect.getsource(detokenizer_manager.DetokenizerManager.handle_batch_token_id_out)
    assert "self._b64_encode_per_request(recv_obj.routed_experts)" in detok
    assert "routed_experts=routed_experts," in detok
    # The tokenizer manager puts any non-tensor value in meta_info as it is.
    tm = inspect.getsource(tokenizer_manager)
    assert 'meta_info["routed_experts"] = val' in tm
    # Default IPC is pickle (compact rows need it).
    from sglang.srt.environ import envs

    assert envs.SGLANG_USE_PICKLE_IPC.get() is True


def test_moe_layer_rules_match_sglang_models() -> None:
    """layers.moe_shape assumes these rules of SGLang's model code."""
    from sglang.srt.models import glm4_moe, qwen3_moe

    src_glm = inspect.getsource(glm4_moe)
    assert "layer_id >= config.first_k_dense_replace" in src_glm
    src_qwen = inspect.getsource(qwen3_moe)
    assert "mlp_only_layers" not in src_qwen, "SGLang's Qwen3-MoE now honours mlp_only_layers"


def test_hook_registry_api() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    assert {"BEFORE", "AFTER", "AROUND"} <= {t.name for t in HookType}
    assert isinstance(HookRegistry._hooks, dict) and isinstance(HookRegistry._patched, set)


def test_plugin_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang may call ``register`` more than once per process: nothing is added twice
    (also with the test-only ``bogus_hook`` shim's hook, registered by the same code)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_r3 import hooks, plugin, targets
    from tests.engine.cpu_shims.r3_cpu_shims.bogus_hook import add_bogus_hook

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(hooks, "HOOKS", list(hooks.HOOKS))
    monkeypatch.setattr(targets, "HTTP_TARGETS", list(targets.HTTP_TARGETS))
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)

    def register() -> None:  # both plugins, as SGLang's load_plugins calls them
        plugin.register()
        add_bogus_hook("sglang.srt.nowhere.Nothing.method")

    register()
    once = ({k: list(v) for k, v in HookRegistry._hooks.items()}, list(hooks.HOOKS))
    register()
    register()
    assert ({k: list(v) for k, v in HookRegistry._hooks.items()}, list(hooks.HOOKS)) == once
    assert "sglang.srt.nowhere.Nothing.method" in HookRegistry._hooks
