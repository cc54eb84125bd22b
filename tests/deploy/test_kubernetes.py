"""deploy/k8s: both overlays render, every object validates against the Kubernetes schemas,
and the objects are wired and locked down the way docs/kubernetes.md says.

No cluster here: ``kubectl kustomize`` renders, ``kubernetes-validate`` checks each object
against the OpenAPI schemas it ships for ``K8S_VERSION`` (strict: an unknown field fails),
and the policy checks below read the rendered objects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kvroute.cli import build_parser
from router_service.kv_events import parse_source
from router_service.redis_client import parse_redis_url
from router_service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.31.0"  # the oldest Kubernetes these manifests promise to apply on
OVERLAYS = ("emulated", "gpu")
COMPONENTS = ("external-redis", "model-hostpath", "prometheus-operator")
WORKLOADS = ("Deployment", "StatefulSet")
Objects = list[dict[str, Any]]


def _kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip(
            "kubectl is not installed: the manifests under deploy/k8s are rendered with "
            "`kubectl kustomize` (install kubectl >= 1.27 to run these checks)"
        )
    return exe


def _render(directory: Path) -> Objects:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _with_components(overlay: str, components: tuple[str, ...]) -> Objects:
    """``overlay`` plus ``components``, rendered from a kustomization outside the tree."""
    with tempfile.TemporaryDirectory() as scratch:
        rel = os.path.relpath(K8S, scratch)
        (Path(scratch) / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [f"{rel}/overlays/{overlay}"],
                    "components": [f"{rel}/components/{c}" for c in components],
                }
            )
        )
        return _render(Path(scratch))


@pytest.fixture(scope="module")
def rendered() -> dict[str, Objects]:
    out = {name: _render(K8S / "overlays" / name) for name in OVERLAYS}
    out["gpu+components"] = _with_components("gpu", COMPONENTS)
    return out


def _one(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _router(objects: Objects) -> dict[str, Any]:
    (container,) = _one(objects, "Deployment", "kvroute-router")["spec"]["template"]["spec"][
        "containers"
    ]
    return container


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _named_ports(workload: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in _containers(workload) for p in c["ports"]}


# -- schemas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [*OVERLAYS, "gpu+components"])
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, Objects], variant: str
) -> None:
    objects = rendered[variant]
    checked = 0
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # the Prometheus Operator's CRD: checked by the wiring tests below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_the_validation_refuses_what_is_wrong() -> None:
    """The schema check is not vacuous: an unknown field and a wrong type both fail."""
    deployment = yaml.safe_load((K8S / "base" / "router-deployment.yaml").read_text())
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # not "resources"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


# -- policy ------------------------------------------------------------------------------------
def _policy_problems(obj: dict[str, Any]) -> Iterator[str]:
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    pod = obj["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext", {})
    if pod.get("automountServiceAccountToken") is not False:
        yield f"{where}: mounts a service account token"
    if pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        yield f"{where}: no RuntimeDefault seccomp profile"
    for c in _containers(obj):
        at = f"{where} container {c['name']}"
        image = c["image"]
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        if not tag or tag == "latest":
            yield f"{at}: image {image!r} has no pinned tag"
        res = c.get("resources", {})
        for need in ("cpu", "memory"):
            if need not in res.get("requests", {}):
                yield f"{at}: no {need} request"
        if "memory" not in res.get("limits", {}):
            yield f"{at}: no memory limit"
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in c:
                yield f"{at}: no {probe}"
        sc = {**pod_sc, **c.get("securityContext", {})}
        if sc.get("runAsNonRoot") is not True or sc.get("runAsUser", 0) == 0:
            yield f"{at}: may run as root"
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"{at}: privilege escalation allowed"
        if sc.get("readOnlyRootFilesystem") is not True:
            yield f"{at}: writable root filesystem"
        if sc.get("privileged"):
            yield f"{at}: privileged"
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            yield f"{at}: capabilities not dropped"


@pytest.mark.parametrize("variant", [*OVERLAYS, "gpu+components"])
def test_every_workload_is_pinned_sized_probed_and_locked_down(
    rendered: dict[str, Objects], variant: str
) -> None:
    workloads = [o for o in rendered[variant] if o["kind"] in WORKLOADS]
    assert {o["metadata"]["name"] for o in workloads} >= {"kvroute-router", "kvroute-worker"}
    problems = [p for o in workloads for p in _policy_problems(o)]
    assert problems == []


def test_the_policy_check_finds_what_it_looks_for() -> None:
    deployment = yaml.safe_load((K8S / "base" / "router-deployment.yaml").read_text())
    assert list(_policy_problems(deployment)) == []
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "kvroute-router:latest"
    del container["readinessProbe"]
    del container["resources"]["requests"]["cpu"]
    container["securityContext"]["readOnlyRootFilesystem"] = False
    deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0
    problems = " | ".join(_policy_problems(deployment))
    for expected in ("no pinned tag", "no readinessProbe", "no cpu request", "writable root"):
        assert expected in problems
    assert "may run as root" in problems


def test_no_secret_is_kept_in_the_manifests(rendered: dict[str, Objects]) -> None:
    for variant, objects in rendered.items():
        assert [o for o in objects if o["kind"] == "Secret"] == [], variant
        env = _env(_router(objects))
        for name, key in (
            ("KVROUTE_ADMIN_TOKEN", "admin-token"),
            ("KVROUTE_MODEL_SNAPSHOT_KEY", "model-snapshot-key"),
        ):
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("kvroute-secrets", key)


# -- the router --------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_is_replicated_probed_budgeted_and_autoscaled(
    rendered: dict[str, Objects], overlay: str
) -> None:
    objects = rendered[overlay]
    deployment = _one(objects, "Deployment", "kvroute-router")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    router = _router(objects)
    ports = _named_ports(deployment)
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in router["livenessProbe"]  # /health's 503 is no reason to restart
    # Drain: the grace period covers the drain's two phases.
    env = {k: v.get("value") for k, v in _env(router).items()}
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > float(env["KVROUTE_DRAIN_GRACE_S"]) + float(env["KVROUTE_DRAIN_TIMEOUT_S"])

    pdb = _one(objects, "PodDisruptionBudget", "kvroute-router")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] >= 1
    hpa = _one(objects, "HorizontalPodAutoscaler", "kvroute-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kvroute-router",
    }
    assert hpa["spec"]["minReplicas"] >= 2
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "cpu" in router["resources"]["requests"]  # utilization is of the request

    # The data plane and the control plane on separate ClusterIP Services.
    data = _one(objects, "Service", "kvroute")
    control = _one(objects, "Service", "kvroute-control")
    for service in (data, control):
        assert service["spec"]["type"] == "ClusterIP"
        assert _matches(service["spec"]["selector"], labels)
    assert [(p["port"], p["targetPort"]) for p in data["spec"]["ports"]] == [(8000, "http")]
    assert [(p["port"], p["targetPort"]) for p in control["spec"]["ports"]] == [(8001, "control")]
    assert ports == {"http": 8000, "control": 8001}
    assert router["args"][-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    assert env["KVROUTE_CONTROL_PORT"] == "8001"
    assert env["KVROUTE_CONTROL_HOST"] == "0.0.0.0"
    # Prometheus scrapes /metrics where it is served: the control listener.
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/port"] == str(ports["control"])
    assert notes["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("variant", [*OVERLAYS, "gpu+components"])
def test_the_router_environment_is_valid_settings_that_discover_the_workers(
    rendered: dict[str, Objects], variant: str
) -> None:
    objects = rendered[variant]
    values: dict[str, Any] = {}
    for name, entry in _env(_router(objects)).items():
        if "value" in entry:
            values[name] = entry["value"]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            key = entry["valueFrom"]["secretKeyRef"]["key"]
            values[name] = {
                "admin-token": "t" * 32,
                "model-snapshot-key": "k" * 32,
                "redis-url": "redis+sentinel://rfs-kvroute:26379/mymaster",
            }[key]
        else:
            values[name] = "kvroute-router-abc"  # the pod's name (fieldRef)
    fields = {k.removeprefix("KVROUTE_").lower(): v for k, v in values.items()}
    settings = Settings(**fields)
    assert settings.redis_url is not None
    parse_redis_url(settings.redis_url)
    if variant != "gpu+components":
        assert urlsplit(settings.redis_url).hostname == "kvroute-redis"
        redis_service = _one(objects, "Service", "kvroute-redis")
        assert redis_service["spec"]["ports"][0]["port"] == urlsplit(settings.redis_url).port
    else:  # external-redis: the bundled Redis is gone, the URL comes from the Secret
        assert not [o for o in objects if o["metadata"]["name"] == "kvroute-redis"]

    # Discovery: the headless Service's name and port; its pods pass the allow-list.
    assert settings.worker_dns is not None
    dns = urlsplit(settings.worker_dns)
    headless = _one(objects, "Service", str(dns.hostname))
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    ports = {p["name"]: p for p in headless["spec"]["ports"]}
    assert ports["http"]["port"] == dns.port
    workers = _one(objects, "StatefulSet", "kvroute-worker")
    assert workers["spec"]["serviceName"] == headless["metadata"]["name"]
    assert _matches(headless["spec"]["selector"], workers["spec"]["template"]["metadata"]["labels"])
    container_ports = _named_ports(workers)
    for port in headless["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]
    assert settings.accepted_worker(f"http://10.244.1.7:{dns.port}") is not None  # kind's pods
    assert settings.accepted_worker(f"http://169.254.169.254:{dns.port}") is None  # metadata
    # KV events: the router's template names the ports the workers publish on.
    assert settings.worker_dns_kv_events is not None
    source = parse_source(settings.worker_dns_kv_events.replace("*", "10.0.0.1"))
    assert urlsplit(source.endpoint).port == container_ports["kv-events"]
    assert source.replay is not None
    assert urlsplit(source.replay).port == container_ports["kv-replay"]


# -- the workers ---------------------------------------------------------------------------------
def _kv_events_config(args: list[str]) -> dict[str, str]:
    config: dict[str, str] = json.loads(args[args.index("--kv-events-config") + 1])
    return config


def test_emulated_workers_run_kvroute_emulate_with_kv_events(rendered: dict[str, Objects]) -> None:
    workers = _one(rendered["emulated"], "StatefulSet", "kvroute-worker")
    (container,) = _containers(workers)
    args = container["args"]
    assert args[:2] == ["kvroute", "emulate"]
    parsed = build_parser().parse_args(args[1:])  # kvroute's own CLI accepts them
    assert parsed.port == 30000
    assert parsed.eviction == "rlt"
    config = _kv_events_config(args)
    assert config["endpoint"] == "tcp://*:5557"
    assert config["replay_endpoint"] == "tcp://*:5558"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert not any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in [container])


def test_gpu_workers_run_sglang_with_rlt_a_gpu_each_the_model_and_kv_events(
    rendered: dict[str, Objects],
) -> None:
    objects = rendered["gpu"]
    workers = _one(objects, "StatefulSet", "kvroute-worker")
    (container,) = _containers(workers)
    args = container["args"]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    assert args[args.index("--radix-cache-backend") + 1] == "rlt"
    assert "--enable-metrics" in args
    assert args[args.index("--port") + 1] == "30000"
    config = _kv_events_config(args)
    assert (config["publisher"], config["endpoint"]) == ("zmq", "tcp://*:5557")
    for where in ("requests", "limits"):
        assert container["resources"][where]["nvidia.com/gpu"] == "1"
    # The SGLang pin agrees with the engine extra's (docs/operations.md: bump both).
    pyproject = (ROOT / "pyproject.toml").read_text()
    pinned = re.search(r'"sglang==([0-9.]+)"', pyproject)
    assert pinned is not None
    assert container["image"].endswith(f"-sglang{pinned.group(1)}")
    # The model: a read-only volume from the PVC, and MODEL_PATH inside it.
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True
    model_path = _env(container)["MODEL_PATH"]["value"]
    assert model_path.startswith(mounts["model"]["mountPath"] + "/")
    assert args[args.index("--model-path") + 1] == "$(MODEL_PATH)"
    volumes = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}
    claim = volumes["model"]["persistentVolumeClaim"]["claimName"]
    assert _one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert "startupProbe" in container  # minutes of weight loading before the others count
    # From a node's directory instead, with the components:
    variant = _one(rendered["gpu+components"], "StatefulSet", "kvroute-worker")
    volumes = {v["name"]: v for v in variant["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/models", "type": "Directory"}
    assert "persistentVolumeClaim" not in volumes["model"]
    assert not [o for o in rendered["gpu+components"] if o["kind"] == "PersistentVolumeClaim"]


# -- observability ---------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grafana_dashboard_configmap_is_the_compose_dashboard(
    rendered: dict[str, Objects], overlay: str
) -> None:
    config_map = _one(rendered[overlay], "ConfigMap", "kvroute-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (ROOT / "docker" / "grafana" / "dashboards" / "kvroute.json").read_text()
    # kustomize reads only inside its tree: the component keeps a copy, which must not drift
    # (deploy/k8s/components/grafana-dashboard/kustomization.yaml says how to refresh it).
    assert config_map["data"]["kvroute.json"] == source


def test_service_monitors_scrape_the_control_listener_and_the_workers(
    rendered: dict[str, Objects],
) -> None:
    objects = rendered["gpu+components"]
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"kvroute-router", "kvroute-workers"}
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in monitors.values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        (service,) = [
            s
            for s in services
            if _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names
            assert endpoint["path"] == "/metrics"
    router = monitors["kvroute-router"]["spec"]["endpoints"][0]
    assert router["port"] == "control"
