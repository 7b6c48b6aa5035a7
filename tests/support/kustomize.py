"""Rendering the kustomize overlays and walking the objects they produce."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
Obj = dict[str, Any]

# What users apply: the two overlays, and the opt-in components on top of prod.
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dev": ("overlays/dev", ()),
    "prod": ("overlays/prod", ()),
    "prod+servicemonitor": ("overlays/prod", ("components/servicemonitor",)),
    "prod+external-redis": ("overlays/prod", ("components/external-redis",)),
}
POD_KINDS = ("Deployment", "StatefulSet", "Job")


def kubectl() -> str:
    """The kubectl binary; a missing one is a broken machine, not a skipped test."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not on PATH: the deploy tests render with `kubectl kustomize`")
    return path


@functools.cache
def render(variant: str) -> list[Obj]:
    """``kubectl kustomize`` of one variant, as a list of objects (once per session).

    Shared by every test: callers copy what they change.
    """
    base, components = VARIANTS[variant]
    if not components:
        out = subprocess.run(
            [kubectl(), "kustomize", str(DEPLOY / base)], capture_output=True, text=True
        )
    else:
        # An overlay of the user's own, as docs/deploy.md tells them to write it.
        # kustomize wants relative paths, so it lives next to the overlays.
        with tempfile.TemporaryDirectory(dir=DEPLOY / "overlays") as tmp:
            rel = os.path.relpath(DEPLOY, tmp)
            (Path(tmp) / "kustomization.yaml").write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "kustomize.config.k8s.io/v1beta1",
                        "kind": "Kustomization",
                        "resources": [f"{rel}/{base}"],
                        "components": [f"{rel}/{c}" for c in components],
                    }
                )
            )
            out = subprocess.run([kubectl(), "kustomize", tmp], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {variant} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    """The one object of ``kind`` named ``name`` (generated names match on their prefix:
    ``name-<hash>``, so ``sglang`` does not also find ``sglang-router``)."""
    hits = [
        o
        for o in objs
        if o["kind"] == kind
        and (
            o["metadata"]["name"] == name
            or re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", o["metadata"]["name"])
        )
    ]
    found = [h["metadata"]["name"] for h in hits]
    assert len(hits) == 1, f"expected one {kind} {name}, found {found}"
    return hits[0]


def has(objs: list[Obj], kind: str, name: str) -> bool:
    """Whether an object of ``kind`` named exactly ``name`` is rendered."""
    return any(o["kind"] == kind and o["metadata"]["name"] == name for o in objs)


def pod_spec(obj: Obj) -> Obj:
    """The pod template's spec of a Deployment, StatefulSet or Job."""
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """Every container and init container of a workload, with a readable label."""
    spec = pod_spec(obj)
    for c in spec.get("initContainers", []) + spec["containers"]:
        yield f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}", c


def workloads(objs: list[Obj]) -> list[Obj]:
    """Every object that runs pods."""
    return [o for o in objs if o["kind"] in POD_KINDS]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels + In/NotIn/Exists/DoesNotExist)."""
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def ingress_allows(
    policy: Obj,
    *,
    pod_labels: dict[str, str],
    ns_labels: dict[str, str],
    same_namespace: bool,
    port: int,
) -> bool:
    """Whether ``policy`` lets a client pod with these labels reach ``port`` (no ipBlocks)."""
    for rule in policy["spec"].get("ingress", []):
        ports = [p["port"] for p in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        for peer in rule.get("from", []):
            assert "ipBlock" not in peer, "the deploy manifests use no ipBlock peers"
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            ns_ok = selects(ns_sel, ns_labels) if ns_sel is not None else same_namespace
            pod_ok = selects(pod_sel, pod_labels) if pod_sel is not None else True
            if ns_ok and pod_ok:
                return True
    return False


def container_env(
    obj: Obj, container: Obj, *, pod_name: str = "pod-0", secrets: dict[str, str] | None = None
) -> dict[str, str]:
    """A container's ``env`` as the kubelet resolves it (no ``envFrom``).

    ``$(VAR)`` expands to a variable defined *earlier* in the list (the kubelet's rule;
    a later or unknown one stays as written). ``fieldRef`` gives the object's namespace
    or ``pod_name``; ``secretKeyRef`` values come from ``secrets``, keyed
    ``"<secret>/<key>"`` without a generated name's hash suffix (else ``<secret/key>``).
    """
    secrets = secrets or {}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                e["value"],
            )
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            assert path in ("metadata.namespace", "metadata.name"), e
            ns = obj["metadata"].get("namespace", "default")
            env[e["name"]] = ns if path == "metadata.namespace" else pod_name
        elif "secretKeyRef" in src:
            name = re.sub(r"-[a-z0-9]{10}$", "", src["secretKeyRef"]["name"])  # kustomize's hash
            ref = f"{name}/{src['secretKeyRef']['key']}"
            env[e["name"]] = secrets.get(ref, f"<{ref}>")
        else:
            raise AssertionError(f"unexpected env source {src}")
    return env
