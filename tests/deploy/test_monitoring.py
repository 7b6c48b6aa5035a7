"""``deploy/components/monitoring``: the alerts and the dashboard's queries pass ``promtool``,
the alerts fire on their failures and stay silent when healthy (``promtool test rules``),
each alert has a runbook, and every overlay renders with the component and validates offline.

``promtool`` comes with Debian's ``prometheus`` package (scripts/bootstrap.sh installs it);
a machine without it fails these tests rather than skipping them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.monitoring_exprs import (
    MONITORING,
    dashboards,
    metric_selectors,
    monitoring_selectors,
    promql_expressions,
    rule_groups,
)
from tests.deploy.test_manifests import K8S_VERSIONS, SERVICE_MONITOR_SCHEMA
from tests.support.kustomize import DEPLOY, ROOT, Obj, kubectl

RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_URL = "https://github.com/sglang-r3/sglang-r3/blob/main/docs/runbooks.md#"
OVERLAYS = sorted(
    p.name
    for p in (DEPLOY / "overlays").iterdir()
    if (p / "kustomization.yaml").exists() and not p.name.startswith("tmp")
)

# The series the service (/metrics), the engine (/r3/metrics) and the trainer's client
# (prometheus_client's default registry) export, with their labels: what the dashboard and
# the alerts may read. tests against the real processes check the exporters' side.
EXPORTED: dict[str, set[str]] = {
    "r3_requests_total": {"transport", "op", "code"},
    "r3_request_seconds_bucket": {"transport", "op"},
    "r3_bytes_in_total": {"transport"},
    "r3_bytes_out_total": {"transport"},
    "r3_dedupe_hits_total": set(),
    "r3_dedupe_saved_bytes_total": set(),
    "r3_store_used_memory_bytes": set(),
    "r3_store_keys": set(),
    "r3_store_maxmemory_bytes": set(),
    "r3_store_fullest_ratio": set(),
    "r3_store_up": set(),
    "r3_batch_items_total": {"result"},
    "r3_views_stored_total": set(),
    "r3_view_rows_stored_total": set(),
    "r3_rollouts_dropped_total": {"how"},
    "r3_dropped_bytes_total": {"how"},
    "r3_engine_outputs_total": {"outcome"},
    "r3_engine_cache_errors_total": {"error"},
    "r3_engine_guard_trips_total": {"guard"},
    "r3_engine_views_total": set(),
    "r3_engine_view_rows_total": set(),
    "r3_engine_rows_lost_total": {"error"},
    "r3_engine_rows_total": set(),
    "r3_engine_bytes_shipped_total": set(),
    "r3_engine_bytes_engine_total": set(),
    "r3_engine_ship_seconds_bucket": set(),
    "r3_engine_conflicts_total": set(),
    "r3_engine_retracted_outputs_total": set(),
    "r3_client_off_state_samples_total": {"policy"},
    "r3_client_off_state_tokens_total": {"policy"},
    "r3_client_step_samples_total": {"policy"},
    "r3_client_step_tokens_total": {"policy"},
    "r3_client_steps_checked_total": {"policy"},
    "r3_client_step_off_state_ratio": {"policy"},
    "r3_client_expansion_extra_tokens_total": set(),
    "r3_client_expansion_extra_samples_total": set(),
}

_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# kubernetes-validate knows the built-in kinds only; the prometheus-operator CRD is checked
# against its v1 schema (monitoring.coreos.com_prometheusrules.yaml, operator 0.82),
# transcribed with unknown fields refused, as test_manifests does for the ServiceMonitor.
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "limit": {"type": "integer"},
                            "partial_response_strategy": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": {"type": "string", "pattern": _DURATION},
                                        "keep_firing_for": {"type": "string", "pattern": _DURATION},
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


def promtool() -> str:
    """The promtool binary; a missing one is a broken machine, not a skipped test."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH: scripts/bootstrap.sh installs Debian's prometheus")
    return path


def run_promtool(*args: str, cwd: Path) -> str:
    out = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    out = run_promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert f"SUCCESS: {len(alerts())} rules found" in out


def test_alerts_fire_on_failure_and_stay_silent_when_healthy(tmp_path: Path) -> None:
    """promtool's unit tests (tests/rules_test.yaml) pass, and they cover every alert both
    ways: firing on its failure, and silent on a healthy (or briefly unhealthy) input."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    shutil.copy(MONITORING / "tests" / "rules_test.yaml", tmp_path / "rules_test.yaml")
    out = run_promtool("test", "rules", "rules_test.yaml", cwd=tmp_path)
    assert "SUCCESS" in out
    spec = yaml.safe_load((MONITORING / "tests" / "rules_test.yaml").read_text())
    fires: set[str] = set()
    silent: set[str] = set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fires == set(), "alerts never shown to fire"
    assert names - silent == set(), "alerts never shown to stay silent"


_SAMPLES = re.compile(
    r"(?P<a>_|stale|[-+]?(?:[0-9.]+(?:e[-+]?[0-9]+)?|Inf|NaN))"
    r"(?:(?P<op>[-+])(?P<b>[0-9.]+(?:e[-+]?[0-9]+)?))?(?:x(?P<n>[0-9]+))?",
    re.I,
)


def series_values(values: str) -> list[float | None]:
    """promtool's expanding notation (``0+40x3``, ``1x2``, ``_x10``, ``stale``) as the
    samples it stands for, ``None`` where there is none (``_``, ``stale``)."""
    out: list[float | None] = []
    for item in values.split():
        m = _SAMPLES.fullmatch(item)
        assert m, f"cannot read {item!r} of {values!r}"
        n = int(m["n"] or 0)
        if m["a"] in ("_", "stale"):
            out += [None] * max(n, 1)
            continue
        step = float(m["b"] or 0) * (-1 if m["op"] == "-" else 1)
        out += [float(m["a"]) + step * k for k in range(n + 1)]
    return out


def _minutes(duration: str) -> float:
    """A promtool ``eval_time`` (``20m``, ``1h30m``, ``90s``) in minutes."""
    units = {"h": 60.0, "m": 1.0, "s": 1 / 60}
    parts = re.findall(r"([0-9.]+)(ms|[hms])", duration)
    assert "".join(a + u for a, u in parts) == duration, duration
    return sum(float(a) * units.get(u, 1 / 60000) for a, u in parts)


def new_counter_terms(expr: str) -> set[str]:
    """The series ``expr`` reads as ``x unless x offset …``: a series whose first sample
    must page by itself (the header of prometheusrule.yaml)."""
    return set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+offset\b", expr))


def rule_test_gaps(rules: list[dict[str, Any]], tests: list[dict[str, Any]]) -> list[str]:
    """What promtool's tests leave unshown, one line per (alert, series) the alert's
    ``expr`` reads (:func:`metric_selectors`): each needs a test case that

    - isolates the series: of the series the alert reads, only this one's samples change
      (the others are absent or constant), so the series alone makes the alert fire;
    - shows the alert firing at one ``eval_time`` and resolved at a later one;
    - for a series read as ``x unless x offset …`` (:func:`new_counter_terms`), exists
      twice: once with the series there before the failure, once with it appearing
      (its first value ``_``) with the failure, the counter's first increment."""
    gaps: list[str] = []
    for rule in rules:
        if "alert" not in rule:
            continue
        name, expr = rule["alert"], rule["expr"]
        read = set(metric_selectors(expr))
        kinds: dict[str, set[str]] = {m: set() for m in read}
        for case in tests:
            evals = [
                (_minutes(c["eval_time"]), bool(c.get("exp_alerts")))
                for c in case.get("alert_rule_test", [])
                if c["alertname"] == name
            ]
            fired = [t for t, fires in evals if fires]
            if not fired or not any(t > min(fired) for t, fires in evals if not fires):
                continue
            by_metric: dict[str, list[list[float | None]]] = {}
            for s in case.get("input_series", []):
                metric = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", s["series"])
                assert metric, s["series"]
                by_metric.setdefault(metric.group(), []).append(series_values(s["values"]))
            changing = {
                m
                for m, all_values in by_metric.items()
                if m in read and any(len({v for v in vs if v is not None}) > 1 for vs in all_values)
            }
            for m in read & set(by_metric):
                if changing - {m}:
                    continue
                new = any(vs and vs[0] is None for vs in by_metric[m])
                kinds[m].add("appearing" if new else "present")
        offset = new_counter_terms(expr)
        for m in sorted(read):
            if m in offset:
                missing = sorted({"present", "appearing"} - kinds[m])
            else:
                missing = [] if kinds[m] else ["present"]
            gaps += [f"{name}: no test fires then resolves on {m} alone ({k})" for k in missing]
    return gaps


def rule_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load(
        (MONITORING / "tests" / "rules_test.yaml").read_text()
    )["tests"]
    return tests


def test_rule_tests_cover_each_series_each_alert_reads() -> None:
    """Every series an alert's expression reads has a promtool case of its own, firing
    and resolving (:func:`rule_test_gaps`); a counter read with ``unless … offset`` has
    one for a series that existed and one for its first appearance. A series added to
    an alert without a test fails here."""
    assert rule_test_gaps([r for g in rule_groups() for r in g["rules"]], rule_tests()) == []


def test_the_rule_test_coverage_check_can_fail() -> None:
    """rule_test_gaps sees a series added to an alert, a case that never resolves, and a
    counter's first appearance left untested; and reads promtool's notation."""
    got = series_values("0+40x2 _x2 1x1 stale 3-1x1")
    assert got == [0, 40, 80, None, None, 1, 1, None, 3, 2]
    rules = [r for g in rule_groups() for r in g["rules"]]
    added = json.loads(json.dumps(rules))
    ship = next(r for r in added if r.get("alert") == "R3EngineShipFailures")
    ship["expr"] += " or sum by (namespace) (increase(r3_engine_conflicts_total[5m])) > 0"
    assert rule_test_gaps(added, rule_tests()) == [
        "R3EngineShipFailures: no test fires then resolves on r3_engine_conflicts_total alone "
        "(present)"
    ]
    tests = rule_tests()
    unresolved = [
        {**case, "alert_rule_test": [c for c in case["alert_rule_test"] if c["exp_alerts"]]}
        if case["name"].startswith("the first guard trip")
        else case
        for case in tests
    ]
    assert rule_test_gaps(rules, unresolved) == [
        "R3EngineShipFailures: no test fires then resolves on r3_engine_guard_trips_total alone "
        "(appearing)"
    ]
    (lost,) = [c for c in tests if c["name"].startswith("rows lost on a counter")]
    mixed = [
        {**case, "input_series": [*case["input_series"], *lost["input_series"]]}
        if case["name"].startswith("guard trips page")
        else case
        for case in tests
    ]
    assert rule_test_gaps(rules, mixed) == [
        "R3EngineShipFailures: no test fires then resolves on r3_engine_guard_trips_total alone "
        "(present)"
    ]


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_has_severity_and_a_runbook() -> None:
    doc = RUNBOOKS.read_text()
    sections = dict(
        (m.group(1), m.group(2))
        for m in re.finditer(r"^## (\S+)\n(.*?)(?=^## |\Z)", doc, flags=re.M | re.S)
    )
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        assert notes["runbook_url"] == RUNBOOK_URL + _slug(name), name
        assert name in sections, f"docs/runbooks.md has no section for {name}"
        for part in ("**Means.**", "**Impact on training.**", "**Diagnose.**", "**Fix.**"):
            assert part in sections[name], f"runbook {name} lacks {part}"


def test_runbook_links_resolve() -> None:
    """Every relative link of docs/runbooks.md names a file that exists, and an anchor
    that one of its headings makes."""
    for target in re.findall(r"\]\(([^)#:]*\.md)?(?:#([^)]*))?\)", RUNBOOKS.read_text()):
        path, anchor = target
        doc = (RUNBOOKS.parent / path) if path else RUNBOOKS
        assert doc.exists(), path
        if anchor:
            headings = re.findall(r"^#+ (.+)$", doc.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path}#{anchor}"


def test_the_rule_validator_rejects_what_it_should() -> None:
    """PROMETHEUS_RULE_SCHEMA can fail: a misspelt field and a malformed duration."""
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    jsonschema.validate(rule, PROMETHEUS_RULE_SCHEMA)
    typo = json.loads(json.dumps(rule))
    typo["spec"]["groups"][0]["rules"][0]["expresion"] = "1"
    bad_for = json.loads(json.dumps(rule))
    bad_for["spec"]["groups"][1]["rules"][0]["for"] = "2 minutes"
    for wrong in (typo, bad_for):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, PROMETHEUS_RULE_SCHEMA)


def test_dashboard_and_alert_queries_pass_promtool(tmp_path: Path) -> None:
    """Every panel's, variable's and alert's expression parses, as promtool parses rules
    (each written as a recording rule, Grafana's variables replaced by literals)."""
    exprs = promql_expressions()
    assert len(exprs) > 30
    rules = [{"record": f"r3_check:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    (tmp_path / "exprs.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]})
    )
    proc = subprocess.run(
        [promtool(), "check", "rules", "exprs.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    if proc.returncode != 0:
        bad = [f"{where}: {e}" for i, (where, e) in enumerate(exprs) if f"expr_{i}" in proc.stderr]
        pytest.fail(f"promtool refuses:\n{proc.stderr}\n" + "\n".join(bad))


def test_queries_read_only_exported_series_and_labels() -> None:
    """Every series named exists (EXPORTED, above) and is read by the labels it has; every
    exported series is on the dashboard or in an alert; no weight version as a label."""
    used = monitoring_selectors()
    assert set(used) - set(EXPORTED) == set(), "series nobody exports"
    assert set(EXPORTED) - set(used) == set(), "exported series nothing shows"
    for name, labels in used.items():
        assert labels <= EXPORTED[name], f"{name} read by {labels - EXPORTED[name]}"
    assert not any("version" in label for labels in used.values() for label in labels)


def test_the_selector_extraction() -> None:
    """monitoring_selectors' parser: matchers, prefix and postfix grouping, vector matching,
    label_values; ``le`` and the scrape's labels left out."""
    got = metric_selectors(
        'sum by (op, le, namespace) (rate(a_bucket{code=~"5..", job="x"}[5m]))'
        " / on (op) group_left (policy) sum(rate(b_total[5m])) by (error)"
        " or c offset 5m > bool 0"
    )
    assert got == {
        "a_bucket": {"op", "code", "policy"},
        "b_total": {"error", "op", "policy"},
        "c": {"op", "policy"},
    }
    assert metric_selectors("label_values(r3_requests_total, op)") == {"r3_requests_total": {"op"}}


def test_dashboard_is_provisionable() -> None:
    """A recent schema, every query through the ``${datasource}`` variable (a Prometheus
    data source), unique panel ids, a stable uid, and the panels the issue names."""
    (name, dash), *rest = dashboards().items()
    assert not rest and name == "sglang-r3.json"
    assert dash["uid"] == "sglang-r3" and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["namespace"]["allValue"] == ".*", "matches series without the label too"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    assert variables["namespace"]["datasource"] == ds
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"] == ds, p["title"]
        assert p["targets"] and all(t["datasource"] == ds for t in p["targets"]), p["title"]
        assert p.get("description"), p["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for needle in (
        "histogram_quantile(0.99, sum by (op, le) (rate(r3_request_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(r3_engine_ship_seconds_bucket",
        "r3_engine_bytes_shipped_total{",
        "r3_engine_bytes_engine_total{",
        'outcome="failed"',
        "sum by (policy) (rate(r3_client_off_state_tokens_total",
    ):
        assert needle in exprs, needle


@functools.cache
def render_with(overlay: str, components: tuple[str, ...]) -> list[Obj]:
    """``kubectl kustomize`` of an overlay of the user's own: ``overlay`` plus
    ``components``, in the overlay's namespace (a component's objects take the namespace
    of the kustomization that lists it), as docs/deploy.md tells them to write it."""
    inner = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
    with tempfile.TemporaryDirectory(dir=DEPLOY / "overlays") as tmp:
        rel = os.path.relpath(DEPLOY, tmp)
        (Path(tmp) / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "namespace": inner["namespace"],
                    "resources": [f"{rel}/overlays/{overlay}"],
                    "components": [f"{rel}/components/{c}" for c in components],
                }
            )
        )
        out = subprocess.run([kubectl(), "kustomize", tmp], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {overlay} + {components}:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize(
    "components", [("monitoring",), ("servicemonitor", "monitoring")], ids=["alone", "scraped"]
)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_with_the_component(
    overlay: str, components: tuple[str, ...]
) -> None:
    """Every object validates offline (built-in kinds strictly for the oldest and newest
    Kubernetes we support, the operator's kinds by their CRD's schema); the dashboard's
    ConfigMap keeps its name, carries the sidecar's label and the dashboard's JSON."""
    objs = render_with(overlay, components)
    for obj in objs:
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        if obj["kind"] == "PrometheusRule":
            jsonschema.validate(obj, PROMETHEUS_RULE_SCHEMA)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc}")
    ns = next(o for o in objs if o["kind"] == "Namespace")["metadata"]["name"]
    (cm,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and "grafana_dashboard" in o["metadata"].get("labels", {})
    ]
    assert cm["metadata"]["name"] == "sglang-r3-dashboard", "no hash suffix: a stable name"
    assert cm["metadata"]["namespace"] == ns
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sglang-r3"
    assert json.loads(cm["data"]["sglang-r3.json"]) == dashboards()["sglang-r3.json"]
    (rule,) = [o for o in objs if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == ns
    assert rule["spec"]["groups"] == rule_groups(), "kustomize leaves the rules as written"
    assert ("servicemonitor" in components) == any(o["kind"] == "ServiceMonitor" for o in objs)
