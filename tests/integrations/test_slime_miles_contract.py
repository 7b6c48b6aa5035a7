"""Contract tests: our slime / miles layouts against what their code asserts and consumes.

Pinned sources (read with ``git show <commit>:<path>``; nothing of theirs is copied here,
each check below is restated minimally from the cited lines):

* slime  -- THUDM/slime     @ 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21)
* miles  -- radixark/miles  @ 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21)

Both hold ``Sample.rollout_routed_experts`` as ``[len(tokens) - 1, args.num_layers, K]``
(absolute decoder layers, dense layers present, MTP layers absent), add the last
token's row themselves, then pack samples back to back (thd), zigzag-slice for context
parallelism and take column ``layer_id`` for the router of absolute layer ``layer_id``.
docs/integrations.md (sections ``## slime`` / ``## miles``) states the contract; its
recipes, built on ``r3_client.integrations``, run in test_glue.py against a real cache.
"""

from __future__ import annotations

import base64
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from r3_client import Routing, ShapeError
from r3_client.layouts import miles_layout, slime_layout
from r3_client.synthetic import synthetic_routing

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"

E, K = 8, 2
T = 11  # tokens per sample; routing rows = T - 1


@dataclasses.dataclass(frozen=True)
class Model:
    """A Megatron model shape: ``num_layers`` decoder layers, MoE at ``moe_ids``."""

    name: str
    num_layers: int
    moe_ids: tuple[int, ...]

    @property
    def moe_layer_freq(self) -> list[int]:
        """Megatron's list form of ``moe_layer_freq`` (1 = MoE layer)."""
        return [int(i in self.moe_ids) for i in range(self.num_layers)]


ALL_MOE = Model("all-moe", 4, (0, 1, 2, 3))
DENSE_FIRST = Model("dense-first", 6, (2, 3, 4, 5))  # DeepSeek-V3 / GLM-4.5 / Kimi-K2 style
INTERLEAVED = Model("interleaved", 6, (1, 3, 5))
MODELS = [ALL_MOE, DENSE_FIRST, INTERLEAVED]


def routing_for(model: Model, rows: int = T - 1, seed: int = 0) -> Routing:
    """A rollout's routing in our format: MoE layers only, with their absolute ids."""
    arr = synthetic_routing(rows, len(model.moe_ids), E, K, seed=seed)
    return Routing.from_array(arr, num_experts=E, layer_ids=model.moe_ids)


def moe_rows(routing: Routing, layer_id: int) -> npt.NDArray[Any]:
    """Our rows for absolute layer ``layer_id``."""
    return np.array(routing.indices[:, routing.layer_ids.index(layer_id)])


def stages(num_layers: int, pp: int) -> list[range]:
    """Each pipeline stage's absolute layers (Megatron's even split: offset, count)."""
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


# ------------------------------------------------------------------------------------------
# slime @ 624b824, restated


def slime_decode_meta_info(
    b64: str, num_tokens: int, num_layers: int, topk: int, start_len: int = 0
) -> torch.Tensor:
    """What slime builds from SGLang's ``meta_info["routed_experts"]``.

    slime/utils/misc.py:25-30 (base64 -> int32); slime/utils/types.py:356-375 (element
    count must be ``(len(tokens) - 1 - start_len) * args.num_layers * args.moe_router_topk``,
    then reshaped to ``[rows, args.num_layers, topk]``).
    """
    flat = torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.int32)
    rows = max(0, num_tokens - 1 - start_len)
    if flat.numel() != rows * num_layers * topk:
        raise ValueError("SGLang routed_experts element count does not match sample tokens")
    return flat.reshape(rows, num_layers, topk)


def slime_validate_for_replay(
    experts: torch.Tensor, num_layers: int, topk: int, moe_layer_freq: Sequence[int]
) -> None:
    """slime/observability/rollout_data_utils.py:55-89, called at slime/ray/rollout.py:734-738.

    ``[*, args.num_layers, args.moe_router_topk]``, at least one row, and (top-k > 1) no
    MoE layer (per the list form of ``moe_layer_freq``) may be all zero.
    """
    if experts.ndim != 3 or tuple(experts.shape[1:]) != (num_layers, topk):
        raise ValueError(f"Invalid rollout routed-experts shape for R3: {tuple(experts.shape)}")
    if experts.shape[0] == 0:
        raise ValueError("R3 sample has no routed-experts rows")
    if topk > 1:
        zero = [i for i, f in enumerate(moe_layer_freq) if f and not experts[:, i].count_nonzero()]
        if zero:
            raise ValueError(f"R3 routed-experts capture is all zero for MoE layers {zero}")


def zigzag(x: torch.Tensor, cp_size: int, cp_rank: int, pad: Any) -> torch.Tensor:
    """Zigzag context-parallel slice of one sample's first axis.

    slime/backends/megatron_utils/cp_utils.py:196-209 and
    miles/backends/training_utils/cp_utils.py:290-301: pad to ``2 * cp * chunk``, keep
    chunks ``rank`` and ``2 * cp - 1 - rank``.  ``pad(x, n)`` appends ``n`` rows.
    """
    if cp_size == 1:
        return x
    chunk = (len(x) + 2 * cp_size - 1) // (2 * cp_size)
    x = pad(x, 2 * cp_size * chunk - len(x))
    first = x[chunk * cp_rank : chunk * (cp_rank + 1)]
    second = x[chunk * (2 * cp_size - cp_rank - 1) : chunk * (2 * cp_size - cp_rank)]
    return torch.cat([first, second])


def slime_pad(experts: torch.Tensor, n: int, num_experts: int) -> torch.Tensor:
    """slime/backends/megatron_utils/cp_utils.py:239-251: ``n`` rows of ``arange % E``."""
    if n == 0:
        return experts
    _, nl, k = experts.shape
    fill = torch.arange(n * nl * k, dtype=experts.dtype).reshape(n, nl, k) % num_experts
    return torch.cat([experts, fill])


def slime_prepare(
    experts: Sequence[torch.Tensor],
    tokens: Sequence[torch.Tensor],
    num_experts: int,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_size: int = 1,
) -> torch.Tensor:
    """prepare_routed_experts_for_routing_replay, cp_utils.py:254-297 (allgather_cp off, no SP).

    Asserts ``rows == len(tokens) - 1`` per sample (cp_utils.py:264-266), appends the last
    token's row (cp_utils.py:268), zigzag-slices each sample, packs them and pads the
    pack to ``tp * data_pad_size_multiplier`` (cp_utils.py:280-286).
    """
    assert len(experts) == len(tokens)
    for e, t in zip(experts, tokens, strict=True):
        assert e.shape[0] == t.shape[0] - 1, f"{e.shape}, {t.shape}"
    pad = lambda x, n: slime_pad(x, n, num_experts)  # noqa: E731
    packed = torch.cat([zigzag(pad(e, 1), cp_size, cp_rank, pad) for e in experts])
    return pad(packed, (pad_size - packed.shape[0] % pad_size) % pad_size)


def slime_routers(
    prepared: torch.Tensor, stage: range, moe_layer_freq: Sequence[int]
) -> dict[int, torch.Tensor]:
    """fill_routing_replay, slime/backends/megatron_utils/actor.py:333-350.

    For each layer of the stage (``get_transformer_layer_offset`` .. + count), dense layers
    skipped, the router of absolute layer ``layer_id`` records ``prepared[:, layer_id]``.
    """
    return {i: prepared[:, i] for i in stage if moe_layer_freq[i]}


def slime_replay(scores: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """RoutingReplay.pop_forward + compute_topk, slime/utils/routing_replay.py:118-127, 192-197.

    The recorded indices are moved as ``int32``, then ``scores.gather(1, idx)``.
    """
    idx = recorded.to(dtype=torch.int32)
    assert idx.shape[0] == scores.shape[0]
    return scores.gather(1, idx)


# ------------------------------------------------------------------------------------------
# miles @ 31f1ca9, restated


def miles_decode_meta_info(
    b64: str, prompt_tokens: int, new_tokens: int, num_layers: int
) -> npt.NDArray[np.int32]:
    """miles/rollout/sglang_rollout.py:255-271: int32 ``[prompt + new - 1, args.num_layers, K]``
    (K recovered from the size; a stop-edge extra row is dropped)."""
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    ntok = prompt_tokens + new_tokens - 1
    k = flat.size // max(1, ntok * num_layers)
    if flat.size == (ntok + 1) * num_layers * max(1, k):
        flat = flat[: ntok * num_layers * k]
    assert flat.size == ntok * num_layers * k
    return flat.reshape(ntok, num_layers, k)


def miles_sample_validate(tokens: Sequence[int], experts: npt.NDArray[Any]) -> None:
    """Sample.validate, miles/utils/types.py:205-215 (text-only: no media expansion)."""
    assert len(experts) == len(tokens) - 1, (
        f"rollout_routed_experts length ({len(experts)}) != len(tokens) - 1 ({len(tokens) - 1})"
    )


def miles_wire_check(experts: npt.NDArray[Any]) -> None:
    """miles' session samples wire (rollout/session/samples/codec.py:38, 119-122): int32 only."""
    if np.asarray(experts).dtype != np.int32:
        raise ValueError(f"rollout_routed_experts must have dtype int32, got {experts.dtype}")


def miles_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """miles/backends/training_utils/replay_data.py:63-71: ``n`` rows of ``-1``."""
    return torch.cat([x, torch.full((n, *x.shape[1:]), -1, dtype=x.dtype)])


def miles_fill(
    experts: Sequence[npt.NDArray[Any]],
    tokens: Sequence[torch.Tensor],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_size: int = 1,
) -> torch.Tensor:
    """The rollout arrays as the trainer packs them (thd, allgather_cp off, no SP).

    miles/backends/training_utils/data.py:117-118 (``torch.from_numpy`` of each array);
    replay_data.py:77-83 (assert ``rows == len(tokens) - 1``, append one ``-1`` row);
    replay_data.py:109-120 (zigzag each sample, pack, pad to ``tp * multiplier`` with -1).
    """
    tensors = [torch.from_numpy(e) for e in experts]
    assert len(tensors) == len(tokens)
    for a, b in zip(tensors, tokens, strict=True):
        assert a.shape[0] == b.shape[0] - 1, f"{a.shape}, {b.shape}"
    packed = torch.cat([zigzag(miles_pad(a, 1), cp_size, cp_rank, miles_pad) for a in tensors])
    return miles_pad(packed, (pad_size - packed.shape[0] % pad_size) % pad_size)


def miles_routers_megatron(
    packed: torch.Tensor, stage: range, moe_layer_freq: Sequence[int]
) -> dict[int, torch.Tensor]:
    """register_replay_list_moe, miles/backends/megatron_utils/replay_utils.py:5-24:
    the router of absolute layer ``layer_idx`` records ``packed[:, layer_idx]``."""
    return {i: packed[:, i] for i in stage if moe_layer_freq[i]}


def miles_routers_fsdp(
    packed: torch.Tensor, hf_moe_layers: Sequence[int]
) -> dict[int, torch.Tensor]:
    """FSDP: each MoE block registers with ``stream_idx`` = its HF decoder-layer index
    (miles/backends/fsdp_utils/adaptations/routing_replay.py:120-122); register_replay_list_
    sequential (replay_data.py:13-27) bounds-checks it and records ``packed[:, stream_idx]``."""
    out = {}
    for i in hf_moe_layers:
        if not 0 <= i < packed.shape[1]:
            raise AssertionError(f"replay stream_idx {i} out of range")
        out[i] = packed[:, i]
    return out


def miles_replay(scores: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """miles/utils/replay_base.py:90-113 (after Replay.pop_forward, :26-37, which keeps dtype):
    an all ``-1`` row becomes ``arange(K) % E``; then ``scores.gather(1, idx)`` with the
    recorded dtype."""
    assert recorded.shape[0] == scores.shape[0]
    invalid = (recorded == -1).all(dim=-1)
    fill = torch.arange(recorded.shape[1], dtype=recorded.dtype) % scores.shape[1]
    idx = torch.where(invalid.unsqueeze(-1), fill, recorded)
    return scores.gather(1, idx)


def sglang_b64(routing: Routing, model: Model) -> str:
    """Upstream SGLang's ``meta_info["routed_experts"]`` for the same routing: int32 base64 of
    ``[T-1, num_hidden_layers, K]``, dense layers read as expert 0 (DESIGN.md, sglang 0.5.23)."""
    full = np.zeros((routing.num_rows, model.num_layers, K), dtype=np.int32)
    full[:, list(routing.layer_ids)] = routing.indices
    return base64.b64encode(full.tobytes()).decode("ascii")


# ------------------------------------------------------------------------------------------
# slime: the contract holds


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("pp", [1, 2])
def test_slime_replays_each_layers_rows(model: Model, pp: int) -> None:
    """Rows pass slime's checks; every MoE router of every stage replays exactly our rows for its
    layer, then slime's own last-token row."""
    routing = routing_for(model)
    out = slime_layout(routing, T, num_layers=model.num_layers)
    assert out.shape == (T - 1, model.num_layers, K) and out.dtype == np.int16
    experts = torch.as_tensor(out)  # slime/ray/rollout.py:735
    slime_validate_for_replay(experts, model.num_layers, K, model.moe_layer_freq)
    prepared = slime_prepare([experts], [torch.arange(T)], E)
    last = (np.arange(model.num_layers * K) % E).reshape(model.num_layers, K)
    seen = []
    for stage in stages(model.num_layers, pp):
        for layer_id, rec in slime_routers(prepared, stage, model.moe_layer_freq).items():
            assert np.array_equal(rec[: T - 1].numpy(), moe_rows(routing, layer_id))
            assert np.array_equal(rec[T - 1].numpy(), last[layer_id])
            scores = torch.rand(T, E)
            picked = slime_replay(scores, rec)
            assert torch.equal(picked, torch.take_along_dim(scores, rec.long(), 1))
            seen.append(layer_id)
    assert seen == list(model.moe_ids)  # one router per MoE layer, none left unfilled


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_slime_layout_equals_what_slime_builds_from_sglang(model: Model) -> None:
    """Fetch-by-id is a drop-in for slime's inline path: the same values it decodes from
    SGLang's base64 (types.py:352-377), dense layers 0."""
    routing = routing_for(model, seed=3)
    inline = slime_decode_meta_info(sglang_b64(routing, model), T, model.num_layers, K)
    ours = slime_layout(routing, T, num_layers=model.num_layers)
    assert np.array_equal(ours, inline.numpy())


@pytest.mark.parametrize("cp_size", [2, 3])
def test_slime_context_parallel_packs_rows_with_their_tokens(cp_size: int) -> None:
    """Two packed samples, zigzag CP: on every rank, local position ``p`` holds token ``t`` and
    routing row ``t`` of the same sample (the last token and padding: slime's arange fill)."""
    model = DENSE_FIRST
    lens = [T, 7]
    routings = [routing_for(model, n - 1, seed=i) for i, n in enumerate(lens)]
    # token ids encode (sample, position): 1000 * sample + position + 1; 0 marks padding
    tokens = [torch.arange(n) + 1 + 1000 * i for i, n in enumerate(lens)]
    experts = [
        torch.as_tensor(slime_layout(r, n, num_layers=model.num_layers))
        for r, n in zip(routings, lens, strict=True)
    ]
    zero_pad = lambda x, n: torch.cat([x, torch.zeros(n, dtype=x.dtype)])  # noqa: E731
    for rank in range(cp_size):
        local_tokens = torch.cat([zigzag(t, cp_size, rank, zero_pad) for t in tokens])
        prepared = slime_prepare(experts, tokens, E, cp_size=cp_size, cp_rank=rank)
        assert prepared.shape[0] == local_tokens.shape[0]
        routers = slime_routers(prepared, range(model.num_layers), model.moe_layer_freq)
        for p, tok in enumerate(local_tokens.tolist()):
            if tok == 0:
                continue  # CP padding: no token, slime's fill
            sample, pos = divmod(tok - 1, 1000)
            if pos == lens[sample] - 1:
                continue  # the last token: slime's own row
            for layer_id, rec in routers.items():
                assert np.array_equal(rec[p].numpy(), moe_rows(routings[sample], layer_id)[pos])


# ------------------------------------------------------------------------------------------
# miles: the contract holds


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("pp", [1, 2])
def test_miles_replays_each_layers_rows(model: Model, pp: int) -> None:
    """int32 rows pass miles' sample and wire checks; every MoE router (Megatron, any stage, and
    FSDP) replays our rows for its layer; the last token replays ``0..K-1``."""
    routing = routing_for(model)
    out = miles_layout(routing, T, num_layers=model.num_layers)
    assert out.shape == (T - 1, model.num_layers, K) and out.dtype == np.int32
    tokens = list(range(T))
    miles_sample_validate(tokens, out)
    miles_wire_check(out)
    packed = miles_fill([out], [torch.tensor(tokens)], pad_size=4)
    megatron: dict[int, torch.Tensor] = {}
    for stage in stages(model.num_layers, pp):
        megatron.update(miles_routers_megatron(packed, stage, model.moe_layer_freq))
    fsdp = miles_routers_fsdp(packed, model.moe_ids)
    assert sorted(megatron) == sorted(fsdp) == list(model.moe_ids)
    for routers in (megatron, fsdp):
        for layer_id, rec in routers.items():
            scores = torch.rand(rec.shape[0], E)
            picked = miles_replay(scores, rec)
            assert torch.equal(
                picked[: T - 1],
                torch.take_along_dim(
                    scores[: T - 1], torch.from_numpy(moe_rows(routing, layer_id)).long(), 1
                ),
            )
            assert torch.equal(picked[T - 1 :], scores[T - 1 :, :K])  # last token + pack padding


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_miles_layout_equals_what_miles_builds_from_sglang(model: Model) -> None:
    """The same array, dtype included, that miles decodes inline (sglang_rollout.py:255-271)."""
    routing = routing_for(model, seed=5)
    prompt = 4
    inline = miles_decode_meta_info(
        sglang_b64(routing, model), prompt, T - prompt, model.num_layers
    )
    ours = miles_layout(routing, T, num_layers=model.num_layers)
    assert ours.dtype == inline.dtype and np.array_equal(ours, inline)


# ------------------------------------------------------------------------------------------
# the defects (issue 26), reproduced against their checks


def old_pad_last(routing: Routing, num_tokens: int) -> npt.NDArray[Any]:
    """What ``slime_layout(..., pad_last=True)`` returned before 6a64a6b: the rows plus one
    ``-1`` row for the last token (``[num_tokens, L, K]``), documented as miles' convention."""
    rows = np.asarray(routing.indices)
    return np.concatenate([rows, np.full((1, *rows.shape[1:]), -1, rows.dtype)])


def test_defect_pad_last_violates_both_len_tokens_minus_one_asserts() -> None:
    routing = routing_for(ALL_MOE)
    old = old_pad_last(routing, T)
    assert old.shape[0] == T
    with pytest.raises(AssertionError):  # slime cp_utils.py:266
        slime_prepare([torch.as_tensor(old)], [torch.arange(T)], E)
    with pytest.raises(AssertionError):  # miles types.py:212
        miles_sample_validate(list(range(T)), old)
    with pytest.raises(AssertionError):  # miles replay_data.py:79
        miles_fill([old.astype(np.int32)], [torch.arange(T)])
    with pytest.raises(TypeError):  # the keyword is gone
        slime_layout(routing, T, pad_last=True)  # type: ignore[call-arg]
    # fixed: both layouts give len(tokens) - 1 rows
    slime_prepare([torch.as_tensor(slime_layout(routing, T))], [torch.arange(T)], E)
    miles_fill([miles_layout(routing, T)], [torch.arange(T)])


def test_defect_int16_fails_miles_gather_and_wire() -> None:
    routing = routing_for(ALL_MOE)
    int16 = slime_layout(routing, T)
    assert int16.dtype == np.int16
    rec = miles_routers_megatron(miles_fill([int16], [torch.arange(T)]), range(4), [1] * 4)[0]
    with pytest.raises(RuntimeError, match="int32/int64"):
        miles_replay(torch.rand(T, E), rec)
    with pytest.raises(ValueError, match="int32"):
        miles_wire_check(int16)
    with pytest.raises(ValueError, match="int32"):  # int64 is refused on the wire too
        miles_wire_check(int16.astype(np.int64))
    # fixed: miles_layout is int32, and slime (which casts to int32 itself) takes int16
    out = miles_layout(routing, T)
    miles_wire_check(out)
    miles_replay(
        torch.rand(T, E),
        miles_routers_megatron(miles_fill([out], [torch.arange(T)]), range(4), [1] * 4)[0],
    )
    slime_replay(
        torch.rand(T, E), slime_prepare([torch.as_tensor(int16)], [torch.arange(T)], E)[:, 0]
    )


def test_defect_moe_only_layer_axis_with_dense_first_layers() -> None:
    """Our MoE-only axis (4 columns for layers 2..5 of 6) under their absolute indexing."""
    model = DENSE_FIRST
    routing = routing_for(model)
    moe_only = slime_layout(routing, T)
    assert moe_only.shape[1] == 4
    # slime refuses it at validation (rollout_data_utils.py:73)
    with pytest.raises(ValueError, match="shape"):
        slime_validate_for_replay(
            torch.as_tensor(moe_only), model.num_layers, K, model.moe_layer_freq
        )
    # without validation, slime's and miles' Megatron stage 0 of 2 (layers 0..2) silently
    # replays column 2 -- layer 4's rows -- at layer 2; stage 1 hits layer 4: IndexError
    prepared = slime_prepare([torch.as_tensor(moe_only)], [torch.arange(T)], E)
    packed = miles_fill([moe_only.astype(np.int32)], [torch.arange(T)])
    first, second = stages(model.num_layers, 2)
    for rec in (
        slime_routers(prepared, first, model.moe_layer_freq)[2],
        miles_routers_megatron(packed, first, model.moe_layer_freq)[2],
    ):
        assert np.array_equal(rec[: T - 1].numpy(), moe_rows(routing, 4))
        assert not np.array_equal(rec[: T - 1].numpy(), moe_rows(routing, 2))
    with pytest.raises(IndexError):
        slime_routers(prepared, second, model.moe_layer_freq)
    with pytest.raises(IndexError):
        miles_routers_megatron(packed, second, model.moe_layer_freq)
    with pytest.raises(AssertionError, match="out of range"):  # miles FSDP
        miles_routers_fsdp(packed, model.moe_ids)
    # fixed: num_layers= puts each MoE layer at its id (test_*_replays_each_layers_rows)
    assert slime_layout(routing, T, num_layers=6).shape[1] == 6


def with_gap(model: Model) -> Routing:
    """Routing whose token rows 3..4 nobody shipped (``-1``, as decode_rollout leaves a gap)."""
    arr = synthetic_routing(T - 1, len(model.moe_ids), E, K, seed=9).astype(np.int16)
    arr[3:5] = -1
    return Routing.from_array(arr, num_experts=E, layer_ids=model.moe_ids)


@pytest.mark.parametrize("layout", [slime_layout, miles_layout])
def test_defect_uncovered_rows_are_refused_or_filled(layout: Any) -> None:
    model = DENSE_FIRST
    routing = with_gap(model)
    with pytest.raises(ShapeError, match=r"\[3, 5\)"):
        layout(routing, T, num_layers=model.num_layers)
    filled = layout(routing, T, num_layers=model.num_layers, missing="fill")
    assert (filled[3:5][:, list(model.moe_ids)] == np.arange(K)).all()  # 0..K-1
    assert (filled[:, [0, 1]] == 0).all()  # dense layers stay 0
    assert (filled >= 0).all()
    slime_validate_for_replay(torch.as_tensor(filled), model.num_layers, K, model.moe_layer_freq)


def test_why_raw_minus_one_is_refused() -> None:
    """A raw ``-1`` row crashes slime's gather; miles silently replays ``0..K-1`` there, which
    is exactly what ``missing="fill"`` gives (and why the default refuses instead)."""
    routing = with_gap(ALL_MOE)
    raw = np.array(routing.indices)
    rec = slime_prepare([torch.as_tensor(raw)], [torch.arange(T)], E)[:, 0]
    with pytest.raises(RuntimeError, match="out of bounds"):
        slime_replay(torch.rand(T, E), rec)
    scores = torch.rand(T, E)
    raw_rec = miles_fill([raw.astype(np.int32)], [torch.arange(T)])[:, 0]
    ours = miles_fill([miles_layout(routing, T, missing="fill")], [torch.arange(T)])[:, 0]
    assert torch.equal(miles_replay(scores, raw_rec), miles_replay(scores, ours))


# ------------------------------------------------------------------------------------------
# docs/integrations.md names the pinned commits (its recipes run in test_glue.py)


def section(title: str) -> str:
    text = DOCS.read_text()
    m = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"docs/integrations.md has no '## {title}' section"
    return m.group(0)


def test_docs_name_the_pinned_commits() -> None:
    assert SLIME_COMMIT[:7] in section("slime").splitlines()[0]
    assert MILES_COMMIT[:7] in section("miles").splitlines()[0]
