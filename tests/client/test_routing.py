"""The logical format: validation errors are specific, objects behave as documented."""

from __future__ import annotations

import numpy as np
import pytest

from r3_client import (
    DuplicateExpertError,
    ExpertIdError,
    FormatError,
    PartialRowError,
    Routing,
    Segment,
    ShapeError,
    canonical_rows,
    token_digest,
    validate_indices,
)
from r3_client._kernels.sortnet import sort_rows
from r3_client.synthetic import synthetic_routing


def test_valid_routing_passes_and_sorts() -> None:
    idx = np.array([[[3, 1], [-1, -1]], [[0, 7], [5, 2]]])
    validate_indices(idx, 8, num_layers=2, topk=2, num_rows=2)
    assert canonical_rows(idx, 8).tolist() == [[[1, 3], [-1, -1]], [[0, 7], [2, 5]]]


@pytest.mark.parametrize(
    ("idx", "err", "msg"),
    [
        ([[[8, 1]]], ExpertIdError, "outside [0, 8)"),
        ([[[-2, 1]]], ExpertIdError, "not -1"),
        ([[[-1, 1]]], PartialRowError, "mixes -1"),
        ([[[4, 4]]], DuplicateExpertError, "expert 4 appears twice"),
        ([[1, 2]], ShapeError, "[tokens, layers, topk]"),
        ([[[1.0, 2.0]]], ShapeError, "integer array"),
    ],
)
def test_invalid_routing_raises_specific_error(idx: list, err: type, msg: str) -> None:
    with pytest.raises(err, match=msg.replace("[", r"\[").replace(")", r"\)")):
        validate_indices(np.array(idx), 8)


def test_shape_mismatch_is_named() -> None:
    idx = np.zeros((3, 2, 1), dtype=np.int32)
    with pytest.raises(ShapeError, match="2 MoE layers, expected 4"):
        validate_indices(idx, 8, num_layers=4)
    with pytest.raises(ShapeError, match="3 token rows, expected 5"):
        validate_indices(idx, 8, num_rows=5)


def test_errors_are_value_errors_and_r3_errors() -> None:
    assert issubclass(DuplicateExpertError, ValueError)
    assert issubclass(DuplicateExpertError, FormatError)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 13, 16, 33, 64])
def test_sorting_network_matches_numpy(k: int) -> None:
    rng = np.random.default_rng(k)
    x = rng.integers(-1, 1000, size=(70_001, k)).astype(np.int16)
    assert np.array_equal(sort_rows(x), np.sort(x, axis=-1))


def test_segment_validation() -> None:
    seg = Segment(0, 10, "qwen3", "v3", token_digest([1, 2, 3]))
    assert Segment.from_dict(seg.to_dict()) == seg
    assert seg.overlaps(9, 12)
    assert not seg.overlaps(10, 12)
    with pytest.raises(FormatError, match="empty or negative"):
        Segment(5, 5)
    with pytest.raises(FormatError, match="64 lowercase hex"):
        Segment(0, 1, tokens_digest="abc")
    with pytest.raises(FormatError, match="unknown fields"):
        Segment.from_dict({"start": 0, "end": 1, "evil": 1})
    with pytest.raises(FormatError, match="must be an int"):
        Segment("0", 1)  # type: ignore[arg-type]


def test_token_digest_is_order_and_value_sensitive() -> None:
    assert token_digest([1, 2, 3]) != token_digest([1, 3, 2])
    assert token_digest(np.array([1, 2, 3], dtype=np.int64)) == token_digest([1, 2, 3])
    with pytest.raises(ShapeError):
        token_digest([-1])


def test_routing_select_by_tokens_and_layers() -> None:
    idx = synthetic_routing(20, 3, 16, 2, seed=1)
    r = Routing.from_array(idx, num_experts=16, layer_ids=[1, 3, 5], start=100)
    assert r.indices.dtype == np.int16
    assert not r.indices.flags.writeable
    sub = r.select(start=105, end=110, layers=[5, 1])
    assert sub.start == 105
    assert sub.layer_ids == (1, 5)  # ascending, as stored
    assert np.array_equal(sub.indices, idx[5:10][:, [0, 2]])
    with pytest.raises(ShapeError, match="outside the held rows"):
        r.select(start=99)
    with pytest.raises(ShapeError, match="not MoE layers"):
        r.select(layers=[2])
    assert r.same_sets(
        Routing.from_array(idx[..., ::-1], num_experts=16, layer_ids=[1, 3, 5], start=100)
    )


def test_routing_rejects_bad_layer_ids() -> None:
    idx = np.zeros((1, 2, 1), dtype=np.int32)
    with pytest.raises(ShapeError, match="strictly increasing"):
        Routing.from_array(idx, num_experts=4, layer_ids=[3, 3])
    with pytest.raises(ShapeError, match="2 MoE layers, expected 3"):
        Routing.from_array(idx, num_experts=4, layer_ids=[0, 1, 2])
