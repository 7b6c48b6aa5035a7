"""Megatron-Core replay from rank-local fetches: each rank reads its rows, real routers replay them.

Against a real cache service (HTTP and gRPC) and Redis read directly:
:func:`fetch_megatron_rank_batch` equals :func:`megatron_layout` of the whole rollouts for
every tp x cp x SP x stage rank (tests/client/test_layout_slices.py proves that layout
equal to Megatron-Core's own CP and SP splits), and a real ``GPTModel``'s ``TopKRouter``
s (all-MoE and dense-first), driven by ``RouterReplayDriver`` with a batch fetched that
way, route every token of every MoE layer exactly as the cache holds it, in the forward
and in the full recompute.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from r3_client import DirectReader, RoutingClient, ShapeError
from r3_client.layouts import megatron_layout
from r3_client.rank_local import fetch_megatron_rank_batch
from r3_client.replay.megatron import RouterReplayDriver
from tests.replay.test_megatron_model import (
    DENSE_FIRST,
    SHAPE,
    RoutingSpy,
    assert_routes,
    foreign_routings,
    loss_of,
    packed_tokens,
    replayed,
)
from tests.support.frames import rid
from tests.support.megatron_model import Shape, build_gpt, forward, megatron_env, schedule_env
from tests.support.service_process import KEY_A, Service, url_of

pytest.importorskip("megatron.core.transformer.moe.router_replay")

LENGTHS = [700, 37, 2600, 9, 1501]  # rows straddle the 2,048-row blocks


def _store(client: RoutingClient, routings: list) -> list[str]:  # type: ignore[type-arg]
    ids = []
    for routing in routings:
        key = rid()
        client.put(key, routing)
        ids.append(key)
    return ids


def _same(got: object, want: object) -> None:
    for x, y in zip(got.per_layer, want.per_layer, strict=True):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(x, y)
    for name in ("layer_ids", "rollout_ids"):
        assert getattr(got, name) == getattr(want, name)
    for name in ("cu_seqlens", "seqlens", "positions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


RANKS = [
    dict(tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=c, sequence_parallel=sp, stage_layers=st)
    for tp, cp, sp in ((1, 1, False), (2, 1, True), (2, 1, False), (1, 2, False), (2, 2, True))
    for t, c in itertools.product(range(tp), range(cp))
    for st in (None, (1,), (2,))
]


def test_every_rank_fetches_what_megatron_layout_lays_out(svc: Service, transport: str) -> None:
    shape = DENSE_FIRST
    routings = foreign_routings(LENGTHS, shape.moe_layer_ids, 5, shape)
    with (
        RoutingClient(url_of(svc, transport), api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        ids = _store(client, routings)
        whole = [routing for _, routing in client.get_many(ids)]  # the rows as the cache holds them
        for n, rank in enumerate(RANKS):
            want = megatron_layout(whole, seqlens=LENGTHS, rollout_ids=ids, **rank)  # type: ignore[arg-type]
            source = reader if n % 4 == 3 else client
            got = fetch_megatron_rank_batch(source, ids, seqlens=LENGTHS, **rank)  # type: ignore[arg-type]
            _same(got, want)
        with pytest.raises(ShapeError, match=r"sample 2 \(rollout .*rows"):
            fetch_megatron_rank_batch(client, ids, seqlens=[700, 37, 2700, 9, 1501])
        with pytest.raises(ShapeError, match="empty"):
            fetch_megatron_rank_batch(client, ids, seqlens=LENGTHS, stage_layers=())


@pytest.fixture
def cpu() -> Iterator[torch.device]:
    dev = torch.device("cpu")
    with megatron_env(dev):
        yield dev


@pytest.mark.parametrize("shape", [SHAPE, DENSE_FIRST], ids=["all-moe", "dense-first"])
def test_real_routers_replay_a_rank_local_fetch(
    svc: Service, cpu: torch.device, shape: Shape
) -> None:
    lengths = [7, 5]
    routings = foreign_routings(lengths, shape.moe_layer_ids, 13, shape)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        ids = _store(client, routings)
        batch = fetch_megatron_rank_batch(client, ids, seqlens=lengths)
    model = build_gpt(shape, cpu, recompute=True)
    n_moe = len(shape.moe_layer_ids)
    spy = RoutingSpy(model, count=n_moe)
    driver = RouterReplayDriver(model.config, model=model)
    tokens = packed_tokens(batch, 13, cpu)
    driver.add_micro_batch(batch, cpu, cu_seqlens=batch.cu_seqlens)
    with driver.forward():
        loss = loss_of(forward(model, tokens))
    with driver.backward():
        loss.backward()
    driver.finish_step()
    spy.close()
    assert [layer for layer, _ in spy.calls] == [*range(n_moe), *reversed(range(n_moe))]
    for layer, got in spy.calls:
        # the rows as stored, at each sample's tokens; -1 (last tokens) as experts 0..K-1
        want = np.full((sum(lengths), shape.topk), -1)
        at = 0
        for t, routing in zip(lengths, routings, strict=True):
            want[at : at + t - 1] = routing.indices[:, layer]
            at += t
        np.testing.assert_array_equal(np.sort(batch.per_layer[layer], 1), np.sort(want, 1))
        assert_routes(got, replayed(want, shape.topk))


def test_megatrons_schedule_replays_batches_fetched_while_it_runs(
    svc: Service, cpu: torch.device
) -> None:
    """``wrap_forward_step`` over a lazy ``prefetched`` stream: each micro-batch's routing
    is read from the cache (the next one while the schedule runs the current one) and
    every router of every forward and recompute routes as the cache holds it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from r3_client.rank_local import prefetched

    lengths = [[7, 5], [4, 8], [12]]
    model = build_gpt(SHAPE, cpu, recompute=True)
    spy = RoutingSpy(model)
    driver = RouterReplayDriver(model.config, model=model)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        stored = [
            _store(client, foreign_routings(mb, SHAPE.moe_layer_ids, 20 + n))
            for n, mb in enumerate(lengths)
        ]
        fetched: list = []  # type: ignore[type-arg]

        def fetch(n: int) -> object:
            batch = fetch_megatron_rank_batch(client, stored[n], seqlens=lengths[n])
            fetched.append(batch)
            return batch

        data = iter([torch.randint(0, 256, (1, sum(mb))) for mb in lengths])

        def forward_step(data_iterator: object, model: object) -> object:
            output = forward(model, next(data_iterator))  # type: ignore[call-overload]

            def loss_func(output_tensor: torch.Tensor) -> object:
                loss = loss_of(output_tensor)
                return loss, {"loss": loss.detach()}

            return output, loss_func

        stream = (batch for _, batch in prefetched(range(len(lengths)), fetch))
        with schedule_env(cpu):
            get_forward_backward_func()(
                forward_step_func=driver.wrap_forward_step(forward_step, stream),  # type: ignore[arg-type]
                data_iterator=data,
                model=[model],
                num_microbatches=len(lengths),
                seq_length=12,
                micro_batch_size=1,
                forward_only=False,
            )
    driver.finish_step()
    spy.close()
    assert len(fetched) == len(lengths)
    assert len(spy.calls) == len(lengths) * 2 * SHAPE.layers
    for n, (layer, ids) in enumerate(spy.calls):
        batch = fetched[n // (2 * SHAPE.layers)]
        assert_routes(ids, replayed(batch.per_layer[layer], SHAPE.topk))
