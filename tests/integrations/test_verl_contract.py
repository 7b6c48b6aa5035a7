"""verl 0.9.1's own R3 code, fed with ``verl_layout``'s output (docs/integrations.md, "verl 0.9.1").

Nothing of verl's logic is re-implemented here.  The batch goes the way verl's
trainer sends it (paths under ``site-packages/verl/``):

1. a ``DataProto`` with ``batch["routed_experts"]`` -> ``to_tensordict()`` ->
   ``left_right_2_no_padding`` (``trainer/ppo/ray_trainer.py:1295``,
   ``workers/utils/padding.py:73-79``);
2. the Megatron engine's R3 branch (``workers/engine/megatron/transformer_impl.py:1306-1327``):
   ``align_r3_router_replay_data``, ``build_r3_replay_mask``, then
   ``set_router_replay_data(..., model=...)`` (``utils/megatron/router_replay_utils.py``),
   with the action ``REPLAY_FORWARD`` (``transformer_impl.py:955``);
3. a real Megatron-Core ``GPTModel`` whose ``TopKRouter``\\ s carry verl's patch
   (``apply_router_replay_patch``, ``transformer_impl.py:224``) and run on the tokens packed
   by verl's ``preprocess_thd_engine`` (``models/mcore/model_forward.py:303``).

Each router's ``routing_map`` (its real output) must equal the recorded routing at every
replayed token of every MoE layer.  TP / CP / SP / PP coordinates other than one rank are
given to verl's and Megatron's own code through fake process groups (one process only).

verl is installed ``--no-deps`` (scripts/bootstrap.sh, the ``verl`` extra); ``verl.protocol``
imports ``ray`` at module level for ``DataProtoFuture`` only, so where ray is not installed a
stub stands in for it (in this process only).  On CPU verl resolves its device to ``"cuda"``
(it has no CPU platform), so ``router_replay_utils.device_name`` is set to ``"cpu"``.
"""

from __future__ import annotations

import importlib.util
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is not installed: scripts/bootstrap.sh installs verl==0.9.1 --no-deps "
        "(the `verl` extra in pyproject.toml)",
        allow_module_level=True,
    )

from r3_client import Routing, RoutingClient, Segment, ShapeError
from r3_client.layouts import verl_layout
from r3_client.synthetic import synthetic_routing
from tests.support.frames import rid
from tests.support.megatron_model import _hide_broken_flash_mla, causal_mask, megatron_env
from tests.support.service_process import KEY_A, Service
from tests.support.verl_stubs import FakeGroup, stub_ray, verl_tensors

ROOT = Path(__file__).resolve().parents[2]
E, K, HIDDEN, VOCAB = 8, 2, 64, 256
NUM_LAYERS = 4
# Prompt / response lengths: left- and right-padding, a one-token response (its only
# token is the last one), prompts of different lengths.
PROMPTS, RESPONSES = (3, 5, 2, 4), (4, 1, 6, 3)
PROMPT_LEN, RESPONSE_LEN = 6, 7


@dataclass(frozen=True)
class Model:
    """A transformer shape: which of its ``NUM_LAYERS`` layers are MoE."""

    name: str
    moe_layer_freq: int | list[int]
    moe_ids: tuple[int, ...]


ALL_MOE = Model("all-moe", 1, (0, 1, 2, 3))
DENSE_FIRST = Model("dense-first", [0, 0, 1, 1], (2, 3))  # DeepSeek-V3 / GLM-4.5 style


@dataclass
class Verl:
    """verl 0.9.1's functions and classes this module drives."""

    DataProto: Any
    left_right_2_no_padding: Any
    compute_position_id_with_mask: Any
    align_r3_router_replay_data: Any
    build_r3_replay_mask: Any
    set_router_replay_data: Any
    preprocess_thd_engine: Any
    RouterReplay: Any
    RouterReplayAction: Any


def _class_state(classes: Sequence[type]) -> list[tuple[type, dict[str, Any]]]:
    return [(cls, dict(vars(cls))) for cls in classes]


def _restore(saved: list[tuple[type, dict[str, Any]]]) -> None:
    for cls, before in saved:
        for name in set(vars(cls)) - set(before):
            delattr(cls, name)
        for name, value in before.items():
            if vars(cls).get(name) is not value:
                setattr(cls, name, value)


@pytest.fixture(scope="module")
def verl() -> Iterator[Verl]:
    """verl imported, its router-replay patch applied for this module only, one CPU rank."""
    stub_ray()
    _hide_broken_flash_mla()
    import verl as verl_pkg

    assert verl_pkg.__version__ == "0.9.1", verl_pkg.__version__
    with megatron_env(torch.device("cpu")):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
        from verl.models.mcore.util import preprocess_thd_engine
        from verl.protocol import DataProto
        from verl.utils.megatron import router_replay_utils as rru
        from verl.utils.megatron.router_replay_patch import (
            RouterReplay,
            RouterReplayAction,
            apply_router_replay_patch,
        )
        from verl.utils.model import compute_position_id_with_mask
        from verl.workers.utils.padding import left_right_2_no_padding

        # verl patches Megatron's classes process-wide; undo it afterwards so the
        # Megatron-Core tests in the same session see the library as it ships.
        saved = _class_state([TopKRouter, TransformerConfig, MoEAlltoAllTokenDispatcher])
        init = TransformerConfig.__init__
        had_signature = "__signature__" in vars(init)
        apply_router_replay_patch()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rru, "device_name", "cpu")
            try:
                yield Verl(
                    DataProto,
                    left_right_2_no_padding,
                    compute_position_id_with_mask,
                    rru.align_r3_router_replay_data,
                    rru.build_r3_replay_mask,
                    rru.set_router_replay_data,
                    preprocess_thd_engine,
                    RouterReplay,
                    RouterReplayAction,
                )
            finally:
                RouterReplay.router_instances.clear()
                _restore(saved)
                if not had_signature:
                    vars(init).pop("__signature__", None)


def _routings(model: Model, seed: int = 0) -> list[Routing]:
    """One recorded routing per sample: ``P + R - 1`` rows over the model's MoE layers."""
    return [
        Routing.from_array(
            synthetic_routing(p + r - 1, len(model.moe_ids), E, K, seed=seed + i),
            num_experts=E,
            layer_ids=model.moe_ids,
        )
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]


def _batch(verl: Verl, routed_experts: np.ndarray) -> Any:
    """The DataProto verl's agent loop hands the trainer: prompts left-, responses right-padded."""
    tensors = verl_tensors(
        PROMPTS, RESPONSES, PROMPT_LEN, RESPONSE_LEN, VOCAB, verl.compute_position_id_with_mask
    )
    tensors["routed_experts"] = torch.from_numpy(routed_experts)
    return verl.DataProto.from_dict(tensors=tensors)


def _build(
    verl: Verl, model: Model, *, pp: tuple[int, int] | None = None
) -> tuple[Any, Any, list[Any]]:
    """A Megatron-Core GPTModel (local spec) with verl's routers; ``pp=(size, rank)`` builds
    that pipeline stage only.  Returns the model, its TransformerConfig and its routers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    verl.RouterReplay.router_instances.clear()  # as apply_router_replay_patch does per engine
    pp_size, pp_rank = pp or (1, 0)
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=32,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_layer_freq=model.moe_layer_freq,
        moe_token_dispatcher_type="allgather",  # alltoall makes a CUDA stream
        moe_enable_routing_replay=True,  # what verl's engine sets (transformer_impl.py:424)
        pipeline_model_parallel_size=pp_size,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    groups = ProcessGroupCollection.use_mpu_process_groups()
    if pp is not None:  # the stage's layer offset comes from the PP group's rank
        groups.pp = FakeGroup(pp_size, pp_rank)
    torch.manual_seed(0)
    gpt = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=pp_rank),
        vocab_size=VOCAB,
        max_sequence_length=4096,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        share_embeddings_and_output_weights=False,
        pg_collection=groups,
    )
    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    return gpt, config, routers


@dataclass
class Packed:
    """What verl packed for one rank: the local rows' token identities and replay input."""

    input_ids: torch.Tensor  # [1, local] as the model sees them
    sample: np.ndarray  # [local] sample index, -1 for alignment padding
    token: np.ndarray  # [local] token index within the sample


def _replay(verl: Verl, batch: Any, config: Any, gpt: Any, *, sp: bool = False) -> Packed:
    """verl's trainer + Megatron engine R3 path up to the router targets being set."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    td = verl.left_right_2_no_padding(batch.to_tensordict())  # ray_trainer.py:1295
    input_ids = td["input_ids"]
    layers_topk_idx = verl.align_r3_router_replay_data(td["routed_experts"], input_ids)
    replay_mask = verl.build_r3_replay_mask(input_ids, td["response_mask"])
    verl.RouterReplay.set_global_router_replay_action(verl.RouterReplayAction.REPLAY_FORWARD)
    verl.set_router_replay_data(
        layers_topk_idx,
        td.get("attention_mask", None),
        config,
        0,
        replay_mask=replay_mask,
        local_cp_size=None,
        model=gpt,
    )
    ids, _, _ = verl.preprocess_thd_engine(input_ids, pre_process=True)  # model_forward.py:303
    # Where each packed row comes from: (sample + 1, token + 1), 0 in alignment padding,
    # packed by the same function; Megatron's embedding then splits the sequence over the
    # TP ranks under sequence parallelism (language_model_embedding.py:137).
    lens = input_ids.offsets().diff().tolist()
    origin = torch.cat(
        [
            torch.stack([torch.full((n,), i + 1), torch.arange(1, n + 1)], 1)
            for i, n in enumerate(lens)
        ]
    )
    nested = torch.nested.nested_tensor_from_jagged(origin, offsets=input_ids.offsets())
    where, _, _ = verl.preprocess_thd_engine(nested, pre_process=True)
    where = where.reshape(-1, 2)
    if sp:
        where = scatter_to_sequence_parallel_region(where)
    return Packed(ids.reshape(1, -1), where[:, 0].numpy() - 1, where[:, 1].numpy() - 1)


def _expected(routings: Sequence[Routing], packed: Packed, layer: int) -> list[np.ndarray | None]:
    """Per local row: the recorded expert set verl must replay there, or None (router's own)."""
    out: list[np.ndarray | None] = []
    for i, t in zip(packed.sample, packed.token, strict=True):
        r = routings[i] if i >= 0 else None
        if r is None or RESPONSES[i] == 0 or t >= r.indices.shape[0]:
            out.append(None)  # alignment padding or the last token: not replayed
        else:
            out.append(np.sort(r.indices[t, r.layer_ids.index(layer)]))
    return out


def _check_targets(routings: Sequence[Routing], packed: Packed, routers: Sequence[Any]) -> int:
    """Each router's replay target and mask (set by verl) against the recorded rows."""
    replayed = 0
    for router in routers:
        target = router.router_replay.target_topk_idx
        mask = router.router_replay.target_replay_mask.bool()
        want = _expected(routings, packed, router.layer_number - 1)
        assert target.shape == (len(want), K) and mask.shape == (len(want),)
        assert mask.tolist() == [w is not None for w in want], f"layer {router.layer_number - 1}"
        for row, w in enumerate(want):
            if w is not None:
                assert np.array_equal(np.sort(target[row].numpy()), w), (router.layer_number, row)
        replayed += int(mask.sum())
    return replayed


class RoutingSpy:
    """The experts each router really routed to (its ``routing_map``), by absolute layer."""

    def __init__(self, routers: Sequence[Any]) -> None:
        self.maps: dict[int, torch.Tensor] = {}
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        self.maps[module.layer_number - 1] = out[1].detach().clone()

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _forward(gpt: Any, packed: Packed, routers: Sequence[Any]) -> dict[int, torch.Tensor]:
    spy = RoutingSpy(routers)
    seq = packed.input_ids.shape[1]
    try:
        with torch.no_grad():
            if gpt.pre_process:
                gpt(
                    packed.input_ids, torch.arange(seq)[None], causal_mask(seq, torch.device("cpu"))
                )
            else:  # a later pipeline stage: hidden states from the previous one
                gpt.set_input_tensor(torch.randn(seq, 1, HIDDEN))
                gpt(None, None, causal_mask(seq, torch.device("cpu")))
    finally:
        spy.close()
    return spy.maps


def _check_replayed(
    routings: Sequence[Routing],
    packed: Packed,
    maps: dict[int, torch.Tensor],
    layers: Sequence[int],
) -> None:
    assert sorted(maps) == sorted(layers)
    for layer, routing_map in maps.items():
        for row, w in enumerate(_expected(routings, packed, layer)):
            if w is not None:
                got = routing_map[row].nonzero().flatten().numpy()
                assert np.array_equal(got, w), f"layer {layer}, packed row {row}: {got} != {w}"


def _all_rows() -> set[tuple[int, int]]:
    return {
        (i, t)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
        for t in range(p + r - 1)
    }


def _layout(routings: Sequence[Routing], *, absolute: bool = True) -> np.ndarray:
    return verl_layout(
        routings,
        PROMPTS,
        RESPONSES,
        prompt_len=PROMPT_LEN,
        response_len=RESPONSE_LEN,
        num_layers=NUM_LAYERS if absolute else None,
    )


# ------------------------------------------------------------------ the contract


@pytest.mark.parametrize("model", [ALL_MOE, DENSE_FIRST], ids=lambda m: m.name)
def test_layout_is_what_verls_rollout_builds(model: Model) -> None:
    """Shape, dtype and fill of verl's own rollout (agent_loop.py:131-141, 796-809): int16
    ``[bs, prompt_len + response_len, num_hidden_layers, K]``, zeros wherever no row was
    recorded; the layer axis absolute, as SGLang returns it (async_sglang_server.py:697)."""
    routings = _routings(model)
    out = _layout(routings)
    assert out.dtype == np.int16
    assert out.shape == (len(PROMPTS), PROMPT_LEN + RESPONSE_LEN, NUM_LAYERS, K)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        rows = out[i, PROMPT_LEN - p : PROMPT_LEN + r]
        assert np.array_equal(rows[:-1][:, list(model.moe_ids)], routings[i].indices)
        assert not rows[-1].any()  # the last token
        assert not out[i, : PROMPT_LEN - p].any() and not out[i, PROMPT_LEN + r :].any()
        dense = [j for j in range(NUM_LAYERS) if j not in model.moe_ids]
        assert not rows[:, dense].any()


@pytest.mark.parametrize("model", [ALL_MOE, DENSE_FIRST], ids=lambda m: m.name)
def test_verl_replays_the_recorded_routing_at_every_moe_layer(verl: Verl, model: Model) -> None:
    """One rank: every recorded row is what the router of its layer routes that token to."""
    routings = _routings(model)
    gpt, config, routers = _build(verl, model)
    packed = _replay(verl, _batch(verl, _layout(routings)), config, gpt)
    assert _check_targets(routings, packed, routers) == len(_all_rows()) * len(model.moe_ids)
    _check_replayed(routings, packed, _forward(gpt, packed, routers), model.moe_ids)


def test_verl_also_takes_a_moe_only_layer_axis(verl: Verl) -> None:
    """A layer axis of MoE layers only (``num_layers=None``) is indexed by MoE ordinal when its
    length is not ``num_layers`` (router_replay_utils.py:519-533); the absolute axis is what
    verl's rollout produces, and the one the docs prescribe."""
    routings = _routings(DENSE_FIRST)
    gpt, config, routers = _build(verl, DENSE_FIRST)
    packed = _replay(verl, _batch(verl, _layout(routings, absolute=False)), config, gpt)
    _check_targets(routings, packed, routers)
    _check_replayed(routings, packed, _forward(gpt, packed, routers), DENSE_FIRST.moe_ids)


# (tp, cp, sequence parallel): verl scatters the targets over the TP group whatever the
# config says (router_replay_utils.py:507), so TP > 1 implies SP, which verl's engine
# turns on with TP (workers/config/engine.py:195, models/mcore/config_converter.py:87).
PARALLEL = [(1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True)]


@pytest.mark.parametrize("model", [ALL_MOE, DENSE_FIRST], ids=lambda m: m.name)
@pytest.mark.parametrize(("tp", "cp", "sp"), PARALLEL, ids=lambda v: str(v))
def test_verl_packing_keeps_every_row_with_its_token(
    verl: Verl, model: Model, tp: int, cp: int, sp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each TP/CP rank's targets (verl's packing, zigzag CP split and SP scatter) hold the
    recorded row of the token that rank's routers see at that row; over all ranks every
    recorded row is replayed exactly once per MoE layer."""
    from megatron.core import parallel_state

    routings = _routings(model)
    gpt, config, routers = _build(verl, model)
    batch = _batch(verl, _layout(routings))
    seen: list[tuple[int, int]] = []
    for tp_rank in range(tp):
        for cp_rank in range(cp):
            monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=cp_rank: r)
            monkeypatch.setattr(
                parallel_state,
                "get_tensor_model_parallel_group",
                lambda *a, r=tp_rank, **k: FakeGroup(tp, r),
            )
            packed = _replay(verl, batch, config, gpt, sp=sp)
            _check_targets(routings, packed, routers)
            mask = routers[0].router_replay.target_replay_mask.bool().numpy()
            seen += list(
                zip(packed.sample[mask].tolist(), packed.token[mask].tolist(), strict=True)
            )
    assert sorted(seen) == sorted(_all_rows())  # each recorded row on exactly one rank


@pytest.mark.parametrize("model", [ALL_MOE, DENSE_FIRST], ids=lambda m: m.name)
@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "moe-only"])
def test_verl_replays_on_each_pipeline_stage(verl: Verl, model: Model, absolute: bool) -> None:
    """pp=2: each stage's routers (global ``layer_number``) replay their own layers' rows."""
    routings = _routings(model)
    batch = _batch(verl, _layout(routings, absolute=absolute))
    for stage in range(2):
        gpt, config, routers = _build(verl, model, pp=(2, stage))
        stage_layers = [r.layer_number - 1 for r in routers]
        assert stage_layers == [j for j in model.moe_ids if j // 2 == stage]
        if not routers:  # the dense stage: verl does not call set_router_replay_data
            continue  # (is_replay_forward_action is False without routers, transformer_impl:1306)
        packed = _replay(verl, batch, config, gpt)
        _check_targets(routings, packed, routers)
        _check_replayed(routings, packed, _forward(gpt, packed, routers), stage_layers)


# ------------------------------------------------------------------ what must not reach verl


def _with_hole(model: Model, row: int = 2) -> list[Routing]:
    """Sample 0 with one row nobody shipped (``-1`` in every slot, as decode_rollout fills)."""
    routings = _routings(model)
    holed = np.array(routings[0].indices)
    holed[row] = -1
    routings[0] = Routing(holed, E, model.moe_ids)
    return routings


def test_a_row_nobody_shipped_crashes_verls_replay(verl: Verl) -> None:
    """The defect reproduced: a ``-1`` inside a sample's rows (what the old layout passed
    through) is gathered by verl's replay (router_replay_patch.py:135-136) and crashes on
    CPU (a device-side assert on GPU).  So ``verl_layout`` refuses it by default."""
    routings = _with_hole(ALL_MOE)
    with pytest.raises(
        ShapeError, match=r"sample 0's routing has no recorded route for token rows \[2, 3\)"
    ):
        _layout(routings)
    passed_through = _layout(_routings(ALL_MOE))
    passed_through[0, PROMPT_LEN - PROMPTS[0] + 2] = -1  # what the layout did before
    gpt, config, routers = _build(verl, ALL_MOE)
    packed = _replay(verl, _batch(verl, passed_through), config, gpt)
    with pytest.raises(RuntimeError, match="index -1 is out of bounds"):
        _forward(gpt, packed, routers)


def test_missing_fill_replays_expert_zero_as_verl_fills_it(verl: Verl) -> None:
    """``missing="fill"``: the row becomes 0, verl's own fill (agent_loop.py:138); verl replays
    it (expert 0 in all K slots, collapsing to one expert) and does not crash."""
    routings = _with_hole(ALL_MOE)
    filled = verl_layout(
        routings,
        PROMPTS,
        RESPONSES,
        prompt_len=PROMPT_LEN,
        response_len=RESPONSE_LEN,
        num_layers=NUM_LAYERS,
        missing="fill",
    )
    assert not filled[0, PROMPT_LEN - PROMPTS[0] + 2].any()
    gpt, config, routers = _build(verl, ALL_MOE)
    packed = _replay(verl, _batch(verl, filled), config, gpt)
    maps = _forward(gpt, packed, routers)
    row = int(np.flatnonzero((packed.sample == 0) & (packed.token == 2))[0])
    for routing_map in maps.values():
        assert routing_map[row].nonzero().flatten().tolist() == [0]


def test_minus_one_at_the_last_token_and_padding_is_never_gathered(verl: Verl) -> None:
    """The old layout's ``-1`` at each last token and in padding does not crash 0.9.1's R3
    path: ``left_right_2_no_padding`` drops padding (padding.py:75), ``build_r3_replay_mask``
    leaves each last token to the router (router_replay_utils.py:392) and
    ``get_replay_topk`` takes the native top-k there before its gather
    (router_replay_patch.py:135).  ``0`` is still what verl's rollout writes there
    (agent_loop.py:138, 797), so ``verl_layout`` writes ``0``."""
    routings = _routings(DENSE_FIRST)
    old = _layout(routings)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        old[i, : PROMPT_LEN - p] = -1
        old[i, PROMPT_LEN + r - 1 :] = -1
    gpt, config, routers = _build(verl, DENSE_FIRST)
    packed = _replay(verl, _batch(verl, old), config, gpt)
    _check_targets(routings, packed, routers)
    _check_replayed(routings, packed, _forward(gpt, packed, routers), DENSE_FIRST.moe_ids)


# ------------------------------------------------------------------ docs/integrations.md


def _doc_snippet() -> str:
    """The python block of docs/integrations.md's verl section."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    section = re.search(r"^## verl 0\.9\.1\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "docs/integrations.md has a '## verl 0.9.1' section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), flags=re.S)
    assert len(blocks) == 1, "the verl section has one python recipe"
    return str(blocks[0])


def test_doc_recipe_fetches_lays_out_and_verl_replays_it(
    verl: Verl, service_single: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe, run as written: rollouts stored in a real cache service under the ids the
    rollout left in ``non_tensor_batch["r3_rollout_id"]``, fetched with one
    ``RoutingClient.get_many`` when the trainer's rollout manager returns the batch, laid out
    into the DataProto, replayed by verl.  (tests/integrations/test_verl_glue.py runs the
    same block through verl's own rollout code.)"""
    routings = _routings(DENSE_FIRST, seed=100)
    ids = [rid() for _ in routings]
    for name, value in (
        ("R3_URL", service_single.http_url),
        ("R3_KEY", KEY_A),
        ("R3_NUM_LAYERS", str(NUM_LAYERS)),
    ):
        monkeypatch.setenv(name, value)
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        for rollout_id, r in zip(ids, routings, strict=True):
            seg = Segment(0, r.indices.shape[0], "tiny-moe", "v1")
            client.put(rollout_id, r.indices, num_experts=E, layer_ids=r.layer_ids, segment=seg)
    empty = np.zeros((len(PROMPTS), PROMPT_LEN + RESPONSE_LEN, NUM_LAYERS, K), np.int16)
    rollout = _batch(verl, empty)
    rollout.batch.pop("routed_experts")
    rollout.non_tensor_batch["r3_rollout_id"] = np.array(ids, dtype=object)

    class Manager:  # the trainer's AgentLoopManager, as far as the recipe can tell
        def generate_sequences(self, prompts: Any) -> Any:
            return rollout

    namespace: dict[str, Any] = {}
    exec(compile(_doc_snippet(), "docs/integrations.md", "exec"), namespace)
    trainer = types.SimpleNamespace(async_rollout_manager=Manager())
    try:
        namespace["install_r3"](trainer)
        batch = trainer.async_rollout_manager.generate_sequences(verl.DataProto())
    finally:
        namespace["r3"].close()
    routed = batch.batch["routed_experts"]
    assert routed.dtype == torch.int16
    assert routed.shape == (len(PROMPTS), PROMPT_LEN + RESPONSE_LEN, NUM_LAYERS, K)
    gpt, config, routers = _build(verl, DENSE_FIRST)
    packed = _replay(verl, batch, config, gpt)
    _check_targets(routings, packed, routers)
    _check_replayed(routings, packed, _forward(gpt, packed, routers), DENSE_FIRST.moe_ids)
