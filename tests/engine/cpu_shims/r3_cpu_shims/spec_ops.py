"""The ``sgl_kernel`` ``*_cpu`` ops SGLang 0.5.23's speculative decoding calls on CPU, in torch.

This project's ``sgl_kernel`` wheel is a CUDA build: none of the CPU ops its Python wrappers
name (``sgl_kernel/speculative.py``) are registered, so the first speculative step dies with
``AttributeError: ... sgl_kernel has no attribute ...``.  This shim registers pure-torch
versions under the same ``torch.ops.sgl_kernel`` names (only those that are missing), each
with the semantics of the kernel used on GPU next to its call site:

- ``copy_all_layer_kv_cache_cpu``: ``kernels/ops/kvcache/cache_move.py:191`` (KV-copy
  warm-up at start-up, ``mem_cache/memory_pool.py`` ``move_kv_cache``);
- ``assign_req_to_token_pool_cpu``: ``srt/mem_cache/allocation.py:746``;
- ``assign_extend_cache_locs_cpu``: ``kernels/ops/speculative/cache_locs.py:740, 763``;
- ``assign_draft_cache_locs_contiguous_cpu``: ``kernels/ops/speculative/cache_locs.py:99``;
- ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu``:
  ``kernels/ops/speculative/eagle.py:40, 80``;
- ``verify_tree_greedy_cpu``: ``kernels/ops/speculative/spec_tree.py:510`` (the CUDA
  ``verify_tree_greedy`` walk);
- ``build_tree_kernel_efficient_cpu``: ``kernels/ops/speculative/spec_tree.py:412``;
- ``reconstruct_indices_from_tree_mask_cpu``: ``sgl_kernel/speculative.py:103`` (NGRAM).

Python loops: slow, and fine at test batch sizes.  Nothing here touches routing rows.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

_LIB: Any = None


def _request_spans(
    req_pool_indices: Tensor, start_offset: Tensor, end_offset: Tensor
) -> Iterator[tuple[int, slice, slice]]:
    """Per request: its ``req_to_token`` row, its ``start:end`` there, and the next
    ``end - start`` places of the packed ``out_cache_loc`` (requests in order)."""
    off = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        yield int(req_pool_indices[i]), slice(s, e), slice(off, off + e - s)
        off += e - s


def assign_req_to_token_pool(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    start_offset: Tensor,
    end_offset: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[r, start:end] = out_cache_loc[next end-start]`` for each request."""
    for row, span, packed in _request_spans(req_pool_indices, start_offset, end_offset):
        req_to_token[row, span] = out_cache_loc[packed].to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    start_offset: Tensor,
    end_offset: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
) -> None:
    """The inverse gather: ``out_cache_loc[next end-start] = req_to_token[r, start:end]``."""
    for row, span, packed in _request_spans(req_pool_indices, start_offset, end_offset):
        out_cache_loc[packed] = req_to_token[row, span].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    seq_lens: Tensor,
    out_cache_loc: Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Each request's ``topk * num_steps`` slots from ``seq_lens`` on, packed per request."""
    n = topk * num_steps
    for i in range(req_pool_indices.numel()):
        s = int(seq_lens[i])
        row = int(req_pool_indices[i])
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[row, s : s + n].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc(
    accept_index: Tensor, out_cache_loc: Tensor, accept_out_cache_loc: Tensor
) -> None:
    """``out_cache_loc`` at every accepted index (``-1`` skipped), packed to the front."""
    idx = accept_index.reshape(-1)
    idx = idx[idx != -1].long()
    accept_out_cache_loc[: idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens(
    accept_tokens: Tensor, accept_lens: Tensor, bonus_tokens: Tensor, accept_stride: int
) -> None:
    """Request ``i``'s last accepted token (``accept_lens`` counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i in range(accept_lens.numel()):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def verify_tree_greedy(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    target_predict: Tensor,
) -> None:
    """Greedy tree verification: from the root, follow the child whose draft token equals
    the target's prediction at the current node, level by level; record the path."""
    bs, n = candidates.shape
    num_spec = accept_index.shape[1]
    tp = target_predict.reshape(-1)
    ri = retrive_index.reshape(bs, n)
    rn = retrive_next_token.reshape(bs, n)
    rs = retrive_next_sibling.reshape(bs, n)
    for b in range(bs):
        last = int(ri[b, 0])
        accept_index[b, 0] = last
        num = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = int(rn[b, cur])
            target = int(tp[last])
            found = False
            while cur != -1:
                if int(candidates[b, cur]) == target:
                    predicts[last] = target
                    num += 1
                    accept_index[b, num] = ri[b, cur]
                    last = int(ri[b, cur])
                    found = True
                    break
                cur = int(rs[b, cur])
            if not found:
                break
        accept_token_num[b] = num
        predicts[last] = tp[last]


def reconstruct_indices_from_tree_mask(
    tree_mask: Tensor,
    verified_seq_len: Tensor,
    positions: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Positions and first-child / next-sibling links of each request's draft tree, read
    from its ``[n, n]`` ancestor mask (NGRAM)."""
    n = draft_token_num
    mask = tree_mask.reshape(batch_size, n, n).bool()
    ar = torch.arange(n)
    ancestors = mask & (ar[None, :] < ar[:, None])  # [i, j]: j is a strict ancestor of i
    pos = positions.view(-1)
    rix, rnt, rns = (
        retrive_index.view(-1),
        retrive_next_token.view(-1),
        retrive_next_sibling.view(-1),
    )
    for b in range(batch_size):
        a = ancestors[b]
        depth = a.sum(1)
        parent = torch.where(a, ar[None, :].expand(n, n), torch.full((n, n), -1)).max(1).values
        for t in range(n):
            k = b * n + t
            pos[k] = int(depth[t]) + int(verified_seq_len[b])
            rix[k] = k
            kids = [c for c in range(t + 1, n) if a[c, t] and parent[c] == t]
            rnt[k] = kids[0] if kids else -1
            if parent[t] < 0:
                rns[k] = -1
            else:
                sibs = [s for s in range(t + 1, n) if parent[s] == parent[t]]
                rns[k] = sibs[0] if sibs else -1


def build_tree_kernel_efficient(
    parent_list: Tensor,
    selected_index: Tensor,
    verified_seq_len: Tensor,
    tree_mask: Tensor,
    positions: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """EAGLE's draft tree from the draft's top-k picks: retrive links, positions and the
    verify mask (mode 0: full ``[n, seq+n]`` rows; otherwise ``[n, n]``), as the CUDA
    ``build_tree_efficient`` kernel does it."""
    n = draft_token_num
    bs = verified_seq_len.numel()
    rix = retrive_index.view(bs, n)
    rnt = retrive_next_token.view(bs, n)
    rns = retrive_next_sibling.view(bs, n)
    tm = tree_mask.view(-1)
    prefix_sum = 0
    for b in range(bs):
        seq_len = int(verified_seq_len[b])
        seq_tree_idx = n * n * b + prefix_sum * n
        positions[b * n] = seq_len

        def find(token: int, b: int = b) -> int | None:
            for p in range(n - 1):
                if int(selected_index[b, p]) == token:
                    return p
            return None

        for i in range(n - 1, 0, -1):
            rix[b, i] = b * n + i
            parent_tb = int(selected_index[b, i - 1]) // topk
            if parent_tb == 0:
                parent_pos: int | None = 0
            else:
                f = find(int(parent_list[b, parent_tb]))
                parent_pos = None if f is None else f + 1
            if parent_pos is not None:
                next_token = int(rnt[b, parent_pos])
                rnt[b, parent_pos] = i
                if next_token != -1:
                    rns[b, i] = next_token
        rix[b, 0] = b * n
        for x in range(n):
            if tree_mask_mode == 0:
                tti = seq_tree_idx + (seq_len + n) * x + seq_len + 1
            else:
                tti = n * n * b + n * x + 1
            tm[tti - 1] = 1
            tm[tti : tti + n - 1] = 0
            if x > 0:
                cur, position = x - 1, 0
                for _ in range(depth):
                    position += 1
                    tm[tti + cur] = 1
                    parent_tb = int(selected_index[b, cur]) // topk
                    if parent_tb == 0:
                        break
                    f = find(int(parent_list[b, parent_tb]))
                    if f is None:
                        break
                    cur = f
                positions[b * n + x] = position + seq_len
        prefix_sum += seq_len


def copy_all_layer_kv_cache(
    data_ptrs: Tensor, strides: Tensor, tgt_loc: Tensor, src_loc: Tensor
) -> None:
    """``buffer[tgt] = buffer[src]`` in every layer's K and V buffer, given as raw pointers
    and per-slot byte strides (the pool hands the op no tensors)."""
    tgt, src = tgt_loc.long().numpy(), src_loc.long().numpy()
    if tgt.size == 0:
        return
    top = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (top * int(stride))).from_address(int(ptr))
        a = np.frombuffer(memoryview(raw), dtype=np.uint8).reshape(top, int(stride))
        a[tgt] = a[src]


_OPS: list[tuple[str, Callable[..., None]]] = [
    (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, "
        "Tensor src_loc) -> ()",
        copy_all_layer_kv_cache,
    ),
    (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()",
        assign_req_to_token_pool,
    ),
    (
        "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()",
        assign_extend_cache_locs,
    ),
    (
        "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, "
        "Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()",
        assign_draft_cache_locs_contiguous,
    ),
    (
        "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, "
        "Tensor(a!) accept_out_cache_loc) -> ()",
        fill_accept_out_cache_loc,
    ),
    (
        "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, "
        "Tensor(a!) bonus_tokens, int accept_stride) -> ()",
        fill_bonus_tokens,
    ),
    (
        "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, "
        "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrive_index, "
        "Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()",
        verify_tree_greedy,
    ),
    (
        "reconstruct_indices_from_tree_mask_cpu(Tensor tree_mask, Tensor verified_seq_len, "
        "Tensor(a!) positions, Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, "
        "Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()",
        reconstruct_indices_from_tree_mask,
    ),
    (
        "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, "
        "Tensor verified_seq_len, Tensor(a!) tree_mask, Tensor(b!) positions, "
        "Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, "
        "int tree_mask_mode) -> ()",
        build_tree_kernel_efficient,
    ),
]


def apply() -> None:
    """Register every op of :data:`_OPS` that ``torch.ops.sgl_kernel`` lacks (CPU kernels)."""
    global _LIB
    importlib.import_module("sgl_kernel")  # registers whatever ops the wheel has, first
    library: Any = torch.library  # untyped
    _LIB = library.Library("sgl_kernel", "FRAGMENT")
    for schema, fn in _OPS:
        name = schema.split("(", 1)[0]
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        _LIB.define(schema)
        _LIB.impl(name, fn, "CPU")
