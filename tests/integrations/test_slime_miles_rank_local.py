"""slime and miles on the rank-local path: each Megatron rank reads only its own slice.

Against a real cache service (``svc`` x ``transport``; Redis read directly too), for every
(TP, CP, SP, allgather_cp) x pipeline-stage rank, ``fetch_rank_replay`` equals, router by
router, what slime's / miles' own fill records when every sample carries its whole
``*_layout`` array.  Their fill is restated (nothing of theirs is copied) from the pinned
lines, as tests/integrations/test_slime_miles_contract.py does:

* slime  @ 624b824: ``fill_routing_replay`` (slime/backends/megatron_utils/actor.py:308-355:
  ``get_next(["rollout_routed_experts", "tokens"])`` per micro-batch, then
  ``prepare_routed_experts_for_routing_replay``, then router ``j`` of the rank records
  ``prepared[:, layer_id]`` for its stage's MoE layers, :333-350);
  ``prepare_routed_experts_for_routing_replay`` (cp_utils.py:254-297: last-token row,
  zigzag ``slice_with_cp`` :180-209 or ``allgather_cp`` chunks :271-278, pack padding to
  ``tp * data_pad_size_multiplier`` :269,285-286, SP slice :288-295), padding rows
  ``arange % num_experts`` in the tensor's dtype (:239-251); ``RoutingReplay.pop_forward``
  casts to int32 (slime/utils/routing_replay.py:118-127).
* miles  @ 31f1ca9: ``fill_replay_data`` (miles/backends/training_utils/replay_data.py:30-134,
  thd: last-token row :83, zigzag :110 or ``allgather_cp`` :102-108, pack padding :118-120,
  SP :123-127, ``-1`` padding :63-71) and ``register_replay_list_moe``
  (miles/backends/megatron_utils/replay_utils.py:5-24), called at
  miles/backends/megatron_utils/actor.py:482-495.

The rollout side runs ``wrap_generate(..., fill=False)`` through the stub frameworks and
fake engine of test_glue.py; a missing, short or foreign-token rollout is refused before
dispatch, naming the sample.

The training-side hooks (``install_rank_local``, ``rank_local_fill_routing_replay`` /
``rank_local_fill_replay_data``) run inside stand-in slime / miles modules, driven by
restated data iterators over several micro-batches with Megatron-Core ``TransformerConfig``
model chunks, and must leave every router holding what the restated fill records.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import types
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from r3_client import (
    AsyncRoutingClient,
    DirectReader,
    InvalidRequestError,
    RolloutNotFoundError,
    Routing,
    RoutingClient,
    Segment,
    ShapeError,
    token_digest,
)
from r3_client.integrations import miles as r3_miles
from r3_client.integrations import slime as r3_slime
from r3_client.integrations.samples.rank import SampleRank
from r3_client.layouts import miles_layout, slime_layout
from r3_client.synthetic import synthetic_routing
from tests.integrations import test_glue as glue
from tests.integrations.test_slime_miles_contract import miles_pad, slime_pad, zigzag
from tests.support.service_process import KEY_A, Service, url_of

E, K = 16, 2
NUM_LAYERS, MOE = 6, (1, 2, 4, 5)  # dense layers 0 and 3
LENGTHS = [37, 2, 120, 9, 64]  # len(tokens) per sample of the micro-batch
STAGES: dict[int, list[tuple[int, ...]]] = {
    1: [(1, 2, 4, 5)],
    2: [(1, 2), (4, 5)],
}  # pp -> each stage's MoE routers


@dataclasses.dataclass(frozen=True)
class Cfg:
    tp: int
    cp: int
    sp: bool
    allgather_cp: bool = False
    mult: int = 4


CONFIGS = [
    Cfg(1, 1, False),
    Cfg(2, 1, True),
    Cfg(2, 1, False),  # TP without SP: every TP rank keeps the whole CP-local pack
    Cfg(1, 2, False),
    Cfg(2, 2, True),
    Cfg(1, 3, False, mult=128),  # slime's and miles' default multiplier
    Cfg(2, 2, True, allgather_cp=True),
    Cfg(1, 3, False, allgather_cp=True),
]


def ranks(cfgs: Sequence[Cfg] = CONFIGS) -> list[tuple[Cfg, SampleRank]]:
    out = []
    for c in cfgs:
        for t, r, pp in itertools.product(range(c.tp), range(c.cp), (1, 2)):
            for stage in STAGES[pp]:
                rank = SampleRank(
                    tp_size=c.tp,
                    tp_rank=t,
                    cp_size=c.cp,
                    cp_rank=r,
                    sequence_parallel=c.sp,
                    allgather_cp=c.allgather_cp,
                    data_pad_size_multiplier=c.mult,
                    router_layers=stage,
                )
                out.append((c, rank))
    return out


# ------------------------------------------------------------------ their fill, restated


def slime_prepare(
    experts: Sequence[torch.Tensor], tokens: Sequence[int], rank: SampleRank, num_experts: int = E
) -> Any:
    """prepare_routed_experts_for_routing_replay, slime cp_utils.py:254-297."""
    for e, n in zip(experts, tokens, strict=True):
        assert e.shape[0] == n - 1  # :264-266

    def pad(x: torch.Tensor, n: int) -> torch.Tensor:  # _pad_routed_experts, :239-251
        return slime_pad(x, n, num_experts)

    padded = [pad(e, 1) for e in experts]  # :268
    pad_size = rank.tp_size * rank.data_pad_size_multiplier  # :269
    if rank.allgather_cp:  # :271-278
        out = torch.cat(padded)
        unit = rank.cp_size * pad_size
        out = pad(out, (unit - out.size(0) % unit) % unit).chunk(rank.cp_size)[rank.cp_rank]
    else:  # :280-286
        out = torch.cat([zigzag(e, rank.cp_size, rank.cp_rank, pad) for e in padded])
        out = pad(out, (pad_size - out.size(0) % pad_size) % pad_size)
    if rank.sequence_parallel:  # :288-295
        n = out.size(0)
        assert n % rank.tp_size == 0
        out = out[n // rank.tp_size * rank.tp_rank : n // rank.tp_size * (rank.tp_rank + 1)]
    return out


def miles_prepare(experts: Sequence[np.ndarray], tokens: Sequence[int], rank: SampleRank) -> Any:
    """fill_replay_data (thd), miles replay_data.py:73-127, after data.py:117-118."""
    data = [torch.from_numpy(e) for e in experts]
    for a, n in zip(data, tokens, strict=True):
        assert a.shape[0] == n - 1  # :77-79
    data = [miles_pad(a, 1) for a in data]  # :83
    pad_size = rank.tp_size * rank.data_pad_size_multiplier  # :101
    if rank.allgather_cp and rank.cp_size > 1:  # :102-108
        out = torch.cat(data)
        unit = rank.cp_size * pad_size
        out = miles_pad(out, (unit - out.size(0) % unit) % unit).chunk(rank.cp_size)[rank.cp_rank]
    else:  # :110-120
        out = torch.cat([zigzag(a, rank.cp_size, rank.cp_rank, miles_pad) for a in data])
        out = miles_pad(out, (pad_size - out.size(0) % pad_size) % pad_size)
    if rank.sequence_parallel:  # :123-127
        n = out.size(0)
        assert n % rank.tp_size == 0
        out = out[n // rank.tp_size * rank.tp_rank : n // rank.tp_size * (rank.tp_rank + 1)]
    return out


def routers(prepared: torch.Tensor, router_layers: Sequence[int]) -> list[torch.Tensor]:
    """slime actor.py:333-350 / miles replay_utils.py:5-24: router j records column layer_id."""
    return [prepared[:, layer_id] for layer_id in router_layers]


class Recorder:
    """A replay object: ``record`` keeps what the actor hands it (routing_replay.py:91-103)."""

    def __init__(self) -> None:
        self.recorded: list[torch.Tensor] = []

    def record(self, top_indices: torch.Tensor) -> None:
        self.recorded.append(top_indices.clone())


# ------------------------------------------------------------------ storage


def store(
    client: RoutingClient,
    lengths: Sequence[int],
    seed: int = 0,
    keys: Sequence[str] | None = None,
) -> list[str]:
    """Rollouts of ``T - 1`` rows each, stored as two segments (prompt, then response)."""
    ids = []
    for n, length in enumerate(lengths):
        key = keys[n] if keys is not None else f"rl-{uuid.uuid4().hex[:10]}.{n}"
        rows = synthetic_routing(length - 1, len(MOE), E, K, seed=seed + n)
        cut = max(1, (length - 1) // 3)
        for a, b in ((0, cut), (cut, length - 1)):
            if a < b:
                seg = Segment(a, b, "tiny-moe", "v1")
                client.put(key, rows[a:b], num_experts=E, layer_ids=MOE, segment=seg)
        ids.append(key)
    return ids


def whole(client: RoutingClient, ids: Sequence[str], framework: str) -> list[Any]:
    """Each sample's whole field, as the rollout side fills it today."""
    layout = slime_layout if framework == "slime" else miles_layout
    return [
        layout(client.get(k), n, num_layers=NUM_LAYERS) for k, n in zip(ids, LENGTHS, strict=True)
    ]


def theirs(framework: str, fields: Sequence[Any], rank: SampleRank) -> list[torch.Tensor]:
    if framework == "slime":
        prepared = slime_prepare([torch.as_tensor(f) for f in fields], LENGTHS, rank)
    else:
        prepared = miles_prepare(fields, LENGTHS, rank)
    assert rank.router_layers is not None
    return routers(prepared, rank.router_layers)


def ours(source: Any, framework: str, ids: Sequence[str], rank: SampleRank, **kw: Any) -> Any:
    if framework == "slime":
        return r3_slime.fetch_rank_replay(
            source, ids, LENGTHS, rank=rank, num_layers=NUM_LAYERS, num_experts=E, **kw
        )
    return r3_miles.fetch_rank_replay(source, ids, LENGTHS, rank=rank, num_layers=NUM_LAYERS, **kw)


def same(framework: str, got: Any, want: list[torch.Tensor]) -> None:
    """Router by router: the values each replay object is handed (slime casts to int32 when
    it pops, routing_replay.py:123-127; miles keeps the dtype, replay_base.py:37)."""
    assert len(got.per_layer) == len(want)
    for g, w in zip(got.per_layer, want, strict=True):
        assert isinstance(g, torch.Tensor) and g.dtype == torch.int32
        if framework == "miles":
            assert w.dtype == torch.int32
        assert g.shape == w.shape, (g.shape, w.shape)
        assert torch.equal(g, w.to(torch.int32))


def keyed(sample: Any, field: str, key: str) -> Any:
    setattr(sample, field, key)
    return sample


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_every_rank_replays_what_the_whole_sample_path_records(
    svc: Service, transport: str, framework: str
) -> None:
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        ids = store(client, LENGTHS)
        fields = whole(client, ids, framework)
        total_rows = sum(n - 1 for n in LENGTHS)
        for cfg, rank in ranks():
            want = theirs(framework, fields, rank)
            got = ours(client, framework, ids, rank, as_torch=True)
            same(framework, got, want)
            assert got.layer_ids == tuple(rank.router_layers or ())
            assert got.rollout_ids == tuple(ids)
            split = cfg.cp * (cfg.tp if cfg.sp else 1)
            if split > 1:  # a rank reads about its share of the rows, never all of them
                assert got.num_rows < total_rows, (cfg, rank, got.num_rows)
            # the actor's record loop, fed from our replay
            recorders = [Recorder() for _ in got.per_layer]
            got.record(recorders)
            for rec, w in zip(recorders, want, strict=True):
                assert torch.equal(rec.recorded[0], w.to(torch.int32))
        # every layer the rollouts hold (router_layers=None), and a dense stage (no routers)
        rank = SampleRank(data_pad_size_multiplier=1)
        full = ours(client, framework, ids, rank)
        assert full.layer_ids == MOE
        want = theirs(framework, fields, dataclasses.replace(rank, router_layers=MOE))
        same(framework, ours(client, framework, ids, rank, as_torch=True), want)
        dense = ours(client, framework, ids, dataclasses.replace(rank, router_layers=()))
        assert dense.per_layer == [] and dense.layer_ids == ()
        with pytest.raises(ShapeError, match="routers"):
            full.record([Recorder()])


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_direct_reads_give_the_same_replay(svc: Service, framework: str) -> None:
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        ids = store(client, LENGTHS, seed=7)
        fields = whole(client, ids, framework)
        for _, rank in ranks()[::5]:
            got = ours(reader, framework, ids, rank, as_torch=True)
            same(framework, got, theirs(framework, fields, rank))


def test_slime_padding_wraps_in_int16_as_slime_computes_it(svc: Service) -> None:
    """slime pads in the per-sample tensor's dtype (int16 from slime_layout): past 32767
    elements its arange wraps (cp_utils.py:243-248); ours wraps the same way."""
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids = store(client, LENGTHS, seed=3)
        fields = whole(client, ids, "slime")
        assert all(f.dtype == np.int16 for f in fields)
        # 6 layers * K=2 = 12 per padding row: 3000+ rows of padding wrap int16
        rank = SampleRank(data_pad_size_multiplier=3000, router_layers=MOE)
        same(
            "slime", ours(client, "slime", ids, rank, as_torch=True), theirs("slime", fields, rank)
        )


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_rollout_side_tags_without_filling_and_ranks_fetch_it(
    service_single: Service, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wrap_generate(..., fill=False)``: keyed as before, nothing fetched into the sample;
    the key is rebuilt on a rank from ``sample_indices`` and the rank's replay equals the
    whole-sample path's (the field ``fill=True`` would have set)."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    module = r3_slime if framework == "slime" else r3_miles
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as client:
        engine = glue.FakeEngine(client, behind_router=True)
        glue.stub_framework(monkeypatch, framework, engine)
        gen = module.wrap_generate(run=run, client=client, num_layers=glue.NUM_LAYERS, fill=False)
        group = [glue.Sample(index=i) for i in (3, 4)]
        for s in group:
            assert await gen(glue.args_for(framework), s, glue.params()) is s
            assert s.status is glue.Status.COMPLETED and s.rollout_routed_experts is None
        keys = module.rank_keys(run, [s.index for s in group])
        field = "session_id" if framework == "slime" else "routing_key"
        assert keys == [getattr(s, field) for s in group]
        assert keys[0] == (f"{run}.3" if framework == "slime" else f"{run}.3.0")
        layout = slime_layout if framework == "slime" else miles_layout
        fields = [
            layout(await client.get(k), len(s.tokens), num_layers=glue.NUM_LAYERS)
            for k, s in zip(keys, group, strict=True)
        ]
    counts = [len(s.tokens) for s in group]
    with RoutingClient(service_single.http_url, api_key=KEY_A) as sync:
        found = module.check_samples(group, sync)
        assert (found.samples, found.samples_with_views, found.off_state_tokens) == (2, 0, 0)
        assert found.tokens == sum(counts) - 2 and found.policy == "exact"
        for pp_stage in ((2, 3), (4, 5)):
            rank = SampleRank(cp_size=2, cp_rank=1, data_pad_size_multiplier=1)
            rank = dataclasses.replace(rank, router_layers=pp_stage)
            kw: dict[str, Any] = {"num_experts": glue.E} if framework == "slime" else {}
            got = module.fetch_rank_replay(
                sync, keys, counts, rank=rank, num_layers=glue.NUM_LAYERS, as_torch=True, **kw
            )
            if framework == "slime":
                prepared = slime_prepare([torch.as_tensor(f) for f in fields], counts, rank, glue.E)
            else:
                prepared = miles_prepare(fields, counts, rank)
            same(framework, got, routers(prepared, pp_stage))


async def test_miles_retry_keeps_the_rank_key_and_drops_the_old_attempt(
    service_single: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank sees ``sample_indices``, not ``metadata``: under ``fill=False`` a retry from the
    prompt keeps ``f"{run}.{index}.0"`` and the earlier attempt's rows are deleted first."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as client:
        engine = glue.FakeEngine(client, behind_router=True)
        glue.stub_framework(monkeypatch, "miles", engine)
        deleted: list[str] = []
        real_delete = client.delete

        async def delete(key: str) -> bool:  # the engine's view of a key is the store's
            deleted.append(key)
            engine.tokens.pop(key, None)
            engine.truth.pop(key, None)
            return await real_delete(key)

        monkeypatch.setattr(client, "delete", delete)
        gen = r3_miles.wrap_generate(run=run, client=client, num_layers=glue.NUM_LAYERS, fill=False)
        sample = glue.Sample(index=7)
        await gen(glue.args_for("miles"), sample, glue.params())
        assert deleted == [] and sample.routing_key == f"{run}.7.0"
        sample.reset_for_retry()
        await gen(glue.args_for("miles"), sample, glue.params())
        assert deleted == [f"{run}.7.0"] and sample.routing_key == f"{run}.7.0"
        got = await client.get(f"{run}.7.0")
        assert np.array_equal(got.indices, engine.truth[f"{run}.7.0"])
        assert got.num_rows == len(sample.tokens) - 1


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_rollout_side_refuses_a_view_it_would_ignore(
    service_single: Service, framework: str
) -> None:
    """``wrap_generate(..., fill=False)`` fetches nothing: a policy given to it would be
    ignored (the ranks read under their own ``view``), so it is refused before any
    generation; none given is taken."""
    run = f"run-{uuid.uuid4().hex[:8]}"
    module = r3_slime if framework == "slime" else r3_miles
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as client:
        with pytest.raises(InvalidRequestError, match=r"view='latest'.*on the training side"):
            module.wrap_generate(
                run=run, client=client, num_layers=glue.NUM_LAYERS, fill=False, view="latest"
            )
        for view in ("exact", "generated"):  # any policy given here: the ranks choose
            with pytest.raises(InvalidRequestError, match="on the training side"):
                module.wrap_generate(
                    run=run, client=client, num_layers=glue.NUM_LAYERS, fill=False, view=view
                )
        module.wrap_generate(run=run, client=client, num_layers=glue.NUM_LAYERS, fill=False)
        module.wrap_generate(run=run, client=client, num_layers=glue.NUM_LAYERS, view="latest")


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_missing_and_short_rollouts_are_refused_before_dispatch(
    svc: Service, framework: str
) -> None:
    module = r3_slime if framework == "slime" else r3_miles
    field = "session_id" if framework == "slime" else "routing_key"
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ok, short = store(client, [12, 12])
        lost = f"rl-lost-{uuid.uuid4().hex[:8]}.0"
        samples = [
            keyed(glue.Sample(index=i, tokens=list(range(n))), field, key)
            for i, (key, n) in enumerate(((ok, 12), (lost, 12), (short, 20)))
        ]
        module.check_samples(samples[:1], client)
        with pytest.raises(ShapeError) as info:
            module.check_samples(samples, client)
        msg = str(info.value)
        assert msg.startswith(f"{framework} rank-local routing: 2 of 3 samples cannot be replayed")
        assert f"sample 1 (rollout '{lost}') is not in the cache" in msg
        assert f"sample 2 (rollout '{short}') holds 11 rows, its sample needs 19" in msg
        with pytest.raises(RolloutNotFoundError, match=rf"sample 0 \(rollout '{lost}'\)"):
            module.check_samples(samples[1:2], client)
        # and at the rank, had it been dispatched anyway
        rank = SampleRank(data_pad_size_multiplier=1, router_layers=(1, 2))
        kw: dict[str, Any] = {"num_experts": E} if framework == "slime" else {}
        with pytest.raises(RolloutNotFoundError, match=rf"sample 1 \(rollout '{lost}'\)"):
            module.fetch_rank_replay(client, [ok, lost], [12, 12], rank=rank, num_layers=6, **kw)
        with pytest.raises(ShapeError, match=rf"sample 1 \(rollout '{short}'\) has 20 tokens"):
            module.fetch_rank_replay(client, [ok, short], [12, 20], rank=rank, num_layers=6, **kw)


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_rollout_side_check_refuses_missing_gapped_and_foreign_tokens(
    service_single: Service, framework: str
) -> None:
    module = r3_slime if framework == "slime" else r3_miles
    field = "session_id" if framework == "slime" else "routing_key"
    tokens = list(range(100, 112))
    rows = synthetic_routing(11, len(MOE), E, K, seed=1)
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as client:
        good, foreign, gap = (f"rl-{uuid.uuid4().hex[:8]}.{n}" for n in range(3))
        for key, toks, spans in (
            (good, tokens, ((0, 11),)),
            (foreign, [t + 1 for t in tokens], ((0, 11),)),
            (gap, tokens, ((0, 4), (6, 11))),
        ):
            for a, b in spans:
                seg = Segment(a, b, "m", "v1", tokens_digest=token_digest(toks[:b]))
                await client.put(key, rows[a:b], num_experts=E, layer_ids=MOE, segment=seg)

        def sample(key: str) -> Any:
            return keyed(glue.Sample(index=0, tokens=tokens), field, key)

        found = await module.check_stored(sample(good), client)
        assert (found.samples, found.off_state_tokens, found.tokens) == (1, 0, 11)
        with pytest.raises(ShapeError, match="token digest differs"):
            await module.check_stored(sample(foreign), client)
        with pytest.raises(ShapeError, match=r"has no rows \[4, 6\)"):
            await module.check_stored(sample(gap), client)
        await module.check_stored(sample(gap), client, missing="fill")
        with pytest.raises(RolloutNotFoundError, match="is not in the cache"):
            await module.check_stored([sample(good), sample(f"rl-none-{uuid.uuid4().hex}")], client)


# ------------------------------------------------------------------ the installed hooks
#
# The product hooks (r3_slime.install_rank_local / r3_miles.install_rank_local) run inside
# stand-ins of the modules they patch, driven the way the actors drive their fill, and
# must leave every router holding what the restated fill above records from whole
# fields.  Megatron's own get_transformer_layer_offset / get_num_layers_to_build walk
# real TransformerConfigs.  Megatron's parallel state is answered by monkeypatching the
# mpu getters the code reads (TP / CP in slime's fill, the pipeline rank in Megatron's
# layer walk): initialize_model_parallel would need a torch.distributed world of
# tp * cp * pp processes, while one process must stand as every rank in turn here.

INDICES = [40, 41, 42, 43, 44]  # Sample.index of LENGTHS' samples (sample_indices)
MICRO_BATCHES = [[2, 0], [4, 1, 3]]  # rollout_data["micro_batch_indices"]: local positions
HOOK_CFGS = [
    Cfg(1, 1, False),
    Cfg(2, 1, True),
    Cfg(2, 2, True),
    Cfg(1, 2, False, allgather_cp=True),
]
#: (pp, vpp, pp_rank) -> the rank's routers as slime's actor / miles' walk finds them
PIPELINES: dict[tuple[int, int | None, int], tuple[int, ...]] = {
    (1, None, 0): (1, 2, 4, 5),
    (2, None, 0): (1, 2),
    (2, None, 1): (4, 5),
    (2, 3, 0): (2, 4),  # virtual stages hold layers 0, 2, 4 (0 is dense)
    (2, 3, 1): (1, 5),  # and 1, 3, 5
}


class DataIterator:
    """slime's ``DataIterator`` (slime/backends/megatron_utils/data.py:152-189; miles'
    training_utils/data.py:353-410 with ``micro_batch_indices`` is the same), restated."""

    def __init__(self, rollout_data: dict[str, Any], micro_batch_indices: list[list[int]]):
        self.rollout_data = rollout_data
        self.micro_batch_indices = micro_batch_indices
        self.offset = 0
        self.resets = 0

    def get_next(self, keys: Sequence[str]) -> dict[str, list[Any] | None]:
        batch: dict[str, list[Any] | None] = {}
        indices = self.micro_batch_indices[self.offset]
        for key in keys:
            vals = self.rollout_data.get(key, None)
            batch[key] = None if vals is None else [vals[i] for i in indices]
        self.offset += 1
        return batch

    def reset(self) -> DataIterator:
        self.offset = 0
        self.resets += 1
        return self


@functools.cache
def model_chunks(pp: int, vpp: int | None) -> list[Any]:
    """The actor's ``self.model``: one DDP-wrapped chunk per virtual stage, whose
    ``.module.config`` is what slime's actor.py:335 and miles' replay_utils.py:9 read."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_layer_freq=[1 if i in MOE else 0 for i in range(NUM_LAYERS)],
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    return [types.SimpleNamespace(module=types.SimpleNamespace(config=config))] * (vpp or 1)


def answer_mpu(
    mp: pytest.MonkeyPatch, tp: int, tp_rank: int, cp: int, cp_rank: int, pp_rank: int
) -> None:
    """The mpu getters slime's fill and Megatron's layer walk read, answering for one rank."""
    from megatron.core import parallel_state

    for name, value in (
        ("get_tensor_model_parallel_world_size", tp),
        ("get_tensor_model_parallel_rank", tp_rank),
        ("get_context_parallel_world_size", cp),
        ("get_context_parallel_rank", cp_rank),
        ("get_pipeline_model_parallel_rank", pp_rank),
    ):
        mp.setattr(parallel_state, name, lambda *a, v=value, **k: v)


def stand_in(mp: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    """A module in ``sys.modules`` (its parent packages too, unless already there)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            mp.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    mp.setitem(sys.modules, name, module)
    return module


class RoutingReplay:
    """slime.utils.routing_replay.RoutingReplay's class list (routing_replay.py:81-89)."""

    all_routing_replays: ClassVar[list[Any]] = []


def stub_slime(mp: pytest.MonkeyPatch) -> type:
    """slime's actor module and routing replay module, as far as the hook touches them."""

    class MegatronTrainRayActor:
        def fill_routing_replay(
            self, data_iterator: Any, num_microbatches: Any, rollout_data: Any
        ) -> None:
            raise AssertionError("slime's own fill ran")

    stand_in(mp, "slime.backends.megatron_utils.actor", MegatronTrainRayActor=MegatronTrainRayActor)
    mp.setattr(RoutingReplay, "all_routing_replays", [])
    stand_in(mp, "slime.utils.routing_replay", RoutingReplay=RoutingReplay)
    return MegatronTrainRayActor


def miles_own_fill(calls: list[dict[str, Any]]) -> Any:
    def fill_replay_data(
        *,
        args: Any,
        models: Any,
        data_iterator: Any,
        num_microbatches: Any,
        rollout_data: Any,
        data_key: str,
        replay_list: list[Any],
        register_replay_list_func: Any,
        if_sp_region: bool = True,
        indices_are_token_positions: bool = False,
    ) -> None:
        calls.append({"data_key": data_key, "if_sp_region": if_sp_region})

    return fill_replay_data


def stub_miles(mp: pytest.MonkeyPatch, calls: list[dict[str, Any]], state: list[Any]) -> Any:
    """miles' actor module (binding fill_replay_data, actor.py:49) and get_parallel_state."""
    own = miles_own_fill(calls)
    stand_in(mp, "miles.backends.training_utils.replay_data", fill_replay_data=own)
    stand_in(mp, "miles.backends.training_utils.parallel", get_parallel_state=lambda: state[0])
    return stand_in(mp, "miles.backends.megatron_utils.actor", fill_replay_data=own)


def group(size: int, rank: int) -> Any:
    """miles' GroupInfo as the fill reads it (``.size``, ``.rank``)."""
    return types.SimpleNamespace(size=size, rank=rank)


def hook_args(cfg: Cfg, bshd: bool = False) -> types.SimpleNamespace:
    """The trainer's ``args``, as far as the fills read them."""
    return types.SimpleNamespace(
        use_rollout_routing_replay=True,
        sequence_parallel=cfg.sp,
        allgather_cp=cfg.allgather_cp,
        data_pad_size_multiplier=cfg.mult,
        num_layers=NUM_LAYERS,
        num_experts=E,
        qkv_format="bshd" if bshd else "thd",
    )


def rollout_data(
    vpp: int | None, fields: Sequence[Any] | None = None
) -> tuple[dict[str, Any], list[DataIterator]]:
    """One DP rank's rollout_data (only what the fills read) and its iterators, one per
    virtual stage (slime data.py:192-196)."""
    data: dict[str, Any] = {
        "tokens": [torch.arange(n, dtype=torch.long) for n in LENGTHS],
        "sample_indices": list(INDICES),
        "micro_batch_indices": MICRO_BATCHES,
    }
    if fields is not None:
        data["rollout_routed_experts"] = list(fields)
    return data, [DataIterator(data, MICRO_BATCHES) for _ in range(vpp or 1)]


def hook_ranks() -> list[tuple[Cfg, int, int, tuple[int, int | None, int], SampleRank]]:
    out = []
    for cfg in HOOK_CFGS:
        for t, r, pipe in itertools.product(range(cfg.tp), range(cfg.cp), PIPELINES):
            rank = SampleRank(
                tp_size=cfg.tp,
                tp_rank=t,
                cp_size=cfg.cp,
                cp_rank=r,
                sequence_parallel=cfg.sp,
                allgather_cp=cfg.allgather_cp,
                data_pad_size_multiplier=cfg.mult,
                router_layers=PIPELINES[pipe],
            )
            out.append((cfg, t, r, pipe, rank))
    return out


def their_micro_batches(
    framework: str, fields: Sequence[Any], rank: SampleRank
) -> list[list[torch.Tensor]]:
    """Per router, what the restated fill records for each micro-batch, in order."""
    per_router: list[list[torch.Tensor]] = [[] for _ in rank.router_layers or ()]
    for mb in MICRO_BATCHES:
        counts = [LENGTHS[i] for i in mb]
        if framework == "slime":
            prepared = slime_prepare([torch.as_tensor(fields[i]) for i in mb], counts, rank)
        else:
            prepared = miles_prepare([fields[i] for i in mb], counts, rank)
        assert rank.router_layers is not None
        for j, got in enumerate(routers(prepared, rank.router_layers)):
            per_router[j].append(got)
    return per_router


def same_records(recorders: Sequence[Recorder], want: list[list[torch.Tensor]]) -> None:
    assert len(recorders) == len(want)
    for rec, w in zip(recorders, want, strict=True):
        assert len(rec.recorded) == len(MICRO_BATCHES)
        for g, x in zip(rec.recorded, w, strict=True):
            assert g.dtype == torch.int32 and g.shape == x.shape
            assert torch.equal(g, x.to(torch.int32))


def test_slime_hook_records_what_slime_fill_records(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"hk-{uuid.uuid4().hex[:8]}"
    actor_cls = stub_slime(monkeypatch)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        keys = store(client, LENGTHS, seed=11, keys=r3_slime.rank_keys(run, INDICES))
        assert keys[0] == f"{run}.40"
        fields = whole(client, keys, "slime")
        fill = r3_slime.install_rank_local(hook_args(Cfg(1, 1, False)), source=client, run=run)
        assert actor_cls.fill_routing_replay is fill  # type: ignore[attr-defined]
        for cfg, t, r, (pp, vpp, pp_rank), rank in hook_ranks():
            with monkeypatch.context() as mp:
                answer_mpu(mp, cfg.tp, t, cfg.cp, r, pp_rank)
                actor = actor_cls()
                actor.args = hook_args(cfg)  # type: ignore[attr-defined]
                actor.model = model_chunks(pp, vpp)  # type: ignore[attr-defined]
                recorders = [Recorder() for _ in PIPELINES[(pp, vpp, pp_rank)]]
                RoutingReplay.all_routing_replays[:] = recorders
                data, iterators = rollout_data(vpp)
                actor.fill_routing_replay(iterators, [1, 1], data)  # type: ignore[attr-defined]
                same_records(recorders, their_micro_batches("slime", fields, rank))
                assert all(it.offset == 0 and it.resets == 2 for it in iterators)
        # a shipped whole field is dropped unread, as slime deletes it (actor.py:352)
        with monkeypatch.context() as mp:
            answer_mpu(mp, 1, 0, 1, 0, 0)
            actor = actor_cls()
            actor.args, actor.model = hook_args(Cfg(1, 1, False)), model_chunks(1, None)  # type: ignore[attr-defined]
            RoutingReplay.all_routing_replays[:] = [Recorder() for _ in MOE]
            data, iterators = rollout_data(None, fields)
            actor.fill_routing_replay(iterators, [2], data)  # type: ignore[attr-defined]
            assert "rollout_routed_experts" not in data
            # one router too few: refused, as slime asserts (actor.py:350)
            RoutingReplay.all_routing_replays[:] = [Recorder() for _ in MOE[1:]]
            data, iterators = rollout_data(None)
            with pytest.raises(ShapeError, match="the rank has 3 routers"):
                actor.fill_routing_replay(iterators, [2], data)  # type: ignore[attr-defined]


def test_miles_hook_records_what_miles_fill_records(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"hk-{uuid.uuid4().hex[:8]}"
    calls: list[dict[str, Any]] = []
    state: list[Any] = [None]
    actor_mod = stub_miles(monkeypatch, calls, state)
    own = actor_mod.fill_replay_data
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        keys = store(client, LENGTHS, seed=13, keys=r3_miles.rank_keys(run, INDICES))
        assert keys[0] == f"{run}.40.0"
        fields = whole(client, keys, "miles")
        fill = r3_miles.install_rank_local(hook_args(Cfg(1, 1, False)), source=client, run=run)
        assert actor_mod.fill_replay_data is fill and fill._r3_original is own  # type: ignore[attr-defined]

        def call(cfg: Cfg, pipe: tuple[int, int | None, int], replays: list[Any], **kw: Any) -> Any:
            data, iterators = rollout_data(pipe[1])
            kwargs: dict[str, Any] = dict(
                args=hook_args(cfg),
                models=model_chunks(pipe[0], pipe[1]),
                data_iterator=iterators,
                num_microbatches=[1, 1],
                rollout_data=data,
                data_key="rollout_routed_experts",
                replay_list=replays,
                register_replay_list_func=None,  # miles' register_replay_list_moe: not called
                if_sp_region=True,
                indices_are_token_positions=False,
            )
            kwargs.update(kw)
            actor_mod.fill_replay_data(**kwargs)  # as train_actor calls it, actor.py:484-495
            return iterators

        for cfg, t, r, pipe, rank in hook_ranks():
            with monkeypatch.context() as mp:
                answer_mpu(mp, 99, 0, 99, 0, pipe[2])  # miles reads TP / CP from its own state
                state[0] = types.SimpleNamespace(tp=group(cfg.tp, t), cp=group(cfg.cp, r))
                recorders = [Recorder() for _ in PIPELINES[pipe]]
                iterators = call(cfg, pipe, recorders)
                same_records(recorders, their_micro_batches("miles", fields, rank))
                assert all(it.offset == 0 and it.resets == 2 for it in iterators)
        assert calls == []
        with monkeypatch.context() as mp:
            answer_mpu(mp, 99, 0, 99, 0, 0)
            state[0] = types.SimpleNamespace(tp=group(2, 1), cp=group(1, 0))
            # outside an SP region no SP slice (replay_data.py:123)
            recorders = [Recorder() for _ in MOE]
            call(Cfg(2, 1, True), (1, None, 0), recorders, if_sp_region=False)
            rank = SampleRank(tp_size=2, tp_rank=1, data_pad_size_multiplier=4, router_layers=MOE)
            same_records(recorders, their_micro_batches("miles", fields, rank))
            # other data keys go to miles' own fill
            call(
                Cfg(1, 1, False),
                (1, None, 0),
                [],
                data_key="rollout_indexer_topk",
                if_sp_region=False,
            )
            assert calls == [{"data_key": "rollout_indexer_topk", "if_sp_region": False}]
            with pytest.raises(ShapeError, match="2 routing replays but 4 MoE layers"):
                call(Cfg(1, 1, False), (1, None, 0), [Recorder(), Recorder()])
            with pytest.raises(ValueError, match="qkv_format 'thd', not 'bshd'"):
                call(Cfg(1, 1, False), (1, None, 0), [], args=hook_args(Cfg(1, 1, False), True))
            with pytest.raises(ValueError, match="not token positions"):
                call(Cfg(1, 1, False), (1, None, 0), [], indices_are_token_positions=True)


def test_install_replaces_never_wraps_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    actor_cls = stub_slime(monkeypatch)
    own = actor_cls.fill_routing_replay  # type: ignore[attr-defined]
    miles_actor = stub_miles(monkeypatch, [], [None])
    miles_own = miles_actor.fill_replay_data
    args = hook_args(Cfg(1, 1, False))
    for var in ("R3_URL", "R3_KEY", "R3_RUN"):
        monkeypatch.delenv(var, raising=False)
    for module in (r3_slime, r3_miles):
        with pytest.raises(RuntimeError, match=r"R3_URL and R3_RUN .*unset here: R3_URL, R3_RUN"):
            module.install_rank_local(args)
        off = hook_args(Cfg(1, 1, False))
        off.use_rollout_routing_replay = False
        with pytest.raises(ValueError, match="--use-rollout-routing-replay"):
            module.install_rank_local(off, source=object, run="r")
    monkeypatch.setenv("R3_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("R3_RUN", "run-env")
    first = r3_slime.install_rank_local(args)
    second = r3_slime.install_rank_local(args, run="run-other")
    assert actor_cls.fill_routing_replay is second  # type: ignore[attr-defined]
    assert first._r3_original is own and second._r3_original is own  # type: ignore[attr-defined]
    assert "run-other" in (second.__doc__ or "") and "run-env" in (first.__doc__ or "")
    m1 = r3_miles.install_rank_local(args)
    m2 = r3_miles.install_rank_local(args)
    assert miles_actor.fill_replay_data is m2 and m2._r3_original is miles_own  # type: ignore[attr-defined]
    assert m1._r3_original is miles_own  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="get_ranges"):
        r3_slime.rank_local_fill_routing_replay(3, "run")
    with pytest.raises(ValueError, match="bad run/"):
        r3_miles.rank_local_fill_replay_data(object, "bad run/")


def test_the_canary_names_what_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    args = hook_args(Cfg(1, 1, False))
    for name in [m for m in sys.modules if m.split(".")[0] in ("slime", "miles")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        RuntimeError, match=r"slime is not the code .*actor\.py:308-355.*cannot be imported"
    ):
        r3_slime.install_rank_local(args, source=object, run="r")
    with pytest.raises(RuntimeError, match=r"miles is not the code .*cannot be imported"):
        r3_miles.install_rank_local(args, source=object, run="r")
    with monkeypatch.context() as mp:  # slime's actor without the method
        stub_slime(mp)
        stand_in(mp, "slime.backends.megatron_utils.actor", MegatronTrainRayActor=type("A", (), {}))
        with pytest.raises(RuntimeError, match="MegatronTrainRayActor has no fill_routing_replay"):
            r3_slime.install_rank_local(args, source=object, run="r")
        stand_in(mp, "slime.backends.megatron_utils.actor")
        with pytest.raises(RuntimeError, match="actor has no MegatronTrainRayActor"):
            r3_slime.install_rank_local(args, source=object, run="r")

        class Moved:
            def fill_routing_replay(self, data_iterator: Any, rollout_data: Any) -> None: ...

        stand_in(mp, "slime.backends.megatron_utils.actor", MegatronTrainRayActor=Moved)
        stand_in(mp, "slime.utils.routing_replay", RoutingReplay=type("R", (), {}))
        with pytest.raises(RuntimeError) as info:
            r3_slime.install_rank_local(args, source=object, run="r")
        assert "fill_routing_replay takes ['self', 'data_iterator', 'rollout_data']" in str(
            info.value
        )
        assert "has no RoutingReplay.all_routing_replays" in str(info.value)
        assert Moved.fill_routing_replay.__name__ == "fill_routing_replay"  # not patched
    with monkeypatch.context() as mp:  # miles' actor no longer binding fill_replay_data
        stub_miles(mp, [], [None])
        stand_in(mp, "miles.backends.megatron_utils.actor")
        with pytest.raises(RuntimeError, match=r"megatron_utils\.actor has no fill_replay_data"):
            r3_miles.install_rank_local(args, source=object, run="r")
        stand_in(mp, "miles.backends.megatron_utils.actor", fill_replay_data=lambda *, args: None)
        stand_in(mp, "miles.backends.training_utils.parallel")
        with pytest.raises(RuntimeError) as info:
            r3_miles.install_rank_local(args, source=object, run="r")
        assert "fill_replay_data takes ['args'], not ['args', 'models'" in str(info.value)
        assert "parallel has no get_parallel_state" in str(info.value)


def test_docs_rank_local_recipe_installs(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    """The python block of docs/integrations.md's '### slime and miles' (rank-local fetch),
    as written: its install(args) hooks slime, whose fill then reads Redis directly."""
    import re

    text = (glue.ROOT / "docs" / "integrations.md").read_text()
    m = re.search(r"^### slime and miles\n.*?(?=^##)", text, flags=re.S | re.M)
    assert m
    blocks = re.findall(r"```python\n(.*?)```", m.group(0), flags=re.S)
    assert len(blocks) == 1
    run = f"dr-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("R3_URL", svc.http_url)
    monkeypatch.setenv("R3_KEY", KEY_A)
    monkeypatch.setenv("R3_RUN", run)
    actor_cls = stub_slime(monkeypatch)
    ns: dict[str, Any] = {}
    exec(compile(blocks[0], "docs/integrations.md#rank-local-slime", "exec"), ns)
    args = hook_args(Cfg(2, 1, True))
    ns["install"](args)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        keys = store(client, LENGTHS, seed=17, keys=r3_slime.rank_keys(run, INDICES))
        fields = whole(client, keys, "slime")
    answer_mpu(monkeypatch, 2, 1, 1, 0, 1)
    actor = actor_cls()
    actor.args, actor.model = args, model_chunks(2, None)  # type: ignore[attr-defined]
    recorders = [Recorder(), Recorder()]
    RoutingReplay.all_routing_replays[:] = recorders
    data, iterators = rollout_data(None)
    actor.fill_routing_replay(iterators, [1, 1], data)  # type: ignore[attr-defined]
    rank = SampleRank(tp_size=2, tp_rank=1, sequence_parallel=True, data_pad_size_multiplier=4)
    want = their_micro_batches("slime", fields, dataclasses.replace(rank, router_layers=(4, 5)))
    same_records(recorders, want)


# ------------------------------------------------------------------ exact: state expansion
#
# A step whose rollouts straddle several routing states (a weight push between an agent's
# turns, an eviction, a view inside the prompt), stored with its views as the engine
# ships them (``put(..., view=serves)``, as tests/service/test_exact_ranges.py and the verl
# test's ``_store_straddled``).  ``expand_samples`` on the rollout side cuts each sample into
# one ``Sample`` per state; every rank then replays each copy in its own state, equal to
# what the framework's own fill records when each copy carries the whole layout of its own
# state's rows.


@dataclasses.dataclass
class FullSample:
    """The ``Sample`` fields expansion reads and cuts (slime utils/types.py:93-150, miles
    utils/types.py:25-80)."""

    index: int
    tokens: list[int]
    response_length: int
    reward: float | None = 1.0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None  # miles
    rollout_top_p_token_ids: list[int] | None = None  # slime
    rollout_top_p_token_offsets: list[int] | None = None  # slime
    rollout_routed_experts: Any = None
    rollout_id: int | None = None
    group_index: int | None = None
    status: glue.Status = glue.Status.COMPLETED
    session_id: str | None = None  # slime
    routing_key: str | None = None  # miles
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


X_LENGTHS = [40, 12, 30, 9]  # len(tokens)
X_PROMPTS = [5, 3, 4, 6]
X_INDICES = [60, 61, 62, 63]
#: each original's copies: (original, state, len(tokens)); sample 3's first state (rows
#: [0, 2)) trains prompt tokens only and is dropped; sample 1 has one state, kept as it is
X_COPIES = [(0, 0, 13), (0, 12, 27), (0, 26, 40), (1, None, 12), (2, 0, 11), (2, 10, 30), (3, 2, 9)]


def store_straddled(client: RoutingClient, keys: Sequence[str], seed: int) -> list[list[Any]]:
    """Sample 0 a three-turn agent with a push before each later turn (views serving rows
    12 and 26), sample 2 recomputed after an eviction (a view of rows [2, 10) serving row
    10), sample 3 a view inside its prompt (rows [0, 2) serving row 2), sample 1 one call;
    each sample's states' rows."""
    g = np.random.default_rng(seed)

    def rows(n: int) -> np.ndarray:
        # each row's experts ascending: the cache's canonical order (a set per token)
        top = np.argsort(g.random((n, len(MOE), E)), axis=-1)[..., :K]
        return np.sort(top, axis=-1).astype(np.int16)

    def put(key: str, idx: np.ndarray, start: int, version: str, view: int | None = None) -> None:
        seg = Segment(start, start + idx.shape[0], "tiny-moe", version)
        client.put(key, idx, num_experts=E, layer_ids=MOE, segment=seg, view=view)

    states: list[list[Any]] = []
    for i, (key, n) in enumerate(zip(keys, X_LENGTHS, strict=True)):
        first = rows(n - 1)
        if i == 0:
            again, third = rows(12), rows(26)
            put(key, first[:12], 0, "w1")
            put(key, again, 0, "w2", view=12)
            put(key, first[12:26], 12, "w2")
            put(key, third, 0, "w3", view=26)
            put(key, first[26:], 26, "w3")
            cat = np.concatenate
            states.append([first[:12], cat([again, first[12:26]]), cat([third, first[26:]])])
        elif i == 2:
            redo = rows(8)
            put(key, first[:10], 0, "w1")
            put(key, redo, 2, "w1", view=10)
            put(key, first[10:], 10, "w1")
            states.append([first[:10], np.concatenate([first[:2], redo, first[10:]])])
        elif i == 3:
            redo = rows(2)
            put(key, first[:2], 0, "w1")
            put(key, redo, 0, "w2", view=2)
            put(key, first[2:], 2, "w2")
            states.append([np.concatenate([redo, first[2:]])])  # its one kept state's rows
        else:
            put(key, first, 0, "w1")
            states.append([first])
    return states


def x_samples(framework: str, keys: Sequence[str]) -> list[FullSample]:
    field = "session_id" if framework == "slime" else "routing_key"
    out = []
    for i, (n, p, idx, key) in enumerate(zip(X_LENGTHS, X_PROMPTS, X_INDICES, keys, strict=True)):
        r = n - p
        mask = [1] * r
        if i == 0:
            mask[13 - p : 16 - p] = [0, 0, 0]  # tool tokens 13..15: state 12 trains from 16
        s = FullSample(
            index=idx,
            tokens=list(range(100 * i, 100 * i + n)),
            response_length=r,
            reward=[1.0, 0.0, 0.5, 2.0][i],
            loss_mask=None if i == 2 else mask,
            rollout_log_probs=[-0.01 * j for j in range(r)],
            teacher_log_probs=[-0.02 * j for j in range(r)],
            group_index=i // 2,
        )
        if framework == "slime":  # response token j keeps ids [o[j], o[j+1]): j % 3 of them
            s.rollout_top_p_token_offsets = [0, *itertools.accumulate(j % 3 for j in range(r))]
            s.rollout_top_p_token_ids = list(range(s.rollout_top_p_token_offsets[-1]))
        else:
            s.opd_reverse_kl = [0.1 * j for j in range(r)]
            s.metadata["opd_student_top_logprobs"] = [[j] for j in range(r)]
        setattr(s, field, key)
        out.append(s)
    return out


def own_fields(framework: str, copies: Sequence[Any], states: list[list[Any]]) -> list[Any]:
    """Each copy's whole field, laid out from its own state's rows (the reference)."""
    layout = slime_layout if framework == "slime" else miles_layout
    seen: dict[int, int] = {}
    out = []
    assert len(copies) == len(X_COPIES)
    for origin, _, n in X_COPIES:
        k = seen.get(origin, 0)
        seen[origin] = k + 1
        rows = states[origin][k][: n - 1]
        routing = Routing.from_array(rows, num_experts=E, layer_ids=MOE)
        out.append(layout(routing, n, num_layers=NUM_LAYERS))
    return out


def their_fill(
    framework: str, fields: Sequence[Any], counts: Sequence[int], rank: SampleRank
) -> list[torch.Tensor]:
    if framework == "slime":
        prepared = slime_prepare([torch.as_tensor(f) for f in fields], counts, rank)
    else:
        prepared = miles_prepare(list(fields), counts, rank)
    assert rank.router_layers is not None
    return routers(prepared, rank.router_layers)


def x_args(framework: str, **kw: Any) -> types.SimpleNamespace:
    """The trainer's args as expansion checks them (GRPO with group normalization)."""
    base: dict[str, Any] = dict(
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        reward_key=None,
        use_opsm=False,
        custom_reward_post_process_path=(
            "r3_client.integrations.slime.normalize_rewards" if framework == "slime" else None
        ),
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_expanded_samples_replay_each_state_on_every_rank(svc: Service, framework: str) -> None:
    """``expand_samples`` (rollout side) cuts each straddled sample into one Sample per
    state; ``fetch_rank_replay(..., states=...)`` on every rank equals the framework's own
    fill of whole fields laid out from each copy's own state; every trained token of an
    original is trained by exactly one copy; the unexpanded step is refused at the rank."""
    module = r3_slime if framework == "slime" else r3_miles
    run = f"x-{uuid.uuid4().hex[:8]}"
    with RoutingClient(url_of(svc, "http"), api_key=KEY_A) as client:
        keys = module.rank_keys(run, X_INDICES)
        states = store_straddled(client, keys, seed=5)
        originals = x_samples(framework, keys)
        copies = module.expand_samples(originals, client, args=x_args(framework))
        # the copies, in order, each original's states consecutive
        assert [c.metadata.get("r3_state") for c in copies] == [s for _, s, _ in X_COPIES]
        assert [len(c.tokens) for c in copies] == [n for *_, n in X_COPIES]
        assert copies[3] is originals[1]  # one state: the sample itself
        by_origin: dict[int, list[Any]] = {}
        for c, (origin, _, n) in zip(copies, X_COPIES, strict=True):
            by_origin.setdefault(origin, []).append(c)
            o = originals[origin]
            p = X_PROMPTS[origin]
            assert c.tokens == o.tokens[:n] and c.response_length == n - p
            assert c.index == o.index and c.reward == o.reward and c.group_index == o.group_index
            assert module.rank_keys(run, [c.index]) == [keys[origin]]
            assert c.rollout_log_probs == o.rollout_log_probs[: n - p]
            assert c.teacher_log_probs == o.teacher_log_probs[: n - p]
            if framework == "slime":
                offsets = c.rollout_top_p_token_offsets
                assert offsets == o.rollout_top_p_token_offsets[: n - p + 1]
                assert c.rollout_top_p_token_ids == o.rollout_top_p_token_ids[: offsets[-1]]
            else:
                assert c.opd_reverse_kl == o.opd_reverse_kl[: n - p]
                assert len(c.metadata["opd_student_top_logprobs"]) == n - p
            if c is not o:
                assert c.rollout_id == o.index  # siblings share it: the rollout counts once
        assert all(o.metadata.get("r3_state") is None for o in originals)  # untouched
        # every trained token of an original is trained by exactly one of its copies
        for origin, own in by_origin.items():
            o = originals[origin]
            p, n = X_PROMPTS[origin], X_LENGTHS[origin]
            acc = np.zeros(n, dtype=np.int64)
            for c in own:
                mask = c.loss_mask if c.loss_mask is not None else [1] * c.response_length
                assert len(mask) == c.response_length
                acc[p : p + len(mask)] += np.asarray(mask)
            want = o.loss_mask if o.loss_mask is not None else [1] * o.response_length
            assert acc[p:].tolist() == list(want), origin
        # before dispatch: the copies replay no token off its state and expand nothing; the
        # originals none off either (exact never replays one): three samples to expand, one
        # more copy than expand_samples made (it drops sample 3's prompt-only state)
        found = module.check_samples(copies, client)
        assert found.off_state_tokens == 0 and found.samples_with_views == 6
        assert (found.expanded_samples, found.extra_samples, found.extra_tokens) == (0, 0, 0)
        found = module.check_samples(originals, client)
        assert found.off_state_tokens == 0 and found.off_state_samples == 0
        assert (found.expanded_samples, found.extra_samples) == (3, len(copies) - 4 + 1)
        assert found.extra_tokens == 13 + 27 + 11 + 3
        # every rank: the copies' replay equals their fill of each copy's own state's rows
        fields = own_fields(framework, copies, states)
        counts = [len(c.tokens) for c in copies]
        copy_keys = [module.rank_keys(run, [c.index])[0] for c in copies]
        copy_states = [c.metadata.get("r3_state") for c in copies]
        kw: dict[str, Any] = {"num_experts": E} if framework == "slime" else {}
        for _, rank in ranks()[::3]:
            got = module.fetch_rank_replay(
                client, copy_keys, counts, rank=rank, num_layers=NUM_LAYERS, as_torch=True,
                states=copy_states, **kw,
            )  # fmt: skip
            same(framework, got, their_fill(framework, fields, counts, rank))
        # the unexpanded step: refused at the rank, never replayed in one state
        rank = SampleRank(data_pad_size_multiplier=1, router_layers=MOE)
        with pytest.raises(InvalidRequestError, match="expand the sample"):
            module.fetch_rank_replay(
                client, keys, X_LENGTHS, rank=rank, num_layers=NUM_LAYERS, **kw
            )
        # under one-routing policies the originals are replayed (the caller chose it)
        module.fetch_rank_replay(
            client, keys, X_LENGTHS, rank=rank, num_layers=NUM_LAYERS, view="latest", **kw
        )


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_expansion_refuses_what_the_cut_would_change(svc: Service, framework: str) -> None:
    module = r3_slime if framework == "slime" else r3_miles
    run = f"x-{uuid.uuid4().hex[:8]}"
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        keys = module.rank_keys(run, X_INDICES)
        store_straddled(client, keys, seed=6)
        samples = x_samples(framework, keys)
        for bad in ("ppo", "reinforce_plus_plus", "gspo"):
            with pytest.raises(ValueError, match=f"advantage_estimator='{bad}'"):
                module.expand_samples(
                    samples, client, args=x_args(framework, advantage_estimator=bad)
                )
        with pytest.raises(ValueError, match="use_opsm"):
            module.expand_samples(samples, client, args=x_args(framework, use_opsm=True))
        if framework == "slime":  # slime's own normalization reshapes by count
            args = x_args(framework, custom_reward_post_process_path=None)
            with pytest.raises(ValueError, match="normalize_rewards"):
                module.expand_samples(samples, client, args=args)
        else:  # miles' counts each rollout once already
            module.expand_samples(samples, client, args=x_args(framework))
        samples[2].reward = None  # the reward model has not run: a cut copy would be scored
        with pytest.raises(ValueError, match=r"sample 2 .* has no reward"):
            module.expand_samples(samples, client)
        samples[2].reward = 0.5
        samples[1].reward = None  # one state, not cut: nothing to copy
        assert len(module.expand_samples(samples, client)) == len(X_COPIES)
        # a sample that trains nothing (remove_sample) keeps one whole copy, in its last state
        samples[2].loss_mask = [0] * samples[2].response_length
        got = module.expand_samples(samples, client)
        assert [len(c.tokens) for c in got[4:6]] == [30, 9]
        assert got[4].metadata["r3_state"] == 10 and got[4].loss_mask == samples[2].loss_mask
        lost = keyed(samples[0], "session_id" if framework == "slime" else "routing_key", "x.0")
        with pytest.raises(RolloutNotFoundError, match=f"{framework} rank-local routing"):
            module.expand_samples([lost], client)


def test_slime_normalize_rewards_counts_each_rollout_once(svc: Service) -> None:
    """On originals it is slime's own _post_process_rewards (ray/rollout.py:612-631,
    restated); on their expansion every copy gets its original's value."""

    def slime_post_process(args: Any, samples: Sequence[Any]) -> tuple[list[Any], list[float]]:
        raw = [s.reward for s in samples]
        rewards = torch.tensor(raw, dtype=torch.float)
        if rewards.shape[-1] == args.n_samples_per_prompt * args.rollout_batch_size:
            rewards = rewards.reshape(-1, args.n_samples_per_prompt)
        else:
            rewards = rewards.view(-1, rewards.shape[-1])
        rewards = rewards - rewards.mean(dim=-1, keepdim=True)
        if args.advantage_estimator in ["grpo", "gspo", "cispo"] and args.grpo_std_normalization:
            rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
        return raw, rewards.flatten().tolist()

    run = f"x-{uuid.uuid4().hex[:8]}"
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        keys = r3_slime.rank_keys(run, X_INDICES)
        store_straddled(client, keys, seed=7)
        originals = x_samples("slime", keys)
        for kw in ({}, {"grpo_std_normalization": False}, {"rollout_batch_size": 3}):
            args = x_args("slime", **kw)
            raw, want = slime_post_process(args, originals)
            got_raw, got = r3_slime.normalize_rewards(args, originals)
            assert got_raw == raw and got == pytest.approx(want, abs=1e-6)
            copies = r3_slime.expand_samples(originals, client, args=args)
            _, spread = r3_slime.normalize_rewards(args, copies)
            origin = [o for o, _, _ in X_COPIES]
            assert spread == pytest.approx([want[o] for o in origin], abs=1e-6)
        args = x_args("slime", rewards_normalization=False)
        assert r3_slime.normalize_rewards(args, originals)[1] == [1.0, 0.0, 0.5, 2.0]
        copies = r3_slime.expand_samples(originals, client)
        copies[1].reward = 3.0
        with pytest.raises(ValueError, match="must share one reward"):
            r3_slime.normalize_rewards(x_args("slime"), copies)


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_the_hooks_replay_an_expanded_step_in_each_state(
    svc: Service, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The installed hooks on an expanded step: each rank tells each copy's state from the
    shipped loss masks and response lengths (one stat per call) and records what the
    framework's own fill records from each copy's own state's layout; the unexpanded step
    is refused; a source without stats reads every copy in its first state (refused)."""
    module = r3_slime if framework == "slime" else r3_miles
    run = f"hx-{uuid.uuid4().hex[:8]}"
    calls: list[dict[str, Any]] = []
    state: list[Any] = [None]
    slime_actor = stub_slime(monkeypatch)
    stub_miles(monkeypatch, calls, state)
    micro = [[2, 0, 5], [1, 6, 3, 4]]
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        keys = module.rank_keys(run, X_INDICES)
        states = store_straddled(client, keys, seed=8)
        originals = x_samples(framework, keys)
        copies = module.expand_samples(originals, client)
        fields = own_fields(framework, copies, states)

        def data_of(samples: Sequence[Any], mbs: list[list[int]], vpp: int | None) -> Any:
            data: dict[str, Any] = {
                "tokens": [torch.tensor(s.tokens) for s in samples],
                "sample_indices": [s.index for s in samples],
                "loss_masks": [
                    torch.tensor(s.loss_mask or [1] * s.response_length, dtype=torch.int)
                    for s in samples
                ],
                "response_lengths": [s.response_length for s in samples],
                "micro_batch_indices": mbs,
            }
            return data, [DataIterator(data, mbs) for _ in range(vpp or 1)]

        def fill(source: Any, cfg: Cfg, pipe: tuple[int, int | None, int], data: Any) -> list[Any]:
            recorders = [Recorder() for _ in PIPELINES[pipe]]
            d, iterators = data
            if framework == "slime":
                hook = r3_slime.install_rank_local(hook_args(cfg), source=source, run=run)
                actor = slime_actor()
                actor.args, actor.model = hook_args(cfg), model_chunks(pipe[0], pipe[1])  # type: ignore[attr-defined]
                RoutingReplay.all_routing_replays[:] = recorders
                hook(actor, iterators, [1] * len(d["micro_batch_indices"]), d)
            else:
                hook = r3_miles.install_rank_local(hook_args(cfg), source=source, run=run)
                hook(
                    args=hook_args(cfg), models=model_chunks(pipe[0], pipe[1]),
                    data_iterator=iterators, num_microbatches=[1] * len(d["micro_batch_indices"]),
                    rollout_data=d,
                    data_key="rollout_routed_experts", replay_list=recorders,
                    register_replay_list_func=None,
                )  # fmt: skip
            return recorders

        for cfg, t, r, pipe, rank in hook_ranks()[::2]:
            with monkeypatch.context() as mp:
                answer_mpu(mp, cfg.tp, t, cfg.cp, r, pipe[2])
                state[0] = types.SimpleNamespace(tp=group(cfg.tp, t), cp=group(cfg.cp, r))
                recorders = fill(client, cfg, pipe, data_of(copies, micro, pipe[1]))
                for j, rec in enumerate(recorders):
                    assert len(rec.recorded) == len(micro)
                    for got, mb in zip(rec.recorded, micro, strict=True):
                        counts = [len(copies[i].tokens) for i in mb]
                        want = their_fill(framework, [fields[i] for i in mb], counts, rank)[j]
                        assert got.dtype == torch.int32 and torch.equal(got, want.to(torch.int32))
        assert calls == []
        with monkeypatch.context() as mp:
            cfg, pipe = Cfg(1, 1, False), (1, None, 0)
            answer_mpu(mp, 1, 0, 1, 0, 0)
            state[0] = types.SimpleNamespace(tp=group(1, 0), cp=group(1, 0))
            with pytest.raises(InvalidRequestError, match="expand the sample"):
                fill(client, cfg, pipe, data_of(originals, [[0, 1], [2, 3]], None))
            with pytest.raises(InvalidRequestError, match="expand the sample"):
                fill(reader, cfg, pipe, data_of(copies, micro, None))  # no stats: first states
            # a step without views reads through a DirectReader as before
            plain = [c for c, (o, *_) in zip(copies, X_COPIES, strict=True) if o == 1]
            fill(reader, cfg, pipe, data_of(plain, [[0], [0]], None))
