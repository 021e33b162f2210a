"""The stream-ordered expert path (services/expert_parallel/stream_port.py) on the
CPU, where its flags are host memory and the waits host polls: every member gets
every token, answers with its partial sum over the experts it holds, and the
partials add up to the fused MoE; two dispatches may be in flight; a member
process that is killed, or that stops serving, fails the worker's wait at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from expert_layer import TOP_K, E, H, moe_weights

from kernels import reference
from services.expert_parallel.mailbox import MailboxError
from services.expert_parallel.stream_member import StreamMember
from services.expert_parallel.stream_port import StreamPort

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")
HELD = [[0, 2, 4], [1, 3, 5]]  # member m holds these experts (logical ids)

_MEMBER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests")
    from expert_layer import moe_weights
    from kernels import reference
    from services.expert_parallel.stream_member import StreamMember
    torch.set_num_threads(1)
    held = [int(e) for e in sys.argv[2].split(",")]
    w13, w2 = moe_weights()
    local = torch.full((w13.shape[0],), -1, dtype=torch.int64)
    local[held] = torch.arange(len(held))
    member = StreamMember(open(sys.argv[1], "rb").read(), torch.device("cpu"))
    print("open", flush=True)
    while (got := member.receive()) is not None:
        if len(sys.argv) > 3:  # takes a dispatch and dies before answering
            import os
            os._exit(0)
        layer, tokens, weights, ids = got
        mine = torch.where(ids >= 0, local[ids.clamp(min=0).long()], -1)
        member.reply(reference.fused_moe(tokens, w13[held], w2[held], weights, mine) * (layer + 1))
    member.close()
""")


def _members(port: StreamPort, tmp_path, ranks=(1, 2), dies: int = 0) -> list[subprocess.Popen]:
    """Member processes; `dies`: the rank that takes its first dispatch and exits."""
    procs = []
    for rank in ranks:
        desc = tmp_path / f"member{rank}"
        desc.write_bytes(port.description(rank))
        held = ",".join(map(str, HELD[rank - 1]))
        extra = ["die"] if rank == dies else []
        proc = subprocess.Popen([sys.executable, "-c", _MEMBER, str(desc), held, *extra],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == "open"
        procs.append(proc)
    return procs


def _split(ids: torch.Tensor) -> torch.Tensor:
    """Each member's ids [members, T, k]: the pair's expert where it holds it, -1 elsewhere."""
    return torch.stack([torch.where(torch.isin(ids, torch.tensor(h)), ids, -1) for h in HELD])


def _stop(port: StreamPort, procs) -> None:
    port.close()
    for proc in procs:
        proc.wait(10)


def test_partial_sums_of_every_member_add_up_to_the_fused_moe(tmp_path):
    w13, w2 = moe_weights()
    port = StreamPort(2, torch.float32, H, TOP_K, CPU, timeout=10.0, capacity=16, slots=2)
    procs = _members(port, tmp_path)
    port.opened()
    assert not list(port.stem.parent.glob(port.stem.name + "*"))  # the names went
    try:
        for step in range(3):
            port.begin_step()
            sent = []
            for layer, rows in ((0, 9 + step), (1, 3)):  # two in flight: both slots
                x = torch.randn(rows, H)
                weights, ids = reference.moe_route(torch.randn(rows, E), TOP_K, True)
                sent.append((port.send(layer, x, weights, _split(ids)), layer, x, weights, ids))
            with pytest.raises(MailboxError, match="in flight"):
                port.send(2, x, weights, _split(ids))  # a third: no slot left
            for dispatch, layer, x, weights, ids in sent:
                want = reference.fused_moe(x, w13, w2, weights, ids) * (layer + 1)
                torch.testing.assert_close(port.combine(dispatch), want)
        with pytest.raises(ValueError, match="17 tokens"):
            port.send(0, torch.randn(17, H), torch.ones(17, TOP_K), _split(torch.zeros(17, 2)))
    finally:
        _stop(port, procs)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_member_that_is_gone_fails_the_wait_at_once(tmp_path, how):
    port = StreamPort(2, torch.float32, H, TOP_K, CPU, timeout=30.0, capacity=16)
    procs = _members(port, tmp_path, (1, 2) if how == "killed" else (1,))
    try:
        if how == "killed":
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(10)
        else:  # the member's loop ended: it marks itself gone
            StreamMember(port.description(2), CPU).close()
        port.opened()
        x = torch.randn(4, H)
        weights, ids = reference.moe_route(torch.randn(4, E), TOP_K, True)
        started = time.monotonic()
        dispatch = port.send(0, x, weights, _split(ids))
        with pytest.raises(MailboxError, match="expert service 2"):
            port.combine(dispatch)
        assert time.monotonic() - started < 2  # not the 30 s timeout
    finally:
        _stop(port, procs[:1])
        for proc in procs:
            proc.kill()


def test_a_description_for_the_gpu_is_refused_on_the_cpu(tmp_path):
    port = StreamPort(1, torch.float32, H, TOP_K, CPU, timeout=5.0, capacity=4)
    try:
        import pickle

        desc = pickle.loads(port.description(1))
        desc["cuda"], desc["paths"] = {"hidden": {}}, None
        with pytest.raises(MailboxError, match="on the GPU"):
            StreamMember(pickle.dumps(desc), CPU)
        with pytest.raises(MailboxError, match="version-1"):
            StreamMember(pickle.dumps({"version": 1, "kind": "mailbox"}), CPU)
    finally:
        port.close()


@pytest.mark.parametrize("how", ["killed", "took_then_died"])
def test_the_worker_answers_for_a_member_lost_mid_step(tmp_path, how):
    """Guarded, a lost member's part comes from the worker's own experts: the dispatch
    in flight (sent before the death was seen, or taken by the member, which died
    before answering) and the ones after it end with the whole layer's sum."""
    w13, w2 = moe_weights()
    port = StreamPort(2, torch.float32, H, TOP_K, CPU, timeout=30.0, capacity=16)
    procs = _members(port, tmp_path, dies=2 if how == "took_then_died" else 0)
    lost = []

    def compute(layer, tokens, weights, ids):  # what the worker's RemoteExperts does
        return reference.fused_moe(tokens, w13, w2, weights, ids.long()) * (layer + 1)

    port.guard(compute, lost.append)
    try:
        if how == "killed":
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].wait(10)
        for layer in range(3):
            x = torch.randn(5, H)
            weights, ids = reference.moe_route(torch.randn(5, E), TOP_K, True)
            want = reference.fused_moe(x, w13, w2, weights, ids) * (layer + 1)
            started = time.monotonic()
            torch.testing.assert_close(port.combine(port.send(layer, x, weights, _split(ids))),
                                       want)  # fmt: skip
            assert time.monotonic() - started < 2
        assert lost == [1] and port.stand_ins[1].answered == 3
    finally:
        _stop(port, procs[:1])
        for proc in procs:
            proc.kill()


def test_remote_experts_over_the_stream_path_survive_a_member_lost_mid_step(tmp_path):
    """The worker's backend: dispatches over two member processes add up to the fused
    MoE; one member dies between the dispatch and its combine: the stand-in answers
    for it, the worker asks for a new group once, and computes here meanwhile."""
    from expert_layer import MoeStub

    from services.expert_parallel.group import ExpertGroup
    from services.expert_parallel.placement import Member, Placement
    from services.expert_parallel.remote import RemoteExperts

    w13, w2 = moe_weights()
    port = StreamPort(2, torch.float32, H, TOP_K, CPU, timeout=30.0, capacity=16)
    procs = _members(port, tmp_path)
    members = tuple(Member(f"e{i}", f"127.0.0.1:{1000 + i}") for i in range(2))
    group = ExpertGroup.shared(members, port)
    assert group.transport == "stream"
    placement = Placement(1, members, 3, torch.tensor([HELD[0] + HELD[1]]), E)
    failures = []
    experts = RemoteExperts("w", [0], lambda: failures.append(1))
    experts.install(group, placement)
    moe = MoeStub(w13, w2)
    try:
        for step in range(3):
            experts.begin_step()
            x = torch.randn(6, H)
            weights, ids = reference.moe_route(torch.randn(6, E), TOP_K, True)
            sent = experts.dispatch(moe, x, weights, ids)
            if step == 1:  # dies with the dispatch in flight
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait(10)
            got = experts.combine(sent)
            torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, weights, ids))
            experts.end_step()
        assert failures == [1] and experts.broken
        assert experts.record.snapshot()["fallbacks"] >= 1
    finally:
        _stop(port, procs[:1])
        for proc in procs:
            proc.kill()
