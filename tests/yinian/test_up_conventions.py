"""What a vLLM user types works: `yinian up --served-model-name foo
--tool-call-parser hermes --api-key k` serves `foo` behind that key, with tool
calls; the banner lists every service's metrics endpoint, and each answers with
its own service's families only; `yinian bench serve --num-prompts 20` against
it needs no other flag (the tokenizer comes from the folder the server names)
and says what it wrote; a clean stop removes the logs' temporary folder. A
model folder no worker could load is refused before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.up_process import UpProcess
from services.common import metrics
from services.expert_parallel import metrics as _expert_metrics  # noqa: F401 - their families

URL = "http://127.0.0.1:8000"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.alone  # yinian up's default ports, free only with nothing beside it
def test_served_name_tool_parser_and_key_as_vllm_takes_them(tmp_path):
    assert _port_free(8000), "port 8000 (yinian up's default) is taken on this machine"
    up = UpProcess("--served-model-name", "foo", "--tool-call-parser", "hermes", "--api-key", "k")
    try:
        up.wait_for("yinian is ready", timeout=240)
        logs = Path(re.search(r"logs in (\S+)\)", up.output).group(1))
        assert logs.is_dir()
        _each_service_exports_its_own_metrics(up.output)
        assert httpx.get(f"{URL}/v1/models", timeout=10).status_code == 401
        key = {"Authorization": "Bearer k"}
        models = httpx.get(f"{URL}/v1/models", headers=key, timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["foo"]
        body = {"model": "foo", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [WEATHER], "tool_choice": "required", "max_tokens": 400}  # fmt: skip
        answer = httpx.post(f"{URL}/v1/chat/completions", json=body, headers=key, timeout=60)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"][:1]
        assert call["function"]["name"] == "get_weather"
        assert "city" in json.loads(call["function"]["arguments"])
        bench = subprocess.run(
            [sys.executable, "-m", "yinian", "bench", "serve", "--num-prompts", "20"],
            cwd=tmp_path, env=dict(os.environ, OPENAI_API_KEY="k"),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        written = re.findall(r"^wrote (\S+)$", bench.stdout, re.M)
        assert written and all((tmp_path / w).is_file() or Path(w).is_file() for w in written)
        result = json.loads(
            (tmp_path / next(w for w in written if w.endswith(".json"))).read_text()
        )
        assert result["completed"] == 20 and result["model"] == "foo"
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(timeout=60) == 0, up.output[-2000:]
    assert not logs.exists()  # a clean stop leaves no log folder behind


def _each_service_exports_its_own_metrics(banner: str) -> None:
    listed = dict(re.findall(r"^\s+(?:metrics:\s+)?(\S+)\s+(http://\S+/metrics)$", banner, re.M))
    assert {"gateway", "scheduler", "kvstore", "worker-0"} <= set(listed), banner
    owners = {"gateway": metrics.GATEWAY, "scheduler": metrics.SCHEDULER,
              "kvstore": metrics.KVSTORE, "worker-0": metrics.WORKER}  # fmt: skip
    for name, url in listed.items():
        text = httpx.get(url, headers={"Authorization": "Bearer k"}, timeout=10).text
        served = set(re.findall(r"^# TYPE (yinian:\S+)", text, re.M))
        own = {n for names in owners[name]._collector_to_names.values() for n in names}
        assert served and served <= own, (name, sorted(served - own))


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: None, "not a model folder (no config.json)"),
        (lambda d: (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1,
            "quantization_config": {"quant_method": "awq"}})), "the checkpoint is quantized (awq)"),
        (lambda d: (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1})), "no *.safetensors weights"),
    ],
    ids=["no config", "quantized", "no weights"],
)  # fmt: skip
def test_a_model_folder_no_worker_could_load_is_refused_before_anything_starts(
    tmp_path, make, says
):
    make(tmp_path)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "yinian", "up", "--model", str(tmp_path),
                          "--port", "0"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "starting the mesh" not in run.stdout  # nothing was started
    assert time.monotonic() - start < 30


def test_quantization_other_than_none_is_refused_naming_what_is_supported():
    run = subprocess.run([sys.executable, "-m", "yinian", "up", "--quantization", "fp8"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert "--quantization: invalid choice: 'fp8' (choose from 'none')" in run.stderr
