"""A bounded slice of the chaos drill (bench/reliability/chaos.py): kill -9 of the
scheduler, NATS and one of two gateways under concurrent streams, each restarted
by the supervisor. No stream may hang, differ from a clean run or fail, and new
requests must succeed again within 10 s. (Killed workers: test_supervisor.py,
test_pd_failures.py, test_mesh_failures.py.)"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.reliability.chaos import GOALS, chaos_spec, drill, prompts
from bench.reliability.rounds import Load
from yinian.mesh import Mesh


def test_killed_scheduler_nats_and_gateway_cost_no_stream(model_dir):
    spec = chaos_spec(model_dir("tiny-llama"), workers=2, prefill=0, decode=0, kvstore=False)
    with Mesh(spec) as mesh:
        load = Load(mesh.urls, "tiny-llama", prompts(16), max_tokens=500)
        results = drill(mesh, ["scheduler", "nats", "gateway-1"], load, min_probe_s=4.0)
    for name, r in results["rounds"].items():
        assert r["open_at_fault"] >= 1, f"{name}: killed after every stream had ended"
        assert r["hung"] == [] and r["corrupted"] == [] and r["failed"] == {}, (name, r)
        assert r["recovery_s"] is not None and r["recovery_s"] < GOALS["recovery_s"], (name, r)
    # Streams through the killed gateway end with its connections; the others go on.
    gateway = results["rounds"]["gateway-1"]
    assert set(map(int, gateway["lost_with_gateway"])) <= set(range(1, 16, 2))
    assert gateway["completed"] >= 8


def test_killed_pd_scheduler_fails_no_new_request(model_dir):
    """A prefill/decode mesh loses its scheduler: every new request meanwhile goes
    where recent ones were placed (about 40 probes over 14 s), none fails."""
    spec = chaos_spec(model_dir("tiny-llama"), workers=0, prefill=1, decode=1, kvstore=False)
    with Mesh(spec) as mesh:
        load = Load(mesh.urls, "tiny-llama", prompts(8), max_tokens=200)
        results = drill(mesh, ["scheduler"], load, min_probe_s=14.0)
    r = results["rounds"]["scheduler"]
    assert r["probes"] >= 36 and r["probe_failures"] == 0, r
    assert r["hung"] == [] and r["corrupted"] == [] and r["failed"] == {}, r


def test_a_stuck_pd_scheduler_fails_no_new_request(model_dir):
    """The scheduler stops answering (SIGSTOP) for 8 s: 40 new requests meanwhile each
    wait a second for it at most, then go where recent ones were placed; none fails."""
    spec = chaos_spec(model_dir("tiny-llama"), workers=0, prefill=1, decode=1, kvstore=False)
    with Mesh(spec) as mesh:
        body = {"model": "tiny-llama", "prompt": "The river", "max_tokens": 8}
        url = f"{mesh.urls[0]}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).is_success  # placed by the scheduler

        def send(i: int) -> tuple[int, float]:
            time.sleep(0.2 * i)
            start = time.monotonic()
            resp = httpx.post(url, json={**body, "prompt": f"The river {i}"}, timeout=60)
            return resp.status_code, time.monotonic() - start

        scheduler = mesh.child("scheduler").proc.pid
        os.kill(scheduler, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(40) as pool:
                answers = list(pool.map(send, range(40)))
        finally:
            os.kill(scheduler, signal.SIGCONT)
    assert [code for code, _ in answers] == [200] * 40, answers
    assert max(seconds for _, seconds in answers) < 5.0, answers
