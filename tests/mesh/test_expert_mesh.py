"""Expert services in the mesh, as users meet it: 32 streams through the
gateway while the balancer rebalances (EPLB on the load just gathered) or an
expert service is killed; no stream fails, hangs or changes a token, and a
service that comes back gets slots at the next rebalance."""

from __future__ import annotations

import threading
import time

import pytest
from expert_cluster import balancer
from prompts import greedy_texts, random_prompts

from bench.gpu.pd_kill import start_streams, stream_completion
from proto.yinian.v1 import expert_pb2
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import metric_sum

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 64  # streams long enough that a rebalance lands while they run (24 raced it)
STREAMS = 32


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(500, [6 + (5 * i) % 23 for i in range(STREAMS)], seed=17)


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    return greedy_texts(model_dir("tiny-moe"), prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def mesh(model_dir):
    spec = MeshSpec(
        model=str(model_dir("tiny-moe")),
        workers=1,
        experts=3,
        port=0,
        engine_argv=[
            "--device",
            "cpu",
            "--micro-batches",
            "2",
            "--micro-batch-decode-tokens",
            "8",
            "--micro-batch-prefill-tokens",
            "8",
        ],  # fmt: skip
        scheduler_argv=["--expert-redundant-slots", "1", "--heartbeat-timeout", "1.5"],
        worker_argv=["--expert-timeout", "10"],
        # load reports every 0.1 s: a rebalance planned on them comes while 32 streams
        # of 24 tokens still run (at 0.5 s, one run saw every stream end first)
        expert_argv=["--report-interval", "0.1"],
    )
    with Mesh(spec) as m:
        _wait(m, lambda s: len(s.placement.members) == 3, rebalance=True)
        yield m


def _status(mesh) -> expert_pb2.ExpertStatus:
    return balancer(mesh).GetExpertStatus(expert_pb2.ExpertStatusRequest())


def _wait(mesh, done, timeout: float = 60.0, rebalance: bool = False) -> expert_pb2.ExpertStatus:
    deadline = time.monotonic() + timeout
    while not done(status := _status(mesh)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"expert balancer state not reached: {status}")
        if rebalance and status.placement.members:
            balancer(mesh).Rebalance(expert_pb2.RebalanceRequest())
        time.sleep(0.2)
    return status


def run_streams(mesh, prompts, action, wait_started: int = 8) -> list[dict]:
    """Concurrent streams; `action(results)` runs once `wait_started` of them have
    tokens (`results` fills as streams end)."""
    results: dict[int, dict] = {}
    started = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        results[i] = stream_completion(mesh.url, "tiny-moe", prompts[i], MAX_TOKENS,
                                       started=started[i], timeout=120)  # fmt: skip

    threads = start_streams(one, started, wait_started)
    action(results)
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return [results[i] for i in range(len(prompts))]


def assert_all_equal(results, expected) -> None:
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got["error"] is None, f"stream {i}: {got['error']}"
        assert got["text"] == want, f"stream {i} differs from the single-process engine"


def worker_version(mesh) -> float:
    return metric_sum(mesh, "yinian:expert_placement_version", role="colocated")


def test_a_rebalance_amid_32_streams_changes_no_token(mesh, prompts, expected):
    before = _status(mesh).placement
    seen = {}

    def rebalance(results):
        # plan once a load report arrived
        _wait(mesh, lambda s: sum(s.window_load) > 0, timeout=30)
        seen["reply"] = reply = balancer(mesh).Rebalance(expert_pb2.RebalanceRequest())
        deadline = time.monotonic() + 30
        # the worker switches at a step boundary (none comes once the streams ended)
        while worker_version(mesh) < reply.version and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["finished_at_switch"] = len(results)

    results = run_streams(mesh, prompts, rebalance)
    assert_all_equal(results, expected)
    reply = seen["reply"]
    assert seen["finished_at_switch"] < STREAMS  # it switched while streams ran
    assert reply.version > before.version and reply.window_tokens > 0
    assert len(reply.imbalance_before) == len(reply.imbalance_after) == 2  # MoE layers
    status = _wait(mesh, lambda s: list(s.workers) == ["worker-0"])
    assert status.placement.version == reply.version
    assert metric_sum(mesh, "yinian:expert_fallbacks_total", role="colocated") == 0


def test_killing_an_expert_service_amid_32_streams_fails_no_request(mesh, prompts, expected):
    version = worker_version(mesh)
    results = run_streams(mesh, prompts, lambda results: mesh.kill("expert-1"))
    assert_all_equal(results, expected)
    # the step that lost it computed its experts here; the lost service's experts
    # were then placed on the others, and the worker formed a group with them
    assert metric_sum(mesh, "yinian:expert_fallbacks_total", role="colocated") >= 1
    survivors = ["expert-0", "expert-2"]
    status = _wait(mesh, lambda s: [m.expert_id for m in s.placement.members] == survivors)
    assert set(status.placement.phy2log) >= set(range(8))  # every expert has a slot
    # the worker routes by the repaired placement from its next step on
    assert_all_equal(run_streams(mesh, prompts[:4], lambda results: None, 0), expected[:4])
    _wait(mesh, lambda s: list(s.workers) == ["worker-0"])
    assert worker_version(mesh) > version
    # a service that comes back gets slots at the next rebalance, and serves
    mesh.respawn("expert-1")
    _wait(mesh, lambda s: len(s.placement.members) == 3, rebalance=True)
    assert_all_equal(run_streams(mesh, prompts[:8], lambda results: None, 0), expected[:8])
