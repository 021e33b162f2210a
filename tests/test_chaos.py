"""A bounded slice of the chaos drill (bench/reliability/chaos.py): kill -9 of the
scheduler, NATS and one of two gateways under concurrent streams, each restarted
by the supervisor. No stream may hang, differ from a clean run or fail, and new
requests must succeed again within 10 s. (Killed workers: test_supervisor.py,
test_pd_failures.py, test_mesh_failures.py.)"""

from __future__ import annotations

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
