"""The deployment files under deploy/: every YAML file parses, the compose mesh
has its services, and each yinian service's command and environment are
accepted by that service's own argument parser (and say what a container
needs: listen on 0.0.0.0, advertise the service name, fixed metrics ports
that prometheus.yml scrapes). `docker compose config` validates the compose
files where the compose plugin exists. No Docker engine is needed."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import threading
from concurrent import futures
from pathlib import Path

import pytest
import yaml
from deploy_helpers import DEPLOY, K8S, PARSERS, ROOT, parse_command

COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "docker-compose.gpu.yml"
COMPOSE_MODEL = DEPLOY / "docker-compose.model.yml"

YINIAN_SERVICES = {"scheduler", "kvstore", "worker-1", "worker-2", "gateway"}
WORKERS = ("worker-1", "worker-2")
EXPECTED_SERVICES = YINIAN_SERVICES | {"nats", "redis", "jaeger", "prometheus"}
TINY_MODEL = "/models/tiny-llama"

_VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and ${VAR:?error}."""
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        name, op, arg = match.groups()
        have = env.get(name)
        if op in (":-", ":?") and not have:
            have = None
        if have is not None:
            return have
        if op and op.endswith("?"):
            raise ValueError(f"{name}: {arg}")
        return arg if op else ""

    return _VARIABLE.sub(sub, value)


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


def environment(service: dict, host_env: dict[str, str] | None = None) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(interpolate(v, host_env or {})) for k, v in env.items()}


def service_config(monkeypatch, compose: dict, name: str, host_env: dict | None = None):
    service = compose["services"][name]
    argv = [str(interpolate(a, host_env or {})) for a in service["command"]]
    return parse_command(monkeypatch, argv, environment(service, host_env))


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE)


# (a) the files parse, and agree with the services' own flags


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path):
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    assert docs, f"{path} is empty"
    if K8S in path.parents and not isinstance(docs[0], list):  # a list: a JSON patch
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), doc
            if doc["kind"] not in ("Kustomization", "Component"):
                assert doc["metadata"]["name"]


def test_compose_has_the_mesh(compose):
    assert set(compose["services"]) == EXPECTED_SERVICES
    for name in YINIAN_SERVICES:
        service = compose["services"][name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
        assert (COMPOSE.parent / service["build"]["context"] / "deploy/Dockerfile.cpu").is_file()
        assert service["command"][0] in PARSERS
        env = environment(service)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert "healthcheck" in service, name
    names = [environment(compose["services"][n])["OTEL_SERVICE_NAME"] for n in YINIAN_SERVICES]
    assert len(set(names)) == len(names), names
    assert " -js " in compose["services"]["nats"]["entrypoint"][2]  # JetStream on
    ports = compose["services"]["jaeger"]["ports"]
    assert any(p.endswith(":16686") for p in ports) and any(p.endswith(":4317") for p in ports)


def test_depends_on_conditions(compose):
    services = compose["services"]
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            condition = spec["condition"]
            assert condition in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
    for worker in WORKERS:
        assert services[worker]["depends_on"]["scheduler"]["condition"] == "service_healthy"
        assert services[worker]["depends_on"]["nats"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_scheduler_command(monkeypatch, compose):
    config = service_config(monkeypatch, compose, "scheduler")
    assert config.host == "0.0.0.0"
    assert config.nats_url == "nats://nats:4222"
    assert config.metrics_port != 0, "a fixed metrics port, for prometheus.yml"
    test = compose["services"]["scheduler"]["healthcheck"]["test"]
    assert f"127.0.0.1:{config.port}" in test


def test_kvstore_command(monkeypatch, compose):
    config = service_config(monkeypatch, compose, "kvstore")
    assert config.host == "0.0.0.0"
    assert config.nats_url == "nats://nats:4222"
    assert config.redis_url == "redis://redis:6379/0", "the shared tier is on"
    assert config.metrics_port != 0
    test = compose["services"]["kvstore"]["healthcheck"]["test"]
    assert f"127.0.0.1:{config.port}" in test
    assert compose["services"]["kvstore"]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", WORKERS)
def test_worker_command(monkeypatch, compose, name):
    config = service_config(monkeypatch, compose, name)
    scheduler = service_config(monkeypatch, compose, "scheduler")
    assert config.model == TINY_MODEL
    assert config.role == "colocated"
    assert config.host == "0.0.0.0"
    assert config.advertise_host == name, "peers must reach the worker by its service name"
    assert config.worker_id == name
    assert config.scheduler == f"scheduler:{scheduler.port}"
    assert config.nats_url == "nats://nats:4222"
    assert config.port != 0 and config.metrics_port != 0
    test = compose["services"][name]["healthcheck"]["test"]
    assert f"127.0.0.1:{config.port}" in test


def test_gateway_command(monkeypatch, compose):
    config = service_config(monkeypatch, compose, "gateway")
    scheduler = service_config(monkeypatch, compose, "scheduler")
    assert config.model == TINY_MODEL
    assert config.host == "0.0.0.0"
    assert config.scheduler == f"scheduler:{scheduler.port}"
    assert (config.port, config.grpc_port) == (8000, 50051)
    # open unless YINIAN_API_KEYS is given (like vLLM's server), published on loopback
    assert config.allow_unauthenticated
    env = environment(compose["services"]["gateway"], {"YINIAN_API_KEYS": "sk-a:t"})
    assert env["YINIAN_API_KEYS"] == "sk-a:t"
    ports = [interpolate(p, {}) for p in compose["services"]["gateway"]["ports"]]
    assert f"127.0.0.1:{config.port}:{config.port}" in ports
    assert f"127.0.0.1:{config.grpc_port}:{config.grpc_port}" in ports
    test = compose["services"]["gateway"]["healthcheck"]["test"]
    assert f"http://127.0.0.1:{config.port}/health" in test


def test_the_image_makes_the_default_model():
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / dockerfile).read_text()
        assert f"make-model --preset tiny-llama --out {TINY_MODEL}" in text
        assert re.search(r"^USER (?!root)\w+", text, re.M), f"{dockerfile} runs as root"
        assert "pip install" in text and "COPY deploy/healthcheck.py" in text
    cpu = (DEPLOY / "Dockerfile.cpu").read_text()
    assert "FROM ${PYTHON_IMAGE}" in cpu and "ARG PYTHON_IMAGE=python:3.11-slim" in cpu
    assert "download.pytorch.org/whl/cpu" in cpu


def test_prometheus_scrapes_every_service(monkeypatch, compose):
    prometheus = load(DEPLOY / "prometheus.yml")
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    gateway = service_config(monkeypatch, compose, "gateway")
    assert f"gateway:{gateway.port}" in targets  # /metrics on the REST port
    for name in ("scheduler", "kvstore", *WORKERS):
        config = service_config(monkeypatch, compose, name)
        assert f"{name}:{config.metrics_port}" in targets
    volumes = compose["services"]["prometheus"]["volumes"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes


def test_gpu_override(monkeypatch, compose):
    gpu = load(COMPOSE_GPU)
    assert set(gpu["services"]) <= set(compose["services"])
    for name in YINIAN_SERVICES:
        assert gpu["services"][name]["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    gpus = []
    for name in WORKERS:
        service = gpu["services"][name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        gpus += [interpolate(d, {}) for d in devices[0]["device_ids"]]
        merged = dict(compose["services"][name], command=service["command"])
        config = service_config(monkeypatch, {"services": {name: merged}}, name)
        assert config.engine_options["device"] == "cuda"
        assert config.advertise_host == name
    assert len(set(gpus)) == len(gpus), "each worker gets its own GPU by default"


def test_model_override(monkeypatch, compose):
    override = load(COMPOSE_MODEL)
    host_env = {"MODEL_DIR": "/data/llama", "SERVED_MODEL_NAME": "llama"}
    for name in ("gateway", *WORKERS):
        service = override["services"][name]
        source, target, mode = interpolate(service["volumes"][0], host_env).split(":")
        assert (source, mode) == ("/data/llama", "ro")
        merged = dict(compose["services"][name])
        merged["environment"] = {**environment(merged), **environment(service, host_env)}
        config = service_config(monkeypatch, {"services": {name: merged}}, name, host_env)
        assert config.model == target
        if name == "gateway":
            assert config.served_model_name == "llama"
    with pytest.raises(ValueError, match="MODEL_DIR"):
        interpolate(override["services"]["gateway"]["volumes"][0], {})


# the health checks the containers run


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("yinian_healthcheck", DEPLOY / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_grpc():
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    check = _healthcheck_module()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check.main(["grpc", address]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check.main(["grpc", address]) == 0
    finally:
        server.stop(0)
    assert check.main(["grpc", address], timeout=0.5) == 1  # nothing listening
    assert check.main(["bogus"]) == 2


def test_healthcheck_http():
    status = {"code": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check = _healthcheck_module()
        url = f"http://127.0.0.1:{server.server_port}/health"
        assert check.main([url]) == 1
        status["code"] = 200
        assert check.main([url]) == 0
    finally:
        server.shutdown()
        server.server_close()


# (b) docker compose's own validation, where the plugin exists


def _compose_unavailable() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH"
    try:
        result = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker compose version` failed: {exc}"
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        return message.splitlines()[0] if message else f"exit {result.returncode}"
    return None


@pytest.mark.parametrize(
    "files",
    [
        [COMPOSE],
        [COMPOSE, COMPOSE_GPU],
        [COMPOSE, COMPOSE_MODEL],
        [COMPOSE, COMPOSE_GPU, COMPOSE_MODEL],
    ],
    ids=["cpu", "gpu", "model", "gpu+model"],
)
def test_docker_compose_config(files, tmp_path, monkeypatch):
    reason = _compose_unavailable()
    if reason:
        pytest.skip(f"docker compose plugin not available: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YINIAN_", "COMPOSE_"))}
    env["MODEL_DIR"] = str(tmp_path)
    cmd = ["docker", "compose"] + [a for f in files for a in ("-f", str(f))] + ["config"]
    result = subprocess.run(
        [*cmd, "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    # What compose resolved (anchors, merges, overrides, interpolation) still
    # starts every yinian service the way the checks above expect.
    resolved = json.loads(result.stdout)
    assert set(resolved["services"]) == EXPECTED_SERVICES
    for name in YINIAN_SERVICES:
        service = resolved["services"][name]
        config = parse_command(monkeypatch, service["command"], service["environment"])
        assert config.host == "0.0.0.0"
        if name in WORKERS:
            assert config.advertise_host == name
            assert config.model == ("/models/model" if COMPOSE_MODEL in files else TINY_MODEL)
            assert ("deploy" in service) == (COMPOSE_GPU in files)
