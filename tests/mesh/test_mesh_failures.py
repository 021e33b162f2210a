"""The mesh under failure: a killed worker, saturation, unsafe listening."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.common.processes import free_port
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import default_tls, list_workers


def stream_request(url: str, results: list, i: int, max_tokens: int, started: threading.Event):
    tokens, error = 0, None
    begin = time.monotonic()
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=60,
            verify=default_tls(),
            json={
                "model": "tiny-llama",
                "prompt": f"stream {i}",
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
            },
        ) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    error = payload["error"]
                    continue
                tokens += 1
                started.set()
    except httpx.HTTPError as exc:
        error = {"message": str(exc)}
    results[i] = (tokens, error, time.monotonic() - begin)


def test_killed_worker_fails_its_streams_and_survivor_serves(model_dir):
    # No migrations: a stream whose worker dies must end with an error, not hang.
    # (Migration itself is tested with the disaggregated mesh.)
    spec = MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=2,
        port=0,
        engine_argv=["--device", "cpu"],
        gateway_argv=["--max-migrations", "0"],
    )
    with Mesh(spec) as mesh:
        n, max_tokens = 8, 1500
        results: list = [None] * n
        started = threading.Event()
        threads = [
            threading.Thread(
                target=stream_request, args=(mesh.url, results, i, max_tokens, started)
            )
            for i in range(n)
        ]
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.5)
        killed_at = time.monotonic()
        mesh.kill("worker-0")
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a stream hung after its worker died"
        failed = [r for r in results if r[1] is not None]
        finished = [r for r in results if r[1] is None]
        assert failed, "the killed worker had no streams"
        for tokens, error, _ in failed:
            assert "worker" in error["message"] and tokens < max_tokens
        assert time.monotonic() - killed_at < 60
        for tokens, _, _ in finished:
            assert tokens == max_tokens  # one content chunk per token
        # New requests go to the survivor, even before the scheduler notices the death.
        for i in range(4):
            resp = httpx.post(
                f"{mesh.url}/v1/completions",
                timeout=30,
                json={"model": "tiny-llama", "prompt": f"after {i}", "max_tokens": 4},
            )
            assert resp.status_code == 200, resp.text


def wait_for_load(mesh, running: int, timeout: float = 30.0) -> None:
    """Until the scheduler's latest load reports add up to `running` requests running
    and none waiting (reports arrive on a timer, later on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        workers = list_workers(mesh)
        counts = (sum(w.num_requests_running for w in workers),
                  sum(w.num_requests_waiting for w in workers))  # fmt: skip
        if counts == (running, 0):
            return
        assert time.monotonic() < deadline, f"load stayed at {counts}, waiting for {running}"
        time.sleep(0.05)


def test_saturated_mesh_answers_429_with_retry_after(model_dir):
    spec = MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=1,
        port=0,
        engine_argv=["--device", "cpu", "--max-num-seqs", "1"],
        scheduler_argv=["--max-waiting", "0"],
    )
    with Mesh(spec) as mesh:
        results: list = [None]
        started = threading.Event()
        busy = threading.Thread(target=stream_request, args=(mesh.url, results, 0, 800, started))
        busy.start()
        assert started.wait(30)
        wait_for_load(mesh, running=1)  # the scheduler has the worker's report of it busy
        resp = httpx.post(
            f"{mesh.url}/v1/completions",
            timeout=30,
            json={"model": "tiny-llama", "prompt": "one more", "max_tokens": 4},
        )
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["Retry-After"]) >= 1
        assert resp.json()["error"]["type"] == "rate_limit_error"
        busy.join(timeout=120)
        assert results[0][1] is None
        wait_for_load(mesh, running=0)
        again = httpx.post(
            f"{mesh.url}/v1/completions",
            timeout=30,
            json={"model": "tiny-llama", "prompt": "one more", "max_tokens": 4},
        )
        assert again.status_code == 200


def test_gateway_refuses_open_address_without_keys(model_dir):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.gateway",
            "--model",
            str(model_dir("tiny-llama")),
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "--allow-unauthenticated" in run.stderr


@pytest.mark.parametrize("signal_name", ["SIGINT"])
def test_yinian_up_ready_fast_and_stops_clean(tmp_path, model_dir, signal_name):
    import signal

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "yinian",
            "up",
            "--model",
            str(model_dir("tiny-llama")),
            "--port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--device",
            "cpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    begin = time.monotonic()
    ready = False
    output = []
    for line in proc.stdout:
        output.append(line)
        if "yinian is ready" in line:
            ready = True
            break
    elapsed = time.monotonic() - begin
    assert ready, "".join(output)
    assert elapsed < 60
    resp = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=30,
        json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 3},
    )
    assert resp.status_code == 200
    children = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) >= 4  # nats, scheduler, worker, gateway
    proc.send_signal(getattr(signal, signal_name))
    assert proc.wait(timeout=30) == 0
    time.sleep(0.5)
    alive = [
        pid
        for pid in children
        if subprocess.run(["kill", "-0", pid], capture_output=True).returncode == 0
    ]
    assert alive == [], f"left behind: {alive}"
