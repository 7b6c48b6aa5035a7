"""PD disaggregation's two writers of one rollout, on the real hook code and the real cache.

A prefill server and a decode server each run the plugin's :class:`Shipper` (two
processes: two shippers here) and write their rows of a turn under the same rollout
id: prefill ``[stored, P)``, decode ``[P, P+N-1)`` (``sglang_r3.http_server.pd``).  The decode
write may land first, leaving a gap below it that the prefill write fills; every
lookup either server makes before generation must still see a trajectory it can check.
No transfer backend needed (tests/engine/test_pd.py runs the real pair).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from r3_client import AsyncRoutingClient, RoutingClient
from r3_client.synthetic import synthetic_routing
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.pd import check_decode_retractions, decode_start, is_decode_server
from sglang_r3.http_server.shipping import Continuation, Shipper
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import moe_shape
from sglang_r3.scheduler.row_transport import EngineRows
from tests.support.service_process import KEY_A, Service

SHAPE = moe_shape(
    SimpleNamespace(
        num_hidden_layers=3, num_experts_per_tok=2, num_experts=8, model_type="qwen3_moe"
    )
)


def tag(rollout: str) -> OutputTag:
    return OutputTag(0, 0, rollout, "", False, False)


def shipper(svc: Service) -> Shipper:
    return Shipper(EngineConfig(routing_cache=svc.http_url, api_key=KEY_A), SHAPE, "tiny")


def engine_rows(n: int, seed: int) -> np.ndarray:
    return synthetic_routing(n, 3, 8, 2, skew=1.0, seed=seed).astype(np.int32)


async def test_decode_rows_land_before_prefill_rows_over_two_turns(svc: Service) -> None:
    """Per turn: both servers look up before generation (prefill: the contiguous
    trajectory; decode: gaps allowed), decode's segment is stored first above a gap,
    prefill's fills it; the rollout then reads as the rows of one engine."""
    rollout = f"pd-order-{np.random.default_rng().integers(1 << 30)}"
    prefill, decode = shipper(svc), shipper(svc)
    t = tag(rollout)
    tokens = list(range(3, 200))
    truth = engine_rows(len(tokens) - 1, seed=7)  # row i: the forward of position i
    stored_end = 0
    for p, n in ((40, 9), (70, 12)):  # turn 2's prompt = turn 1's tokens + 21 more
        prompt, output = tokens[:p], tokens[p : p + n]
        # Before generation (the prefill server looks up first: decode waits for its KV).
        cont_p = await prefill.continuation(rollout)
        cont_d = await decode.continuation(rollout, gaps=True)
        assert (cont_p.end if cont_p else 0) == stored_end
        start_d = decode_start(t, cont_d, prompt)
        assert start_d == p
        # Decode's write lands first: rows [P, P+N-1) above a gap.
        ref_d = await decode.ship(t, start_d, EngineRows(truth[p : p + n - 1]), prompt, output, {})
        assert ref_d["stored"] and (ref_d["start"], ref_d["end"]) == (p, p + n - 1)
        with pytest.raises(R3RequestError) as err:  # prefill's view of a gap: not continuable
            await prefill.continuation(rollout)
        assert err.value.status_code == 409 and "gaps" in str(err.value)
        gapped = await decode.continuation(rollout, gaps=True)
        assert gapped is not None and gapped.end == p + n - 1
        # Then prefill's: rows [stored, P) of its answer (prompt + its first token).
        ref_p = await prefill.ship(
            t, stored_end, EngineRows(truth[stored_end:p]), prompt, output[:1], {}
        )
        assert ref_p["stored"] and (ref_p["start"], ref_p["end"]) == (stored_end, p)
        stored_end = p + n - 1
        whole = await prefill.continuation(rollout)
        assert whole is not None and whole.end == stored_end
    async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as client:
        got = await client.get(rollout)
    assert (got.start, got.end) == (0, stored_end)
    assert [(s.start, s.end) for s in got.segments] == [(0, 40), (40, 48), (48, 70), (70, 81)]
    np.testing.assert_array_equal(np.sort(got.indices, -1), np.sort(truth[:stored_end], -1))
    for s in (prefill, decode):
        await s.client.aclose()


async def test_prefill_rows_land_first_and_decode_sees_the_prompt_stored(svc: Service) -> None:
    """The usual order: prefill's [0, P) is stored when decode looks up (stored end ==
    P is a valid prefix for decode, not a conflict)."""
    rollout = f"pd-order-{np.random.default_rng().integers(1 << 30)}"
    prefill, decode = shipper(svc), shipper(svc)
    t = tag(rollout)
    tokens = list(range(10, 60))
    truth = engine_rows(len(tokens) - 1, seed=3)
    prompt, output = tokens[:30], tokens[30:]
    await prefill.ship(t, 0, EngineRows(truth[:30]), prompt, output[:1], {})
    cont = await decode.continuation(rollout, gaps=True)
    assert cont is not None and cont.end == 30
    start = decode_start(t, cont, prompt)
    ref = await decode.ship(t, start, EngineRows(truth[30:]), prompt, output, {})
    assert (ref["start"], ref["end"]) == (30, 49)
    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
        got = client.get(rollout)
    np.testing.assert_array_equal(np.sort(got.indices, -1), np.sort(truth, -1))
    for s in (prefill, decode):
        await s.client.aclose()


def test_decode_prefix_check() -> None:
    """Decode refuses a prompt that does not extend what is stored (409 before any
    compute, as prefill does), and accepts one whose rows are stored up to its end."""
    from r3_client import token_digest

    t = tag("pd-prefix")
    prompt = list(range(100, 140))
    assert decode_start(t, None, prompt) == 40
    assert decode_start(t, Continuation(40, token_digest(prompt)), prompt) == 40
    assert decode_start(t, Continuation(25, token_digest(prompt[:25])), prompt) == 40
    for cont in (
        Continuation(41, token_digest([*prompt, 7])),  # stored past this prompt
        Continuation(25, token_digest([*prompt[:24], 0])),  # another trajectory
    ):
        with pytest.raises(R3RequestError) as err:
            decode_start(t, cont, prompt)
        assert err.value.status_code == 409


def test_decode_retraction_is_refused_whatever_the_policy() -> None:
    check_decode_retractions(tag("r"), {"num_retractions": 0})
    with pytest.raises(R3RequestError) as err:
        check_decode_retractions(tag("r"), {"num_retractions": 2})
    assert err.value.status_code == 503 and "restored its KV" in str(err.value)


def test_decode_server_is_told_by_its_server_args() -> None:
    def tm(mode: str) -> SimpleNamespace:
        return SimpleNamespace(server_args=SimpleNamespace(disaggregation_mode=mode))

    assert is_decode_server(tm("decode"))
    assert not is_decode_server(tm("prefill"))
    assert not is_decode_server(tm("null"))
    assert not is_decode_server(SimpleNamespace())
