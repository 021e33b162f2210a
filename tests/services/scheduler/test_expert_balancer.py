"""The expert balancer's state without a network: membership, load windows,
EPLB plans over the live services, and which workers have switched; and a
scheduler run without it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.tls import sync_channel
from services.scheduler.expert_balancer import ExpertBalancer
from services.scheduler.expert_rollout import collecting
from yinian.mesh import Mesh, MeshSpec


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(expert_id: str, slots: int = 3, model: str = "tiny-moe-abc", experts: int = 8):
    return expert_pb2.ExpertServiceInfo(
        expert_id=expert_id, address=f"127.0.0.1:{len(expert_id)}", model=model, slots=slots,
        host="h", num_moe_layers=2, num_experts=experts, hidden_size=64, dtype="float32",
    )  # fmt: skip


def report(expert_id: str, counts: torch.Tensor, version: int = 1) -> expert_pb2.ExpertLoad:
    return expert_pb2.ExpertLoad(expert_id=expert_id, num_layers=2, num_experts=8,
                                 counts=counts.flatten().long().tolist(), collecting=True,
                                 held_version=version)  # fmt: skip


def test_a_plan_covers_every_expert_with_the_redundant_slots_given_to_hot_ones():
    clock = Clock()
    balancer = ExpertBalancer(redundant_slots=1, clock=clock)
    for name in ("e0", "e1", "e2"):
        balancer.register(info(name))
    first = balancer.plan()  # no load yet: uniform
    assert first.version == 1 and first.slots_per_member == 3 and len(first.members) == 3
    balancer.adopt(first)
    hot = torch.ones(2, 8)
    hot[:, 5] = 50  # expert 5 is hot in both layers
    balancer.on_load(report("e0", hot))
    second = balancer.plan()
    assert second.version == 2
    assert second.logcnt[:, 5].tolist() == [2, 2]  # the spare slot replicates the hot one
    assert (second.logcnt >= 1).all()
    before = balancer.predicted_imbalance(first)
    after = balancer.predicted_imbalance(second)
    assert all(a < b for a, b in zip(after, before))


def test_membership_follows_registrations_and_silence():
    clock = Clock()
    balancer = ExpertBalancer(heartbeat_timeout=2.0, clock=clock)
    balancer.register(info("e0", slots=4))
    balancer.register(info("e1", slots=4))
    balancer.adopt(balancer.plan())
    with pytest.raises(ValueError, match="serves"):
        balancer.register(info("e9", model="other-model"))
    clock.now += 1.5
    balancer.on_load(report("e0", torch.zeros(2, 8)))
    clock.now += 1.0
    assert balancer.expire() == ["e1"]  # silent for 2.5 s
    assert balancer.lost_members() == ["e1"]
    assert balancer.plan() is None  # 4 slots cannot hold 8 experts
    degraded = balancer.degraded({"e1"})
    assert [m.expert_id for m in degraded.members] == ["e0"] and degraded.version == 2


def test_old_experts_are_freed_only_when_every_live_worker_switched():
    clock = Clock()
    balancer = ExpertBalancer(heartbeat_timeout=2.0, clock=clock)
    balancer.worker_seen("w0", 1)
    balancer.worker_seen("w1", 2)
    assert balancer.workers_on(2) == (["w1"], False)
    balancer.worker_seen("w0", 2)
    assert balancer.workers_on(2) == (["w0", "w1"], True)
    clock.now += 3  # w1 gone silent: it no longer holds anything back
    balancer.worker_seen("w0", 2)
    assert balancer.workers_on(3) == ([], False)


def test_load_is_counted_only_inside_statistics_windows():
    assert collecting(None, 50.0, 10.0)  # rebalances on request: always on
    assert not collecting(100.0, 80.0, 10.0)
    assert collecting(100.0, 91.0, 10.0)


def test_an_expert_service_refuses_bad_settings_before_it_starts(model_dir, tmp_path):
    from services.common.entry import StartupError
    from services.expert.app import build_store
    from services.expert.config import parse

    with pytest.raises(SystemExit):  # a usage error, as for every flag
        parse(["--model", str(model_dir("tiny-moe")), "--slots", "0"])
    with pytest.raises(StartupError, match="not a mixture-of-experts model"):
        build_store(parse(["--model", str(model_dir("tiny-llama"))]))
    with pytest.raises(StartupError, match="--model"):
        build_store(parse(["--model", str(tmp_path / "missing")]))


def test_a_mesh_without_expert_services_runs_its_scheduler_without_the_balancer(model_dir):
    """No expert services: the scheduler starts without the balancer (nor torch), and
    an expert service that registers anyway is told why it is refused."""
    spec = MeshSpec(model=str(model_dir("tiny-moe")), workers=0, gateways=0, port=0)
    with Mesh(spec) as mesh:
        pid = mesh.child("scheduler").proc.pid
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps
        channel = sync_channel(mesh.scheduler_address, mesh.spec.tls)
        with pytest.raises(grpc.RpcError) as refused:
            expert_pb2_grpc.ExpertBalancerStub(channel).RegisterExpert(info("e0"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--no-expert-balancer" in refused.value.details()
        # placement goes on: the scheduler's own service answers
        listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5
        )
        assert list(listed.workers) == []
