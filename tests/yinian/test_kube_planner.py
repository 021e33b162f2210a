"""`yinian planner`: the SLA planner scales a worker Deployment on Kubernetes. No API
server runs here: a recording one stands in (it keeps the Deployment, answers kr8s's
reads and patches as the API does and records every call), and a page of gateway
metrics whose request rate the test sets stands in for the gateways."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from paths import ROOT
from planner_helpers import PROFILE, gateway_page
from prometheus_client import CollectorRegistry, Counter, generate_latest

DEPLOYMENT = "/apis/apps/v1/namespaces/yinian/deployments/yinian-worker"


class FakeApi:
    """The API server's part kr8s uses for one Deployment; pods are ready on the
    first read after a patch (they start between two reads)."""

    def __init__(self):
        self.calls: list[tuple[str, str, str | None, str]] = []
        self.spec, self.ready = 1, 1
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                size = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(size).decode() if size else ""
                status, out = api.answer(self.command, self.path, body)
                with api.lock:
                    api.calls.append((self.command, self.path,
                                      self.headers.get("content-type"), body))  # fmt: skip
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = _answer  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def deployment(self) -> dict:
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "yinian-worker", "namespace": "yinian"},
                "spec": {"replicas": self.spec},
                "status": {"replicas": self.spec, "readyReplicas": self.ready}}  # fmt: skip

    def pods(self, path: str) -> dict:
        """The gateway pods: one ready at 127.0.0.1, one not ready yet."""
        assert "labelSelector=app.kubernetes.io%2Fname%3Dyinian-gateway" in path, path

        def pod(name: str, ready: str) -> dict:
            return {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": "yinian"},
                    "status": {"podIP": "127.0.0.1" if ready == "True" else "10.0.0.9",
                               "conditions": [{"type": "Ready", "status": ready}]}}  # fmt: skip

        return {"kind": "PodList", "apiVersion": "v1", "metadata": {},
                "items": [pod("gateway-a", "True"), pod("gateway-b", "False")]}  # fmt: skip

    def answer(self, method: str, path: str, body: str) -> tuple[int, dict]:
        with self.lock:
            if path.startswith("/version"):
                return 200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"}
            if path.startswith("/api/v1/namespaces/yinian/pods"):
                return 200, self.pods(path)
            if not path.startswith(DEPLOYMENT.rsplit("/", 1)[0]):
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if "fieldSelector" in path:  # a list, as kr8s gets one object by name
                named = "metadata.name%3Dyinian-worker" in path
                return 200, {"kind": "DeploymentList", "apiVersion": "apps/v1", "metadata": {},
                             "items": [self.deployment()] if named else []}  # fmt: skip
            if path != DEPLOYMENT:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
            if method == "PATCH":
                self.spec = json.loads(body)["spec"]["replicas"]
                return 200, self.deployment()
            out = self.deployment()
            self.ready = self.spec  # the pods asked for are up by the next read
            return 200, out

    def replicas_patched(self) -> list[int]:
        with self.lock:
            return [json.loads(b)["spec"]["replicas"] for m, p, _, b in self.calls
                    if m == "PATCH"]  # fmt: skip


class Gateway:
    """A gateway's /metrics at `rate` requests a second, finished as they come."""

    def __init__(self, rate: float):
        self.rate, self.finished, self.at = rate, 0.0, time.monotonic()
        self.server = gateway_page(self.page)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def set_rate(self, rate: float) -> None:
        self.page()
        self.rate = rate

    def page(self) -> bytes:
        now = time.monotonic()
        self.finished += self.rate * (now - self.at)
        self.at = now
        registry = CollectorRegistry()
        Counter("yinian:request_total", "", ["finish_reason"],
                registry=registry).labels("stop").inc(self.finished)  # fmt: skip
        return generate_latest(registry)


def planner(api: FakeApi, gateway: Gateway, tmp_path: Path, *extra: str,
            by_selector: bool = False) -> subprocess.Popen:  # fmt: skip
    gateways = (["--gateway-selector", "app.kubernetes.io/name=yinian-gateway",
                 "--gateway-port", str(gateway.server.server_port)] if by_selector
                else ["--gateway", gateway.url])  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "yinian", "planner", *gateways, "--kube-url",
         api.url, "--namespace", "yinian", "--planner-profile", str(PROFILE),
         "--planner-interval", "0.5", "--max-workers", "4", "--ttft-slo-ms", "300",
         "--itl-slo-ms", "100", "--decisions", str(tmp_path / "planner.jsonl"), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("by_selector", [False, True], ids=["urls", "pods"])
def test_the_planner_scales_a_deployment_up_and_down_as_the_rate_rises_and_falls(
    tmp_path, by_selector
):
    """The gateways given by URL, or found as the ready pods of a label selector."""
    api, gateway = FakeApi(), Gateway(rate=10.0)  # 10 req/s: three workers by the profile
    proc = planner(api, gateway, tmp_path, by_selector=by_selector)
    try:
        wait_for(lambda: 3 in api.replicas_patched() or proc.poll() is not None)
        assert proc.poll() is None
        gateway.set_rate(1.0)  # one worker's load: back to one once two decisions agree
        wait_for(lambda: api.replicas_patched()[-1:] == [1] or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
        api.server.shutdown()
        gateway.server.shutdown()
    assert proc.returncode == 0, output
    patches = [(p, t, json.loads(b)) for m, p, t, b in api.calls if m == "PATCH"]
    # each change is `kubectl scale`'s: a merge patch of the Deployment's replicas
    assert {(p, t) for p, t, _ in patches} == {(DEPLOYMENT, "application/merge-patch+json")}
    replicas = [b["spec"]["replicas"] for _, _, b in patches]
    # up to three at once, then down (through two while the rate falls mid-interval):
    # never up again, never past three
    assert replicas[0] == 3 and replicas[-1] == 1, replicas
    assert replicas == sorted(replicas, reverse=True), replicas
    assert "deployment/yinian-worker scaled to 3" in output
    decisions = [json.loads(line) for line in (tmp_path / "planner.jsonl").read_text().splitlines()]
    assert decisions[0]["decided"] == 3 and decisions[-1]["decided"] == 1
    assert max(d["serving"] for d in decisions) == 3


def test_a_missing_deployment_or_profile_is_said_before_anything_scales(tmp_path):
    api, gateway = FakeApi(), Gateway(rate=10.0)
    try:
        proc = planner(api, gateway, tmp_path, "--deployment", "nope")
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 2 and "no Deployment nope in namespace yinian" in output
        proc = planner(api, gateway, tmp_path, "--planner-profile", "")
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 2 and "give --planner-profile" in output
        proc = planner(api, gateway, tmp_path, "--gateway-selector", "a=b")
        output, _ = proc.communicate(timeout=30)
        assert (
            proc.returncode == 2 and "either as --gateway URLs or by --gateway-selector" in output
        )
    finally:
        api.server.shutdown()
        gateway.server.shutdown()
    assert not [c for c in api.calls if c[0] == "PATCH"]
