"""The pre-dispatch check (``check_step``) reports tokens replayed off their own state.

Against the real service (HTTP and gRPC, single Redis): a rollout of 100 rows stored as
segments ``[0, 40)`` and ``[40, 100)``, whose second call recomputed rows ``[0, 40)`` (a
view serving row 40).  Tokens ``1 … 40`` attended to the first computation, tokens
``41 … 100`` to the view's rows.  A 101-token sample replayed under one routing has some
tokens off their state: ``generated`` gives tokens 41 … 100 the first computation (60
tokens), ``latest`` gives tokens 1 … 40 the view's rows (40 tokens, every one attended to
rows ``[0, t)`` and ``t > 0`` reaches the view's first row, 0); ``exact`` never has any:
of the first state over 41 tokens nothing to expand, of the whole 101 tokens with no state
given one sample the exact replay expands into two (one more sample of 41 tokens), counted
under its own name (``expansion_totals``), never as off-state (issue 53: it was counted as
60 off-state tokens, a false alarm on the default path).  Each report is logged and
counted.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

from r3_client import InvalidRequestError, RoutingClient, ShapeError
from r3_client.rank_local import (
    StepCheck,
    check_step,
    checked_totals,
    expansion_totals,
    off_state_totals,
)
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, K, frame_for, rid
from tests.support.service_process import KEY_A, Service, url_of

#: What the second call computed for the rows it recomputed.
RECOMPUTED = synthetic_routing(100, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=11)
LOGGER = "r3_client.rank_local"


def _store_with_view(c: RoutingClient) -> str:
    """Turn 1: rows [0, 40); turn 2 recomputed [0, 40) under v2 and added [40, 100)."""
    r = rid()
    c.put(r, frame_for(TRAJ[:40], 0))
    c.put(r, frame_for(RECOMPUTED[0:40], 0, version="v2"), view=40)
    c.put(r, frame_for(TRAJ[40:100], 40, version="v2"))
    return r


def _plain(c: RoutingClient, rows: int) -> str:
    r = rid()
    c.put(r, frame_for(TRAJ[:rows], 0))
    return r


def _prometheus(policy: str) -> tuple[float, float] | None:
    """The Prometheus counters' values for ``policy`` (None without prometheus_client)."""
    if importlib.util.find_spec("prometheus_client") is None:
        return None
    from prometheus_client import REGISTRY

    def value(name: str) -> float:
        got = REGISTRY.get_sample_value(name, {"policy": policy})
        return 0.0 if got is None else got

    return value("r3_client_off_state_samples_total"), value("r3_client_off_state_tokens_total")


def _totals(policy: str) -> tuple[int, int]:
    got = off_state_totals().get(policy, {})
    return got.get("samples", 0), got.get("tokens", 0)


def _steps(policy: str) -> tuple[float, ...]:
    """``checked_totals()`` for ``policy``, then the same three Prometheus counters where
    prometheus_client is installed."""
    got = checked_totals().get(policy, {})
    out: tuple[float, ...] = (got.get("steps", 0), got.get("samples", 0), got.get("tokens", 0))
    if importlib.util.find_spec("prometheus_client") is not None:
        from prometheus_client import REGISTRY

        for name in ("steps_checked", "step_samples", "step_tokens"):
            out += (REGISTRY.get_sample_value(f"r3_client_{name}_total", {"policy": policy}) or 0,)
    return out


def _ratio(policy: str) -> float | None:
    """``r3_client_step_off_state_ratio`` for ``policy`` (None without prometheus_client)."""
    if importlib.util.find_spec("prometheus_client") is None:
        return None
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("r3_client_step_off_state_ratio", {"policy": policy})


def test_a_step_with_views_reports_its_off_state_tokens(
    service_single: Service, transport: str, step_check_logs: pytest.LogCaptureFixture
) -> None:
    caplog = step_check_logs
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        r = _store_with_view(c)
        plain = _plain(c, 30)
        assert [(v.serves, v.start, v.end) for v in c.stat(r).views] == [(40, 0, 40)]
        for policy, num_tokens, states, off, expanded in (
            ("generated", 101, None, 60, (0, 0, 0)),
            ("latest", 101, None, 40, (0, 0, 0)),
            ("exact", 41, [0], 0, (0, 0, 0)),
            ("exact", 101, None, 0, (1, 1, 41)),  # expanded: one more sample of 41 tokens
            ("exact", 101, [40], 0, (0, 0, 0)),  # the second state: tokens 41 … 100, all on it
        ):
            before, prom_before, steps = _totals(policy), _prometheus(policy), _steps(policy)
            cut_before = expansion_totals()
            caplog.clear()
            with caplog.at_level(logging.INFO):
                both = None if states is None else [None, *states]
                got = check_step(c, [plain, r], [31, num_tokens], view=policy, states=both)  # type: ignore[arg-type]
            assert got == StepCheck(
                samples=2,
                samples_with_views=1,
                off_state_samples=1 if off else 0,
                off_state_tokens=off,
                tokens=30 + num_tokens - 1,
                policy=policy,
                expanded_samples=expanded[0],
                extra_samples=expanded[1],
                extra_tokens=expanded[2],
            ), (policy, num_tokens, states)
            cut = expansion_totals()
            assert (cut["samples"], cut["extra_samples"], cut["extra_tokens"]) == tuple(
                cut_before[k] + d
                for k, d in zip(("samples", "extra_samples", "extra_tokens"), expanded, strict=True)
            )
            infos = [m for m in caplog.records if m.name == LOGGER and m.levelno == logging.INFO]
            assert len(infos) == (1 if expanded[0] else 0)
            if expanded[0]:
                assert "1 of 2 samples span several routing states" in infos[0].getMessage()
                assert "(1 more samples, 41 tokens forwarded again)" in infos[0].getMessage()
            # Every step checked is counted, off-state tokens or not.
            tokens = 30 + num_tokens - 1
            assert _steps(policy) == tuple(
                n + d for n, d in zip(steps, (1, 2, tokens) * 2, strict=False)
            )
            assert _ratio(policy) in (None, off / tokens)
            warned = [
                m for m in caplog.records if m.name == LOGGER and m.levelno >= logging.WARNING
            ]
            after = _totals(policy)
            if not off:
                assert warned == [] and after == before
                continue
            (record,) = warned
            assert record.levelno == logging.WARNING
            msg = record.getMessage()
            assert f"1 of 2 samples ({off} of {30 + num_tokens - 1} tokens)" in msg
            assert f"policy {policy!r}" in msg and 'view="exact"' in msg
            assert "r3_client.expand_states" in msg
            assert after == (before[0] + 1, before[1] + off)
            prom_after = _prometheus(policy)
            if prom_before is not None and prom_after is not None:
                assert prom_after == (prom_before[0] + 1, prom_before[1] + off)
        # a step without views: nothing off, nothing logged
        caplog.clear()
        with caplog.at_level(logging.INFO):
            got = check_step(c, [plain], [31], view="generated")
        assert got == StepCheck(1, 0, 0, 0, 30, "generated")
        assert not [m for m in caplog.records if m.name == LOGGER]


def test_the_policy_and_states_are_checked(service_single: Service) -> None:
    with RoutingClient(service_single.http_url, api_key=KEY_A) as c:
        r = _store_with_view(c)
        plain = _plain(c, 30)
        with pytest.raises(InvalidRequestError, match="view must be one of"):
            check_step(c, [r], [101], view="newest")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match='only view="exact"'):
            check_step(c, [r], [101], view="latest", states=[0])
        with pytest.raises(ShapeError, match="2 rollout ids for 1 states"):
            check_step(c, [r, plain], [101, 31], states=[0])
        # a state that starts no state of its rollout: reported like the other problems
        with pytest.raises(ShapeError) as info:
            check_step(c, [plain, r, plain], [31, 101, 31], states=[None, 39, 5])
        msg = str(info.value)
        assert msg.startswith("2 of 3 samples cannot be replayed")
        assert f"sample 1 (rollout '{r}') replays a state starting at row 39" in msg
        assert "states start at rows [0, 40]" in msg
        assert f"sample 2 (rollout '{plain}') replays a state starting at row 5" in msg
        assert check_step(c, [plain, r], [31, 41], states=[0, None]).off_state_tokens == 0
        # a state given whose sample reaches past it: refused here, as every fetch refuses it
        with pytest.raises(ShapeError, match=r"replays the state of rows \[0, 40\) but its "):
            check_step(c, [r], [101], states=[0])
