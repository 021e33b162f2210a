"""The same-host expert data path (services/expert_parallel/mailbox.py) on the
CPU: dispatches over host shared memory equal the fused MoE bit for bit (several
in flight, pieces larger than a slot, the ring wrapping), a member in another
process that is killed fails the dispatch at once (the step computes it here),
and a mailbox that cannot be mapped is refused before anything is served."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from expert_layer import TOP_K, E, H, MoeStub, moe_weights

from kernels import reference
from services.expert_parallel.group import ExpertGroup
from services.expert_parallel.mailbox import GONE, MailboxError, MailboxPort
from services.expert_parallel.mailbox_member import MemberMailbox
from services.expert_parallel.placement import Member, Placement
from services.expert_parallel.remote import RemoteExperts

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


def _serve(box: MemberMailbox, w13, w2, served: list) -> None:
    while (received := box.receive()) is not None:
        _, rows, ids = received
        served.append(rows.shape[0])  # before the reply: the worker may count at once
        box.reply(reference.fused_moe(rows, w13, w2, torch.ones(len(ids), 1), ids[:, None]))
    box.close()


def _group(n: int, weights, capacity: int = 4096, slots: int = 4, timeout: float = 10.0,
           spin: float = 0.0):  # fmt: skip
    port = MailboxPort(n, torch.float32, H, CPU, timeout, capacity=capacity, slots=slots,
                       spin=spin)  # fmt: skip
    served = [[] for _ in range(n)]
    boxes = [MemberMailbox(port.description(rank), CPU, spin=spin) for rank in range(1, n + 1)]
    threads = [threading.Thread(target=_serve, args=(box, *weights, served[i]), daemon=True)
               for i, box in enumerate(boxes)]  # fmt: skip
    for t in threads:
        t.start()
    members = tuple(Member(f"e{i}", f"127.0.0.1:{1000 + i}") for i in range(n))
    return ExpertGroup.shared(members, port), threads, served


def _same(got: torch.Tensor, expected: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(got, expected)
    # an expert's rows in pieces make smaller matmuls: float32 rounding, never more
    return (got - expected).abs().max() <= 4 * torch.finfo(torch.float32).eps * expected.abs().max()


@pytest.mark.parametrize("capacity, slots, spin", [(4096, 4, 0.0), (3, 2, 0.0), (4096, 4, 0.01)])
def test_dispatches_over_mailboxes_equal_the_fused_moe(capacity, slots, spin):
    """Bit for bit where an expert's rows go whole; (3, 2): each member's rows go in
    pieces of 3 through a ring of 2 slots, so a send must first take the replies
    the ring still holds; spin: both ends poll before they sleep (the GPU's default)."""
    w13, w2 = moe_weights()
    group, threads, served = _group(2, (w13, w2), capacity, slots, spin=spin)
    assert group.transport == "shared" and not list(group.port.boxes[0].path.parent.glob(
        group.port.boxes[0].path.name + "*"))  # the names went once both opened  # fmt: skip
    placement = Placement(1, group.members, 3, torch.tensor([[0, 2, 4, 1, 3, 5]]), E)
    failures = []
    experts = RemoteExperts("w", [0], lambda: failures.append(1))
    experts.install(group, placement)
    moe = MoeStub(w13, w2)
    for step in range(3):
        experts.begin_step()
        x = torch.randn(9 + step, H)
        weights, ids = reference.moe_route(torch.randn(len(x), E), TOP_K, True)
        first = experts.dispatch(moe, x, weights, ids)
        second = experts.dispatch(moe, x[:4], weights[:4], ids[:4])  # two in flight
        exact = capacity > len(x) * TOP_K
        assert _same(experts.combine(first), reference.fused_moe(x, w13, w2, weights, ids), exact)
        assert _same(experts.combine(second),
                     reference.fused_moe(x[:4], w13, w2, weights[:4], ids[:4]), exact)  # fmt: skip
        experts.end_step()
    assert not failures and not experts.broken
    assert sum(map(sum, served)) == (9 + 10 + 11 + 3 * 4) * TOP_K
    if capacity == 3:
        assert max(max(s) for s in served) == 3  # pieces of a slot at most
    group.close(graceful=True)
    for t in threads:
        t.join(5)
        assert not t.is_alive()  # closing ends every member's loop


_MEMBER = textwrap.dedent("""
    import sys, torch
    from services.expert_parallel.mailbox_member import MemberMailbox
    box = MemberMailbox(open(sys.argv[1], "rb").read(), torch.device("cpu"))
    print("open", flush=True)
    while (got := box.receive()) is not None:
        layer, rows, ids = got
        box.reply(torch.zeros(rows.shape[0], int(sys.argv[2])))
""")


def test_a_killed_member_process_fails_the_dispatch_at_once(tmp_path):
    w13, w2 = moe_weights(1)
    port = MailboxPort(1, torch.float32, H, CPU, timeout=30.0)
    desc = tmp_path / "mailbox"
    desc.write_bytes(port.description(1))
    proc = subprocess.Popen([sys.executable, "-c", _MEMBER, str(desc), str(H)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "open"
        group = ExpertGroup.shared((Member("e0", "127.0.0.1:1"),), port)
        assert port.member_pids == [proc.pid]
        experts = RemoteExperts("w", [0], lambda: None)
        experts.install(group, Placement(1, group.members, 6, torch.arange(E).view(1, -1), E))
        experts.begin_step()
        moe, x = MoeStub(w13, w2), torch.randn(5, H)
        weights, ids = reference.moe_route(torch.randn(5, E), TOP_K, True)
        # the member answers (zeros: it holds no weights), so the group works
        assert torch.equal(experts.combine(experts.dispatch(moe, x, weights, ids)),
                           torch.zeros(5, H))  # fmt: skip
        proc.kill()
        proc.wait(5)
        started = time.monotonic()
        got = experts.combine(experts.dispatch(moe, x, weights, ids))
        assert time.monotonic() - started < 2.0  # not the 30 s timeout
        assert experts.broken
        assert torch.allclose(got, reference.fused_moe(x, w13, w2, weights, ids))
        experts.end_step()
    finally:
        proc.kill()
        port.close()


def test_a_member_that_stops_serving_fails_the_dispatch_at_once():
    """Its loop ended (an error computing, or the service stopping): the worker does
    not wait out the timeout for a member whose process lives on."""
    w13, w2 = moe_weights(2)
    port = MailboxPort(1, torch.float32, H, CPU, timeout=30.0)
    box = MemberMailbox(port.description(1), CPU)
    group = ExpertGroup.shared((Member("e0", "127.0.0.1:1"),), port)
    experts = RemoteExperts("w", [0], lambda: None)
    experts.install(group, Placement(1, group.members, 6, torch.arange(E).view(1, -1), E))
    experts.begin_step()
    moe, x = MoeStub(w13, w2), torch.randn(3, H)
    weights, ids = reference.moe_route(torch.randn(3, E), TOP_K, True)
    box.close()  # what its serving thread does last, whatever ended the loop
    started = time.monotonic()
    got = experts.combine(experts.dispatch(moe, x, weights, ids))
    assert time.monotonic() - started < 2.0 and experts.broken
    assert torch.allclose(got, reference.fused_moe(x, w13, w2, weights, ids))
    experts.end_step()


def test_a_member_stopped_from_another_thread_ends_its_loop():
    port = MailboxPort(1, torch.float32, H, CPU, timeout=5.0)
    box = MemberMailbox(port.description(1), CPU)
    ended = []
    thread = threading.Thread(target=lambda: ended.append(box.receive()), daemon=True)
    thread.start()
    time.sleep(0.1)
    box.stop()
    thread.join(2)
    assert ended == [None]
    box.close()
    assert port.boxes[0].control[GONE] == 1  # as the worker sees it
    port.close()


@pytest.mark.parametrize("hidden, dtype", [(15, torch.bfloat16), (7, torch.float32)])
def test_odd_widths_and_int32_ids_cross_in_pieces(hidden, dtype):
    """Rows of any width and dtype, ids of either integer type, 11 rows through slots
    of 5 in a ring of 3: each reply is the member's function of its own rows and ids."""
    port = MailboxPort(1, dtype, hidden, CPU, timeout=5.0, capacity=5, slots=3)
    box = MemberMailbox(port.description(1), CPU)

    def serve():
        while (got := box.receive()) is not None:
            _, rows, ids = got
            box.reply(rows * 2 + ids[:, None].to(rows.dtype))
        box.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    x = torch.randn(11, hidden).to(dtype)
    ids = torch.arange(11, dtype=torch.int32)
    assert torch.equal(port.send(0, [11], x, ids).wait(), x * 2 + ids[:, None].to(dtype))
    port.close()
    thread.join(2)
    assert not thread.is_alive()


def test_a_mailbox_that_cannot_be_mapped_is_refused():
    port = MailboxPort(1, torch.float32, H, CPU, timeout=5.0)
    description = port.description(1)
    port.opened()  # its name is gone: no other process can map it now
    with pytest.raises(MailboxError, match="cannot open"):
        MemberMailbox(description, CPU)
    with pytest.raises(MailboxError, match="cannot open"):
        MemberMailbox(b"not a description", CPU)
    port.close()
    with pytest.raises(MailboxError, match="closed"):
        port.send(0, [1], torch.zeros(1, H), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError):
        MailboxPort(0, torch.float32, H, CPU, timeout=5.0)
