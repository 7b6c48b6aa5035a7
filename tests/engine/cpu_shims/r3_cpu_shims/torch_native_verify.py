"""Speculative verify (``ForwardMode.TARGET_VERIFY``) in SGLang's torch_native attention.

Stands in for ``layers/attention/torch_native_backend.py:279`` (``forward_extend``), which
on a verify batch dies at ``:101`` (``assert seq_lens.shape[0] ==
extend_prefix_lens.shape[0]``: a verify batch carries no extend lengths) and could not
attend over a draft tree anyway.  For ``TARGET_VERIFY`` each request's ``n`` draft tokens
attend to its whole committed prefix (``seq_lens``, drafts not included) and to their
tree ancestors, read from ``spec_info.custom_mask``: either the ``[bs, n, n]`` q-length
mask NGRAM builds on CPU (``speculative/ngram_worker.py:326, 355``) or the full mask EAGLE
builds (``[n, seq + n]`` per request, concatenated).  Every other mode goes to upstream.
"""

from __future__ import annotations

from typing import Any

import torch


def apply() -> None:
    """Wrap ``TorchNativeAttnBackend.forward_extend`` for ``TARGET_VERIFY``."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    upstream = TorchNativeAttnBackend.forward_extend

    def forward_extend(
        self: Any,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if not forward_batch.forward_mode.is_target_verify():
            return upstream(self, q, k, v, layer, forward_batch, save_kv_cache)  # type: ignore[no-any-return]
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = out.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        spec = forward_batch.spec_info
        n = int(spec.draft_token_num)
        bs = int(forward_batch.seq_lens.shape[0])
        custom_mask = spec.custom_mask
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        off = 0
        for i in range(bs):
            prefix = int(forward_batch.seq_lens[i])
            if custom_mask.numel() == bs * n * n:
                tree = custom_mask.view(bs, n, n)[i].bool()
            else:
                full = custom_mask[off : off + n * (prefix + n)].view(n, prefix + n)
                tree = full[:, prefix:].bool()
                off += n * (prefix + n)
            mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tree], 1)
            slots = req_to_token[forward_batch.req_pool_indices[i], : prefix + n]
            qq = q_[i * n : (i + 1) * n].movedim(0, 1).unsqueeze(0)
            kk = k_cache[slots].movedim(0, 1).unsqueeze(0).to(qq.dtype)
            vv = v_cache[slots].movedim(0, 1).unsqueeze(0).to(qq.dtype)
            attn = sdpa(
                qq,
                kk,
                vv,
                attn_mask=mask,
                scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            o_[i * n : (i + 1) * n] = attn.squeeze(0).movedim(0, 1)
        return out

    forward_extend.__wrapped__ = upstream  # type: ignore[attr-defined]
    TorchNativeAttnBackend.forward_extend = forward_extend
