"""Canary: the SGLang internals the extension touches are where it expects them.

If an SGLang upgrade moves any of these, this file fails with the name of what moved,
before a server ever runs with a hook that silently did not apply.  It checks the
installed release against that release's row of :mod:`sglang_r3.releases`;
``tests/engine/test_release_canary.py`` runs it again in every other tested release's
environment, and ``tests/engine/test_release_wheels.py`` resolves every release's
targets in its wheel without installing it.
"""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil
from collections import defaultdict
from importlib.metadata import entry_points, version

import pytest

from sglang_r3 import releases
from sglang_r3.hooks import HOOKS
from sglang_r3.launch.startup import resolve_target

RELEASE = releases.current()

# Parameters each hooked callable must still take, in order.
SIGNATURES = {
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": [
        "self",
        "obj",
        "request",
    ],
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__": [
        "self",
        "server_args",
        "port_args",
    ],
    # (a classmethod, read bound: cls is not listed)
    "sglang.srt.entrypoints.engine.Engine._launch_detokenizer_subprocesses": [
        "server_args",
        "port_args",
        "run_detokenizer_process_func",
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
    # (keyword-only: around_release_req reads req and req_to_token_pool by name; 0.5.13
    # to 0.5.18 also take server_args, an order SIGNATURES does not pin)
    "sglang.srt.managers.schedule_batch.release_req": ["req", "req_to_token_pool"],
    # Before 0.5.13 (sglang_r3.releases): the mixin's collect, release_req as a method.
    releases.T_COLLECT_MIXIN: ["self", "req"],
    releases.T_RELEASE_METHOD: ["self", "idx", "remaing_req_count", "server_args"],
    releases.T_STREAM_OUTPUT: ["self", "reqs", "return_logprob"],
}
#: Targets whose parameters are checked as a set of names, not a prefix.
BY_NAME = {"sglang.srt.managers.schedule_batch.release_req"}


def test_sglang_is_in_the_supported_range() -> None:
    assert RELEASE.version == version("sglang")
    assert RELEASE.supported, releases.range_problem(RELEASE)


def test_plugin_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("r3") == "sglang_r3.plugin:register"


def test_hooks_are_the_installed_releases() -> None:
    """The registered table is this release's: each target where the release has it."""
    assert [t for t, _, _ in HOOKS] == RELEASE.targets(releases.ALL_TARGETS)


@pytest.mark.parametrize("target", [t for t, _, _ in HOOKS])
def test_hook_target_resolves_with_expected_signature(target: str) -> None:
    fn = resolve_target(target)
    params = list(inspect.signature(fn).parameters)
    if target in BY_NAME:
        assert set(SIGNATURES[target]) <= set(params), f"{target} moved: {params}"
    else:
        assert params[: len(SIGNATURES[target])] == SIGNATURES[target], f"{target} moved: {params}"
    if target.endswith("TokenizerManager.generate_request"):
        assert inspect.isasyncgenfunction(inspect.unwrap(fn))
    if target.endswith(("handle_request", "serve_generate_request")):
        assert inspect.iscoroutinefunction(inspect.unwrap(fn))
    if "send_" in target:  # the hook's form follows upstream's (sync before 0.5.20)
        hook = next(h for t, h, _ in HOOKS if t == target)
        assert inspect.iscoroutinefunction(inspect.unwrap(fn)) == RELEASE.has("async_send")
        assert inspect.iscoroutinefunction(hook) == RELEASE.has("async_send")


def test_req_fields_of_the_release() -> None:
    """The scheduler ``Req`` fields the row hooks read, where this release keeps them."""
    from sglang.srt.managers.schedule_batch import Req

    init = inspect.getsource(Req.__init__)
    if RELEASE.has("req_kv_info"):
        assert "self.kv = ReqKvInfo()" in init
    else:
        assert "self.req_pool_idx" in init and "self.kv_committed_len" in init
    if RELEASE.has("req_prefix_len"):
        assert "self.prefix_len: int = 0" in init
    else:
        assert "self.prefix_indices" in init


@pytest.mark.parametrize("owner", sorted(RELEASE.fields()))
def test_upstream_fields_exist(owner: str) -> None:
    cls = pkgutil.resolve_name(owner)
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    elif hasattr(cls, "model_fields"):  # pydantic models (the OpenAI requests)
        names = set(cls.model_fields)
    else:  # msgspec structs, enums, modules
        names = set(getattr(cls, "__struct_fields__", ())) or set(dir(cls))
    missing = [f for f in RELEASE.fields()[owner] if f not in names]
    assert not missing, f"{owner} lost {missing} in SGLang {RELEASE.version}"


def test_capture_internals() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.state_capturer.base import BaseHostCache, BaseTopkCapturer

    from sglang_r3.cpu.allocator import alloc_funcs

    # The CPU allocator is a key of this dict; rows come from get_topk with start_len.
    assert isinstance(alloc_funcs(), dict)
    assert "start_len" in inspect.signature(BaseTopkCapturer.get_topk).parameters
    host = inspect.getsource(BaseHostCache.__init__)
    if RELEASE.has("capturer_alloc_funcs"):
        assert "ALLOC_MEMORY_FUNCS" in host
    else:  # the CPU recipe replaces this __init__ with an unpinned one (same fields)
        assert "pin_memory=True" in host and "ALLOC_MEMORY_FUNCS" not in host
        assert list(inspect.signature(BaseHostCache.__init__).parameters) == [
            "self",
            "num_tokens",
            "num_layers",
            "topk_size",
            "name",
        ]
    # return_prompt_token_ids puts the prompt ids in each output (we check prefixes on them);
    # before it, the send hooks note them (generate_hooks._note_prompt).
    if RELEASE.has("return_prompt_token_ids"):
        assert GenerateReqInput(input_ids=[1], return_prompt_token_ids=True).return_prompt_token_ids
    else:
        assert "return_prompt_token_ids" not in {
            f.name for f in dataclasses.fields(GenerateReqInput)
        }


def test_routing_handover_internals() -> None:
    """Where the compact hand-over (``scheduler.row_transport``) plugs in, as read in 0.5.23
    (and 0.5.12, where the scheduler's output mixin does the collecting and forwarding)."""
    from sglang.srt.managers import detokenizer_manager, tokenizer_manager
    from sglang.srt.managers.schedule_batch import Req

    # The scheduler gathers the rows onto req.routed_experts, which the output
    # accumulator forwards per request, untouched, to the detokenizer.
    collect = inspect.getsource(resolve_target(RELEASE.target(releases.T_COLLECT) or ""))
    assert "req.routed_experts = capturer.get_topk(" in collect
    if RELEASE.has("batch_result_processor"):
        from sglang.srt.managers.scheduler_components import output_streamer

        forwards = inspect.getsource(output_streamer)
        assert "req.routed_experts if req.return_routed_experts else None" in forwards
    else:  # listed only for requests that asked: around_stream_output_generation aligns it
        from sglang.srt.managers import scheduler_output_processor_mixin as mixin

        stream = inspect.getsource(mixin.SchedulerOutputProcessorMixin.stream_output_generation)
        assert "if req.return_routed_experts:" in stream
        assert "routed_experts.append(req.routed_experts)" in stream
    assert "self.sampling_params = sampling_params" in inspect.getsource(Req.__init__)
    # The detokenizer base64-encodes exactly that list, then builds BatchStrOutput with it.
    detok = inspect.getsource(detokenizer_manager.DetokenizerManager.handle_batch_token_id_out)
    assert "self._b64_encode_per_request(recv_obj.routed_experts)" in detok
    assert "routed_experts=routed_experts," in detok
    # The tokenizer manager puts any non-tensor value in meta_info as it is.
    tm = inspect.getsource(tokenizer_manager)
    assert 'meta_info["routed_experts"] = val' in tm
    # Default IPC is pickle (compact rows need it); before 0.5.15 it is the only IPC.
    if RELEASE.has("pickle_ipc_switch"):
        from sglang.srt.environ import envs

        assert envs.SGLANG_USE_PICKLE_IPC.get() is True
    assert releases.pickle_ipc()


def test_moe_layer_rules_match_sglang_models() -> None:
    """layers.moe_shape assumes these rules of SGLang's model code."""
    from sglang.srt.models import glm4_moe, qwen3_moe

    src_glm = inspect.getsource(glm4_moe)
    # (the method form before 0.5.22, the same rule)
    assert (
        "layer_id >= config.first_k_dense_replace" in src_glm
        or "layer_id >= self.config.first_k_dense_replace" in src_glm
    )
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
