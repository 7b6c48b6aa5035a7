"""The Kubernetes manifests: every overlay renders, validates offline, and keeps the policies.

Rendering is ``kubectl kustomize``; validation is the ``kubernetes-validate`` package's
bundled OpenAPI-derived JSON schemas in strict mode (unknown fields are errors), for the
oldest and newest Kubernetes minor we support. No cluster is involved.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from sglang_r3.launch.fleet import ROUTER_ARGS, ROUTER_VERSION
from tests.support.kustomize import (
    ROOT,
    VARIANTS,
    Obj,
    container_env,
    containers,
    find,
    has,
    ingress_allows,
    pod_spec,
    render,
    selects,
    workloads,
)

K8S_VERSIONS = ("1.30.0", "1.37.0")
ALL = tuple(VARIANTS)
PROD = tuple(v for v in VARIANTS if v.startswith("prod"))

# kubernetes-validate knows the built-in kinds only; the prometheus-operator CRD is
# checked against the fields we use, transcribed from its v1 schema.
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object"},
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scheme": {"enum": ["http", "https"]},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["key"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "name": {"type": "string"},
                                            "key": {"type": "string"},
                                            "optional": {"type": "boolean"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_offline(variant: str, version: str) -> None:
    objs = render(variant)
    assert objs, f"{variant} rendered nothing"
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{variant}: {name} is invalid for Kubernetes {version}: {exc}")


def test_the_validator_rejects_what_it_should() -> None:
    """The strict validation above can fail: a misspelt field and a wrong type are caught."""
    pdb = find(render("prod"), "PodDisruptionBudget", "sglang")
    typo = {**pdb, "spec": {**pdb["spec"], "maxUnavailabel": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSIONS[0], strict=True)
    dep = find(render("prod"), "Deployment", "sglang")
    wrong = {**dep, "spec": {**dep["spec"], "replicas": "sixteen"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("variant", ALL)
def test_images_are_pinned(variant: str) -> None:
    for obj in workloads(render(variant)):
        for where, c in containers(obj):
            image = c["image"]
            name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
            assert name and "/" not in tag, f"{where}: image {image!r} has no tag"
            assert tag != "latest", f"{where}: image {image!r} uses the latest tag"
            assert re.search(r"\d", tag), f"{where}: tag {tag!r} is not a version"


@pytest.mark.parametrize("variant", ALL)
def test_every_pod_meets_the_restricted_standard(variant: str) -> None:
    """Non-root, default seccomp, no privilege escalation, ALL capabilities dropped."""
    for obj in workloads(render(variant)):
        spec = pod_spec(obj)
        psc = spec.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True, obj["metadata"]["name"]
        assert psc.get("runAsUser", 0) > 0, obj["metadata"]["name"]
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        assert spec.get("automountServiceAccountToken") is False
        assert not spec.get("hostNetwork") and not spec.get("hostPID")
        assert not any("hostPath" in v for v in spec.get("volumes", []))
        for where, c in containers(obj):
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert not sc.get("privileged"), where
            assert sc.get("readOnlyRootFilesystem") is True, where
    for ns in (o for o in render(variant) if o["kind"] == "Namespace"):
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("variant", ALL)
def test_resources_and_probes(variant: str) -> None:
    for obj in workloads(render(variant)):
        for where, c in containers(obj):
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), where
            assert "memory" in res.get("limits", {}), where
        if obj["kind"] == "Job":
            continue
        for c in pod_spec(obj)["containers"]:
            where = f"{obj['metadata']['name']}/{c['name']}"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{where} has no {probe}"


@pytest.mark.parametrize("variant", PROD)
def test_sglang_fleet_on_gpus(variant: str) -> None:
    objs = render(variant)
    dep = find(objs, "Deployment", "sglang")
    assert dep["spec"]["replicas"] >= 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (c,) = pod_spec(dep)["containers"]
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert int(req["nvidia.com/gpu"]) >= 1 and req["nvidia.com/gpu"] == lim["nvidia.com/gpu"]
    # Long enough for loading a 30B checkpoint; short probes once up.
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 15 * 60
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["periodSeconds"] <= 10 and c[probe].get("failureThreshold", 3) <= 6
    spec = pod_spec(dep)
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    vol = next(v for v in spec["volumes"] if v["name"] == shm["name"])
    assert vol["emptyDir"]["medium"] == "Memory"
    anti = spec["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # The model is mounted read-only from the PVC the overlay defines.
    model = next(v for v in spec["volumes"] if v["name"] == "model")
    pvc = find(objs, "PersistentVolumeClaim", model["persistentVolumeClaim"]["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]


@pytest.mark.parametrize("variant", ALL)
def test_sglang_runs_the_launcher_against_the_cache(variant: str) -> None:
    objs = render(variant)
    dep = find(objs, "Deployment", "sglang")
    (c,) = pod_spec(dep)["containers"]
    assert c["command"] == ["python", "-m", "sglang_r3.launch_server"]
    args = c["args"]
    assert "--return-routed-experts" in args
    url = args[args.index("--routing-cache") + 1]
    m = re.fullmatch(r"(?:http|grpc)://([a-z0-9-]+):(\d+)", url)
    assert m, url
    svc = find(objs, "Service", m.group(1))
    assert int(m.group(2)) in [p["port"] for p in svc["spec"]["ports"]]
    assert not any("key" in a.lower() for a in args), "API keys stay off the command line"
    key = next(e for e in c["env"] if e["name"] == "SGLANG_R3_API_KEY")
    assert "secretKeyRef" in key["valueFrom"]
    # SGLang's arguments come from the ConfigMap, mounted where --config points.
    config_path = args[args.index("--config") + 1]
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod_spec(dep)["volumes"] if v["name"] == mount["name"])
    cm = find(objs, "ConfigMap", "sglang-config")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.rsplit("/", 1)[1] in cm["data"]


@pytest.mark.parametrize("variant", ALL)
def test_disruption_budgets(variant: str) -> None:
    objs = render(variant)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for obj in workloads(objs):
        if obj["kind"] == "Job" or obj["metadata"]["name"] == "redis":
            # A one-replica Redis with a PDB would block every node drain; its PVC
            # and AOF are what protect it (docs/deploy.md).
            continue
        labels = obj["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if selects(p["spec"]["selector"], labels)]
        assert len(covering) == 1, f"{obj['metadata']['name']}: {len(covering)} PDBs"
        budget = covering[0]["spec"]
        assert "maxUnavailable" in budget or "minAvailable" in budget
        assert budget.get("maxUnavailable", 1) != 0, "a budget of 0 blocks every drain"


@pytest.mark.parametrize("variant", ALL)
def test_cache_service(variant: str) -> None:
    objs = render(variant)
    dep = find(objs, "Deployment", "r3-cache")
    (c,) = pod_spec(dep)["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080, "grpc": 50051}
    svc = find(objs, "Service", "r3-cache")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels)
    # Keys from a Secret volume at the path the settings name.
    cm = find(objs, "ConfigMap", "r3-cache-config")
    keys_file = cm["data"]["R3_CACHE_API_KEYS_FILE"]
    mount = next(m for m in c["volumeMounts"] if keys_file.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod_spec(dep)["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"].startswith("r3-cache-api-keys")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    assert cm["data"]["R3_CACHE_AUTH"] == "on"
    # The direct-read secret: a key of the same Secret, mounted where the setting says.
    secret_file = cm["data"]["R3_CACHE_DIRECT_READ_SECRET_FILE"]
    mount = next(m for m in c["volumeMounts"] if secret_file.startswith(m["mountPath"] + "/"))
    vol = next(v for v in pod_spec(dep)["volumes"] if v["name"] == mount["name"])
    item = {"key": "direct-read-secret", "path": secret_file[len(mount["mountPath"]) + 1 :]}
    assert item in vol["secret"]["items"]
    # Prod enables direct reads (docs/deploy.md); a managed Redis switches them off.
    assert cm["data"]["R3_CACHE_DIRECT_READS"] == str(variant != "prod+external-redis").lower()
    if variant.startswith("prod"):
        assert dep["spec"]["replicas"] >= 2
        hpa = find(objs, "HorizontalPodAutoscaler", "r3-cache")
        assert hpa["spec"]["scaleTargetRef"]["name"] == "r3-cache"
        assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    else:
        assert dep["spec"]["replicas"] == 1


@pytest.mark.parametrize("variant", ALL)
def test_network_policy_admits_only_rollout_and_trainer_clients(variant: str) -> None:
    objs = render(variant)
    (pol,) = [
        p
        for p in objs
        if p["kind"] == "NetworkPolicy"
        and selects(p["spec"]["podSelector"], {"app.kubernetes.io/name": "r3-cache"})
    ]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    assert all(rule.get("from") for rule in pol["spec"]["ingress"]), "an empty from admits all"
    engine = find(objs, "Deployment", "sglang")["spec"]["template"]["metadata"]["labels"]

    def allows(pod: dict[str, str], ns: dict[str, str], same: bool, port: int) -> bool:
        return ingress_allows(pol, pod_labels=pod, ns_labels=ns, same_namespace=same, port=port)

    for port in (8080, 50051):
        assert allows(engine, {}, True, port), "the SGLang pods must reach the cache"
        assert allows({}, {"sglang-r3.io/role": "trainer"}, False, port)
        assert allows({}, {"sglang-r3.io/role": "rollout"}, False, port)
        assert allows({"sglang-r3.io/role": "trainer"}, {}, True, port)
        assert not allows({}, {}, True, port), "an unlabelled pod next door"
        assert not allows({}, {"team": "other"}, False, port), "another namespace"
        assert not allows({"sglang-r3.io/role": "trainer"}, {}, False, port), "label elsewhere"
    assert allows({}, {"sglang-r3.io/role": "monitoring"}, False, 8080)
    assert not allows({}, {"sglang-r3.io/role": "monitoring"}, False, 50051)
    # Redis, when it runs in the namespace: the cache pods, and trainers (direct reads)
    # on the Redis port only; never the engines or anyone else.
    cache = find(objs, "Deployment", "r3-cache")["spec"]["template"]["metadata"]["labels"]
    trainer = {"sglang-r3.io/role": "trainer"}
    rollout = {"sglang-r3.io/role": "rollout"}
    redis_pods = [o for o in objs if o["kind"] == "StatefulSet"]
    assert redis_pods or variant == "prod+external-redis"
    for sts in redis_pods:
        pod = sts["spec"]["template"]["metadata"]["labels"]
        (rpol,) = [
            p
            for p in objs
            if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], pod)
        ]
        assert all(rule.get("from") for rule in rpol["spec"]["ingress"]), "empty from"
        named_ports = {p["name"] for p in pod_spec(sts)["containers"][0]["ports"]}
        bus = [16379] if "bus" in named_ports else []

        def reaches(
            pod_labels: dict[str, str], ns: dict[str, str], same: bool, port: int, pol: Obj = rpol
        ) -> bool:
            return ingress_allows(
                pol, pod_labels=pod_labels, ns_labels=ns, same_namespace=same, port=port
            )

        assert reaches(cache, {}, True, 6379)
        assert reaches(trainer, {}, True, 6379), "a trainer pod next door"
        assert reaches({}, trainer, False, 6379), "a pod of a trainer namespace"
        assert reaches(trainer, trainer, False, 6379)
        for port in bus:  # the cluster bus: the nodes only
            assert reaches(pod, {}, True, port)
            assert not reaches(trainer, {}, True, port) and not reaches({}, trainer, False, port)
            assert not reaches(cache, {}, True, port)
        for port in (6379, *bus):
            assert not reaches(engine, {}, True, port), "the SGLang pods never talk to Redis"
            assert not reaches(rollout, {}, True, port)
            assert not reaches({}, rollout, False, port), "a rollout namespace"
            assert not reaches({}, {"sglang-r3.io/role": "monitoring"}, False, port)
            assert not reaches({}, {}, True, port), "an unlabelled pod next door"
            assert not reaches({}, {"team": "other"}, False, port), "another namespace"
            assert not reaches(trainer, {}, False, port), "a trainer label elsewhere"


def _redis_target(objs: list[Obj]) -> tuple[str, dict[str, Any]]:
    dep = find(objs, "Deployment", "r3-cache")
    (c,) = pod_spec(dep)["containers"]
    env = {e["name"]: e for e in c["env"]}
    return find(objs, "ConfigMap", "r3-cache-config")["data"]["R3_CACHE_REDIS_CLUSTER"], env[
        "R3_CACHE_REDIS_URL"
    ]


@pytest.mark.parametrize(
    ("variant", "service", "cluster"),
    [("dev", "redis", "false"), ("prod", "redis-cluster", "true")],
)
def test_cache_points_at_the_redis_that_is_deployed(
    variant: str, service: str, cluster: str
) -> None:
    objs = render(variant)
    flag, url = _redis_target(objs)
    assert flag == cluster
    m = re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@([a-z0-9-]+):6379/0", url["value"])
    assert m and m.group(1) == service, url
    assert has(objs, "Service", service)
    sts = find(objs, "StatefulSet", service)
    assert sts["spec"]["volumeClaimTemplates"], "Redis data on a PersistentVolume"
    conf_cm = find(objs, "ConfigMap", f"{service}-config")
    conf = conf_cm["data"]["redis.conf"]
    assert re.search(r"^appendonly yes$", conf, re.M)
    args = pod_spec(sts)["containers"][0]["args"]
    assert args[args.index("--dir") + 1] == "/data"
    mounts = pod_spec(sts)["containers"][0]["volumeMounts"]
    assert any(m["mountPath"] == "/data" and m["name"] == "data" for m in mounts)
    if cluster == "true":
        assert sts["spec"]["replicas"] == 6
        assert re.search(r"^cluster-enabled yes$", conf, re.M)
        job = find(objs, "Job", "redis-cluster-init")
        nodes = next(e for e in pod_spec(job)["containers"][0]["env"] if e["name"] == "REDIS_NODES")
        assert len(nodes["value"].split()) == 6
    # The single Redis is gone wherever the cluster is used, and vice versa.
    assert has(objs, "StatefulSet", "redis") == (service == "redis")


def test_external_redis_removes_in_namespace_redis() -> None:
    objs = render("prod+external-redis")
    assert not [o for o in objs if "redis" in o["metadata"]["name"] and o["kind"] != "Secret"]
    _, url = _redis_target(objs)
    assert url["valueFrom"]["secretKeyRef"] == {"name": "r3-redis-url", "key": "url"}


@pytest.mark.parametrize(
    ("variant", "service", "cluster"),
    [("dev", "redis", False), ("prod", "redis-cluster", True)],
)
def test_read_plans_point_trainers_at_the_deployed_redis(
    variant: str, service: str, cluster: bool
) -> None:
    """The Redis URL in read plans resolves from any namespace and names the deployed Redis
    (a cluster's seed); on a cluster, what the nodes announce resolves from anywhere too."""
    objs = render(variant)
    dep = find(objs, "Deployment", "r3-cache")
    (c,) = pod_spec(dep)["containers"]
    env = container_env(dep, c)
    ns = dep["metadata"]["namespace"]
    m = re.fullmatch(r"redis://([a-z0-9.-]+):(\d+)/0", env["R3_CACHE_DIRECT_READ_URL"])
    assert m, env["R3_CACHE_DIRECT_READ_URL"]  # and no credentials: the plan carries the user's
    assert m.group(1) == f"{service}.{ns}.svc"
    (svc,) = [o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == service]
    assert svc["metadata"]["namespace"] == ns
    assert int(m.group(2)) in [p["port"] for p in svc["spec"]["ports"]]
    cm = find(objs, "ConfigMap", "r3-cache-config")["data"]
    assert cm["R3_CACHE_REDIS_CLUSTER"] == str(cluster).lower()  # the plan's `cluster`
    assert "R3_CACHE_DIRECT_READ_URL" not in cm, "set once, in the Deployment"
    if cluster:
        sts = find(objs, "StatefulSet", service)
        (node,) = pod_spec(sts)["containers"]
        args = node["args"]
        announced = args[args.index("--cluster-announce-hostname") + 1]
        announced = announced.replace("$(POD_NAME)", f"{service}-0").replace(
            "$(POD_NAMESPACE)", container_env(sts, node)["POD_NAMESPACE"]
        )
        assert announced == f"{service}-0.{sts['spec']['serviceName']}.{ns}.svc"
        assert has(objs, "Service", sts["spec"]["serviceName"])


def _secrets_table() -> set[tuple[str, str]]:
    """(secret, key) rows of docs/deploy.md's Secrets table."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    return set(re.findall(r"^\| `([a-z0-9-]+)` \| `([A-Za-z0-9._-]+)` \|", doc, flags=re.M))


@pytest.mark.parametrize("variant", ALL)
def test_references_resolve(variant: str) -> None:
    """Every ConfigMap a pod reads is rendered; every Secret is rendered or documented."""
    objs = render(variant)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    for obj in workloads(objs):
        spec = pod_spec(obj)
        refs: list[tuple[str, str]] = []
        keys: list[tuple[str, str]] = []  # (secret, key) each pod reads
        for v in spec.get("volumes", []):
            if "configMap" in v:
                refs.append(("ConfigMap", v["configMap"]["name"]))
            if "secret" in v:
                refs.append(("Secret", v["secret"]["secretName"]))
                keys += [(v["secret"]["secretName"], i["key"]) for i in v["secret"]["items"]]
        for _, c in containers(obj):
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                if "secretKeyRef" in src:
                    refs.append(("Secret", src["secretKeyRef"]["name"]))
                    keys.append((src["secretKeyRef"]["name"], src["secretKeyRef"]["key"]))
                if "configMapKeyRef" in src:
                    refs.append(("ConfigMap", src["configMapKeyRef"]["name"]))
            refs += [("ConfigMap", e["configMapRef"]["name"]) for e in c.get("envFrom", [])]
        for kind, name in refs:
            if (kind, name) in names:
                continue
            assert kind == "Secret" and variant.startswith("prod"), f"{variant}: {kind} {name}"
            assert f"`{name}`" in deploy_doc, f"docs/deploy.md must say how to create {name}"
        # Every key too: a missing key leaves the pod unable to start.
        secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
        for name, key in keys:
            if name in secrets:
                assert key in secrets[name].get("data", {}), f"{variant}: Secret {name} lacks {key}"
            else:
                assert (name, key) in _secrets_table(), f"docs/deploy.md: no row for {name}/{key}"


@pytest.mark.parametrize("variant", ALL)
def test_labels(variant: str) -> None:
    for obj in render(variant):
        if obj["kind"] == "Namespace":
            continue
        labels = obj["metadata"].get("labels", {})
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert labels.get("app.kubernetes.io/part-of") == "sglang-r3", where
        if obj["kind"] not in ("Secret",):
            assert "app.kubernetes.io/name" in labels, where


def _bytes(quantity: str) -> int:
    """Kubernetes (Mi, Gi) and Redis (mb, gb: also powers of 1024) memory quantities."""
    m = re.fullmatch(r"(\d+)(Mi|Gi|mb|gb)", quantity)
    assert m, quantity
    return int(m.group(1)) << (20 if m.group(2) in ("Mi", "mb") else 30)


@pytest.mark.parametrize("variant", ["dev", "prod"])
def test_redis_maxmemory_leaves_fork_headroom(variant: str) -> None:
    """noeviction only refuses writes if maxmemory is set below the container's limit."""
    for sts in (o for o in render(variant) if o["kind"] == "StatefulSet"):
        (c,) = pod_spec(sts)["containers"]
        assert c["args"][c["args"].index("--maxmemory") + 1] == "$(REDIS_MAXMEMORY)"
        env = {e["name"]: e.get("value") for e in c["env"]}
        share = _bytes(env["REDIS_MAXMEMORY"]) / _bytes(c["resources"]["limits"]["memory"])
        assert 0.5 <= share <= 0.75, f"{sts['metadata']['name']}: maxmemory {share:.0%} of limit"


@pytest.mark.parametrize("variant", ALL)
def test_router_fronts_the_fleet_with_r3_settings(variant: str) -> None:
    """sglang-router (pinned) finds the SGLang pods by label and runs sglang_r3.launch.fleet's
    settings; the engines behind it refuse untagged requests."""
    objs = render(variant)
    dep = find(objs, "Deployment", "sglang-router")
    (c,) = pod_spec(dep)["containers"]
    assert c["image"].endswith(f"-router{ROUTER_VERSION}"), c["image"]
    args = c["args"]
    n = len(ROUTER_ARGS)
    assert any(tuple(args[i : i + n]) == ROUTER_ARGS for i in range(len(args))), args
    engines = find(objs, "Deployment", "sglang")
    labels = engines["spec"]["template"]["metadata"]["labels"]
    assert "--service-discovery" in args
    key, _, value = args[args.index("--selector") + 1].partition("=")
    assert labels.get(key) == value, "the selector must match the SGLang pods"
    (engine,) = pod_spec(engines)["containers"]
    port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "http")
    assert int(args[args.index("--service-discovery-port") + 1]) == port
    assert "--routing-require-tag" in engine["args"]
    # Pod discovery with a read-only Role on pods, through a projected token.
    spec = pod_spec(dep)
    sa = find(objs, "ServiceAccount", spec["serviceAccountName"])
    binding = next(
        o
        for o in objs
        if o["kind"] == "RoleBinding"
        and any(s["name"] == sa["metadata"]["name"] for s in o["subjects"])
    )
    role = find(objs, "Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    token = mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
    assert token["readOnly"] is True
    # Only drivers and trainers reach it; Prometheus only its metrics port.
    (pol,) = [
        p
        for p in objs
        if p["kind"] == "NetworkPolicy"
        and selects(p["spec"]["podSelector"], dep["spec"]["template"]["metadata"]["labels"])
    ]

    def allows(pod: dict[str, str], ns: dict[str, str], same: bool, port: int) -> bool:
        return ingress_allows(pol, pod_labels=pod, ns_labels=ns, same_namespace=same, port=port)

    assert allows({"sglang-r3.io/role": "driver"}, {}, True, 30000)
    assert allows({}, {"sglang-r3.io/role": "trainer"}, False, 30000)
    assert not allows({}, {}, True, 30000), "an unlabelled pod next door"
    assert allows({}, {"sglang-r3.io/role": "monitoring"}, False, 29000)
    assert not allows({}, {"sglang-r3.io/role": "monitoring"}, False, 30000)
