"""Start-up manners: a taken port is one line naming it (and never a silently
shared gRPC port), Ctrl-C during `yinian up`'s start-up stops at once and leaves
nothing behind, every `yinian up` flag explains itself, and the gateway's
liveness and readiness are separate probes."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from processes import alive

from bench.up_process import UpProcess
from services.common.processes import free_port, listen_socket
from yinian.cli import build_parser


def service(module: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def assert_one_line_error(run: subprocess.CompletedProcess, expected: str) -> None:
    assert run.returncode != 0
    assert "Traceback" not in run.stderr + run.stdout, run.stderr
    assert f"error: {expected}" in run.stderr.splitlines(), run.stderr[-2000:]


def sharing_grpc_server(port: int) -> grpc.Server:
    """A gRPC server as a running gateway holds its port: with gRPC's default
    SO_REUSEPORT, which would let a second server bind beside it."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    return server


def test_every_yinian_up_flag_has_a_help_line():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    up = sub.choices["up"]
    missing = [
        action.option_strings[0]
        for action in up._actions
        if action.option_strings and action.dest != "help"
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []


def test_gateway_live_not_ready_and_a_second_gateway_on_its_ports_is_refused(model_dir):
    model = str(model_dir("tiny-llama"))
    rest, grpc_port = free_port(), free_port()
    nowhere = f"127.0.0.1:{free_port()}"  # no scheduler: no worker can be ready
    first = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--model", model, "--port", str(rest),
         "--grpc-port", str(grpc_port), "--scheduler", nowhere],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert _ready(first)
        url = f"http://127.0.0.1:{rest}"
        assert httpx.get(f"{url}/health/live", timeout=5).status_code == 200
        assert httpx.get(f"{url}/health/ready", timeout=5).status_code == 503
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        common = ["--model", model, "--scheduler", nowhere]
        taken_grpc = service("services.gateway", *common, "--port", str(free_port()),
                             "--grpc-port", str(grpc_port))  # fmt: skip
        assert_one_line_error(
            taken_grpc, f"gRPC (Inference) port {grpc_port} on 127.0.0.1 is taken"
        )
        taken_rest = service("services.gateway", *common, "--port", str(rest),
                             "--grpc-port", str(free_port()))  # fmt: skip
        assert_one_line_error(taken_rest, f"REST port {rest} on 127.0.0.1 is taken")
    finally:
        first.kill()
        first.wait()


def _ready(proc: subprocess.Popen) -> bool:
    for line in proc.stdout:  # logging lines may come first
        if line.startswith("READY gateway"):
            return True
    return False


def test_scheduler_on_a_taken_port_is_one_line():
    port = free_port()
    holder = sharing_grpc_server(port)
    try:
        run = service("services.scheduler", "--port", str(port), "--nats-url", "nats://127.0.0.1:1")
    finally:
        holder.stop(0)
    assert_one_line_error(run, f"gRPC port {port} on 127.0.0.1 is taken")


def test_second_yinian_up_on_a_taken_grpc_port_never_says_ready(model_dir):
    grpc_port = free_port()
    holder = sharing_grpc_server(grpc_port)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "yinian", "up", "--model", str(model_dir("tiny-llama")),
             "--port", "0", "--grpc-port", str(grpc_port), "--device", "cpu"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        holder.stop(0)
    assert run.returncode == 1
    assert "yinian is ready" not in run.stdout
    assert run.stderr.strip() == f"yinian up: gRPC port {grpc_port} on 127.0.0.1 is taken"


def test_taken_rest_port_stops_yinian_up_before_anything_starts(model_dir):
    with listen_socket("127.0.0.1", free_port(), "test") as held:
        port = held.getsockname()[1]
        begin = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "yinian", "up", "--model", str(model_dir("tiny-llama")),
             "--port", str(port), "--grpc-port", "0", "--device", "cpu"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 1 and time.monotonic() - begin < 20
    assert run.stderr.strip() == f"yinian up: REST port {port} on 127.0.0.1 is taken"


def test_ctrl_c_during_start_up_stops_at_once_and_leaves_nothing(model_dir):
    model = str(model_dir("tiny-llama"))
    up = UpProcess("--model", model, "--workers", "2", "--port", "0",
                   "--grpc-port", "0", "--device", "cpu")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while "worker-1" not in up.children():  # the workers are loading their engines
            assert up.proc.poll() is None and time.monotonic() < deadline, up.output
            time.sleep(0.05)
        started = list(up.children().values())
        interrupted = time.monotonic()
        up.proc.send_signal(signal.SIGINT)
        code = up.proc.wait(timeout=30)
        took = time.monotonic() - interrupted
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
    assert "yinian is ready" not in up.output
    assert code == 130 and took < 5, (took, up.output)
    time.sleep(0.3)
    assert [pid for pid in started if alive(pid)] == []


def test_the_command_line_starts_without_torch():
    """`yinian --help`, `yinian up` and `yinian planner` need no torch before they do
    work that needs it: loading it took about a second of every start."""
    code = "import sys, yinian.cli; print(sorted(m for m in sys.modules if m[:5] == 'torch'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
    helped = subprocess.run([sys.executable, "-m", "yinian", "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert helped.returncode == 0 and "make-model" in helped.stdout


def test_a_service_without_a_nats_login_is_refused_before_it_starts(tmp_path):
    """In a mesh whose NATS has logins, a service with none would talk to the default
    NATS URL (another NATS, or none): refused, naming it, and nothing is started."""
    from yinian.mesh import Mesh, MeshSpec

    mesh = Mesh(MeshSpec(model="unused", log_dir=tmp_path))
    mesh.nats_url = "nats://owner:pw@127.0.0.1:1"
    mesh.service_nats_urls = {"scheduler": "nats://scheduler:pw@127.0.0.1:1"}
    with pytest.raises(ValueError, match="worker-7 has no NATS login"):
        mesh._spawn("worker-7", "services.decode", ["--model", "unused"])
    assert mesh.children == [] and not (tmp_path / "worker-7.log").exists()


def test_free_ports_lie_below_the_range_outgoing_connections_take_theirs_from():
    """A service started again binds its port again; an outgoing connection in between
    takes its source port from the ephemeral range, so ports handed out lie below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(10_000 <= p < low for p in ports), (low, ports)
    for port in ports:  # each free to bind
        listen_socket("127.0.0.1", port, "test").close()
