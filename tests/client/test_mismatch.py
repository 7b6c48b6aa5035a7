"""Mismatch metrics: hand-computed values, masks, empty selections, numpy == torch."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from r3_client import Routing, ShapeError
from r3_client.mismatch import (
    extreme_frac,
    k3_kl,
    logp_abs_diff,
    logprob_mismatch,
    routing_disagreement,
)

LN2 = math.log(2)
KEYS = {"k3_kl", "logp_abs_diff", "extreme_frac_tau2", "extreme_frac_tau5", "n_tokens"}


def test_zero_delta_is_zero() -> None:
    lp = np.log(np.array([0.5, 0.25, 0.9]))
    assert logprob_mismatch(lp, lp.copy()) == {
        "k3_kl": 0.0,
        "logp_abs_diff": 0.0,
        "extreme_frac_tau2": 0.0,
        "extreme_frac_tau5": 0.0,
        "n_tokens": 3,
    }


def test_delta_ln2_everywhere() -> None:
    infer = np.zeros(4)
    up = np.full(4, LN2)  # p_train = 2 * p_infer
    # k3 = exp(ln 2) - 1 - ln 2 = 1 - ln 2;  |D| = ln 2;  ratio exactly 2 is not > 2
    assert k3_kl(up, infer) == pytest.approx(1 - LN2, rel=1e-12)
    assert logp_abs_diff(up, infer) == pytest.approx(LN2, rel=1e-12)
    assert extreme_frac(up, infer, tau=2.0) == 0.0
    assert extreme_frac(up, infer, tau=1.99) == 1.0
    # D = -ln 2: k3 = 1/2 - 1 + ln 2 = ln 2 - 1/2
    assert k3_kl(infer, up) == pytest.approx(LN2 - 0.5, rel=1e-12)
    assert extreme_frac(infer, up, tau=2.0) == 0.0
    assert extreme_frac(infer, up + 1e-9, tau=2.0) == 1.0


def test_mixed_values_by_hand() -> None:
    d = np.array([0.0, math.log(3), -math.log(6), 0.1])
    infer = np.log(np.array([0.1, 0.2, 0.6, 0.3]))
    train = infer + d
    # exp(D) - 1 - D per token: 0, 2 - ln 3, 1/6 - 1 + ln 6, e^0.1 - 1.1
    k3 = (0 + (2 - math.log(3)) + (1 / 6 - 1 + math.log(6)) + (math.exp(0.1) - 1.1)) / 4
    got = logprob_mismatch(train, infer)
    assert set(got) == KEYS
    assert got["k3_kl"] == pytest.approx(k3, rel=1e-9)
    assert got["logp_abs_diff"] == pytest.approx((math.log(3) + math.log(6) + 0.1) / 4)
    assert got["extreme_frac_tau2"] == 0.5  # ln 3 and ln 6 exceed ln 2
    assert got["extreme_frac_tau5"] == 0.25  # only ln 6 exceeds ln 5
    assert got["n_tokens"] == 4


def test_mask_selects_tokens() -> None:
    train = np.array([[0.0, 5.0, np.nan], [LN2, -0.0, 0.0]])
    infer = np.zeros((2, 3))
    mask = np.array([[1, 0, 0], [1, 1, 0]])  # int masks work; NaN and 5.0 are masked out
    got = logprob_mismatch(train, infer, mask)
    assert got["n_tokens"] == 3
    assert got["k3_kl"] == pytest.approx((1 - LN2) / 3)
    assert got["logp_abs_diff"] == pytest.approx(LN2 / 3)
    assert extreme_frac(train, infer, mask.astype(bool), tau=1.5) == pytest.approx(1 / 3)


def test_empty_selection_is_zero_without_warnings() -> None:
    lp = np.array([[0.1, 0.2]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = logprob_mismatch(lp, lp * 2, np.zeros((1, 2), dtype=bool))
        assert got == dict.fromkeys(KEYS, 0.0) and got["n_tokens"] == 0
        assert k3_kl(np.zeros(0), np.zeros(0)) == 0.0
        empty = routing_disagreement(np.full((2, 1, 2), -1), np.full((2, 1, 2), -1))
        assert empty == {
            "router_disagreement": 0.0,
            "token_disagreement": 0.0,
            "differing_routers_per_token": 0.0,
            "n_routers": 0,
            "n_tokens": 0,
        }


def test_numpy_and_torch_agree() -> None:
    rng = np.random.default_rng(0)
    infer = np.log(rng.uniform(0.01, 1, size=(4, 16)))
    train = infer + rng.normal(scale=0.7, size=infer.shape)
    mask = rng.random(infer.shape) < 0.7
    want = logprob_mismatch(train, infer, mask)
    t_train = torch.tensor(train, requires_grad=True)
    got = logprob_mismatch(t_train, torch.tensor(infer), torch.tensor(mask))
    assert got == pytest.approx(want, rel=1e-12)
    assert isinstance(got["k3_kl"], float) and isinstance(got["n_tokens"], int)
    # float32 / bfloat16 tensors convert without error (values only approximately equal)
    f32 = k3_kl(torch.tensor(train, dtype=torch.float32), torch.tensor(infer, dtype=torch.float32))
    assert f32 == pytest.approx(k3_kl(train, infer), rel=1e-4)
    bf16 = logp_abs_diff(torch.tensor(train).bfloat16(), torch.tensor(infer).bfloat16())
    assert bf16 == pytest.approx(logp_abs_diff(train, infer), rel=5e-2)


def test_logprob_errors() -> None:
    with pytest.raises(ShapeError, match="logp_infer has"):
        k3_kl(np.zeros(3), np.zeros(4))
    with pytest.raises(ShapeError, match=r"mask has shape \(2,\), expected \(3,\)"):
        k3_kl(np.zeros(3), np.zeros(3), np.ones(2))
    with pytest.raises(ValueError, match="positive ratio"):
        extreme_frac(np.zeros(3), np.zeros(3), tau=0.0)


# --------------------------------------------------------------------------- routing

N = -1
# T=4 tokens, L=2 layers, K=2
A = np.array(
    [
        [[0, 1], [2, 3]],
        [[4, 5], [N, N]],
        [[6, 7], [0, 2]],
        [[N, N], [N, N]],
    ]
)
B = np.array(
    [
        [[1, 0], [3, 2]],  # same sets, other order: no difference
        [[4, 6], [1, 2]],  # layer 0 differs; layer 1 not compared (A has -1)
        [[N, N], [0, 3]],  # layer 0 not compared (B has -1); layer 1 differs
        [[1, 2], [3, 4]],  # not compared at all (A has -1): not a token
    ]
)


def test_disagreement_by_hand() -> None:
    got = routing_disagreement(A, B)
    # compared routers: t0 x2, t1 x1, t2 x1 = 4; differing: (t1, l0), (t2, l1) = 2
    assert got == {
        "router_disagreement": 0.5,
        "token_disagreement": pytest.approx(2 / 3),
        "differing_routers_per_token": pytest.approx(2 / 3),
        "n_routers": 4,
        "n_tokens": 3,
    }
    assert routing_disagreement(B, A) == got


def test_disagreement_mask() -> None:
    got = routing_disagreement(A, B, mask=np.array([1, 0, 1, 1]))
    # t1 dropped: compared t0 x2, t2 x1 = 3; differing (t2, l1) = 1; tokens t0, t2
    assert got["router_disagreement"] == pytest.approx(1 / 3)
    assert got["token_disagreement"] == 0.5
    assert got["differing_routers_per_token"] == 0.5
    assert (got["n_routers"], got["n_tokens"]) == (3, 2)


def test_differing_routers_per_token_counts_layers() -> None:
    a = np.array([[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4, 5]]])
    b = np.array([[[0, 2], [2, 4], [5, 6]], [[1, 0], [3, 2], [5, 4]]])
    got = routing_disagreement(a, b)
    assert got["router_disagreement"] == 0.5  # 3 of 6 routers
    assert got["token_disagreement"] == 0.5  # token 0 only
    assert got["differing_routers_per_token"] == 1.5  # (3 + 0) / 2 tokens


def test_disagreement_identical_and_reordered_is_zero() -> None:
    rng = np.random.default_rng(1)
    a = np.stack([rng.permutation(32)[:8] for _ in range(40)]).reshape(10, 4, 8)
    b = rng.permuted(a, axis=-1)
    got = routing_disagreement(a, b)
    assert got["router_disagreement"] == 0.0 and got["n_routers"] == 40


def test_disagreement_routing_objects_torch_and_batches() -> None:
    ra = Routing.from_array(A, num_experts=8, layer_ids=[1, 3])
    rb = Routing.from_array(B, num_experts=8, layer_ids=[1, 3])
    want = routing_disagreement(A, B)
    assert routing_disagreement(ra, rb) == want
    assert routing_disagreement(torch.from_numpy(A), torch.from_numpy(B)) == want
    # a padded [batch, seq, L, K] layout works too: leading axes are token axes
    batch = routing_disagreement(np.stack([A, A]), np.stack([B, A]), mask=np.ones((2, 4)))
    assert (batch["n_routers"], batch["n_tokens"]) == (4 + 5, 3 + 3)
    assert batch["router_disagreement"] == pytest.approx(2 / 9)


@pytest.mark.parametrize(
    ("a", "b", "kwargs", "msg"),
    [
        (A, B[:3], {}, "recordings differ in shape"),
        (A[0], B[0], {}, r"\[tokens, layers, topk\]"),
        (A.astype(float), B, {}, "integer expert ids"),
        (A, B, {"mask": np.ones(3)}, r"mask has shape \(3,\), expected \(4,\)"),
    ],
)
def test_disagreement_errors(a: Any, b: Any, kwargs: dict[str, Any], msg: str) -> None:
    with pytest.raises(ShapeError, match=msg):
        routing_disagreement(a, b, **kwargs)


def test_disagreement_routing_layer_mismatch() -> None:
    ra = Routing.from_array(A, num_experts=8, layer_ids=[1, 3])
    rb = Routing.from_array(B, num_experts=8, layer_ids=[1, 4])
    with pytest.raises(ShapeError, match="covers MoE layers"):
        routing_disagreement(ra, rb)
