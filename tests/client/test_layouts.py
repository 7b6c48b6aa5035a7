"""Trainer layouts: hand-computed cases, -1 everywhere a row is missing, and CP/SP/PP slicing
checked against an independent reference written with plain lists."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from r3_client import Routing, ShapeError
from r3_client.layouts import hf_layout, megatron_layout, miles_layout, slime_layout, verl_layout

N = -1  # "no route", for readable literals


def rows(*sets: list[int]) -> npt.NDArray[np.int16]:
    """``[len(sets), 1, K]`` routing with one MoE layer."""
    return np.array([[s] for s in sets], dtype=np.int16)


def assert_rows_are_sets(arr: npt.NDArray[Any], topk: int) -> None:
    """Every row is all -1, or valid expert ids without a repeat (no 0-padding)."""
    flat = np.sort(np.asarray(arr).reshape(-1, topk), axis=1)
    empty = (flat == -1).all(axis=1)
    real = ~empty
    assert (flat[real] >= 0).all(), "a row mixes -1 with expert ids"
    assert (np.diff(flat[real], axis=1) != 0).all(), "a row repeats an expert id"


# --------------------------------------------------------------------------- verl


Z = 0  # verl's fill at padding and the last token (verl 0.9.1 fills 0; it crashes on -1)


def test_verl_hand_computed() -> None:
    # sample 0: P=3, R=2 (T=5, rows r0..r3); sample 1: P=1, R=3 (T=4, rows r0..r2)
    s0 = rows([0, 1], [2, 3], [4, 5], [6, 7])
    s1 = rows([1, 0], [3, 2], [5, 4])
    out = verl_layout([s0, s1], [3, 1], [2, 3])
    assert out.dtype == np.int16 and out.shape == (2, 6, 1, 2)
    expected = [
        # prompt_len = 3        | response_len = 3
        [[0, 1], [2, 3], [4, 5], [6, 7], [Z, Z], [Z, Z]],
        [[Z, Z], [Z, Z], [1, 0], [3, 2], [5, 4], [Z, Z]],
    ]
    assert out[:, :, 0].tolist() == expected


def test_verl_explicit_lengths_and_empty_response() -> None:
    s0 = rows([3, 4], [5, 6])  # P=3, R=0: only prompt tokens, the last one has no row
    s1 = rows([7, 0])  # P=1, R=1
    out = verl_layout([s0, s1], [3, 1], [0, 1], prompt_len=4, response_len=2)
    expected = [
        [[Z, Z], [3, 4], [5, 6], [Z, Z], [Z, Z], [Z, Z]],
        [[Z, Z], [Z, Z], [Z, Z], [7, 0], [Z, Z], [Z, Z]],
    ]
    assert out[:, :, 0].tolist() == expected


def test_verl_accepts_routing_objects_and_keeps_layers() -> None:
    rng = np.random.default_rng(0)
    arr = np.stack([rng.permutation(16)[:4].reshape(2, 2) for _ in range(6)]).astype(np.int16)
    r = Routing.from_array(arr, num_experts=16, layer_ids=[1, 5])
    out = verl_layout([r], [4], [3], prompt_len=5, response_len=4)
    assert out.shape == (1, 9, 2, 2)
    np.testing.assert_array_equal(out[0, 1:5], arr[:4])  # prompt tokens 0..3 at columns 1..4
    np.testing.assert_array_equal(out[0, 5:7], arr[4:6])  # response tokens 4, 5
    assert (out[0, [0, 7, 8]] == 0).all()  # left pad, last token (6), right pad
    assert (out >= 0).all()  # nothing verl's gather would index out of bounds


def test_verl_scatters_moe_rows_to_absolute_layers() -> None:
    """Dense first layers (DeepSeek-V3 style): verl indexes layers by layer_number - 1."""
    rng = np.random.default_rng(1)
    arr = np.stack([rng.permutation(16)[:4].reshape(2, 2) for _ in range(4)]).astype(np.int16)
    r = Routing.from_array(arr, num_experts=16, layer_ids=[2, 4])
    out = verl_layout([r], [3], [2], num_layers=5)
    assert out.shape == (1, 5, 5, 2)
    np.testing.assert_array_equal(out[0, :4, 2], arr[:, 0])
    np.testing.assert_array_equal(out[0, :4, 4], arr[:, 1])
    assert (out[0, :, [0, 1, 3]] == 0).all()  # dense layers: 0, as upstream SGLang returns
    plain = verl_layout([arr], [3], [2], num_layers=5, layer_ids=[2, 4])
    np.testing.assert_array_equal(plain, out)
    with pytest.raises(ShapeError, match="layer_ids= with plain arrays"):
        verl_layout([arr], [3], [2], num_layers=5)
    with pytest.raises(ShapeError, match="not below num_layers=4"):
        verl_layout([r], [3], [2], num_layers=4)
    with pytest.raises(ShapeError, match=r"routing covers MoE layers \[2, 4\]"):
        verl_layout([r], [3], [2], num_layers=5, layer_ids=[1, 4])


def test_layouts_refuse_rows_nobody_shipped_unless_told_to_fill() -> None:
    """decode_rollout marks rows no segment covered with -1; verl and slime crash on them,
    miles replays 0..K-1 silently: refused by default."""
    gap = rows([0, 1], [N, N], [N, N], [6, 7])
    with pytest.raises(
        ShapeError, match=r"sample 0's routing has no recorded route for token rows \[1, 3\)"
    ):
        verl_layout([gap], [2], [3])
    with pytest.raises(ShapeError, match="no recorded route"):
        slime_layout(gap, 5)
    filled = verl_layout([gap], [2], [3], missing="fill")
    assert filled[0, :, 0].tolist() == [[0, 1], [0, 0], [0, 0], [6, 7], [0, 0]]
    assert slime_layout(gap, 5, missing="fill")[:, 0].tolist() == [[0, 1], [0, 1], [0, 1], [6, 7]]
    with pytest.raises(ShapeError, match="mixing -1"):
        verl_layout([rows([0, 1], [N, 3], [4, 5])], [2], [2], missing="fill")


@pytest.mark.parametrize(
    ("prompt_lens", "response_lens", "kwargs", "msg"),
    [
        ([3], [2], {}, "sample 0: routing has 3 rows but the sample has 5 tokens"),
        ([3], [1], {"prompt_len": 2}, "3 prompt tokens, more than prompt_len=2"),
        ([3], [1], {"response_len": 0}, "1 response tokens, more than response_len=0"),
        ([3, 1], [1], {}, "one length per sample (1)"),
        ([-1], [5], {}, "non-negative"),
    ],
)
def test_verl_errors(
    prompt_lens: list[int], response_lens: list[int], kwargs: dict[str, int], msg: str
) -> None:
    with pytest.raises(ShapeError, match=re.escape(msg)):
        verl_layout([rows([0, 1], [2, 3], [4, 5])], prompt_lens, response_lens, **kwargs)


def test_verl_row_count_message_names_expected_rows() -> None:
    with pytest.raises(ShapeError, match=r"9 rows but the sample has 12 tokens.*expected 11"):
        verl_layout([np.tile(rows([0, 1]), (9, 1, 1))], [4], [8])


def test_layouts_reject_bad_routing() -> None:
    good = rows([0, 1], [2, 3])
    with pytest.raises(ShapeError, match=r"\[layers, topk\] = \[1, 3\]"):
        verl_layout([good, np.zeros((2, 1, 3), dtype=np.int16)], [2, 2], [1, 1])
    with pytest.raises(ShapeError, match="expert id -2"):
        verl_layout([np.array([[[-2, 1]]])], [1], [1])
    with pytest.raises(ShapeError, match="integer expert ids"):
        verl_layout([good.astype(np.float32)], [2], [1])
    with pytest.raises(ShapeError, match="list of rollouts"):
        verl_layout(good, [3], [0])  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="at least one sample"):
        verl_layout([], [], [])
    sliced = Routing.from_array(good, num_experts=4, layer_ids=[0], start=3)
    with pytest.raises(ShapeError, match="starts at token 3"):
        verl_layout([sliced], [2], [1])


# --------------------------------------------------------------------------- slime


def test_slime_hand_computed() -> None:
    r = rows([0, 1], [2, 3], [4, 5])
    plain = slime_layout(r, 4)
    assert plain.shape == (3, 1, 2) and plain[:, 0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert plain.dtype == np.int16
    plain[0, 0, 0] = 9
    assert r[0, 0, 0] == 0  # a copy, never the caller's array
    assert slime_layout(np.zeros((0, 1, 2), dtype=np.int32), 1).shape == (0, 1, 2)


def test_slime_and_miles_leave_the_last_row_to_the_trainer() -> None:
    """Both assert rows == len(tokens) - 1 and add the last row themselves; the old
    pad_last=True (documented as miles' convention) gave len(tokens) rows."""
    r = rows([0, 1], [2, 3], [4, 5])
    with pytest.raises(TypeError):
        slime_layout(r, 4, pad_last=True)  # type: ignore[call-arg]
    for layout in (slime_layout, miles_layout):
        assert layout(r, 4).shape[0] == 4 - 1


def test_miles_layout_is_int32_on_the_absolute_layer_axis() -> None:
    arr = np.stack([np.array([[1, 2], [3, 4]]) + t for t in range(3)]).astype(np.int16)
    out = miles_layout(arr, 4, num_layers=4, layer_ids=[1, 3])
    assert out.dtype == np.int32 and out.shape == (3, 4, 2)
    np.testing.assert_array_equal(out[:, 1], arr[:, 0])
    np.testing.assert_array_equal(out[:, 3], arr[:, 1])
    assert (out[:, [0, 2]] == 0).all()


def test_slime_errors() -> None:
    r = np.tile(np.array([[[0, 1]]], dtype=np.int16), (9, 1, 1))
    with pytest.raises(ShapeError, match="9 rows but the sample has 12 tokens; expected 11"):
        slime_layout(r, 12)
    with pytest.raises(ShapeError, match="expected 0 rows"):
        slime_layout(r, 0)
    with pytest.raises(ShapeError, match=r"\[tokens-1, layers, topk\]"):
        slime_layout(r[:, 0], 10)


# --------------------------------------------------------------------------- HF


def test_hf_hand_computed_any_padding() -> None:
    left = rows([0, 1], [2, 3], [4, 5])  # 4 tokens
    right = rows([6, 7], [1, 2])  # 3 tokens
    holes = rows([3, 5], [6, 0], [7, 4])  # 4 tokens, padding in between
    mask = np.array(
        [
            [0, 0, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 0],
            [1, 0, 1, 1, 0, 1],
        ]
    )
    out = hf_layout([left, right, holes], mask)
    assert out.dtype == np.int16 and out.shape == (3, 6, 1, 2)
    expected = [
        [[N, N], [N, N], [0, 1], [2, 3], [4, 5], [N, N]],
        [[6, 7], [1, 2], [N, N], [N, N], [N, N], [N, N]],
        [[3, 5], [N, N], [6, 0], [7, 4], [N, N], [N, N]],
    ]
    assert out[:, :, 0].tolist() == expected
    assert_rows_are_sets(out, 2)


def test_hf_torch_mask_and_torch_output() -> None:
    r = rows([0, 1], [2, 3])
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    out = hf_layout([r], mask, as_torch=True, dtype=torch.int64)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    assert out[0, :, 0].tolist() == [[N, N], [0, 1], [2, 3], [N, N]]
    assert hf_layout([r], mask, as_torch=True).dtype == torch.int16
    assert hf_layout([r], mask.numpy(), dtype=np.int64).dtype == np.int64


def test_hf_errors() -> None:
    r = rows([0, 1], [2, 3])
    with pytest.raises(ShapeError, match=r"2 rows but the sample has 4 tokens.*expected 3"):
        hf_layout([r], np.array([[1, 1, 1, 1]]))
    with pytest.raises(ShapeError, match="2 rows but the sample has 2 tokens"):
        hf_layout([r], np.array([[1, 0, 0, 1]]))
    with pytest.raises(ShapeError, match="sample 1 has no tokens"):
        hf_layout([r, r], np.array([[1, 1, 1], [0, 0, 0]]))
    with pytest.raises(ShapeError, match="2 rows but 1 routings"):
        hf_layout([r], np.ones((2, 3)))
    with pytest.raises(ShapeError, match=r"\[batch, seq_len\]"):
        hf_layout([r], np.ones(3))


# --------------------------------------------------------------------------- Megatron


def two_layer(*sets: tuple[list[int], list[int]]) -> npt.NDArray[np.int16]:
    return np.array(sets, dtype=np.int16)


A = two_layer(([0, 1], [4, 5]), ([2, 3], [6, 7]), ([1, 2], [5, 6]), ([3, 0], [7, 4]))  # T=5
B = two_layer(([7, 6], [3, 2]), ([5, 4], [1, 0]))  # T=3
AB = [5, 3]  # the trainer's token counts of [A, B]


def test_megatron_packing_hand_computed() -> None:
    batch = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], pad_to_multiple=4)
    assert batch.layer_ids == (1, 3)
    assert batch.cu_seqlens.tolist() == [0, 8, 12] and batch.seqlens.tolist() == [5, 3]
    assert [a.dtype for a in batch.per_layer] == [np.int64, np.int64]
    # a0 a1 a2 a3 (a4 last) pad pad pad | b0 b1 (b2 last) pad
    assert batch.per_layer[0].tolist() == [
        [0, 1], [2, 3], [1, 2], [3, 0], [N, N], [N, N], [N, N], [N, N],
        [7, 6], [5, 4], [N, N], [N, N],
    ]  # fmt: skip
    assert batch.per_layer[1].tolist() == [
        [4, 5], [6, 7], [5, 6], [7, 4], [N, N], [N, N], [N, N], [N, N],
        [3, 2], [1, 0], [N, N], [N, N],
    ]  # fmt: skip
    assert batch.num_local_tokens == 12


def test_megatron_default_is_unpadded_thd() -> None:
    batch = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3])
    assert batch.cu_seqlens.tolist() == [0, 5, 8]
    assert batch.per_layer[0][:, 0].tolist() == [0, 2, 1, 3, N, 7, 5, N]


def test_megatron_context_parallel_hand_computed() -> None:
    # cp=2 pads to 2*tp*cp = 4: A -> 8 (chunks of 2), B -> 4 (chunks of 1).
    r0 = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], cp_size=2, cp_rank=0)
    r1 = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], cp_size=2, cp_rank=1)
    assert r0.cu_seqlens.tolist() == [0, 8, 12]
    # rank 0: A chunks 0 and 3, B chunks 0 and 3; rank 1: chunks 1 and 2 of each.
    assert r0.per_layer[0].tolist() == [[0, 1], [2, 3], [N, N], [N, N], [7, 6], [N, N]]
    assert r1.per_layer[0].tolist() == [[1, 2], [3, 0], [N, N], [N, N], [5, 4], [N, N]]
    assert r0.positions.tolist() == [0, 1, 6, 7, 8, 11]
    assert r1.positions.tolist() == [2, 3, 4, 5, 9, 10]


def test_megatron_sequence_parallel_hand_computed() -> None:
    # tp=2 + SP pads to 2: A -> 6, B -> 4; 10 tokens split 5 | 5.
    t0 = megatron_layout(
        [A, B], seqlens=AB, layer_ids=[1, 3], tp_size=2, tp_rank=0, sequence_parallel=True
    )
    t1 = megatron_layout(
        [A, B], seqlens=AB, layer_ids=[1, 3], tp_size=2, tp_rank=1, sequence_parallel=True
    )
    assert t0.cu_seqlens.tolist() == [0, 6, 10]
    assert t0.per_layer[1].tolist() == [[4, 5], [6, 7], [5, 6], [7, 4], [N, N]]
    assert t1.per_layer[1].tolist() == [[N, N], [3, 2], [1, 0], [N, N], [N, N]]
    # Without SP every TP rank's router sees every token.
    no_sp = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], tp_size=2, tp_rank=1)
    assert no_sp.num_local_tokens == 8


def test_megatron_pipeline_stage_layers() -> None:
    full = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3])
    stage = megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], stage_layers=[3])
    assert stage.layer_ids == (3,) and len(stage.per_layer) == 1
    np.testing.assert_array_equal(stage.per_layer[0], full.per_layer[1])
    with pytest.raises(ShapeError, match=r"stage layers \[2\] are not among"):
        megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], stage_layers=[2])
    with pytest.raises(ShapeError, match="without repeats"):
        megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], stage_layers=[3, 3])


def test_megatron_routing_objects_and_torch() -> None:
    ra = Routing.from_array(A, num_experts=8, layer_ids=[1, 3])
    rb = Routing.from_array(B, num_experts=8, layer_ids=[1, 3])
    batch = megatron_layout([ra, rb], seqlens=AB, as_torch=True)  # layer ids from the Routings
    assert batch.layer_ids == (1, 3)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in batch.per_layer)
    assert batch.per_layer[0][:, 0].tolist() == [0, 2, 1, 3, N, 7, 5, N]
    with pytest.raises(ShapeError, match="covers MoE layers"):
        megatron_layout([ra], seqlens=[5], layer_ids=[1, 4])


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({}, "needs layer_ids="),
        ({"layer_ids": [1, 3, 5]}, "2 MoE layers but layer_ids names 3"),
        ({"layer_ids": [1, 3], "tp_size": 2, "tp_rank": 2}, r"tp_rank must be in \[0, 2\)"),
        ({"layer_ids": [1, 3], "cp_size": 0}, "cp_size must be >= 1"),
        ({"layer_ids": [1, 3], "cp_size": 2, "pad_to_multiple": 3}, "divisible by 2\\*cp_size=4"),
        (
            {"layer_ids": [1, 3], "tp_size": 2, "sequence_parallel": True, "pad_to_multiple": 1},
            "11 CP-local tokens over tp_size=2",
        ),
        ({"layer_ids": [1, 3], "pad_to_multiple": 0}, "pad_to_multiple must be >= 1"),
    ],
)
def test_megatron_errors(kwargs: dict[str, Any], msg: str) -> None:
    with pytest.raises(ShapeError, match=msg):
        megatron_layout([A, B, B], seqlens=[5, 3, 3], **kwargs)


def test_megatron_refuses_rows_nobody_shipped_unless_told_to_fill() -> None:
    """A gap between stored segments decodes as -1 rows inside a sample's T-1 rows; the driver
    would replay them as experts 0..K-1 with no error, so the layout refuses them by default
    (as verl/slime/miles layouts do).  The last-token and padding rows it adds are not gaps."""
    gap = two_layer(([0, 1], [4, 5]), ([N, N], [N, N]), ([N, N], [N, N]), ([3, 0], [7, 4]))
    with pytest.raises(
        ShapeError,
        match=r"sample 1's routing \(rollout 'r-gap'\) has no recorded route for token rows "
        r"\[1, 3\)",
    ):
        megatron_layout([B, gap], seqlens=[3, 5], layer_ids=[1, 3], rollout_ids=["r-b", "r-gap"])
    with pytest.raises(ShapeError, match=r"sample 1's routing has no recorded route"):
        megatron_layout([B, gap], seqlens=[3, 5], layer_ids=[1, 3])
    filled = megatron_layout(
        [B, gap], seqlens=[3, 5], layer_ids=[1, 3], missing="fill", pad_to_multiple=4
    )
    # -1 stays -1 (the driver replays it as 0..K-1, miles' rule); padding and last rows too
    assert filled.per_layer[0][:, 0].tolist() == [7, 5, N, N, 0, N, N, 3, N, N, N, N]
    mixed = two_layer(([0, 1], [4, 5]), ([N, 2], [N, N]))
    with pytest.raises(ShapeError, match="mixing -1"):
        megatron_layout([mixed], seqlens=[3], layer_ids=[1, 3], missing="fill")
    with pytest.raises(ShapeError, match="missing must be"):
        megatron_layout([B], seqlens=[3], layer_ids=[1, 3], missing="skip")  # type: ignore[arg-type]


def test_megatron_checks_every_samples_length_against_the_trainers() -> None:
    """A partial rollout (fewer rows) used to shift every later sample silently: the layout
    took T_i = rows + 1.  The trainer's own token counts are required and checked."""
    partial = A[:2]  # 2 rows: the rollout stopped 2 tokens short of the trainer's 5
    with pytest.raises(TypeError, match="seqlens"):
        megatron_layout([A, B], layer_ids=[1, 3])  # type: ignore[call-arg]
    with pytest.raises(
        ShapeError,
        match=re.escape(
            "sample 0 (rollout 'r-a'): routing has 2 rows but the sample has 5 tokens "
            "(the trainer's seqlens); expected 4 rows"
        ),
    ):
        megatron_layout([partial, B], seqlens=AB, layer_ids=[1, 3], rollout_ids=["r-a", "r-b"])
    with pytest.raises(ShapeError, match=r"sample 1: routing has 4 rows .* 3 tokens"):
        megatron_layout([A, A], seqlens=AB, layer_ids=[1, 3])
    with pytest.raises(ShapeError, match=re.escape("seqlens must list one length per sample (2)")):
        megatron_layout([A, B], seqlens=[5], layer_ids=[1, 3])
    with pytest.raises(ShapeError, match=re.escape("rollout_ids must name each sample (2)")):
        megatron_layout([A, B], seqlens=AB, layer_ids=[1, 3], rollout_ids=["r-a"])
    batch = megatron_layout(
        [A, B], seqlens=torch.tensor(AB), layer_ids=[1, 3], rollout_ids=("r-a", "r-b")
    )
    assert batch.seqlens.tolist() == AB and batch.rollout_ids == ("r-a", "r-b")


def test_single_sample_layouts_name_the_rollout_not_sample_0() -> None:
    """slime/miles take one sample: "sample 0's routing" named a sample that is not the
    trainer's sample 0; they say "the routing" (and its rollout id when given)."""
    gap = rows([0, 1], [N, N], [6, 7])
    for layout in (slime_layout, miles_layout):
        with pytest.raises(ShapeError, match=r"^the routing has no recorded route") as info:
            layout(gap, 4)
        assert "sample 0" not in str(info.value)
        with pytest.raises(ShapeError, match=r"^the routing \(rollout 'r-7'\) has no recorded"):
            layout(gap, 4, rollout_id="r-7")
        with pytest.raises(ShapeError, match=r"^the sample \(rollout 'r-7'\): routing has 3 rows"):
            layout(gap, 9, rollout_id="r-7")


def test_verl_names_the_rollout_when_given() -> None:
    gap = rows([0, 1], [N, N], [N, N], [6, 7])
    ok = rows([0, 1], [2, 3])
    with pytest.raises(ShapeError, match=r"sample 1's routing \(rollout 'r-9'\) has no recorded"):
        verl_layout([ok, gap], [2, 2], [1, 3], rollout_ids=["r-8", "r-9"])
    with pytest.raises(ShapeError, match=r"sample 0 \(rollout 'r-8'\): routing has 2 rows"):
        verl_layout([ok, gap], [2, 2], [2, 3], rollout_ids=["r-8", "r-9"])


# ---- independent reference for CP/SP: positions as plain Python lists, then indexing


def reference_positions(
    padded: list[int], cp_size: int, cp_rank: int, tp_size: int, tp_rank: int, sp: bool
) -> list[int]:
    local: list[int] = []
    offset = 0
    for length in padded:
        seq = list(range(offset, offset + length))
        offset += length
        if cp_size == 1:
            local += seq
            continue
        c = length // (2 * cp_size)
        chunks = [seq[j * c : (j + 1) * c] for j in range(2 * cp_size)]
        local += chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]
    if sp:
        part = len(local) // tp_size
        local = local[tp_rank * part : (tp_rank + 1) * part]
    return local


def unique_routing(lengths: list[int], num_layers: int) -> list[npt.NDArray[np.int16]]:
    """Rollouts whose every (sample, token, layer) row is a distinct set {2c, 2c+1}."""
    out, code = [], 0
    for t in lengths:
        codes = code + np.arange((t - 1) * num_layers).reshape(t - 1, num_layers)
        code += (t - 1) * num_layers
        out.append(np.stack([2 * codes, 2 * codes + 1], axis=-1).astype(np.int16))
    return out


GRID = [
    (tp, cp, sp, lengths)
    for tp, cp, sp in itertools.product([1, 2, 4], [1, 2, 3], [False, True])
    for lengths in ([1], [5, 3], [7, 1, 12], [16, 9, 2, 33])
]


@pytest.mark.parametrize(("tp", "cp", "sp", "lengths"), GRID)
def test_megatron_matches_reference(tp: int, cp: int, sp: bool, lengths: list[int]) -> None:
    layer_ids = [0, 2, 7]
    routing = unique_routing(lengths, len(layer_ids))
    multiple = 2 * tp * cp if cp > 1 else (tp if sp else 1)
    padded = [-(-t // multiple) * multiple for t in lengths]
    packed: list[list[list[int]]] = []  # [token][layer] -> row, built token by token
    for arr, length in zip(routing, padded, strict=True):
        for t in range(length):
            packed.append(arr[t].tolist() if t < arr.shape[0] else [[N, N]] * len(layer_ids))
    total = len(packed)

    seen: list[int] = []
    seen_rows: list[tuple[int, ...]] = []
    for cp_rank, tp_rank in itertools.product(range(cp), range(tp)):
        batch = megatron_layout(
            routing,
            seqlens=lengths,
            layer_ids=layer_ids,
            tp_size=tp,
            tp_rank=tp_rank,
            cp_size=cp,
            cp_rank=cp_rank,
            sequence_parallel=sp,
            stage_layers=[2, 7],
        )
        want = reference_positions(padded, cp, cp_rank, tp, tp_rank, sp)
        assert batch.cu_seqlens.tolist() == np.cumsum([0, *padded]).tolist()
        assert batch.positions.tolist() == want
        for j, layer in enumerate((1, 2)):  # stage layers 2, 7 are positions 1, 2
            assert batch.per_layer[j].shape == (len(want), 2)
            assert batch.per_layer[j].tolist() == [packed[p][layer] for p in want]
            assert_rows_are_sets(batch.per_layer[j], 2)
        if sp or tp_rank == 0:  # without SP the TP ranks hold identical copies
            seen += want
            seen_rows += [tuple(r) for r in np.concatenate(batch.per_layer, axis=1).tolist()]
    assert sorted(seen) == list(range(total))  # every padded token on exactly one rank
    real = [r for r in seen_rows if r[0] != N]
    n_real = sum(t - 1 for t in lengths)
    assert len(real) == len(set(real)) == n_real  # every recorded row exactly once
