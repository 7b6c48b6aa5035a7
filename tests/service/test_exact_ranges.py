"""Rank-local reads of every view policy: a rank reads rows by range under the state its
(expanded) sample replays, and gets exactly the routing those tokens attended to.

A rollout written as the engine's shipper writes a three-turn agent with a weight push
before each later turn: turn 1 stores rows ``[0, 40)``; turn 2 recomputes them (a view
serving row 40) and stores ``[40, 100)``; turn 3 recomputes ``[0, 100)`` (a view serving
row 100) and stores ``[100, 150)``.  Three states.  Against the real service (HTTP and
gRPC, single Redis and Cluster) and Redis read directly (:class:`DirectReader`):
``get_ranges`` under ``exact`` equals ``get_served(view="exact")`` state by state, under
``latest`` / ``generated`` equals ``get``; a read that reaches past its state, or names
a state the rollout does not have, is refused; and a step expanded one training sample
per state (:func:`expand_states`) fetched rank by rank is every state's own routing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from r3_client import (
    DirectReader,
    InvalidRequestError,
    Routing,
    RoutingClient,
    expand_infos,
    expand_states,
)
from r3_client.layouts import megatron_layout
from r3_client.rank_local import fetch_megatron_rank_batch
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, E, K, frame_for, rid
from tests.support.service_process import KEY_A, Service, url_of

TURNS = [(0, 40), (40, 100), (100, 150)]


def _rows(n: int, seed: int) -> np.ndarray:
    return synthetic_routing(n, len(LAYERS), E, K, skew=1.0, seed=seed)


def store_agent(c: RoutingClient, seed: int = 0) -> tuple[str, list[np.ndarray]]:
    """The three-turn agent; returns its id and each state's rows ``[0, end)``."""
    r = rid()
    first = _rows(150, seed)
    c.put(r, frame_for(first[:40], 0, version="w1", digest=False))
    again = _rows(40, seed + 1)  # turn 2's recompute of [0, 40) under w2
    c.put(r, frame_for(again, 0, version="w2", digest=False), view=40)
    c.put(r, frame_for(first[40:100], 40, version="w2", digest=False))
    third = _rows(100, seed + 2)  # turn 3's recompute of [0, 100) under w3
    c.put(r, frame_for(third, 0, version="w3", digest=False), view=100)
    c.put(r, frame_for(first[100:150], 100, version="w3", digest=False))
    s0 = first[:40]
    s1 = np.concatenate([again, first[40:100]])
    s2 = np.concatenate([third, first[100:150]])
    return r, [s0, s1, s2]


def _eq(got: Any, want: Any, msg: str = "") -> None:
    """Equal as the cache stores rows: each token's experts a set (canonical order)."""
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1), err_msg=msg)


def _plain(c: RoutingClient, n: int, seed: int) -> tuple[str, np.ndarray]:
    r = rid()
    rows = _rows(n, seed)
    c.put(r, frame_for(rows, 0, digest=False))
    return r, rows


READS = [(0, 40), (5, 17), (30, 40)], [(0, 100), (39, 41), (60, 100)], [(0, 150), (99, 101)]


@pytest.fixture
def agent(svc: Service) -> tuple[str, list[np.ndarray]]:
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        return store_agent(c)


def _readers(svc: Service, transport: str) -> list[Any]:
    return [
        RoutingClient(url_of(svc, transport), api_key=KEY_A),
        DirectReader.from_service(svc.http_url, api_key=KEY_A),
    ]


def test_exact_ranges_are_each_states_own_routing(
    svc: Service, transport: str, agent: tuple[str, list[np.ndarray]]
) -> None:
    r, states = agent
    starts = [a for a, _ in TURNS]
    for reader in _readers(svc, transport):
        with reader:
            reads = [(r, a, b, s) for s, spans in zip(starts, READS, strict=True) for a, b in spans]
            got = list(reader.get_ranges(reads, layers=[5, 1]))
            for (_, a, b, s), (rid_, routing) in zip(reads, got, strict=True):
                assert rid_ == r and (routing.start, routing.end) == (a, b)
                want = states[starts.index(s)][a:b][:, [0, 2]]  # layers 1 and 5, in id order
                _eq(routing.indices, want, f"{reader} {s}")
            # the default is exact, and a read with no state is the first state's
            ((_, first),) = reader.get_ranges([(r, 3, 30)])
            _eq(first.indices, states[0][3:30])


def test_each_row_is_received_once(
    svc: Service, transport: str, agent: tuple[str, list[np.ndarray]]
) -> None:
    """Under ``exact`` a row is asked of the service once, from where the answer takes it:
    the last applied view holding it, else the segments (issue 43: none read twice)."""
    r, states = agent
    asked: list[tuple[int | None, int, int]] = []  # (view or None: the segments, rows)
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        t = c._t
        inner_batch, inner_get = t.batch_get, t.get

        def batch(ids: Any, start: Any, end: Any, layers: Any, ranges: Any = None) -> Any:
            asked.extend((None, a, b) for a, b in ranges)
            yield from inner_batch(ids, start, end, layers, ranges)

        def get(rid: str, start: int, end: Any, layers: Any, *, view: Any = None) -> bytes:
            asked.append((view, start, end))
            return inner_get(rid, start, end, layers, view=view)

        t.batch_get = batch  # type: ignore[method-assign]
        t.get = get  # type: ignore[method-assign]
        reads = [(r, 0, 150, 100), (r, 30, 70, 40), (r, 0, 40, 0), (r, 10, 30, 40)]
        got = list(c.get_ranges(reads))
    for (_, a, b, s), (_, routing) in zip(reads, got, strict=True):
        _eq(routing.indices, states[[0, 40, 100].index(s)][a:b])
    assert asked == [
        (None, 100, 150),  # the batch: the rows no applied view holds
        (None, 40, 70),
        (None, 0, 40),  # the first state applies no view
        (100, 0, 100),  # the second push's view hides the first's rows
        (40, 30, 40),
        (40, 10, 30),  # wholly in a view: no batch item
    ]


def test_latest_and_generated_ranges_are_what_get_answers(
    svc: Service, transport: str, agent: tuple[str, list[np.ndarray]]
) -> None:
    r, _ = agent
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        whole = {p: c.get(r, view=p) for p in ("latest", "generated")}
        served = c.get_served(r)
    assert [(s.serves_start, s.serves_end) for s in served] == TURNS
    for reader in _readers(svc, transport):
        with reader:
            for policy, routing in whole.items():
                spans = [(0, 150), (10, 60), (99, 150)]
                got = list(reader.get_ranges([(r, a, b) for a, b in spans], view=policy))
                for (a, b), (_, part) in zip(spans, got, strict=True):
                    _eq(part.indices, routing.indices[a:b])


def test_exact_refuses_a_read_past_its_state_and_an_unknown_state(
    svc: Service, transport: str, agent: tuple[str, list[np.ndarray]]
) -> None:
    r, _ = agent
    for reader in _readers(svc, transport):
        with reader:
            with pytest.raises(InvalidRequestError, match=r"go past that state's rows \[0, 40\)"):
                list(reader.get_ranges([(r, 0, 41)]))  # a sample of several states
            with pytest.raises(InvalidRequestError, match=r"no state starting at row 50"):
                list(reader.get_ranges([(r, 0, 10, 50)]))
            with pytest.raises(InvalidRequestError, match='only view="exact" reads under'):
                list(reader.get_ranges([(r, 0, 10, 40)], view="latest"))
            with pytest.raises(InvalidRequestError, match="view must be one of"):
                list(reader.get_ranges([(r, 0, 10)], view="first"))  # type: ignore[arg-type]
            # per read with return_errors: the good read is answered beside the refused one
            got = list(reader.get_ranges([(r, 0, 100), (r, 0, 100, 40)], return_errors=True))
            assert isinstance(got[0][1], InvalidRequestError)
            assert isinstance(got[1][1], Routing) and got[1][1].end == 100


def test_an_expanded_step_is_fetched_rank_by_rank_in_each_state(
    svc: Service, transport: str
) -> None:
    """Expansion cuts the agent into its three states (and keeps a plain sample whole);
    every (tp, cp) rank's Megatron batch of the expanded micro-batch is the layout of the
    states' own routings."""
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        agent, states = store_agent(c, seed=7)
        plain, rows = _plain(c, 80, seed=9)
        ids = [plain, agent]
        exp = expand_states(c, ids, [81, 151])
        assert [(s.origin, s.state, s.end, s.num_tokens) for s in exp.states] == [
            (0, 0, 80, 81),
            (1, 0, 40, 41),
            (1, 40, 100, 101),
            (1, 100, 150, 151),
        ]
        assert (exp.extra_samples, exp.extra_tokens) == (2, 41 + 101)
        per_sample = [rows, *states]
        seqlens = exp.num_tokens
        routings = [Routing(x, E, LAYERS, 0) for x in per_sample]
        exp_ids = [s.rollout_id for s in exp.states]
        for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            for t in range(tp):
                for k in range(cp):
                    kw = dict(
                        tp_size=tp, tp_rank=t, cp_size=cp, cp_rank=k, sequence_parallel=tp > 1
                    )
                    want = megatron_layout(routings, seqlens=seqlens, **kw)  # type: ignore[arg-type]
                    got = fetch_megatron_rank_batch(
                        c,
                        exp_ids,
                        seqlens=seqlens,
                        states=exp.state_rows,
                        **kw,  # type: ignore[arg-type]
                    )
                    for x, y in zip(got.per_layer, want.per_layer, strict=True):
                        _eq(x, y, f"tp {t}/{tp} cp {k}/{cp}")
        # unexpanded, the straddled sample is refused under exact, never replayed stale
        with pytest.raises(InvalidRequestError, match="expand the sample"):
            fetch_megatron_rank_batch(c, ids, seqlens=[81, 151])
        # by name, one routing for every token (what the pre-dispatch check counts)
        latest = fetch_megatron_rank_batch(c, ids, seqlens=[81, 151], view="latest")
        whole = megatron_layout(
            [Routing(rows, E, LAYERS, 0), c.get(agent, view="latest")], seqlens=[81, 151]
        )
        for x, y in zip(latest.per_layer, whole.per_layer, strict=True):
            _eq(x, y)


def test_expansion_masks_train_each_token_once() -> None:
    """Every token of an original is trained by exactly one expanded sample, and each
    expanded sample trains only tokens of its state."""
    from r3_client import RolloutInfo, SegmentInfo, ViewInfo
    from r3_client._routing import Segment

    segs = tuple(
        SegmentInfo(Segment(a, b, "m", f"w{i}"), "set", 1, False) for i, (a, b) in enumerate(TURNS)
    )
    views = (ViewInfo(40, 0, 40, "w2", 1), ViewInfo(100, 0, 100, "w3", 1))
    info = RolloutInfo("x", E, K, LAYERS, 150, 3, 0, None, None, segs, views)
    for n in (151, 120, 60, 41, 40, 2, 1):
        exp = expand_infos([info], [n])
        masks = exp.token_masks(n)
        counts = masks.sum(axis=0)
        assert counts[0] == 0 and (counts[1:] == 1).all(), (n, counts)
        for s, m in zip(exp.states, masks, strict=True):
            trained = np.flatnonzero(m)
            if trained.size:
                assert trained[0] == s.state + 1 and trained[-1] <= s.end
            assert s.num_tokens <= n
    # verl-style masks over the response only (offset: the prompt's length)
    exp = expand_infos([info], [151])
    resp = exp.token_masks(151 - 20, offset=20)
    assert resp.sum() == 150 - 19 and resp[0].sum() == 40 - 19
    assert list(exp.take(np.array([7.0]))) == [7.0, 7.0, 7.0]
    assert list(exp.first) == [True, False, False]
