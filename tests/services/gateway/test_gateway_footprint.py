"""The gateway is a front door, not a GPU process: started and serving a
request (here with no scheduler behind it, so the request gets a clean 503), it
never imports torch, Triton, the kernels or the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from services.common.processes import free_port

HEAVY = ("torch", "triton", "kernels", "engine")


def _imported(importtime_log: str) -> set[str]:
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_gateway_never_imports_torch(model_dir, tmp_path):
    log = tmp_path / "importtime.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "services.gateway",
             # port 0: it binds free ports and names them (a port picked here and
             # released could be taken by a test beside it before the gateway binds it)
             "--model", str(model_dir("tiny-llama")), "--port", "0",
             "--grpc-port", "0", "--scheduler", f"127.0.0.1:{free_port()}"],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        ready = ""
        for line in proc.stdout:
            if line.startswith("READY") or time.monotonic() > deadline:
                ready = line
                break
        assert proc.poll() is None, "the gateway exited"
        port = ready.split()[2].rsplit(":", 1)[1]  # READY gateway http://HOST:PORT grpc ...
        body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            body,
            {"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=30)
            status = 200
        except urllib.error.HTTPError as exc:
            status = exc.code
            assert json.loads(exc.read())["error"]["message"]
        assert status == 503  # tokenized, checked, then no scheduler to place it
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    imported = _imported(log.read_text())
    assert "fastapi" in imported and "grpc" in imported  # the log is the real one
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
