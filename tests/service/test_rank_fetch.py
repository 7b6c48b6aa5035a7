"""Rank-local fetch: each rank reads only its rows and layers, and gets exactly its slice.

Against a real cache service (HTTP and gRPC, Redis single and Cluster) and Redis read
directly (:class:`DirectReader`): for every tp x cp x stage rank of verl's layouts,
:func:`fetch_verl_rank_slice` equals :func:`verl_rank_slice` of the whole rollouts
(which tests/client/test_layout_slices.py proves equal to verl 0.9.1's own R3 code),
the rank receives fewer bytes than the whole step, and a missing, short or gapped
rollout is refused naming its sample before (``check_step``) or at the rank.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import redis

from cache_service.redis_proc import RedisProcess
from r3_client import (
    AsyncRoutingClient,
    DirectReader,
    InvalidRequestError,
    RolloutNotFoundError,
    RoutingClient,
    Segment,
    ServiceError,
    ShapeError,
    TransportError,
    encode_frame,
)
from r3_client.layouts import VerlRank, verl_rank_slice
from r3_client.rank_local import check_step, fetch_verl_rank_slice, prefetched
from r3_client.synthetic import synthetic_routing
from tests.support.counting import Counting
from tests.support.frames import rid
from tests.support.service_process import KEY_A, Service, url_of

E, K, LAYERS = 32, 4, (0, 2, 3, 5)


def _store(svc: Service, lengths: Sequence[tuple[int, int]], seed: int = 0) -> list[str]:
    """Rollouts of ``P + R`` tokens (``P + R - 1`` rows), stored as a prompt segment and a
    response segment (a continuation turn), as an engine writes them (2,048-row blocks)."""
    ids = []
    with svc.http() as c:
        for n, (p, r) in enumerate(lengths):
            key = rid()
            rows = synthetic_routing(p + r - 1, len(LAYERS), E, K, skew=1.0, seed=seed + n)
            cut = max(1, min(p, rows.shape[0] - 1))
            for a, b in ((0, cut), (cut, rows.shape[0])):
                if a >= b:
                    continue
                frame = encode_frame(
                    rows[a:b],
                    num_experts=E,
                    layer_ids=LAYERS,
                    segment=Segment(a, b, "tiny-moe", "v1"),
                )
                resp = c.put(f"/v1/rollouts/{key}/segments", content=frame)
                assert resp.status_code in (200, 201), resp.text
            ids.append(key)
    return ids


LENGTHS = [(1500, 4700), (8, 1), (2100, 6093), (21, 0), (4096, 4096)]

RANKS = [
    VerlRank(tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=c, stage_layers=stage, cp_layout=lay)
    for tp, cp, lay in (
        (1, 1, "zigzag"),
        (2, 1, "zigzag"),
        (1, 2, "zigzag"),
        (2, 2, "zigzag"),
        (2, 2, "contiguous"),
    )
    for t in range(tp)
    for c in range(cp)
    for stage in (None, (0, 2), (3, 5))
] + [VerlRank(tp_size=2, tp_rank=1, cp_size=2, cp_rank=0, fp8_padding=True)]


def _same(a: Any, b: Any) -> None:
    assert a.layer_ids == b.layer_ids
    assert len(a.per_layer) == len(b.per_layer)
    for x, y in zip(a.per_layer, b.per_layer, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.replay_mask, b.replay_mask)
    np.testing.assert_array_equal(a.cu_seqlens, b.cu_seqlens)
    np.testing.assert_array_equal(a.positions, b.positions)


@pytest.fixture
def step(svc: Service) -> tuple[list[str], list[int], list[int]]:
    return _store(svc, LENGTHS), [p for p, _ in LENGTHS], [r for _, r in LENGTHS]


def test_every_rank_fetches_exactly_its_slice(
    svc: Service, transport: str, step: tuple[list[str], list[int], list[int]]
) -> None:
    ids, p, r = step
    url = url_of(svc, transport)
    with RoutingClient(url, api_key=KEY_A) as client:
        whole = [routing for _, routing in client.get_many(ids)]
        whole_bytes = sum(len(client.get_frame(k)) for k in ids)
        counted = Counting(client)
        for rank in RANKS:
            want = verl_rank_slice(whole, p, r, rank=rank, rollout_ids=ids)
            counted.bytes = 0
            got = fetch_verl_rank_slice(counted, ids, p, r, rank=rank)
            _same(got, want)
            assert got.rollout_ids == tuple(ids)
            if rank.tp_size * rank.cp_size == 4 and rank.stage_layers is not None:
                # a quarter of the rows of half the layers: well under half the step
                assert counted.bytes < whole_bytes / 2, (rank, counted.bytes, whole_bytes)


def test_direct_reads_give_the_same_slices(
    svc: Service, step: tuple[list[str], list[int], list[int]]
) -> None:
    ids, p, r = step
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        whole = [routing for _, routing in client.get_many(ids)]
        for rank in RANKS[::3]:
            want = verl_rank_slice(whole, p, r, rank=rank)
            _same(fetch_verl_rank_slice(reader, ids, p, r, rank=rank, as_torch=True), want)


def test_a_dense_stage_reads_nothing(svc: Service, step: Any) -> None:
    ids, p, r = step
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        counted = Counting(client)
        got = fetch_verl_rank_slice(counted, ids, p, r, rank=VerlRank(stage_layers=()))
        assert got.per_layer == [] and got.layer_ids == () and counted.bytes == 0
        assert got.num_local_tokens == sum(p) + sum(r)


def test_missing_short_and_gapped_rollouts_are_refused_naming_the_sample(svc: Service) -> None:
    ok, short = _store(svc, [(10, 10), (10, 10)])
    gap = rid()
    with svc.http() as c:  # rows [0, 5) and [12, 19): nobody shipped [5, 12)
        rows = synthetic_routing(19, len(LAYERS), E, K, seed=3)
        for a, b in ((0, 5), (12, 19)):
            frame = encode_frame(
                rows[a:b], num_experts=E, layer_ids=LAYERS, segment=Segment(a, b, "m", "v1")
            )
            assert c.put(f"/v1/rollouts/{gap}/segments", content=frame).status_code in (200, 201)
    lost = rid()
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        for source in (client, reader):
            with pytest.raises(RolloutNotFoundError, match=rf"sample 1 \(rollout '{lost}'\)"):
                fetch_verl_rank_slice(source, [ok, lost], [10, 10], [10, 10])
            with pytest.raises(
                ShapeError, match=rf"sample 1 \(rollout '{short}'\).*rows \[\d+, 24\)"
            ):
                fetch_verl_rank_slice(source, [ok, short], [10, 10], [10, 15])
            with pytest.raises(ShapeError, match=r"sample 0 \(rollout .*token rows \[5, 12\)"):
                fetch_verl_rank_slice(source, [gap], [10], [10])
            filled = fetch_verl_rank_slice(source, [gap], [10], [10], missing="fill")
            assert (filled.per_layer[0][5:12] == 0).all() and (filled.per_layer[0][:5] >= 0).all()
        check_step(client, [ok, short], [20, 20])
        with pytest.raises(ShapeError) as info:
            check_step(client, [ok, lost, short, gap], [20, 20, 25, 20])
        msg = str(info.value)
        assert msg.startswith("3 of 4 samples cannot be replayed")
        assert f"sample 1 (rollout '{lost}') is not in the cache" in msg
        assert f"sample 2 (rollout '{short}') holds 19 rows, its sample needs 24" in msg
        assert f"sample 3 (rollout '{gap}') has no rows [5, 12)" in msg
        check_step(client, [gap], [20], missing="fill")
        with pytest.raises(RolloutNotFoundError, match="1 of 1 samples"):
            check_step(client, [lost], [5])


def test_the_batch_stream_answers_each_range_and_refuses_bad_ones(
    svc: Service, transport: str
) -> None:
    (key,) = _store(svc, [(30, 30)])
    url = url_of(svc, transport)
    with RoutingClient(url, api_key=KEY_A) as client:
        reads = [(key, 0, 7), (key, 40, 59), (key, 50, 70), (key, 3, 4)]
        got = list(client.get_ranges(reads, layers=[2, 5], return_errors=True))
        whole = client.get(key)
        for (k, a, b), (gk, res) in zip(reads, got, strict=True):
            assert gk == k
            if b > whole.end:
                assert isinstance(res, InvalidRequestError) and "outside" in str(res)
                continue
            assert not isinstance(res, Exception)
            assert (res.start, res.end, res.layer_ids) == (a, b, (2, 5))
            np.testing.assert_array_equal(res.indices, whole.indices[a:b, [1, 3]])
        with pytest.raises(ShapeError):
            list(client.get_ranges([(key, 5, 5)]))
    with svc.http() as c:
        for body, why in (
            ({"rollout_ids": [key], "ranges": [[0, 1], [1, 2]]}, "2 row ranges for 1"),
            ({"rollout_ids": [key], "start": 3, "ranges": [[0, 1]]}, "not both"),
            ({"rollout_ids": [key], "ranges": [[4, 2]]}, r"ranges\[0\] = \[4, 2\)"),
            ({"rollout_ids": [key], "ranges": [[-1, 2]]}, r"ranges\[0\]"),
            ({"rollout_ids": [key], "ranges": [[0, 1 << 41]]}, r"ranges\[0\]"),
        ):
            resp = c.post("/v1/batch/get", json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert re.search(why, resp.json()["error"]["message"]), resp.text


def test_prefetched_runs_one_ahead_in_order_and_raises_at_the_item() -> None:
    seen: list[int] = []

    def fetch(i: int) -> int:
        seen.append(i)
        if i == 3:
            raise ValueError("boom")
        return i * 10

    it = prefetched(range(5), fetch)
    assert next(it) == (0, 0)
    # the next item is fetched while the caller holds the first, without another next()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen[:2] == [0, 1]
    assert next(it) == (1, 10) and next(it) == (2, 20)
    with pytest.raises(ValueError, match="boom"):
        next(it)
    assert list(itertools.islice(prefetched([], fetch), 1)) == []


def test_a_ranks_ranges_of_one_rollout_are_one_redis_read(
    service_single: Service, redis_single: RedisProcess
) -> None:
    """A rank's two zigzag chunks of a rollout come from one read of its segments: Redis
    sends the segment's head once and only the chunks the two ranges need (the chunked
    layout, issue 44: before it, the whole segment once), less than two reads would."""
    (key,) = _store(service_single, [(7999, 1)])  # rows [0, 7998) in one segment
    r = redis.Redis.from_url(redis_single.url)
    try:
        with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
            stored = client.stat(key).stored_bytes

            def sent(reads: list[tuple[str, int, int]]) -> int:
                before = int(r.info("stats")["total_net_output_bytes"])
                list(client.get_ranges(reads, layers=[2]))
                return int(r.info("stats")["total_net_output_bytes"]) - before

            grouped = sent([(key, 0, 1000), (key, 6000, 7998)])
            apart = sent([(key, 0, 1000)]) + sent([(key, 6000, 7998)])
    finally:
        r.close()
    assert grouped < apart and grouped < 0.5 * stored, (grouped, stored, apart)


def test_batch_stat_answers_every_id_in_one_request(svc: Service, transport: str) -> None:
    ids = _store(svc, [(10, 10), (5, 3)])
    lost = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:
        got = client.stat_many([ids[0], lost, ids[1], ids[0]])

        def same(a: object, b: object) -> bool:  # the TTL ticks between two stats
            return dataclasses.replace(a, ttl_s=None) == dataclasses.replace(b, ttl_s=None)  # type: ignore[type-var]

        assert same(got[0], client.stat(ids[0])) and same(got[3], got[0])
        assert same(got[2], client.stat(ids[1]))
        assert isinstance(got[1], RolloutNotFoundError) and lost in str(got[1])

        def no_single_stat(rollout_id: str) -> object:
            raise AssertionError("check_step must not stat rollouts one by one")

        client._t.stat = no_single_stat  # type: ignore[method-assign]
        check_step(client, ids, [20, 8])
        with pytest.raises(RolloutNotFoundError, match=rf"sample 1 \(rollout '{lost}'\)"):
            check_step(client, [ids[0], lost], [20, 8])

    async def from_async() -> list[object]:
        async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as ac:
            return list(await ac.stat_many([lost, ids[1]], chunk_size=1))

    async_got = asyncio.run(from_async())
    assert isinstance(async_got[0], RolloutNotFoundError) and same(async_got[1], got[2])
    with svc.http() as c:  # the service answers a hostile id in its item, the others too
        body = c.post("/v1/batch/stat", json={"rollout_ids": [ids[0], "../x", lost]}).json()
        codes = [item["error"]["code"] if item["error"] else "ok" for item in body["items"]]
        assert codes == ["ok", "invalid_request", "not_found"]
        assert [item["status"] for item in body["items"]] == [None, 400, 404]
        too_many = c.post("/v1/batch/stat", json={"rollout_ids": ["a"] * 5000})
        assert too_many.status_code == 413, too_many.text
        assert c.post("/v1/batch/stat", json={"rollout_ids": []}).status_code in (400, 422)
    with svc.http(key=None) as c:
        assert c.post("/v1/batch/stat", json={"rollout_ids": [ids[0]]}).status_code == 401


def test_a_service_without_batch_stat_is_asked_id_by_id(svc: Service, transport: str) -> None:
    """A service older than ``POST /v1/batch/stat`` (HTTP 404 on the route, gRPC
    UNIMPLEMENTED; simulated: the running service has the route) is asked one ``stat``
    per id; any other failure of the batch stat still raises."""
    (key,) = _store(svc, [(6, 6)])
    lost = rid()
    old = (
        TransportError("gRPC call failed with UNIMPLEMENTED: Method not found!")
        if transport == "grpc"
        else ServiceError("Not Found", status=404)
    )
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as client:

        def older(ids: object) -> object:
            raise old

        client._t.stat_many = older  # type: ignore[method-assign]
        got = client.stat_many([key, lost])
        assert got[0].num_rows == 11 and isinstance(got[1], RolloutNotFoundError)  # type: ignore[union-attr]
        check_step(client, [key], [12])

        def down(ids: object) -> object:
            raise ServiceError("internal error", status=500)

        client._t.stat_many = down  # type: ignore[method-assign]
        with pytest.raises(ServiceError, match="internal"):
            client.stat_many([key])


def test_a_micro_batch_decodes_into_its_targets_in_one_compiled_call(
    svc: Service, transport: str, step: tuple[list[str], list[int], list[int]], monkeypatch: Any
) -> None:
    """A rank's reads answered undecoded (``get_ranges(decode=False)``) go straight into its
    int64 targets by one ``decode_into`` call per micro-batch, through the service and read
    directly, equal to the reference; a source whose ``get_ranges`` takes no ``decode``
    (a caller's own) is decoded by the reference, as before."""
    from r3_client._kernels import native

    if not native.decodes_into(True):
        pytest.skip("the compiled codec (with libzstd) is not built here")
    calls: list[int] = []
    real = native.decode_into

    def counted(jobs: Any) -> Any:
        calls.append(len(jobs))
        return real(jobs)

    monkeypatch.setattr(native, "decode_into", counted)
    ids, p, r = step

    class OwnSource:  # a caller's source: no decode= (the reference path)
        def __init__(self, client: RoutingClient) -> None:
            self.client = client

        def get_ranges(
            self,
            reads: Any,
            *,
            layers: Any = None,
            view: Any = "exact",
            return_errors: bool = False,
        ) -> Any:
            return self.client.get_ranges(
                reads, layers=layers, view=view, return_errors=return_errors
            )

    with (
        RoutingClient(url_of(svc, transport), api_key=KEY_A) as client,
        DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader,
    ):
        whole = [routing for _, routing in client.get_many(ids)]
        for rank in RANKS[::4]:
            want = verl_rank_slice(whole, p, r, rank=rank)
            for source in (client, reader):
                calls.clear()
                _same(fetch_verl_rank_slice(source, ids, p, r, rank=rank), want)
                if rank.stage_layers != ():
                    assert len(calls) == 1 and calls[0] >= 1, (rank, type(source), calls)
            calls.clear()
            _same(fetch_verl_rank_slice(OwnSource(client), ids, p, r, rank=rank), want)
            assert calls == []


def test_pinned_targets_without_cuda_are_refused_naming_why(
    svc: Service, step: tuple[list[str], list[int], list[int]]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this process has a CUDA device (tests/client/test_pinned_targets.py)")
    ids, p, r = step
    with (
        RoutingClient(svc.http_url, api_key=KEY_A) as client,
        pytest.raises(InvalidRequestError, match="pin_memory=True needs a CUDA device"),
    ):
        fetch_verl_rank_slice(client, ids, p, r, rank=RANKS[0], pin_memory=True)
