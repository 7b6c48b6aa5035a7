"""AReaL's Megatron R3 (PR inclusionAI/AReaL#1207) fed rank-locally from the cache.

AReaL 1.0.4 has no Megatron R3 consumer; the PR's does not ship in any release, and neither
it nor a mirror of it is available here.  So this file restates, line by line, what the PR's
code at commit ``a9f0b0400e8937242e0994e6a10ec271b75dba06`` does to a step's inline
``routed_experts`` before a rank's routers replay them (each step cites the PR's file:line),
feeds that restatement the rollouts exactly as AReaL's remote engine receives them inline
(:func:`r3_client.integrations.areal.routed_experts`, equal to AReaL 1.0.4's own inline
``ModelResponse.routed_experts`` on a real engine: tests/integrations/test_areal_contract.py),
and checks that :func:`fetch_areal_rank_targets`, reading only the rank's rows of its stage's
layers from a real cache service (HTTP, gRPC, and Redis directly), hands every router of every
tp x cp x pp rank the same targets and the same validity mask.  Megatron-Core's own
``_split_along_first_dim`` (what ``scatter_to_sequence_parallel_region`` runs) does the SP step.

The rank-local trainer path (rollout keys carried per token, ``check_areal_step`` before
dispatch, a micro-batch read back from AReaL's packed and padded layout) runs on the same
restatement of AReaL's batching (``areal/utils/data.py`` at that commit).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest

from r3_client import (
    DirectReader,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    Segment,
    ShapeError,
)
from r3_client.integrations import areal as r3_areal
from r3_client.integrations.areal import (
    KEY_FIELD,
    STATE_FIELD,
    areal_micro_batch,
    check_areal_step,
    expand_areal_batch,
    fetch_areal_rank_targets,
    key_rollout_id,
    new_rollout_key,
    routed_experts,
    set_router_targets,
    stage_moe_layers,
    step_rollouts,
    with_rollout_keys,
)
from r3_client.synthetic import synthetic_routing
from tests.support.service_process import KEY_A, Service, url_of
from tests.support.verl_stubs import FakeGroup

torch = pytest.importorskip("torch")
mappings = pytest.importorskip("megatron.core.tensor_parallel.mappings")

NUM_LAYERS = 6  # Megatron's num_layers == HF num_hidden_layers
MOE_LAYER_FREQ = [0, 1, 1, 1, 0, 1]  # dense layers 0 and 4 (a list moe_layer_freq)
MOE = (1, 2, 3, 5)
E, K = 32, 4
LENGTHS = [700, 37, 2600, 9, 1501]  # token counts; rows straddle the 2,048-row blocks


def _store(client: RoutingClient, lengths: Sequence[int]) -> tuple[list[str], list[Routing]]:
    ids, routings = [], []
    for n, t in enumerate(lengths):
        rid = key_rollout_id(new_rollout_key())
        rows = synthetic_routing(t - 1, len(MOE), E, K, skew=1.0, seed=n)
        routing = Routing.from_array(rows, num_experts=E, layer_ids=MOE)
        client.put(rid, routing)
        ids.append(rid)
        routings.append(routing)
    return ids, routings


# ------------------------------------------------------------------------------------------
# AReaL, restated (PR #1207 at a9f0b0400e8937242e0994e6a10ec271b75dba06).
# ------------------------------------------------------------------------------------------


def ref_preprocess(flat: np.ndarray, seq_len: int, num_moe_layers: int) -> Any:
    """areal/engine/router_replay_utils.py:495-598 (``preprocess_routed_experts_batch``, via
    areal/workflow/rlvr_r3_patch.py:111-168): ``(1, seq_len, L, K)``, SGLang's rows first."""
    num_sgl_tokens, flat_dim = flat.shape
    topk = K
    if flat_dim != num_moe_layers * topk:  # :531-550, the fallback on SGLang's all-layer rows
        num_moe_layers = flat_dim // topk
    tensor = torch.from_numpy(flat.reshape(num_sgl_tokens, num_moe_layers, topk).astype(np.int32))
    real_tokens = seq_len  # :556, attention_mask of ones (rlvr.py)
    padded = torch.zeros(1, seq_len, num_moe_layers, topk, dtype=torch.int32)  # :557
    if num_sgl_tokens <= real_tokens:  # :558, :587-589
        n = min(num_sgl_tokens, real_tokens)
        padded[0, :n] = tensor[:n]
    max_val = padded.max().item()  # :591-596, compress_dtype=True
    if max_val < 256:
        padded = padded.to(torch.uint8)
    elif max_val < 32768:
        padded = padded.to(torch.int16)
    return padded


def ref_pad_cat(tensors: list[Any]) -> Any:
    """areal/utils/data.py:204-238 (``_pad_cat_dim0``, concat_padded_tensors): right-pad dims 1.."""
    shape = [max(t.shape[i] for t in tensors) for i in range(1, tensors[0].ndim)]  # :220-225
    out = []
    for t in tensors:
        pad: list[int] = []
        for i in reversed(range(1, t.ndim)):  # :227-235
            pad.extend([0, shape[i - 1] - t.shape[i]])
        out.append(torch.nn.functional.pad(t, tuple(pad), "constant", 0))
    return torch.cat(out, dim=0)


def ref_padded_cu(lengths: Sequence[int], seq_align_to: int) -> tuple[Any, Any, int]:
    """areal/utils/data.py:492-541 (pack_tensor_dict: cu_seqlens), :1019-1033 (pad_mb_list:
    pad_to_length = align(length, 256)) and :818-978 (pad_packed_tensor_dict: per-sequence
    alignment :849-858, :917-929, then one batch-padding sequence :932-944): ``(old_cu,
    padded cu, max_seqlen)``."""
    lens = torch.tensor(lengths, dtype=torch.int32)
    old_cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))  # :509-511
    total = int(old_cu[-1])
    pad_to_length = (total + 255) // 256 * 256  # :1023
    pad_size = (-lens) % seq_align_to  # :852
    padded_lens = lens + pad_size
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(padded_lens, dim=0)  # :857
    max_seqlen = int(padded_lens.max())
    lcm = math.lcm(seq_align_to, 256)  # :919
    pad_to_length = (pad_to_length + lcm - 1) // lcm * lcm  # :920
    total = int(cu[-1])
    if pad_to_length < total:  # :926-929
        pad_to_length = (total + lcm - 1) // lcm * lcm
    pad_length = pad_to_length - total  # :932
    if pad_length == 0:  # :937
        return old_cu, cu, max_seqlen
    return (
        old_cu,
        torch.nn.functional.pad(cu, (0, 1), value=pad_to_length),
        max(max_seqlen, pad_length),
    )


def ref_align(routed: Any, cu_seqlens: Any, max_seqlen: int) -> Any:
    """areal/engine/megatron_engine_r3_patch.py:69-124 (``_align_routed_experts_to_mask``),
    called with the original cu_seqlens (:385-408)."""
    re_bs, re_seqlen = routed.shape[:2]
    n_seqs = cu_seqlens.shape[0] - 1
    seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    aligned = torch.zeros(n_seqs, max_seqlen, *routed.shape[2:], dtype=routed.dtype)
    for i in range(min(n_seqs, re_bs)):
        if seq_lens[i] <= 0:
            continue
        n = min(seq_lens[i], re_seqlen, max_seqlen)
        aligned[i, :n] = routed[i, :n]
    return aligned


def ref_cp_split(tensor: Any, cu_seqlens: Any, cp_size: int, cp_rank: int) -> Any:
    """areal/engine/megatron_utils/packed_context_parallel.py:74-114."""
    if cp_size <= 1:
        return tensor
    input_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    out = torch.zeros((int(input_lens.sum()) // cp_size, *tensor.shape[1:]), dtype=tensor.dtype)
    for i in range(input_lens.shape[0]):
        seqlen = int(input_lens[i]) // cp_size
        half = seqlen // 2
        start = int(cu_seqlens[i]) // cp_size
        d = tensor[int(cu_seqlens[i]) : int(cu_seqlens[i + 1])]
        out[start : start + half] = d[half * cp_rank : half * (cp_rank + 1)]
        remain_start = int(input_lens[i]) - half * (cp_rank + 1)
        remain_end = min(int(input_lens[i]) - half * cp_rank, d.shape[0])
        out[start + half : start + half + remain_end - remain_start] = d[remain_start:remain_end]
    return out


def ref_set_router_replay_data(
    layers_topk_idx: Any,
    cu_seqlens: Any,
    *,
    tp_size: int,
    tp_rank: int,
    cp_size: int,
    cp_rank: int,
    layer_range: tuple[int, int],
) -> list[tuple[Any, Any]]:
    """areal/engine/router_replay_utils.py:206-443 (``set_router_replay_data``, after
    ``setup_per_microbatch_replay_forward``'s ``.to(torch.int32)``, :469): ``(target, mask)``
    per ``router.set_target_indices`` call on the rank, in router order."""
    layers_topk_idx = layers_topk_idx.to(torch.int32)  # :469
    bs_re, _, num_layers, topk = layers_topk_idx.shape  # :246-248
    n_seqs_in_cu = cu_seqlens.shape[0] - 1  # :252-254
    seq_lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # :257
    seq_align_to = tp_size * cp_size * 2 if cp_size > 1 else tp_size  # megatron_engine_r3_patch:333
    aligned_lens = [s + (-s) % seq_align_to for s in seq_lens]  # :266-269
    packed = torch.zeros(sum(aligned_lens), num_layers, topk, dtype=layers_topk_idx.dtype)  # :277
    valid = torch.zeros(sum(aligned_lens), dtype=torch.bool)  # :295
    offset = 0
    for i in range(min(n_seqs_in_cu, bs_re)):  # :301-315
        slen = seq_lens[i]
        if slen <= 0:
            offset += aligned_lens[i]
            continue
        actual = min(slen, layers_topk_idx.shape[1])
        packed[offset : offset + actual] = layers_topk_idx[i, :actual]
        valid[offset : offset + actual] = True
        offset += aligned_lens[i]
    row_all_zero = (packed == 0).reshape(packed.shape[0], -1).all(dim=-1)  # :348-350
    valid = valid & ~row_all_zero
    if cp_size > 1:  # :355-366
        packed = ref_cp_split(packed, cu_seqlens, cp_size, cp_rank)
        valid = ref_cp_split(valid.to(torch.int32), cu_seqlens, cp_size, cp_rank).bool()
    if tp_size > 1:  # :369-381, Megatron-Core's own split
        group = FakeGroup(tp_size, tp_rank)
        local = mappings._split_along_first_dim(packed, group)
        mask_buf = valid.to(packed.dtype).unsqueeze(-1).unsqueeze(-1)
        local_mask = mappings._split_along_first_dim(mask_buf, group)[..., 0, 0].bool()
    else:
        local, local_mask = packed, valid
    layers_topk = local.permute(1, 0, 2)  # :389
    start, end = layer_range  # :392-394, get_current_rank_layer_info
    routers = len(stage_moe_layers(start, end, MOE_LAYER_FREQ))  # get_micro_batch_router_list
    if routers == 0:  # :396-406: no RouterReplay instances, nothing set
        return []
    index_by_layer = len(layers_topk) == NUM_LAYERS  # :410
    moe_idx = sum(1 for i in range(start) if MOE_LAYER_FREQ[i] == 1)  # :412
    out = []
    for layer_idx in range(start, end):  # :415-443
        if MOE_LAYER_FREQ[layer_idx] != 1:
            continue
        idx = layer_idx if index_by_layer else moe_idx
        out.append((layers_topk[idx].to(torch.int64), local_mask))  # :440-441
        moe_idx += 1
    return out


def areal_inline_micro_batch(
    routings: list[Routing], lengths: Sequence[int], *, moe_only: bool
) -> Any:
    """A micro-batch's ``routed_experts`` as the PR's engine receives it: per sample AReaL's
    inline ``ModelResponse.routed_experts`` (SGLang's rows over all ``num_hidden_layers``,
    dense ``0``), preprocessed by the workflow, concatenated by AReaL's batching."""
    per_sample = []
    for routing, t in zip(routings, lengths, strict=True):
        flat = routed_experts(routing, t, num_layers=NUM_LAYERS)  # [t - 1, NUM_LAYERS * K]
        if moe_only:  # an engine returning only the MoE layers: MoE-ordinal indexing (:410-429)
            flat = flat.reshape(t - 1, NUM_LAYERS, K)[:, list(MOE)].reshape(t - 1, -1)
        per_sample.append(ref_preprocess(flat, t, len(MOE)))
    return ref_pad_cat(per_sample)


# ------------------------------------------------------------------------------------------

RANKS = [
    (tp, t, cp, c)
    for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 2))
    for t in range(tp)
    for c in range(cp)
]
STAGES = [(0, 6), (0, 3), (3, 6), (0, 1), (4, 5)]  # pp=1; pp=2; a dense-only first stage; one dense


def test_every_rank_gets_what_areals_set_router_replay_data_sets(
    svc: Service, transport: str
) -> None:
    with (
        RoutingClient(url_of(svc, transport), api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        ids, _ = _store(client, LENGTHS)
        inline = [routing for _, routing in client.get_many(ids)]  # as the engine shipped it
        checked = 0
        for moe_only in (False, True):
            batch = areal_inline_micro_batch(inline, LENGTHS, moe_only=moe_only)
            for n, ((tp, t, cp, c), (start, end)) in enumerate(itertools.product(RANKS, STAGES)):
                align = tp * cp * 2 if cp > 1 else tp
                old_cu, cu, max_seqlen = ref_padded_cu(LENGTHS, align)
                want = ref_set_router_replay_data(
                    ref_align(batch, old_cu, max_seqlen),
                    cu,
                    tp_size=tp,
                    tp_rank=t,
                    cp_size=cp,
                    cp_rank=c,
                    layer_range=(start, end),
                )
                stage = stage_moe_layers(start, end, MOE_LAYER_FREQ)
                got = fetch_areal_rank_targets(
                    reader if n % 3 == 2 else client,
                    ids,
                    seqlens=LENGTHS,
                    cu_seqlens=cu,
                    tp_size=tp,
                    tp_rank=t,
                    cp_size=cp,
                    cp_rank=c,
                    stage_layers=stage,
                    as_torch=True,
                )
                assert got.layer_ids == stage
                assert len(got.per_layer) == len(want)
                for (w_target, w_mask), g_target, g_mask in zip(
                    want, got.per_layer, got.valid_mask, strict=True
                ):
                    assert g_target.dtype == torch.int64 and g_mask.dtype == torch.bool
                    assert torch.equal(g_target, w_target)
                    assert torch.equal(g_mask, w_mask)
                    checked += 1
        assert checked == 2 * sum(
            len(stage_moe_layers(a, b, MOE_LAYER_FREQ)) for a, b in STAGES
        ) * len(RANKS)


def test_rank_local_refusals(svc: Service) -> None:
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids, _ = _store(client, [40, 9])
        _, cu, _ = ref_padded_cu([40, 9], 4)
        _, longer, _ = ref_padded_cu([44, 9], 4)
        with pytest.raises(ShapeError, match=r"sample 0 \(rollout .*rows"):
            fetch_areal_rank_targets(client, ids, seqlens=[44, 9], cu_seqlens=longer)
        with pytest.raises(RolloutNotFoundError, match="sample 1"):
            fetch_areal_rank_targets(
                client, [ids[0], key_rollout_id(new_rollout_key())], seqlens=[40, 9], cu_seqlens=cu
            )
        with pytest.raises(ShapeError, match="multiples of 8"):  # cp=2, tp=2: AReaL pads to 8
            fetch_areal_rank_targets(
                client, ids, seqlens=[40, 9], cu_seqlens=cu, tp_size=2, cp_size=2
            )
        got = fetch_areal_rank_targets(client, ids, seqlens=[40, 9], cu_seqlens=cu, stage_layers=())
        assert got.per_layer == [] and got.layer_ids == ()


class MicroBatchItem(NamedTuple):
    """areal/utils/data.py:586-602."""

    orig_mb: dict[str, Any]
    padded_mb: dict[str, Any]
    padding_length: int
    old_cu_seqlens: Any
    padded_to_length: int | None = None


def ref_micro_batch(batch: dict[str, Any], order: list[int], seq_align_to: int) -> MicroBatchItem:
    """One micro-batch of samples ``order`` (sorted, as allocate_balanced_mbs leaves them,
    data.py:471), packed (pack_tensor_dict, :492-541) and padded (pad_packed_tensor_dict,
    :898-909 per sequence, :946-955 the batch-padding sequence) as ``_prepare_mb_list``
    (megatron_engine.py:2029-2051) does, for the per-token columns."""
    mask = batch["attention_mask"][order]
    lens = mask.sum(1).tolist()
    old_cu, cu, max_seqlen = ref_padded_cu(lens, seq_align_to)
    orig: dict[str, Any] = {"cu_seqlens": old_cu, "max_seqlen": max(lens)}
    padded: dict[str, Any] = {"cu_seqlens": cu, "max_seqlen": max_seqlen}
    for key in ("input_ids", KEY_FIELD, STATE_FIELD):
        if key not in batch:
            continue
        value = batch[key][order]
        orig[key] = torch.cat([value[i, :n] for i, n in enumerate(lens)])
        out = torch.zeros(int(cu[-1]), dtype=value.dtype)
        for i, n in enumerate(lens):
            out[int(cu[i]) : int(cu[i]) + n] = value[i, :n]
        padded[key] = out
    return MicroBatchItem(orig, padded, int(cu[-1]) - int(cu[len(lens)]), old_cu)


class _Backend:
    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []

    def build_generation_request(self, req: Any, with_lora: bool, version: int) -> Any:
        return SimpleNamespace(payload={"input_ids": list(req.input_ids), "sampling_params": {}})


class _Engine:
    """What KeyedEngine uses of a RemoteSGLangEngine: ``_engine.backend`` and ``agenerate``."""

    def __init__(self) -> None:
        self._engine = SimpleNamespace(backend=_Backend())
        self.sent: list[dict[str, Any]] = []

    async def agenerate(self, req: Any) -> Any:
        req = SimpleNamespace(**{**vars(req), "metadata": dict(req.metadata)})  # AReaL copies
        self.sent.append(self._engine.backend.build_generation_request(req, False, 3).payload)
        return SimpleNamespace(input_tokens=req.input_ids, output_tokens=[])


def test_keys_travel_with_the_samples_to_each_rank(svc: Service) -> None:
    lengths = [700, 37, 260, 9, 150]
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        # Rollout side: one keyed agenerate per row; the request is tagged with the key's id.
        engine = _Engine()
        keyed = r3_areal.KeyedEngine(engine)
        for t in lengths:
            asyncio.run(keyed.agenerate(SimpleNamespace(input_ids=[1] * t, metadata={})))
        ids = [key_rollout_id(k) for k in keyed.keys]
        assert [
            p["sampling_params"]["custom_params"]["r3"]["rollout_id"] for p in engine.sent
        ] == ids
        for rid, t, n in zip(ids, lengths, range(5), strict=True):
            rows = synthetic_routing(t - 1, len(MOE), E, K, skew=1.0, seed=n)
            client.put(rid, Routing.from_array(rows, num_experts=E, layer_ids=MOE))
        results = [
            with_rollout_keys(
                {
                    "input_ids": torch.arange(t, dtype=torch.int32)[None],
                    "attention_mask": torch.ones(1, t, dtype=torch.bool),
                },
                [key],
            )
            for t, key in zip(lengths, keyed.keys, strict=True)
        ]
        batch = {
            k: ref_pad_cat([r[k] for r in results]) for k in results[0]
        }  # concat_padded_tensors
        got_ids, tokens = step_rollouts(batch)
        assert got_ids == ids and tokens.tolist() == lengths
        found = check_areal_step(client, batch)  # before dispatch
        assert (found.samples, found.samples_with_views, found.off_state_tokens) == (5, 0, 0)
        assert found.tokens == sum(lengths) - 5 and found.policy == "exact"
        bad = dict(batch, attention_mask=batch["attention_mask"].clone())
        bad[KEY_FIELD] = batch[KEY_FIELD].clone()
        bad[KEY_FIELD][3] = new_rollout_key()
        with pytest.raises(RolloutNotFoundError, match="sample 3"):
            check_areal_step(client, bad)
        # Trainer side: a micro-batch of samples [1, 2, 4] on a tp=2 x cp=2 rank.
        inline = [routing for _, routing in client.get_many(ids)]
        item = ref_micro_batch(batch, [1, 2, 4], 8)
        mb = areal_micro_batch(item)
        assert mb.rollout_ids == (ids[1], ids[2], ids[4])
        assert mb.seqlens.tolist() == [37, 260, 150]
        assert mb.cu_seqlens.tolist() == item.padded_mb["cu_seqlens"].tolist()
        assert len(mb.cu_seqlens) == 5  # with AReaL's batch-padding sequence
        sub = [lengths[i] for i in (1, 2, 4)]
        batch_re = areal_inline_micro_batch([inline[i] for i in (1, 2, 4)], sub, moe_only=False)
        old_cu = item.old_cu_seqlens
        want = ref_set_router_replay_data(
            ref_align(batch_re, old_cu, item.padded_mb["max_seqlen"]),
            item.padded_mb["cu_seqlens"],
            tp_size=2,
            tp_rank=1,
            cp_size=2,
            cp_rank=1,
            layer_range=(3, 6),
        )
        got = fetch_areal_rank_targets(
            client,
            mb.rollout_ids,
            seqlens=mb.seqlens,
            cu_seqlens=mb.cu_seqlens,
            tp_size=2,
            tp_rank=1,
            cp_size=2,
            cp_rank=1,
            stage_layers=stage_moe_layers(3, 6, MOE_LAYER_FREQ),
        )

        class Router:  # AReaL's RouterReplay.set_target_indices (router_replay_patch.py:154-174)
            def set_target_indices(self, topk_indices: Any, valid_mask: Any = None) -> None:
                self.target_topk_idx, self.target_valid_mask = topk_indices, valid_mask

        routers = [Router(), Router()]
        set_router_targets(routers, got)
        for router, (w_target, w_mask) in zip(routers, want, strict=True):
            assert torch.equal(router.target_topk_idx, w_target)
            assert torch.equal(router.target_valid_mask, w_mask)
        with pytest.raises(ShapeError, match="3 routers"):
            set_router_targets([Router(), Router(), Router()], got)
        no_keys = item._replace(
            padded_mb={k: v for k, v in item.padded_mb.items() if k != KEY_FIELD}
        )
        with pytest.raises(ShapeError, match="with_rollout_keys"):
            areal_micro_batch(no_keys)


def test_missing_fill_routes_gaps_live(svc: Service) -> None:
    """Rows nobody shipped, under ``missing="fill"``: invalid (live routing), as AReaL treats
    rows without routing; under the default, refused."""
    from r3_client import Segment, encode_frame

    rid = key_rollout_id(new_rollout_key())
    rows = synthetic_routing(59, len(MOE), E, K, skew=1.0, seed=7)
    with svc.http() as c:
        for a, b in ((0, 20), (30, 59)):
            frame = encode_frame(
                rows[a:b], num_experts=E, layer_ids=MOE, segment=Segment(a, b, "tiny-moe", "v1")
            )
            assert c.put(f"/v1/rollouts/{rid}/segments", content=frame).status_code in (200, 201)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        _, cu, _ = ref_padded_cu([60], 1)
        with pytest.raises(ShapeError, match="nobody shipped"):
            fetch_areal_rank_targets(client, [rid], seqlens=[60], cu_seqlens=cu)
        got = fetch_areal_rank_targets(client, [rid], seqlens=[60], cu_seqlens=cu, missing="fill")
    want = np.zeros(int(cu[-1]), bool)
    want[:20] = want[30:59] = True
    for target, mask in zip(got.per_layer, got.valid_mask, strict=True):
        np.testing.assert_array_equal(mask, want)
        assert (target[~want] == 0).all()


# ------------------------------------------------------------------------------------------
# exact: a step expanded into one sample per routing state (r3_client.expand_states)
# ------------------------------------------------------------------------------------------

X_LENGTHS = [40, 12, 30]  # token counts


def _store_straddled(client: RoutingClient, seed: int) -> tuple[list[str], list[list[Any]]]:
    """Sample 0 a three-turn agent (a push before each later turn: views serving rows 12
    and 26), sample 2 recomputed after an eviction (a view of rows [2, 10) serving row 10),
    sample 1 one call; each sample's states' rows."""
    g = np.random.default_rng(seed)

    def rows(n: int) -> np.ndarray:
        # each row's experts ascending: the cache's canonical order (a set per token)
        top = np.argsort(g.random((n, len(MOE), E)), axis=-1)[..., :K]
        return np.sort(top, axis=-1).astype(np.int16)

    def put(rid: str, idx: np.ndarray, start: int, version: str, view: int | None = None) -> None:
        seg = Segment(start, start + idx.shape[0], "tiny-moe", version)
        client.put(rid, idx, num_experts=E, layer_ids=MOE, segment=seg, view=view)

    ids: list[str] = []
    states: list[list[Any]] = []
    for i, t in enumerate(X_LENGTHS):
        rid = key_rollout_id(new_rollout_key())
        first = rows(t - 1)
        if i == 0:
            again, third = rows(12), rows(26)
            put(rid, first[:12], 0, "w1")
            put(rid, again, 0, "w2", view=12)
            put(rid, first[12:26], 12, "w2")
            put(rid, third, 0, "w3", view=26)
            put(rid, first[26:], 26, "w3")
            cat = np.concatenate
            states.append([first[:12], cat([again, first[12:26]]), cat([third, first[26:]])])
        elif i == 2:
            redo = rows(8)
            put(rid, first[:10], 0, "w1")
            put(rid, redo, 2, "w1", view=10)
            put(rid, first[10:], 10, "w1")
            states.append([first[:10], np.concatenate([first[:2], redo, first[10:]])])
        else:
            put(rid, first, 0, "w1")
            states.append([first])
        ids.append(rid)
    return ids, states


def test_an_expanded_step_replays_each_sample_in_its_own_state(svc: Service) -> None:
    """``expand_states`` cuts the step (one sample per state: its first ``end + 1`` tokens);
    ``fetch_areal_rank_targets(..., states=...)`` hands every router of every rank what the
    PR's ``set_router_replay_data`` sets from inline ``routed_experts`` of each expanded
    sample's own state; the unexpanded step is refused, never replayed in one state."""
    from r3_client import InvalidRequestError, expand_states
    from r3_client.rank_local import check_step

    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids, states = _store_straddled(client, seed=3)
        exp = expand_states(client, ids, X_LENGTHS)
        assert exp.state_rows == [0, 12, 26, 0, 0, 10]
        assert exp.num_tokens.tolist() == [13, 27, 40, 12, 11, 30]
        lengths = exp.num_tokens.tolist()
        seen: dict[int, int] = {}
        own = []
        for s in exp.states:
            k = seen.get(s.origin, 0)
            seen[s.origin] = k + 1
            rows = states[s.origin][k][: s.num_tokens - 1]
            own.append(Routing.from_array(rows, num_experts=E, layer_ids=MOE))
        x_ids = [ids[s.origin] for s in exp.states]
        batch = areal_inline_micro_batch(own, lengths, moe_only=False)
        for (tp, t, cp, c), (start, end) in itertools.product(RANKS, STAGES[:3]):
            align = tp * cp * 2 if cp > 1 else tp
            old_cu, cu, max_seqlen = ref_padded_cu(lengths, align)
            want = ref_set_router_replay_data(
                ref_align(batch, old_cu, max_seqlen), cu, tp_size=tp, tp_rank=t, cp_size=cp,
                cp_rank=c, layer_range=(start, end),
            )  # fmt: skip
            got = fetch_areal_rank_targets(
                client, x_ids, seqlens=lengths, cu_seqlens=cu, tp_size=tp, tp_rank=t,
                cp_size=cp, cp_rank=c, stage_layers=stage_moe_layers(start, end, MOE_LAYER_FREQ),
                as_torch=True, states=exp.state_rows,
            )  # fmt: skip
            assert len(got.per_layer) == len(want)
            for (w_target, w_mask), g_target, g_mask in zip(
                want, got.per_layer, got.valid_mask, strict=True
            ):
                assert torch.equal(g_target, w_target) and torch.equal(g_mask, w_mask)
        _, cu, _ = ref_padded_cu(X_LENGTHS, 1)
        with pytest.raises(InvalidRequestError, match="expand the sample"):
            fetch_areal_rank_targets(client, ids, seqlens=X_LENGTHS, cu_seqlens=cu)
        # before dispatch: expanded, no token replayed off its state and nothing to expand;
        # unexpanded, none off either (exact never replays one), two samples to expand
        found = check_step(client, x_ids, lengths, states=exp.state_rows)
        assert found.off_state_tokens == 0 and found.samples_with_views == 5
        assert (found.expanded_samples, found.extra_samples, found.extra_tokens) == (0, 0, 0)
        found = check_step(client, ids, X_LENGTHS)
        assert found.off_state_tokens == 0 and found.off_state_samples == 0
        assert (found.expanded_samples, found.extra_samples) == (2, exp.extra_samples)
        assert found.extra_tokens == exp.extra_tokens == 13 + 27 + 11


def _key_of(rollout: str) -> int:
    return int(rollout.removeprefix("areal-"), 16)


def test_expand_areal_batch_carries_each_state_to_the_ranks(svc: Service) -> None:
    """``expand_areal_batch`` on an AReaL step (keys per token, loss mask on the responses):
    the ranks read each expanded sample's state from its ``r3_state`` column through AReaL's
    packing and padding, and get what the PR's ``set_router_replay_data`` sets from each
    state's own inline rows; every original's trained tokens are trained once."""
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids, states = _store_straddled(client, seed=5)
        width = max(X_LENGTHS) + 3
        batch: dict[str, Any] = {
            "input_ids": torch.zeros(3, width, dtype=torch.int64),
            "attention_mask": torch.zeros(3, width, dtype=torch.bool),
            "loss_mask": torch.zeros(3, width, dtype=torch.int32),
            "rewards": torch.tensor([1.0, -1.0, 0.5]),
        }
        for i, t in enumerate(X_LENGTHS):
            batch["input_ids"][i, :t] = torch.arange(1, t + 1)
            batch["attention_mask"][i, :t] = True
            batch["loss_mask"][i, 4:t] = 1  # a 4-token prompt
        batch = {**batch, **with_rollout_keys(batch, [_key_of(r) for r in ids])}
        x, exp = expand_areal_batch(client, batch)
        assert exp.state_rows == [0, 12, 26, 0, 0, 10]
        assert x["attention_mask"].sum(1).tolist() == exp.num_tokens.tolist()
        assert x["rewards"].tolist() == [1.0, 1.0, 1.0, -1.0, 0.5, 0.5]
        for i in range(3):  # each original's response tokens trained exactly once
            trained = x["loss_mask"][torch.as_tensor(exp.origin == i)].sum(0)
            assert torch.equal(trained, batch["loss_mask"][i])
        assert x[STATE_FIELD][:, 0].tolist() == exp.state_rows
        with pytest.raises(ShapeError, match="already expanded"):
            expand_areal_batch(client, x)
        order = [0, 1, 2, 4, 5]  # a micro-batch of five of the six expanded samples
        for tp, cp in ((2, 2), (1, 1)):
            align = tp * cp * 2 if cp > 1 else tp
            item = ref_micro_batch(x, order, align)
            mb = areal_micro_batch(item)
            assert mb.states == tuple(exp.state_rows[j] for j in order)
            own = []
            for j in order:
                s = exp.states[j]
                index = [t.state for t in exp.states if t.origin == s.origin].index(s.state)
                rows = states[s.origin][index][: s.num_tokens - 1]
                own.append(Routing.from_array(rows, num_experts=E, layer_ids=MOE))
            lens = mb.seqlens.tolist()
            inline = areal_inline_micro_batch(own, lens, moe_only=False)
            want = ref_set_router_replay_data(
                ref_align(inline, item.old_cu_seqlens, item.padded_mb["max_seqlen"]),
                item.padded_mb["cu_seqlens"], tp_size=tp, tp_rank=tp - 1, cp_size=cp,
                cp_rank=cp - 1, layer_range=(0, NUM_LAYERS),
            )  # fmt: skip
            got = fetch_areal_rank_targets(
                client, mb.rollout_ids, seqlens=mb.seqlens, cu_seqlens=mb.cu_seqlens,
                tp_size=tp, tp_rank=tp - 1, cp_size=cp, cp_rank=cp - 1, as_torch=True,
                states=mb.states,
            )  # fmt: skip
            for (w_target, w_mask), g_target, g_mask in zip(
                want, got.per_layer, got.valid_mask, strict=True
            ):
                assert torch.equal(g_target, w_target) and torch.equal(g_mask, w_mask)
        with pytest.raises(ShapeError, match="other samples"):
            expand_areal_batch(client, {k: v[:2] for k, v in batch.items()}, expansion=exp)
