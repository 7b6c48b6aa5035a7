import sys, os, json, re, ast
sys.path.insert(0, '/tmp/survey'); sys.path.insert(0, '/work/main')
import resolve as R
import importlib.util
spec = importlib.util.spec_from_file_location('targets', '/work/main/sglang_r3/targets.py'); T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
# SIGNATURES from test_canary without importing it
src = open('/work/main/tests/engine/test_canary.py').read()
tree = ast.parse(src)
SIG = None
for n in tree.body:
    if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'SIGNATURES':
        SIG = ast.literal_eval(n.value)
TARGETS = {k: v for k, v in vars(T).items() if k.startswith('T_')}
EXTRA = {
 'get_global_experts_capturer': 'sglang.srt.state_capturer.routed_experts.get_global_experts_capturer',
 'BaseTopkCapturer.get_topk': 'sglang.srt.state_capturer.base.BaseTopkCapturer.get_topk',
 'old capturer module': 'sglang.srt.layers.moe.routed_experts_capturer',
 'old get_global_experts_capturer': 'sglang.srt.layers.moe.routed_experts_capturer.get_global_experts_capturer',
 'old RoutedExpertsCapturer.get_routed_experts': 'sglang.srt.layers.moe.routed_experts_capturer.RoutedExpertsCapturer.get_routed_experts',
 'old _RoutedExpertsCapturerReal.get_routed_experts': 'sglang.srt.layers.moe.routed_experts_capturer._RoutedExpertsCapturerReal.get_routed_experts',
 'mixin maybe_collect_routed_experts': 'sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin.maybe_collect_routed_experts',
 'mixin _maybe_collect_routed_experts': 'sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin._maybe_collect_routed_experts',
 'plugins.load_plugins': 'sglang.srt.plugins.load_plugins',
 'HookRegistry': 'sglang.srt.plugins.hook_registry.HookRegistry',
 'HookRegistry.register': 'sglang.srt.plugins.hook_registry.HookRegistry.register',
 'HookRegistry._hooks': 'sglang.srt.plugins.hook_registry.HookRegistry._hooks',
 'HookRegistry._patched': 'sglang.srt.plugins.hook_registry.HookRegistry._patched',
 'HookType': 'sglang.srt.plugins.hook_registry.HookType',
 'pool_host.common.ALLOC_MEMORY_FUNCS': 'sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS',
 'memory_pool_host.ALLOC_MEMORY_FUNCS': 'sglang.srt.mem_cache.memory_pool_host.ALLOC_MEMORY_FUNCS',
 'pool_host.mha.MHATokenToKVPoolHost': 'sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost',
 'memory_pool_host.MHATokenToKVPoolHost': 'sglang.srt.mem_cache.memory_pool_host.MHATokenToKVPoolHost',
 'pool_host.mha.transfer_kv_direct': 'sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct',
 'memory_pool_host.transfer_kv_direct': 'sglang.srt.mem_cache.memory_pool_host.transfer_kv_direct',
 'pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES': 'sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES',
 'memory_pool_host.HICACHE_HOST_MEMORY_RESERVE_BYTES': 'sglang.srt.mem_cache.memory_pool_host.HICACHE_HOST_MEMORY_RESERVE_BYTES',
 'TorchNativeAttnBackend.forward_extend': 'sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend',
 'TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value': 'sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value',
 'DraftBackendFactory.create_draft_extend_backend': 'sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend',
 'parallel_state.init_model_parallel_group': 'sglang.srt.distributed.parallel_state.init_model_parallel_group',
 'MooncakeKVSender.supports_host_tensor_indices': 'sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices',
 'MooncakeKVSender': 'sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender',
 'memory_pool.KVWriteLoc': 'sglang.srt.mem_cache.memory_pool.KVWriteLoc',
 'Envs.SGLANG_USE_PICKLE_IPC': 'sglang.srt.environ.Envs.SGLANG_USE_PICKLE_IPC',
 'Envs.SGLANG_PLUGINS': 'sglang.srt.environ.Envs.SGLANG_PLUGINS',
 'Envs.SGLANG_USE_CPU_ENGINE': 'sglang.srt.environ.Envs.SGLANG_USE_CPU_ENGINE',
 'arg_groups.model_override_base.resolved_view': 'sglang.srt.arg_groups.model_override_base.resolved_view',
 'server_args.prepare_server_args': 'sglang.srt.server_args.prepare_server_args',
 'ServerArgs.resolve_once': 'sglang.srt.server_args.ServerArgs.resolve_once',
 'utils.kill_process_tree': 'sglang.srt.utils.kill_process_tree',
 'http_server.app': 'sglang.srt.entrypoints.http_server.app',
 'launch_server.run_server': 'sglang.launch_server.run_server',
 'scheduler_components.output_streamer': 'sglang.srt.managers.scheduler_components.output_streamer',
 'DetokenizerManager._b64_encode_per_request': 'sglang.srt.managers.detokenizer_manager.DetokenizerManager._b64_encode_per_request',
 'unified_radix_cache.UnifiedRadixCache': 'sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache',
 'HiRadixCache': 'sglang.srt.mem_cache.hiradix_cache.HiRadixCache',
 'HiRadixCache.__init__': 'sglang.srt.mem_cache.hiradix_cache.HiRadixCache.__init__',
 'HiCacheController.write': 'sglang.srt.managers.cache_controller.HiCacheController.write',
 'HiCacheController.load': 'sglang.srt.managers.cache_controller.HiCacheController.load',
 'topk.capture_routed_experts_if_allowed': 'sglang.srt.layers.moe.topk.capture_routed_experts_if_allowed',
}
def run(v):
    R.set_root(f'/tmp/sglang-src/{v}')
    out = {'targets': {}, 'fields': {}, 'extra': {}, 'meta': {}}
    for k, t in TARGETS.items():
        if not isinstance(t, str) or not t.startswith('sglang.'): continue
        try: out['targets'][k] = R.resolve(t)
        except Exception as e: out['targets'][k] = {'status': 'error', 'why': repr(e)}
        if t in SIG and out['targets'][k].get('params') is not None:
            exp = SIG[t]; got = out['targets'][k]['params']
            out['targets'][k]['sig_ok'] = got[:len(exp)] == exp
    for k, t in EXTRA.items():
        try: out['extra'][k] = R.resolve(t)
        except Exception as e: out['extra'][k] = {'status': 'error', 'why': repr(e)}
    for owner, fs in T.UPSTREAM_FIELDS.items():
        names, where = R.fields(owner)
        if names is None:
            out['fields'][owner] = {'where': where, 'missing': list(fs), 'present': {}}
        else:
            out['fields'][owner] = {'where': where,
               'missing': [f for f in fs if f not in names],
               'present': {f: f'{R.rel(names[f][1])}:{names[f][0]}' for f in fs if f in names}}
    # metadata
    meta = [p for p in os.popen(f'ls /tmp/sglang-src/{v}/*.dist-info/METADATA').read().split()]
    md = open(meta[0]).read()
    out['meta']['requires'] = [l for l in md.splitlines() if re.match(r'Requires-Dist: (torch|sglang-kernel|sgl-kernel|transformers|flashinfer|torchvision|torchaudio|kernels)\b', l)]
    out['meta']['requires_python'] = [l for l in md.splitlines() if l.startswith('Requires-Python')]
    out['meta']['wheel'] = open(f'/tmp/sglang-src/{v}/.done').read()
    root = f'/tmp/sglang-src/{v}/sglang/srt'
    out['meta']['dirs'] = {d: os.path.isdir(os.path.join(root, d)) for d in ['plugins', 'state_capturer', 'managers/scheduler_components', 'mem_cache/pool_host', 'mem_cache/hybrid_cache', 'arg_groups']}
    out['meta']['files'] = {f: os.path.exists(os.path.join(root, f)) for f in ['layers/moe/routed_experts_capturer.py', 'mem_cache/memory_pool_host.py', 'managers/scheduler_output_processor_mixin.py', 'mem_cache/unified_radix_cache.py', 'mem_cache/hiradix_cache.py', 'managers/cache_controller.py']}
    return out
if __name__ == '__main__':
    vs = sys.argv[1:]
    res = {v: run(v) for v in vs}
    json.dump(res, open('/tmp/survey/results.json', 'w'), indent=1)
