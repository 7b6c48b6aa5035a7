"""The PromQL of ``deploy/components/monitoring``: every expression its Grafana dashboard and
its PrometheusRule hold, and the series and labels they name.

:func:`monitoring_selectors` is what a test against the real service and engine checks:
each series a panel or an alert reads must exist with the labels it matches or groups by.
:func:`monitoring_expressions` gives the expressions themselves, Grafana's variables
replaced by literals, ready for ``promtool``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "components" / "monitoring"
DASHBOARDS = MONITORING / "dashboards"
RULES = MONITORING / "prometheusrule.yaml"

#: Labels Prometheus attaches to a scraped series (Kubernetes service discovery, the
#: prometheus-operator's relabelling): the expressions may group by them, but no exporter
#: emits them, so :func:`monitoring_selectors` leaves them out.
TARGET_LABELS = frozenset(
    {"namespace", "job", "instance", "pod", "service", "container", "endpoint"}
)

#: Grafana's variables as literals PromQL accepts: the rate window, and "every namespace".
GRAFANA_LITERALS = {
    "$__rate_interval": "5m",
    "${__rate_interval}": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "${namespace}": ".*",
}

_AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
_GROUPING = frozenset({"by", "without"})
_MATCHING = frozenset({"on", "ignoring", "group_left", "group_right"})
_KEYWORDS = frozenset({"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"})
_TOKEN = re.compile(
    r"""\s+|\#[^\n]*
    |(?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<num>[0-9][0-9a-zA-Z.]*|\.[0-9][0-9a-zA-Z.]*)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^=<>(){}\[\],@])""",
    re.X,
)


def grafana_literal(expr: str) -> str:
    """``expr`` with Grafana's variables (``$__rate_interval``, ``$namespace``, …) replaced
    by literals, longest name first; a variable left over is an error."""
    for name in sorted(GRAFANA_LITERALS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_LITERALS[name])
    if "$" in expr:
        raise ValueError(f"a Grafana variable without a literal in {expr!r}")
    return expr


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup:
            out.append((m.lastgroup, m.group()))
    return out


def metric_selectors(expr: str) -> dict[str, set[str]]:
    """The series ``expr`` names, each with the label names it uses: those in its ``{…}``
    matchers, those of every ``by (…)`` / ``without (…)`` around it and of ``on (…)`` /
    ``ignoring (…)`` / ``group_*`` beside it, and ``label_values(series, label)``'s label.
    ``le`` and :data:`TARGET_LABELS` are left out; a ``_bucket`` series keeps its name."""
    toks = _tokens(expr)
    found: list[tuple[str, set[str]]] = []
    # A scope per open parenthesis: its occurrences (indices into `found`), the labels that
    # apply to all of them when it closes, and whether it is label_values(…)'s.
    scopes: list[dict[str, Any]] = [{"occ": [], "labels": set(), "label_values": False}]
    last_closed: list[int] = []
    pending: set[str] | None = None  # a `by (…)` waiting for its aggregation's argument

    def label_list(i: int) -> tuple[set[str], int]:
        assert toks[i] == ("op", "("), f"expected ( in {expr!r}"
        labels: set[str] = set()
        i += 1
        while toks[i] != ("op", ")"):
            if toks[i][0] == "ident":
                labels.add(toks[i][1])
            i += 1
        return labels, i + 1

    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and text in _GROUPING | _MATCHING:
            if nxt != ("op", "("):  # group_left without labels
                i += 1
                continue
            labels, i = label_list(i + 1)
            if text in _MATCHING:
                scopes[-1]["labels"] |= labels
            elif i < len(toks) and toks[i] == ("op", "("):
                pending = labels  # prefix form: sum by (x) (…)
            else:
                for k in last_closed:  # postfix form: sum (…) by (x)
                    found[k][1].update(labels)
            continue
        if kind == "op" and text == "(":
            scope: dict[str, Any] = {"occ": [], "labels": pending or set()}
            scope["label_values"] = i > 0 and toks[i - 1] == ("ident", "label_values")
            scopes.append(scope)
            pending = None
        elif kind == "op" and text == ")":
            done = scopes.pop()
            for k in done["occ"]:
                found[k][1].update(done["labels"])
            scopes[-1]["occ"] += done["occ"]
            last_closed = done["occ"]
        elif kind == "op" and text == "[":
            while toks[i] != ("op", "]"):
                i += 1
        elif kind == "ident" and scopes[-1]["label_values"] and toks[i - 1] == ("op", ","):
            for k in scopes[-1]["occ"]:
                found[k][1].add(text)
        elif (
            kind == "ident"
            and nxt != ("op", "(")
            and text not in _AGGREGATIONS | _KEYWORDS
            and not (i > 0 and toks[i - 1] == ("ident", "offset"))
        ):
            labels = set()
            if nxt == ("op", "{"):
                i += 2
                while toks[i] != ("op", "}"):
                    if toks[i][0] == "ident":
                        labels.add(toks[i][1])
                    i += 1
            scopes[-1]["occ"].append(len(found))
            found.append((text, labels))
        i += 1
    for k in scopes[0]["occ"]:
        found[k][1].update(scopes[0]["labels"])
    assert len(scopes) == 1, f"unbalanced parentheses in {expr!r}"
    out: dict[str, set[str]] = {}
    for name, labels in found:
        out.setdefault(name, set()).update(labels - TARGET_LABELS - {"le", "__name__"})
    return out


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel, rows' nested ones included."""
    out: list[dict[str, Any]] = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels", []))
    return out


def dashboards() -> dict[str, dict[str, Any]]:
    """The component's Grafana dashboards, by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def rule_groups() -> list[dict[str, Any]]:
    """The PrometheusRule's ``spec.groups``: what a Prometheus rules file holds."""
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["spec"]["groups"]
    return groups


def monitoring_expressions() -> list[tuple[str, str]]:
    """``(where, expr)`` for every PromQL expression of the component: each dashboard
    panel's targets and its query variables (Grafana's variables replaced by literals,
    :func:`grafana_literal`), and each alert or recording rule."""
    out: list[tuple[str, str]] = []
    for name, dash in dashboards().items():
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                q = var["query"]
                query = q["query"] if isinstance(q, dict) else q
                out.append((f"{name} variable {var['name']}", grafana_literal(query)))
        for panel in _panels(dash["panels"]):
            for t in panel.get("targets", []):
                where = f"{name} panel {panel['title']!r} {t['refId']}"
                out.append((where, grafana_literal(t["expr"])))
    for group in rule_groups():
        for rule in group["rules"]:
            out.append((f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return out


def _label_values_as_promql(expr: str) -> str:
    """A ``label_values(series, label)`` variable query as the series selector it reads."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", expr, re.S)
    return m.group(1) if m else expr


def promql_expressions() -> list[tuple[str, str]]:
    """:func:`monitoring_expressions` as PromQL that ``promtool`` parses (a variable's
    ``label_values(series, label)`` becomes its series selector)."""
    return [(where, _label_values_as_promql(e)) for where, e in monitoring_expressions()]


def monitoring_selectors() -> dict[str, set[str]]:
    """Every series a dashboard panel, a dashboard variable or an alert of
    ``deploy/components/monitoring`` reads, mapped to the label names its expressions use
    for it (matchers, ``by``/``without`` and vector-matching clauses, ``label_values``),
    ``le`` and the scrape's :data:`TARGET_LABELS` left out: what the exporter itself must
    emit. Histograms appear by the name the expression reads (``…_bucket``)."""
    out: dict[str, set[str]] = {}
    for _, expr in monitoring_expressions():
        for name, labels in metric_selectors(expr).items():
            out.setdefault(name, set()).update(labels)
    return out
