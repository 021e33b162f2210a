"""The parts of expert parallelism, in one process: placements and replica
routing, the data path over a real gloo group (members on threads), the
expert store, and the micro-batch split."""

from __future__ import annotations

import threading

import pytest
import torch
from expert_layer import TOP_K, E, H, MoeStub, moe_weights

from engine.attention import AttentionMetadata
from engine.micro_batch import MicroBatchPolicy
from kernels import reference
from services.expert_parallel.group import ExpertGroup, Rendezvous
from services.expert_parallel.placement import Member, Placement, expert_lists, expert_set
from services.expert_parallel.remote import RemoteExperts
from services.expert_parallel.wire import MemberPort, pack, row_bytes, unpack
from services.kv_transport.nccl_group import abort_group, make_group, store_client

pytestmark = pytest.mark.timeout(60)


def members(n: int) -> tuple[Member, ...]:
    return tuple(Member(f"e{i}", f"127.0.0.1:{1000 + i}") for i in range(n))


def test_replicas_take_pairs_in_turn_and_missing_experts_stay_local():
    # 2 services x 3 slots; expert 0 has two replicas (slots 0 and 3), expert 5 none.
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 4]])
    placement = Placement(1, members(2), 3, phy2log, E)
    assert placement.logcnt.tolist() == [[2, 1, 1, 1, 1, 0]]
    slots = placement.route(0, torch.tensor([0, 4, 0, 0, 5, 0]))
    assert slots.tolist() == [0, 5, 3, 0, -1, 3]
    # one pair per dispatch still alternates, as the caller advances the turn
    assert [placement.route(0, torch.tensor([0]), turn).item() for turn in range(4)] == [0, 3, 0, 3]
    assert placement.experts_of(1) == [[0, 3, 4]]


def test_losing_a_member_keeps_or_drops_the_replicas_of_its_experts():
    phy2log = torch.tensor([[0, 1, 2, 0, 3, 4]])
    placement = Placement(7, members(2), 3, phy2log, E)
    kept = placement.without({"e1"}, keep_replicas=True)
    assert [m.expert_id for m in kept.members] == ["e0"] and kept.version == 7
    assert kept.logcnt.tolist() == [[1, 1, 1, 0, 0, 0]]  # expert 0's other replica serves
    dropped = placement.without({"e1"}, keep_replicas=False)
    assert dropped.logcnt.tolist() == [[0, 1, 1, 0, 0, 0]]  # expert 0 computed locally
    again = Placement.from_message(placement.to_message())
    assert torch.equal(again.phy2log, phy2log) and again.members == placement.members
    assert expert_lists(expert_set(3, [[1, 2], [], [0]])) == [[1, 2], [], [0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_rows_and_expert_ids_survive_packing(dtype):
    rows = torch.randn(5, H).to(dtype)
    ids = torch.tensor([3, 0, 5, 5, 1])
    payload = pack(rows, ids)
    assert payload.shape == (5, row_bytes(dtype, H))
    got_rows, got_ids = unpack(payload, dtype, H)
    assert torch.equal(got_rows, rows) and torch.equal(got_ids, ids)


def _serve_member(rendezvous, rank, world, weights_of, stop_after=None):
    """A member on a thread: receive, compute what it holds, answer."""
    client = store_client("127.0.0.1", rendezvous.port, 10)
    pg = make_group("gloo", client, rank, 30.0, "127.0.0.1", world)
    port = MemberPort(pg, world, rank, torch.device("cpu"), torch.float32, H)
    served = 0
    try:
        while (received := port.receive()) is not None:
            if stop_after is not None and served == stop_after:
                break  # dies without answering
            layer, rows, ids = received
            w13, w2 = weights_of
            port.reply(reference.fused_moe(rows, w13, w2, torch.ones(len(ids), 1), ids[:, None]))
            served += 1
    except Exception:
        pass
    finally:
        abort_group(pg)


def _group(n, weights, stop_after=None):
    world = n + 1
    rendezvous = Rendezvous.open("127.0.0.1", world, "gloo", 10.0)
    threads = [threading.Thread(target=_serve_member, daemon=True,
                                args=(rendezvous, r, world, weights, stop_after))
               for r in range(1, world)]  # fmt: skip
    for t in threads:
        t.start()
    group = ExpertGroup.form(rendezvous, members(n), 10.0, torch.device("cpu"))
    return group, threads


def test_remote_dispatch_equals_the_fused_moe_bit_for_bit():
    w13, w2 = moe_weights()
    group, threads = _group(2, (w13, w2))
    # every expert on one slot: rows of an expert go to one place, in order
    placement = Placement(1, group.members, 3, torch.tensor([[0, 2, 4, 1, 3, 5]]), E)
    failures = []
    experts = RemoteExperts("w", [0], lambda: failures.append(1))
    experts.install(group, placement)
    experts.begin_step()
    x = torch.randn(9, H)
    logits = torch.randn(9, E)
    weights, ids = reference.moe_route(logits, TOP_K, True)
    moe = MoeStub(w13, w2)
    first = experts.dispatch(moe, x, weights, ids)
    second = experts.dispatch(moe, x[:4], weights[:4], ids[:4])  # two in flight
    assert torch.equal(experts.combine(first), reference.fused_moe(x, w13, w2, weights, ids))
    assert torch.equal(experts.combine(second),
                       reference.fused_moe(x[:4], w13, w2, weights[:4], ids[:4]))  # fmt: skip
    experts.end_step()
    assert experts.record.snapshot()["remote_pairs"] == 13 * TOP_K and not failures
    group.close(graceful=True)
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def test_replicas_split_an_expert_within_float32_rounding():
    """Pairs of a replicated expert are computed in smaller matmuls on two services:
    the sums may round differently in the last bit, never by more."""
    w13, w2 = moe_weights(2)
    group, threads = _group(2, (w13, w2))
    # every expert on both services: each expert's pairs alternate between them
    placement = Placement(1, group.members, 6, torch.arange(E).repeat(2).view(1, -1), E)
    experts = RemoteExperts("w", [0], lambda: None)
    experts.install(group, placement)
    experts.begin_step()
    x = torch.randn(64, H)
    weights, ids = reference.moe_route(torch.randn(64, E), TOP_K, True)
    got = experts.combine(experts.dispatch(MoeStub(w13, w2), x, weights, ids))
    experts.end_step()
    group.close(graceful=True)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 4 * torch.finfo(torch.float32).eps * scale
    for t in threads:
        t.join(5)


def test_a_member_that_dies_mid_step_is_computed_locally():
    w13, w2 = moe_weights(1)
    group, threads = _group(2, (w13, w2), stop_after=1)
    placement = Placement(1, group.members, 3, torch.tensor([[0, 2, 4, 1, 3, 5]]), E)
    failures = []
    experts = RemoteExperts("w", [0], lambda: failures.append(1))
    experts.install(group, placement)
    experts.begin_step()
    moe = MoeStub(w13, w2)
    x = torch.randn(7, H)
    weights, ids = reference.moe_route(torch.randn(7, E), TOP_K, True)
    expected = reference.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(experts.combine(experts.dispatch(moe, x, weights, ids)), expected)
    # the members stop answering: the step still gets the right result, from here
    assert torch.allclose(experts.combine(experts.dispatch(moe, x, weights, ids)), expected)
    assert experts.broken and failures == [1]
    assert torch.equal(experts.combine(experts.dispatch(moe, x, weights, ids)), expected)
    experts.end_step()
    for t in threads:
        t.join(5)
        assert not t.is_alive()


def _meta(query_lens: list[int]) -> AttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(query_lens)
    return AttentionMetadata(
        slot_mapping=torch.arange(total), query_start_loc=starts,
        seq_lens=torch.tensor(query_lens, dtype=torch.int32) + 5,
        block_tables=torch.arange(len(query_lens) * 2, dtype=torch.int32).view(-1, 2),
        query_lens_cpu=list(query_lens), seq_lens_cpu=[n + 5 for n in query_lens],
    )  # fmt: skip


def test_micro_batches_split_at_sequence_boundaries_by_tokens():
    policy = MicroBatchPolicy(2, decode_tokens=4, prefill_tokens=10)
    assert policy.split(_meta([1, 1, 1])) is None  # decode below its threshold
    parts = policy.split(_meta([1, 1, 1, 1, 1]))
    assert [p.rows for p in parts] == [slice(0, 2), slice(2, 5)]
    parts = policy.split(_meta([8, 1, 1, 6]))  # prefill: 16 tokens, cut near 8
    assert [p.rows for p in parts] == [slice(0, 8), slice(8, 16)]
    second = parts[1].meta
    assert second.query_start_loc.tolist() == [0, 1, 2, 8]
    assert second.query_lens_cpu == [1, 1, 6] and second.seq_lens.tolist() == [6, 6, 11]
    assert torch.equal(second.slot_mapping, torch.arange(8, 16))
    assert second.block_tables.tolist() == [[2, 3], [4, 5], [6, 7]]
    assert MicroBatchPolicy(3, 1, 1).split(_meta([5, 1])) is None  # fewer sequences than parts
    with pytest.raises(ValueError):
        MicroBatchPolicy(1)


def test_an_expert_store_loads_beside_frees_after_and_computes_like_the_engine(model_dir):
    from basis.model_config import ModelConfig
    from engine import LLM
    from services.expert.expert_store import ExpertStore
    from services.expert.expert_weights import ExpertWeights

    folder = model_dir("tiny-moe")
    config = ModelConfig.from_pretrained(folder)
    store = ExpertStore(ExpertWeights(folder, config), torch.float32, torch.device("cpu"))
    assert store.load(1, [[0, 3], [1]]) == 3
    assert store.load(2, [[3, 5], [1, 2]]) == 2  # the new ones beside the held ones
    assert store.held() == [[0, 3, 5], [1, 2]]
    assert store.keep([[3, 5], [1, 2]]) == 1  # every worker switched: expert 0 goes
    assert store.held() == [[3, 5], [1, 2]]
    moe = [layer.mlp for layer in LLM(folder, device="cpu").engine.runner.model.layers
           if hasattr(layer.mlp, "w13")][0]  # fmt: skip
    rows, ids = torch.randn(6, config.hidden_size), torch.tensor([5, 3, 3, 5, 5, 3])
    expected = reference.fused_moe(rows, moe.w13, moe.w2, torch.ones(6, 1), ids[:, None])
    assert torch.equal(store.compute(0, rows, ids), expected)
    with pytest.raises(LookupError, match=r"experts \[0\]"):
        store.compute(0, rows[:1], torch.tensor([0]))
    with pytest.raises(ValueError, match="no expert 8"):
        store.load(3, [[8], []])


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-deepseek-v2"])
def test_dummy_experts_are_the_dummy_worker_s_own(model_dir, preset):
    """A benchmark on dummy weights (no checkpoint) gives the same tokens with expert
    services as colocated only if a service's dummy expert is the worker's."""
    from basis.model_config import ModelConfig
    from engine.loader import load_model
    from services.expert.expert_weights import ExpertWeights

    config = ModelConfig.from_pretrained(model_dir(preset))
    model = load_model(None, config, torch.device("cpu"), torch.float32, load_format="dummy")
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "w13")]
    weights = ExpertWeights("unused", config, dummy=True)
    assert len(moes) == weights.num_moe_layers > 1
    for moe_layer in (0, len(moes) - 1):
        for expert in (0, config.num_experts - 1):
            w13, w2 = weights.read(moe_layer, expert, torch.float32, "cpu")
            assert torch.equal(w13, moes[moe_layer].w13[expert])
            assert torch.equal(w2, moes[moe_layer].w2[expert])
    assert not torch.equal(moes[0].w13[0], moes[0].w13[1])  # each expert its own numbers


def test_an_expert_store_warms_every_shape_it_will_serve(model_dir, monkeypatch):
    """The kernels of each stack size a placement brings run at every power-of-two
    row count before the placement is served (on a GPU, where they are tuned then)."""
    from basis.model_config import ModelConfig
    from services.expert import expert_store
    from services.expert.expert_weights import ExpertWeights

    folder = model_dir("tiny-moe")
    config = ModelConfig.from_pretrained(folder)
    store = expert_store.ExpertStore(ExpertWeights(folder, config), torch.float32,
                                     torch.device("cpu"))  # fmt: skip
    store.load(1, [[0, 3, 5], [1]])
    seen = []
    real = expert_store.expert_rows
    monkeypatch.setattr(expert_store, "expert_rows",
                        lambda x, w13, w2, ids: seen.append((x.shape[0], w13.shape[0]))
                        or real(x, w13, w2, ids))  # fmt: skip
    store.warm({2, 3, 9}, most_rows=8)  # 9: more than any layer holds, skipped
    assert seen == [(n, k) for k in (2, 3) for n in (1, 2, 4, 8)]


def test_expert_services_parts_of_a_layer_sum_to_the_layer(model_dir):
    """The stream path's replies: each service's weighted sum over the pairs it holds
    (-1: another's); two services' parts add up to the engine's whole layer."""
    from basis.model_config import ModelConfig
    from engine import LLM
    from services.expert.expert_store import ExpertStore
    from services.expert.expert_weights import ExpertWeights

    folder = model_dir("tiny-moe")
    config = ModelConfig.from_pretrained(folder)
    experts = config.num_experts
    halves = [list(range(0, experts, 2)), list(range(1, experts, 2))]
    stores = []
    for held in halves:
        store = ExpertStore(ExpertWeights(folder, config), torch.float32, torch.device("cpu"))
        store.load(1, [held] * store.num_layers)
        stores.append(store)
    moe = [layer.mlp for layer in LLM(folder, device="cpu").engine.runner.model.layers
           if hasattr(layer.mlp, "w13")][0]  # fmt: skip
    rows = torch.randn(7, config.hidden_size)
    weights, ids = reference.moe_route(torch.randn(7, experts), 2, True)
    parts = [store.compute_partial(0, rows, weights, torch.where(ids % 2 == i, ids, -1))
             for i, store in enumerate(stores)]  # fmt: skip
    whole = reference.fused_moe(rows, moe.w13, moe.w2, weights, ids)
    torch.testing.assert_close(parts[0] + parts[1], whole)
    with pytest.raises(LookupError, match="not held here"):  # routed here, held by the other
        stores[0].compute_partial(0, rows, weights, ids)
