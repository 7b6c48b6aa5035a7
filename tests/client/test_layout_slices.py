"""One trainer rank's part of a batch equals the whole batch's layout cut by the trainer's own code.

verl: :func:`verl_rank_slice` against verl 0.9.1's R3 branch run on :func:`verl_layout`'s
whole batch, as its Megatron engine runs it (``workers/engine/megatron/transformer_impl.py:
1306-1327``): ``left_right_2_no_padding``, ``align_r3_router_replay_data``,
``build_r3_replay_mask``, then ``set_router_replay_data(..., model=chunk)``, whose routers'
``target_topk_idx`` / ``target_replay_mask`` are compared.  Megatron: :func:`megatron_layout`
with a rank's coordinates against the one-rank layout cut by Megatron-Core's
``get_batch_on_this_cp_rank`` (applied per sequence, which is what Transformer Engine's THD
partition does) and ``scatter_to_sequence_parallel_region``.

TP / CP coordinates reach that code through fake process groups (one process); each pipeline
stage's layers (virtual stages included) come from Megatron-Core's own layer assignment
(``get_transformer_layer_offset``, ``get_num_layers_to_build``).  The chunk's routers are
``TopKRouter`` shells carrying verl's ``RouterReplay`` and their ``layer_number``, which is all
verl's ``iter_model_routers`` reads.  verl's ``import verl`` imports ``ray`` (absent: verl is
installed ``--no-deps``), so a stub stands in for it in this process, as in
tests/integrations/test_verl_contract.py.  A list-based reference covers verl's split where
verl is not installed.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from r3_client import Routing, ShapeError
from r3_client.layouts import (
    VerlRank,
    VerlRankSlice,
    megatron_layout,
    verl_layout,
    verl_rank_slice,
)
from tests.support.verl_stubs import FakeGroup, router_shells, stub_ray

NUM_LAYERS, E, K = 8, 16, 2


@dataclass(frozen=True)
class Model:
    """Which of the ``NUM_LAYERS`` layers are MoE (Megatron's ``moe_layer_freq`` list)."""

    name: str
    freq: tuple[int, ...]

    @property
    def moe_ids(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.freq) if f)


ALL_MOE = Model("all-moe", (1,) * NUM_LAYERS)
DENSE_FIRST = Model("dense-first", (0, 0, 1, 1, 0, 1, 1, 1))  # DeepSeek-V3 style, one more dense
MODELS = [ALL_MOE, DENSE_FIRST]


@dataclass(frozen=True)
class Batch:
    """A micro-batch: each sample's prompt and response length and its recorded rows."""

    routings: list[npt.NDArray[np.int16]]  # [P + R - 1, MoE layers, K]
    prompts: list[int]
    responses: list[int]

    @property
    def tokens(self) -> list[int]:
        return [p + r for p, r in zip(self.prompts, self.responses, strict=True)]


def random_batch(model: Model, seed: int) -> Batch:
    """1-5 samples, prompts of 1-11 tokens, responses of 0-9 (a sample without a response is
    not replayed), each row a set of K distinct experts."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    prompts = [int(x) for x in rng.integers(1, 12, n)]
    responses = [int(x) for x in rng.integers(0, 10, n)]
    routings = [
        np.argsort(rng.random((p + r - 1, len(model.moe_ids), E)), axis=-1)[..., :K].astype(
            np.int16
        )
        for p, r in zip(prompts, responses, strict=True)
    ]
    return Batch(routings, prompts, responses)


@functools.cache
def megatron_chunks(pp: int, vpp: int | None) -> dict[tuple[int, int], range]:
    """``(pp_rank, vp_stage) -> layers`` as Megatron-Core assigns them to model chunks."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=NUM_LAYERS,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
        )
    chunks = {}
    for pp_rank, vp in itertools.product(range(pp), range(vpp or 1)):
        stage = vp if vpp else None
        offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
        chunks[pp_rank, vp] = range(offset, offset + count)
    return chunks


def chunk_moe_layers(model: Model, pp: int, vpp: int | None) -> list[list[int]]:
    """Each model chunk's MoE layers (the layers its routers replay), chunk by chunk."""
    return [[i for i in layers if model.freq[i]] for layers in megatron_chunks(pp, vpp).values()]


def set_rank(mp: pytest.MonkeyPatch, tp: int, tp_rank: int, cp: int, cp_rank: int) -> None:
    """Megatron's parallel state as TP rank ``tp_rank`` of ``tp``, CP rank ``cp_rank`` of ``cp``."""
    import megatron.core.tensor_parallel.mappings as mappings
    from megatron.core import parallel_state

    mp.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    mp.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    mp.setattr(parallel_state, "get_context_parallel_rank", lambda: cp_rank)
    # The SP scatter asks for the TP group (None without torch.distributed): the fake one.
    mp.setattr(
        mappings, "get_tensor_model_parallel_group_if_none", lambda *a, **k: FakeGroup(tp, tp_rank)
    )


# ------------------------------------------------------------------ verl's own code


@dataclass
class Verl:
    """verl 0.9.1's functions this module drives, and Megatron's ``TopKRouter``."""

    left_right_2_no_padding: Any
    compute_position_id_with_mask: Any
    rru: Any  # verl.utils.megatron.router_replay_utils
    RouterReplay: Any
    TopKRouter: Any


@pytest.fixture(scope="module")
def verl() -> Iterator[Verl]:
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed: scripts/bootstrap.sh installs verl==0.9.1 --no-deps")
    stub_ray()
    from tests.support.megatron_model import _hide_broken_flash_mla

    _hide_broken_flash_mla()
    import verl as verl_pkg

    assert verl_pkg.__version__ == "0.9.1", verl_pkg.__version__
    from megatron.core.transformer.moe.router import TopKRouter
    from verl.utils.megatron import router_replay_utils as rru
    from verl.utils.megatron.router_replay_patch import RouterReplay
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rru, "device_name", "cpu")  # verl has no CPU platform: it says "cuda"
        try:
            yield Verl(
                left_right_2_no_padding,
                compute_position_id_with_mask,
                rru,
                RouterReplay,
                TopKRouter,
            )
        finally:
            RouterReplay.router_instances.clear()


def verl_config(
    model: Model, *, fp8: bool = False, dsv4: bool = False, csa_window_size: int | None = None
) -> types.SimpleNamespace:
    """The TransformerConfig fields verl's ``set_router_replay_data`` reads: ``fp8`` picks its
    FP8 padding, the ``dsv4_hybrid`` attention variant the contiguous CP layout with
    ``csa_window_size`` as the minimum of local rows (router_replay_utils.py:470-477)."""
    return types.SimpleNamespace(
        num_layers=NUM_LAYERS,
        moe_layer_freq=list(model.freq),
        fp8="e4m3" if fp8 else None,
        experimental_attention_variant="dsv4_hybrid" if dsv4 else None,
        csa_window_size=csa_window_size,
    )


def whole_batch(batch: Batch, model: Model, *, absolute: bool) -> npt.NDArray[Any]:
    """verl_layout of the batch, with a padding column on each side (left and right padding)."""
    return verl_layout(
        batch.routings,
        batch.prompts,
        batch.responses,
        prompt_len=max(batch.prompts) + 1,
        response_len=max(batch.responses) + 1,
        num_layers=NUM_LAYERS if absolute else None,
        layer_ids=model.moe_ids,
    )


def verl_targets(
    v: Verl, batch: Batch, whole: npt.NDArray[Any], config: Any, layers: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What verl's R3 branch sets on a chunk whose routers are at ``layers``: per router, its
    ``(target_topk_idx, target_replay_mask)``, for the rank the parallel state says."""
    bs, width = whole.shape[:2]
    prompt_len = max(batch.prompts) + 1
    mask = torch.zeros(bs, width, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses, strict=True)):
        mask[i, prompt_len - p : prompt_len + r] = 1
    from tensordict import TensorDict

    td = TensorDict(
        {
            "input_ids": torch.randint(1, 100, (bs, width)),
            "attention_mask": mask,
            "response_mask": mask[:, prompt_len:].clone(),
            "position_ids": v.compute_position_id_with_mask(mask),
            "routed_experts": torch.from_numpy(whole),
        },
        batch_size=[bs],
    )
    td = v.left_right_2_no_padding(td)  # ray_trainer.py:1295
    input_ids = td["input_ids"]
    routes = v.rru.align_r3_router_replay_data(td["routed_experts"], input_ids)
    replay_mask = v.rru.build_r3_replay_mask(input_ids, td["response_mask"])

    chunk = router_shells(v.TopKRouter, v.RouterReplay, layers)
    v.rru.set_router_replay_data(
        routes, None, config, 0, replay_mask=replay_mask, local_cp_size=None, model=chunk
    )
    v.RouterReplay.router_instances.clear()
    return [(r.router_replay.target_topk_idx, r.router_replay.target_replay_mask) for r in chunk]


def assert_is_verls(got: VerlRankSlice, want: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    assert len(got.per_layer) == len(want)
    for mine, (target, mask) in zip(got.per_layer, want, strict=True):
        assert mine.dtype == np.int64 and target.dtype == torch.int64
        np.testing.assert_array_equal(mine, target.numpy())
        np.testing.assert_array_equal(got.replay_mask, mask.numpy())


# (tp, cp, pp, vpp, sequence parallel); TP > 1 without SP: see the refusal test below.
VERL_GRID = [
    (tp, cp, pp, vpp, sp)
    for tp, cp, (pp, vpp), sp in itertools.product(
        [1, 2], [1, 2], [(1, None), (2, None), (2, 2)], [True, False]
    )
    if tp == 1 or sp
]


@pytest.mark.parametrize(("tp", "cp", "pp", "vpp", "sp"), VERL_GRID)
def test_verl_rank_slice_is_what_verls_r3_branch_sets_on_that_rank(
    verl: Verl,
    tp: int,
    cp: int,
    pp: int,
    vpp: int | None,
    sp: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random micro-batches, all-MoE and dense-first, absolute and MoE-only layer axes: on
    every (tp, cp, pp[, vp]) rank the slice is the targets and mask verl's own code sets on
    that chunk's routers from the whole batch."""
    for model, seed, absolute in itertools.product(MODELS, range(2), [True, False]):
        batch = random_batch(model, seed)
        whole = whole_batch(batch, model, absolute=absolute)
        config = verl_config(model)
        for tp_rank, cp_rank, layers in itertools.product(
            range(tp), range(cp), chunk_moe_layers(model, pp, vpp)
        ):
            rank = VerlRank(
                tp_size=tp,
                tp_rank=tp_rank,
                cp_size=cp,
                cp_rank=cp_rank,
                stage_layers=layers,
                sequence_parallel=sp,
            )
            got = verl_rank_slice(
                [
                    Routing.from_array(r, num_experts=E, layer_ids=model.moe_ids)
                    for r in batch.routings
                ],
                batch.prompts,
                batch.responses,
                rank=rank,
            )
            assert got.layer_ids == tuple(layers)
            if not layers:  # a dense chunk: verl's engine sets nothing (transformer_impl:1306)
                assert got.per_layer == []
                continue
            set_rank(monkeypatch, tp, tp_rank, cp, cp_rank)
            assert_is_verls(got, verl_targets(verl, batch, whole, config, layers))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("layout", "min_local_rows"),
    [("zigzag", None), ("contiguous", None), ("contiguous", 64)],
    ids=["zigzag", "contiguous", "contiguous-min-rows"],
)
def test_verl_rank_slice_pads_as_verl_packs(
    verl: Verl,
    fp8: bool,
    layout: str,
    min_local_rows: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8 padding (each sequence to lcm(16, align), the batch to 128 * align) and the
    contiguous CP layout of DeepSeek-V4's hybrid attention (with its minimum of local rows)."""
    model = DENSE_FIRST
    contiguous = layout == "contiguous"
    config = verl_config(model, fp8=fp8, dsv4=contiguous, csa_window_size=min_local_rows)
    if contiguous:
        # megatron-core 0.16.1's PackedSeqParams has no cp_partition_mode, so verl refuses the
        # contiguous layout with CP > 1 before packing (models/mcore/util.py:539-549).  The
        # parameters are not part of the routing verl packs: a stand-in that takes the field,
        # as verl's own tests use (util.py:35-41).
        from verl.models.mcore import util

        monkeypatch.setattr(util, "PackedSeqParams", types.SimpleNamespace)
        monkeypatch.setattr(util, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True)
    for seed, tp, cp in itertools.product(range(2), [1, 2], [1, 2]):
        batch = random_batch(model, seed + 10)
        whole = whole_batch(batch, model, absolute=True)
        for tp_rank, cp_rank in itertools.product(range(tp), range(cp)):
            rank = VerlRank(
                tp_size=tp,
                tp_rank=tp_rank,
                cp_size=cp,
                cp_rank=cp_rank,
                fp8_padding=fp8,
                cp_layout="contiguous" if contiguous else "zigzag",
                min_local_rows=min_local_rows,
            )
            got = verl_rank_slice(
                batch.routings, batch.prompts, batch.responses, rank=rank, layer_ids=model.moe_ids
            )
            set_rank(monkeypatch, tp, tp_rank, cp, cp_rank)
            assert_is_verls(got, verl_targets(verl, batch, whole, config, list(model.moe_ids)))
        align = tp * cp * (2 if cp > 1 and not contiguous else 1)
        if fp8:
            assert got.cu_seqlens[-1] % (128 * align) == 0
        if min_local_rows is not None:
            assert got.cu_seqlens[-1] >= cp * min_local_rows


def test_verl_without_sequence_parallel_is_refused_as_verl_refuses_it(
    verl: Verl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's R3 branch splits routing over the TP group whatever ``sequence_parallel`` says
    (router_replay_utils.py:507-514); without SP each TP rank's routers see every CP-local token,
    and verl's replay refuses the mismatch (router_replay_patch.py:129-134).  So the slice
    refuses that rank before the step rather than on it."""
    with pytest.raises(ShapeError, match="Turn sequence parallel on"):
        VerlRank(tp_size=2, tp_rank=0, sequence_parallel=False)
    batch = random_batch(ALL_MOE, 3)
    whole = whole_batch(batch, ALL_MOE, absolute=True)
    set_rank(monkeypatch, 2, 0, 1, 0)
    (target, mask), *_ = verl_targets(verl, batch, whole, verl_config(ALL_MOE), [0])
    cp_local = VerlRank(tp_size=2, tp_rank=0).padded_lengths(np.array(batch.tokens)).sum()
    assert target.shape[0] == cp_local // 2  # half the tokens the router sees without SP
    router = verl.RouterReplay()
    verl.RouterReplay.router_instances.clear()
    router.set_target_indices(target, replay_mask=mask)
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    scores = torch.rand(int(cp_local), E)
    with pytest.raises(RuntimeError, match="Router replay tensors are not aligned"):
        router.get_replay_topk(
            scores, K, default_compute_topk=lambda s, k, **kw: torch.topk(s, k=k, dim=1)
        )


# ------------------------------------------------------------------ without verl installed


def reference_verl_slice(
    whole: npt.NDArray[Any], batch: Batch, tp: int, tp_rank: int, cp: int, cp_rank: int
) -> tuple[list[list[list[int]]], list[bool]]:
    """verl's R3 split with plain lists: each sample's attended columns of the whole batch,
    padded with zero rows to a multiple of tp*cp*2 (tp with cp=1), the zigzag chunks of this
    CP rank, then this TP rank's part; the replay mask alongside."""
    prompt_len = max(batch.prompts) + 1
    align = tp * cp * 2 if cp > 1 else tp
    rows: list[list[list[int]]] = []
    mask: list[bool] = []
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses, strict=True)):
        seq = whole[i, prompt_len - p : prompt_len + r].tolist()
        replay = [r > 0 and t < p + r - 1 for t in range(p + r)]
        pad = -len(seq) % align
        seq += [[[0] * K] * whole.shape[2]] * pad
        replay += [False] * pad
        if cp > 1:
            c = len(seq) // (2 * cp)
            keep = [*range(cp_rank * c, (cp_rank + 1) * c)]
            keep += [*range((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)]
            seq, replay = [seq[t] for t in keep], [replay[t] for t in keep]
        rows += seq
        mask += replay
    part = len(rows) // tp
    return rows[tp_rank * part : (tp_rank + 1) * part], mask[tp_rank * part : (tp_rank + 1) * part]


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3)])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_verl_rank_slice_matches_a_list_reference(model: Model, tp: int, cp: int) -> None:
    """Every rank's slice is the whole batch cut by the reference; over the ranks each
    recorded row is replayed exactly once per layer."""
    for seed in range(4):
        batch = random_batch(model, seed + 20)
        whole = whole_batch(batch, model, absolute=True)
        replayed = 0
        for tp_rank, cp_rank in itertools.product(range(tp), range(cp)):
            rank = VerlRank(tp_size=tp, tp_rank=tp_rank, cp_size=cp, cp_rank=cp_rank)
            got = verl_rank_slice(
                batch.routings, batch.prompts, batch.responses, rank=rank, layer_ids=model.moe_ids
            )
            rows, mask = reference_verl_slice(whole, batch, tp, tp_rank, cp, cp_rank)
            assert got.replay_mask.tolist() == mask
            for layer, mine in zip(got.layer_ids, got.per_layer, strict=True):
                assert mine.tolist() == [row[layer] for row in rows]
            replayed += int(got.replay_mask.sum())
        assert replayed == sum(
            t - 1 for t, r in zip(batch.tokens, batch.responses, strict=True) if r > 0
        )


def test_verl_rank_slice_hand_computed() -> None:
    """docs/layouts.md's worked example: tp=2 with SP, cp=2, two samples."""
    a = np.array([[[1, 2]], [[3, 4]], [[5, 6]], [[7, 0]]], dtype=np.int16)  # P=3, R=2: r0..r3
    b = np.array([[[2, 5]], [[6, 1]]], dtype=np.int16)  # P=2, R=1: s0, s1
    slices = {
        (cp_rank, tp_rank): verl_rank_slice(
            [a, b],
            [3, 2],
            [2, 1],
            rank=VerlRank(tp_size=2, tp_rank=tp_rank, cp_size=2, cp_rank=cp_rank),
            layer_ids=[3],
        )
        for cp_rank, tp_rank in itertools.product(range(2), range(2))
    }
    z = [0, 0]
    # Padded to 8 each; cp rank 0 keeps chunks 0 and 3 of each, cp rank 1 chunks 1 and 2.
    assert slices[0, 0].per_layer[0].tolist() == [[1, 2], [3, 4], z, z]  # r0 r1 | pad pad
    assert slices[0, 1].per_layer[0].tolist() == [[2, 5], [6, 1], z, z]  # s0 s1 | pad pad
    assert slices[1, 0].per_layer[0].tolist() == [[5, 6], [7, 0], z, z]  # r2 r3 | last pad
    assert slices[1, 1].per_layer[0].tolist() == [z, z, z, z]  # last pad | pad pad
    assert slices[0, 0].replay_mask.tolist() == [True, True, False, False]
    assert slices[1, 0].replay_mask.tolist() == [True, True, False, False]
    assert not slices[1, 1].replay_mask.any()
    assert slices[0, 0].cu_seqlens.tolist() == [0, 8, 16]
    assert slices[0, 1].positions.tolist() == [8, 9, 14, 15]
    assert slices[0, 0].layer_ids == (3,) and slices[0, 0].num_local_tokens == 4


def test_verl_rank_slice_torch_missing_rows_and_errors() -> None:
    a = np.array([[[1, 2]], [[-1, -1]], [[5, 6]]], dtype=np.int16)  # row 1: nobody shipped it
    with pytest.raises(ShapeError, match=r"sample 0's routing \(rollout 'r-a'\) has no recorded"):
        verl_rank_slice([a], [2], [2], layer_ids=[0], rollout_ids=["r-a"])
    filled = verl_rank_slice([a], [2], [2], layer_ids=[0], missing="fill", as_torch=True)
    assert isinstance(filled.per_layer[0], torch.Tensor)
    assert filled.per_layer[0].dtype == torch.int64 and filled.replay_mask.dtype == torch.bool
    assert filled.per_layer[0].tolist() == [[1, 2], [0, 0], [5, 6], [0, 0]]  # 0, as verl fills
    assert filled.replay_mask.tolist() == [True, True, True, False]
    with pytest.raises(ShapeError, match="needs layer_ids="):
        verl_rank_slice([a[:1]], [1], [1])
    with pytest.raises(ShapeError, match=r"stage layers \[2\] are not among"):
        verl_rank_slice([a[:1]], [1], [1], layer_ids=[0], rank=VerlRank(stage_layers=[2]))
    with pytest.raises(ShapeError, match="routing has 1 rows but the sample has 3 tokens"):
        verl_rank_slice([a[:1]], [2], [1], layer_ids=[0])
    with pytest.raises(ShapeError, match="rank must be a VerlRank"):
        verl_rank_slice([a[:1]], [1], [1], layer_ids=[0], rank={"tp_size": 2})  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match=r"cp_rank must be in \[0, 2\)"):
        VerlRank(cp_size=2, cp_rank=2)
    with pytest.raises(ShapeError, match="min_local_rows goes with cp_layout='contiguous'"):
        VerlRank(min_local_rows=8)
    with pytest.raises(ShapeError, match="cp_layout must be"):
        VerlRank(cp_layout="ring")  # type: ignore[arg-type]
    odd = VerlRank(tp_size=2, cp_layout="contiguous", min_local_rows=5)
    with pytest.raises(ShapeError, match="splits the 5 CP-local tokens over tp_size=2"):
        verl_rank_slice([a[:1]], [1], [1], layer_ids=[0], rank=odd)
    assert VerlRank(stage_layers=[3, 1]).stage_layers == (3, 1)  # a list is kept as a tuple
    assert hash(VerlRank(stage_layers=[3, 1])) == hash(VerlRank(stage_layers=(3, 1)))


# ------------------------------------------------------------------ Megatron-Core


@pytest.fixture(scope="module")
def megatron() -> Any:
    pytest.importorskip("megatron.core")
    from tests.support.megatron_model import _hide_broken_flash_mla

    _hide_broken_flash_mla()
    from megatron.core import utils
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return types.SimpleNamespace(
        cp_split=utils.get_batch_on_this_cp_rank, sp_split=scatter_to_sequence_parallel_region
    )


def megatron_cut(
    m: Any,
    whole: torch.Tensor,
    cu: list[int],
    sp: bool,
    mp: pytest.MonkeyPatch,
    rank: tuple[int, int, int, int],
) -> torch.Tensor:
    """The rank's part of a packed tensor, cut by Megatron-Core: each sequence's CP part
    (``get_batch_on_this_cp_rank``), concatenated, then the SP scatter."""
    tp, tp_rank, cp, cp_rank = rank
    set_rank(mp, tp, tp_rank, cp, cp_rank)
    parts = [
        m.cp_split({"tokens": whole[None, a:b]})["tokens"][0] for a, b in itertools.pairwise(cu)
    ]
    local = torch.cat(parts)
    return m.sp_split(local) if sp else local


MEGATRON_GRID = [
    (tp, cp, pp, vpp, sp)
    for tp, cp, (pp, vpp), sp in itertools.product(
        [1, 2], [1, 2], [(1, None), (2, None), (2, 2)], [True, False]
    )
]


@pytest.mark.parametrize(("tp", "cp", "pp", "vpp", "sp"), MEGATRON_GRID)
def test_megatron_layout_is_the_one_rank_layout_cut_by_megatron(
    megatron: Any,
    tp: int,
    cp: int,
    pp: int,
    vpp: int | None,
    sp: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On every (tp, cp, pp) rank, ``megatron_layout`` with that rank's coordinates and
    stage (all its virtual chunks' MoE layers) equals the one-rank layout with the same
    padding, cut by Megatron-Core's CP and SP splits at the stage's layers."""
    for model, seed in itertools.product(MODELS, range(2)):
        batch = random_batch(model, seed + 30)
        multiple = 2 * tp * cp if cp > 1 else (tp if sp else 1)
        common = dict(seqlens=batch.tokens, layer_ids=model.moe_ids, pad_to_multiple=multiple)
        whole = megatron_layout(batch.routings, **common, as_torch=True)
        cu = whole.cu_seqlens.tolist()
        positions = torch.arange(cu[-1])
        for pp_rank, tp_rank, cp_rank in itertools.product(range(pp), range(tp), range(cp)):
            chunks = [megatron_chunks(pp, vpp)[pp_rank, vp] for vp in range(vpp or 1)]
            stage = [i for layers in chunks for i in layers if model.freq[i]]
            if not stage:
                continue  # a dense stage has no router to replay
            got = megatron_layout(
                batch.routings,
                **common,
                tp_size=tp,
                tp_rank=tp_rank,
                cp_size=cp,
                cp_rank=cp_rank,
                sequence_parallel=sp,
                stage_layers=stage,
            )
            rank = (tp, tp_rank, cp, cp_rank)
            cut = functools.partial(megatron_cut, megatron, cu=cu, sp=sp, mp=monkeypatch, rank=rank)
            assert got.layer_ids == tuple(sorted(stage))
            assert got.cu_seqlens.tolist() == cu
            np.testing.assert_array_equal(got.positions, cut(positions).numpy())
            for layer, mine in zip(got.layer_ids, got.per_layer, strict=True):
                want = cut(whole.per_layer[model.moe_ids.index(layer)])
                np.testing.assert_array_equal(mine, want.numpy())
