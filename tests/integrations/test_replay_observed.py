"""Exact replay, observed honestly (issue 53): what the counters, the logs and the alert say
about a step is what its replay does.

Against the real service and Redis, on straddled steps (rollouts whose later turns attended
to recomputed rows: a view before each later state):

* **the exact path raises no off-state alarm**: verl's ``RoutedRolloutManager(rank_local=
  True)``, ``expand_verl_batch`` and ``ExactReplayTrainer``, AReaL's ``check_areal_step``
  and slime's / miles' ``check_samples`` on the *unexpanded* originals count 0 off-state
  tokens (before issue 53: 9 samples / 577 tokens on a 14-sample step, and 1,731 more per
  ``ExactReplayTrainer`` step); what the exact replay expands is counted under its own name
  (``r3_client_expansion_*``), once per step, equal to what the expansion made;
* **named policies are counted where they are chosen**: the whole-step fills under
  ``latest`` / ``generated`` (verl's ``attach_routed_experts``, slime's and miles'
  ``fill_routed_experts``, AReaL's) count and warn exactly the off-state tokens the ground
  truth says (worked out below from the stored layout, not by the library's function);
  before issue 53 they counted nothing;
* a scrape of the trainer's ``/metrics`` after an exact step shows no off-state increase,
  and ``promtool test rules`` on the scraped values keeps ``R3OffStateReplay`` silent for it
  and fires it for the named ``latest`` step;
* **a group of expanded copies fills**, each in its own state (before: ``ValueError: ...
  share rollout key``); every refusal the glue raises is an ``R3Error``.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import logging
import shutil
import types
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import r3_client
from r3_client import AsyncRoutingClient, InvalidRequestError, R3Error, RoutingClient
from r3_client.integrations import areal as r3_areal
from r3_client.integrations import miles as r3_miles
from r3_client.integrations import slime as r3_slime
from r3_client.rank_local import checked_totals, expansion_totals, off_state_totals
from tests.integrations import test_areal_rank_local as areal_t
from tests.integrations import test_slime_miles_rank_local as sm
from tests.support.service_process import KEY_A, Service

LOGGER = "r3_client.rank_local"
INTEGRATIONS = Path(r3_client.__file__).parent / "integrations"
MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "components" / "monitoring"


# ---- what a step's counters say ---------------------------------------------------------------


class Counters:
    """The process's ``r3_client_*`` totals now; ``delta`` after a call says what it counted."""

    def __init__(self) -> None:
        self.off = off_state_totals()
        self.steps = checked_totals()
        self.cut = expansion_totals()

    def delta(self) -> dict[str, Any]:
        off, steps, cut = off_state_totals(), checked_totals(), expansion_totals()
        out: dict[str, Any] = {}
        for policy in set(off) | set(self.off):
            now, was = off.get(policy, {}), self.off.get(policy, {})
            d = (
                now.get("samples", 0) - was.get("samples", 0),
                now.get("tokens", 0) - was.get("tokens", 0),
            )
            if d != (0, 0):
                out[f"off:{policy}"] = d
        for policy in set(steps) | set(self.steps):
            now, was = steps.get(policy, {}), self.steps.get(policy, {})
            if now.get("steps", 0) != was.get("steps", 0):
                out[f"steps:{policy}"] = now["steps"] - was.get("steps", 0)
        d3 = tuple(cut[k] - self.cut[k] for k in ("samples", "extra_samples", "extra_tokens"))
        if d3 != (0, 0, 0):
            out["expanded"] = d3
        return out


@pytest.fixture
def caplog(step_check_logs: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog with the step check's logger at INFO (tests/conftest.py ``step_check_logs``)."""
    return step_check_logs


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        m.getMessage() for m in caplog.records if m.name == LOGGER and m.levelno >= logging.WARNING
    ]


@pytest.fixture
def scrape() -> Iterator[Any]:
    """The trainer process's own ``/metrics`` endpoint (prometheus_client's, as a trainer
    exports it), scraped over HTTP: ``scrape()`` -> ``{(name, policy): value}``."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def read() -> dict[tuple[str, str], float]:
        text = httpx.get(url, timeout=30).text
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("r3_client_"):
                    out[(s.name, s.labels.get("policy", ""))] = s.value
        return out

    yield read
    server.shutdown()
    server.server_close()
    thread.join(10)


# ---- verl ---------------------------------------------------------------------------------------

verl_installed = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(
    not verl_installed, reason="verl is not installed (the verl test extra)"
)
if verl_installed:
    from r3_client.integrations.verl import (
        ExactReplayTrainer,
        RoutedRolloutManager,
        attach_routed_experts,
        expand_verl_batch,
    )
    from tests.integrations import test_verl_fit_exact as fit
    from tests.integrations.test_verl_fit_exact import verl  # noqa: F401 (the fixture)


def _verl_truth() -> dict[str, Any]:
    """What test_verl_fit_exact's step holds, worked out from its layout: sample ``i`` has
    ``n = prompt + response - 1`` rows and states starting at ``STATES[i]``; a view of rows
    ``[1, a)`` serves each later state's first row ``a``.  Token ``t`` of state ``(a, b]``
    attended to the views serving rows ``<= a``.

    * ``generated`` replays no view: every token after the first state is off (its views'
      rows start at row 1 < t): ``n - s1`` per sample;
    * ``latest`` replays every view: a token of a state before the last is off once it
      attends row 1 (``t >= 2``): ``s_last - 1`` per sample;
    * ``exact`` cuts each sample into one copy per state: ``len(states) - 1`` more samples,
      the copy of state ``(a, b]`` holding ``b + 1`` tokens (every state but the last)."""
    gen = lat = expanded = extra = extra_tokens = 0
    for i, starts in fit.STATES.items():
        n = fit.PROMPTS[i] + fit.RESPONSES[i] - 1
        gen += n - starts[1]
        lat += starts[-1] - 1
        expanded += 1
        extra += len(starts) - 1
        ends = [*starts[1:], n]
        extra_tokens += sum(b + 1 for b in ends[:-1])
    samples = len(fit.STATES)
    return {
        "generated": (samples, gen),
        "latest": (samples, lat),
        "expanded": (expanded, extra, extra_tokens),
        "tokens": sum(p + r - 1 for p, r in zip(fit.PROMPTS, fit.RESPONSES, strict=True)),
    }


class _Manager:
    """A verl ``AgentLoopManager`` stand-in: its step is the given batch."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def generate_sequences(self, prompts: Any) -> Any:
        return self.batch


@needs_verl
def test_verl_exact_flows_count_no_off_state_and_the_expansion_once(
    verl: Any,
    service_single: Service,
    caplog: pytest.LogCaptureFixture,
    scrape: Any,
) -> None:
    truth = _verl_truth()
    before = scrape()
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids = fit._store(client)
        # the rank-local manager's pre-dispatch check, on the originals
        counted = Counters()
        prompts = types.SimpleNamespace(meta_info={})
        manager = RoutedRolloutManager(_Manager(fit._batch(verl, ids)), client, rank_local=True)
        found = manager.generate_sequences(prompts).meta_info["r3_step_check"]
        assert (found.off_state_samples, found.off_state_tokens) == (0, 0)
        assert (found.expanded_samples, found.extra_samples, found.extra_tokens) == truth[
            "expanded"
        ]
        assert found.tokens == truth["tokens"] and found.samples_with_views == len(fit.STATES)
        assert counted.delta() == {"steps:exact": 1, "expanded": truth["expanded"]}
        # expand_verl_batch: the same count, equal to what the expansion made
        counted = Counters()
        expanded = expand_verl_batch(fit._batch(verl, ids), client)
        made = expanded.meta_info["r3_expansion"]
        assert (made["extra_rows"], made["extra_tokens"]) == truth["expanded"][1:]
        assert counted.delta() == {"steps:exact": 1, "expanded": truth["expanded"]}
        # ExactReplayTrainer: verl's step expands its batch three times, counted once
        counted = Counters()
        cls = type("Trainer", (ExactReplayTrainer, verl.trainer), {"r3_release_step": False})
        group = fit.ActorGroup(verl, ids, lambda i, t, state: state)
        fit._step(verl, fit._trainer(verl, cls, group, client), fit._batch(verl, ids))
        assert counted.delta() == {"steps:exact": 1, "expanded": truth["expanded"]}
        assert _warnings(caplog) == []  # no off-state warning anywhere on the exact path
        cut = [
            m.getMessage() for m in caplog.records if m.name == LOGGER and m.levelno == logging.INFO
        ]
        assert len(cut) == 3 and all(
            f"{len(fit.STATES)} of 8 samples span several" in m for m in cut
        )
        after_exact = scrape()
        # the scrape: not one off-state token under exact; the expansion under its own name
        off_exact = ("r3_client_off_state_tokens_total", "exact")
        assert after_exact.get(off_exact, 0.0) == before.get(off_exact, 0.0)
        assert after_exact.get(("r3_client_step_off_state_ratio", "exact")) == 0.0
        key = ("r3_client_expansion_extra_tokens_total", "")
        assert after_exact[key] - before.get(key, 0.0) == 3 * truth["expanded"][2]

        # a named latest step: the fill counts exactly the ground truth, and warns
        caplog.clear()
        counted = Counters()
        attach_routed_experts(
            fit._batch(verl, ids), client, num_layers=len(fit.LAYERS), view="latest"
        )
        assert counted.delta() == {"off:latest": truth["latest"], "steps:latest": 1}
        (warned,) = _warnings(caplog)
        assert f"{truth['latest'][0]} of 8 samples ({truth['latest'][1]} of" in warned
        after_latest = scrape()
        counted = Counters()
        attach_routed_experts(
            fit._batch(verl, ids), client, num_layers=len(fit.LAYERS), view="generated"
        )
        assert counted.delta() == {"off:generated": truth["generated"], "steps:generated": 1}
        assert sum(d.existed for d in client.delete_many(ids)) == len(ids)
    _promtool_says(before, after_exact, after_latest)


def _promtool_says(
    before: dict[tuple[str, str], float],
    after_exact: dict[tuple[str, str], float],
    after_latest: dict[tuple[str, str], float],
) -> None:
    """``promtool test rules`` on the scraped counters, as Prometheus would have scraped them
    each minute: 20 minutes before the steps, the exact steps at 20m, the latest step at
    40m.  R3OffStateReplay is silent through the exact steps and fires for the latest one."""
    series = []
    for policy in ("exact", "latest"):
        name = "r3_client_off_state_tokens_total"
        a, b, c = (int(x.get((name, policy), 0.0)) for x in (before, after_exact, after_latest))
        series.append(
            {
                "series": f'{name}{{namespace="trainer", instance="t0", policy="{policy}"}}',
                "values": f"{a}x20 {b}x20 {c}x20",
            }
        )
    cases = yaml.safe_load((MONITORING / "tests" / "rules_test.yaml").read_text())["tests"]
    fired = next(
        alert
        for case in cases
        for check in case.get("alert_rule_test", [])
        if check["alertname"] == "R3OffStateReplay"
        for alert in check.get("exp_alerts", [])
        if alert["exp_labels"]
        == {"severity": "warning", "namespace": "trainer", "policy": "latest"}
    )
    spec = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": "an exact step stays silent, a named latest step fires",
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "39m", "alertname": "R3OffStateReplay", "exp_alerts": []},
                    {"eval_time": "45m", "alertname": "R3OffStateReplay", "exp_alerts": [fired]},
                ],
            }
        ],
    }
    from tests.deploy.test_monitoring import rule_groups, run_promtool

    work = Path(f"/tmp/r3-promtool-{uuid.uuid4().hex[:8]}")
    work.mkdir()
    try:
        (work / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
        (work / "observed_test.yaml").write_text(yaml.safe_dump(spec))
        assert "SUCCESS" in run_promtool("test", "rules", "observed_test.yaml", cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- AReaL --------------------------------------------------------------------------------------


async def test_areal_check_counts_no_off_state_and_named_fills_count_the_truth(
    service_single: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """AReaL's rollouts of test_areal_rank_local's straddled step (samples 0 and 2 as
    test_slime_miles_rank_local's): ``check_areal_step`` on the originals counts nothing off
    state; ``fill_routed_experts`` under ``latest`` counts sample 0's 26 tokens (states
    before the last: rows ``[0, 12)`` and ``[12, 26)`` attend rows the later views
    recomputed, from row 0) and under ``generated`` its 27 (tokens 13 ... 39)."""
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        ids, _ = areal_t._store_straddled(client, seed=4)
        width = max(areal_t.X_LENGTHS)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for i, n in enumerate(areal_t.X_LENGTHS):
            mask[i, :n] = 1
        keys = np.repeat(np.asarray([areal_t._key_of(r) for r in ids])[:, None], width, axis=1)
        counted = Counters()
        found = r3_areal.check_areal_step(
            client, {"attention_mask": mask, r3_areal.KEY_FIELD: keys}
        )
        assert (found.off_state_samples, found.off_state_tokens) == (0, 0)
        assert (found.expanded_samples, found.extra_samples, found.extra_tokens) == (
            2,
            3,
            13 + 27 + 11,
        )
        assert counted.delta() == {"steps:exact": 1, "expanded": (2, 3, 51)}
        assert _warnings(caplog) == []

    async def fill(view: str) -> Any:
        async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as aclient:
            response = types.SimpleNamespace(
                input_tokens=list(range(5)), output_tokens=list(range(35))
            )
            await r3_areal.fill_routed_experts(
                response,
                aclient,
                ids[0],
                num_layers=areal_t.NUM_LAYERS,
                view=view,  # type: ignore[arg-type]
            )
            return response

    for view, truth in (("latest", (1, 26)), ("generated", (1, 27))):
        caplog.clear()
        counted = Counters()
        got = await fill(view)
        assert got.routed_experts.shape[0] == 39
        assert counted.delta() == {f"off:{view}": truth, f"steps:{view}": 1}
        (warned,) = _warnings(caplog)
        assert f"1 of 1 samples ({truth[1]} of 39 tokens)" in warned
    counted = Counters()
    with pytest.raises(InvalidRequestError, match="span 3 routing states"):
        await fill("exact")
    assert counted.delta() == {}  # a refused fill counts nothing


# ---- slime and miles ---------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["slime", "miles"])
async def test_slime_miles_copies_fill_in_their_states_and_named_fills_count(
    service_single: Service, framework: str, caplog: pytest.LogCaptureFixture
) -> None:
    """test_slime_miles_rank_local's straddled step (X_*): the group of copies
    ``expand_samples`` made fills in one call, each copy with its own state's rows; the
    originals' check counts no off-state token; their fill under ``latest`` counts 36 tokens
    of 3 samples (sample 0: 26 as for AReaL; sample 2, a view of rows [2, 10) serving row
    10: tokens 3 ... 10; sample 3, a view of rows [0, 2) serving 2: tokens 1, 2), under
    ``generated`` 52 (27; tokens 11 ... 29; tokens 3 ... 8)."""
    module = r3_slime if framework == "slime" else r3_miles
    run = f"x-{uuid.uuid4().hex[:8]}"
    with RoutingClient(service_single.http_url, api_key=KEY_A) as client:
        keys = module.rank_keys(run, sm.X_INDICES)
        states = sm.store_straddled(client, keys, seed=9)
        originals = sm.x_samples(framework, keys)
        copies = module.expand_samples(originals, client, args=sm.x_args(framework))
        counted = Counters()
        found = module.check_samples(originals, client)
        assert (found.off_state_samples, found.off_state_tokens) == (0, 0)
        assert counted.delta() == {"steps:exact": 1, "expanded": (3, 4, 13 + 27 + 11 + 3)}
    want = sm.own_fields(framework, copies, states)
    async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as aclient:
        for c in copies:
            c.rollout_routed_experts = None
        counted = Counters()
        await module.fill_routed_experts(copies, aclient, num_layers=sm.NUM_LAYERS)
        for c, w in zip(copies, want, strict=True):
            np.testing.assert_array_equal(np.asarray(c.rollout_routed_experts), w)
        assert counted.delta() == {}  # exact: nothing off, and a fill is not a check
        assert _warnings(caplog) == []
        for view, truth in (("latest", (3, 36)), ("generated", (3, 52))):
            caplog.clear()
            counted = Counters()
            await module.fill_routed_experts(
                originals, aclient, num_layers=sm.NUM_LAYERS, view=view
            )
            assert counted.delta() == {f"off:{view}": truth, f"steps:{view}": 1}
            (warned,) = _warnings(caplog)
            assert f"3 of 4 samples ({truth[1]} of" in warned
        # refusals: R3Errors, nothing filled
        for c in copies:
            c.rollout_routed_experts = None
        with pytest.raises(InvalidRequestError, match="replay each its own state"):
            await module.fill_routed_experts(
                copies, aclient, num_layers=sm.NUM_LAYERS, view="latest"
            )
        twice = [copies[0], copies[1], copies[0]]
        with pytest.raises(InvalidRequestError, match=r"share rollout key .* and state 0"):
            await module.fill_routed_experts(twice, aclient, num_layers=sm.NUM_LAYERS)
        with pytest.raises(InvalidRequestError, match="share rollout key"):
            await module.fill_routed_experts(
                [originals[1], originals[1]], aclient, num_layers=sm.NUM_LAYERS
            )
        assert all(c.rollout_routed_experts is None for c in copies)


# ---- every glue refusal is an R3Error ----------------------------------------------------------


def _raised_classes() -> Iterator[tuple[str, int, str, Any]]:
    """Each ``raise f(...)`` in r3_client.integrations: (file, line, what f names, the class
    it raises: f itself, or what a function f is annotated to return)."""
    for path in sorted(INTEGRATIONS.rglob("*.py")):
        rel = path.relative_to(INTEGRATIONS.parent).with_suffix("")
        module = importlib.import_module("r3_client." + ".".join(rel.parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            func = node.exc.func
            if isinstance(func, ast.Name) and func.id == "AttributeError":
                continue  # __getattr__ answering "no such attribute": the protocol, not a refusal
            if isinstance(func, ast.Name):
                name, made = func.id, getattr(module, func.id, getattr(builtins, func.id, None))
            elif isinstance(func, ast.Call) and ast.unparse(func) == "type(exc)":
                continue  # the caught error's own class, re-raised with a name: an R3Error
            else:
                name, made = ast.unparse(func), None
            if made is not None and not isinstance(made, type):
                made = typing.get_type_hints(made).get("return")
            yield str(rel), node.lineno, name, made


def test_every_refusal_the_glue_raises_is_an_r3_error() -> None:
    """A trainer catching ``R3Error`` catches every refusal of the glue: each ``raise
    Cls(...)`` in ``r3_client.integrations`` raises an ``R3Error`` (a re-raise of an error
    caught, ``raise exc``, raises what was raised).  ``ValueError`` / ``TypeError`` /
    ``RuntimeError`` became ``InvalidRequestError`` / ``UsageError`` / ``IntegrationError``,
    which are still those built-ins too."""
    seen = list(_raised_classes())
    assert len(seen) > 40, seen  # the walk finds the glue's raises (45 converted)
    foreign = [
        f"{f}:{line} raises {name}"
        for f, line, name, cls in seen
        if not (isinstance(cls, type) and issubclass(cls, R3Error))
    ]
    assert foreign == []
    assert issubclass(r3_client.UsageError, TypeError)
    assert issubclass(r3_client.IntegrationError, RuntimeError)
    assert issubclass(r3_client.InvalidRequestError, ValueError)
    # and dynamically, a few of them
    sample = types.SimpleNamespace(index=None, tokens=[1, 2], metadata={})
    with pytest.raises(R3Error, match="has no index"):
        r3_slime.rollout_key("run", sample)
    with pytest.raises(R3Error, match="has no session_id"):
        r3_slime.check_samples([sample], None)  # type: ignore[arg-type]
    if verl_installed:
        with pytest.raises(R3Error, match="num_layers"):
            RoutedRolloutManager(object(), None)  # type: ignore[arg-type]
