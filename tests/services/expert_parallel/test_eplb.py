"""DeepSeek's EPLB algorithm: the published example's placement exactly, the
reference implementation's outputs on a global-policy case, and the
properties every placement must have."""

from __future__ import annotations

import pytest
import torch

from services.expert_parallel.eplb import imbalance, rebalance_experts

# deepseek-ai/EPLB README: 2 layers x 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]
# What the reference implementation returns beside it (run on the same input).
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
README_LOG2PHY = [
    [[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1], [4, -1], [9, -1],
     [8, 10], [14, -1]],
    [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1], [6, 3], [7, -1],
     [1, -1], [5, -1]],
]  # fmt: skip


def test_readme_example_is_reproduced_exactly():
    result = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert result.phy2log.tolist() == README_PHY2LOG
    assert result.logcnt.tolist() == README_LOGCNT
    assert result.log2phy.tolist() == README_LOG2PHY


def test_global_policy_matches_the_reference():
    # One group over two nodes does not divide: the global policy.
    weight = torch.tensor([[120, 15, 300, 48, 77, 9, 260, 33], [5, 410, 62, 88, 140, 19, 230, 71]])
    result = rebalance_experts(weight, 12, 1, 2, 4)
    assert result.phy2log.tolist() == [
        [0, 4, 5, 2, 6, 3, 2, 6, 7, 2, 6, 1],
        [1, 3, 5, 1, 7, 2, 1, 4, 4, 6, 6, 0],
    ]
    assert result.logcnt.tolist() == [[1, 1, 3, 1, 1, 1, 3, 1], [1, 3, 1, 1, 2, 1, 2, 1]]
    assert imbalance(weight, result.phy2log, 4).max() < 1.09


@pytest.mark.parametrize(
    "slots,groups,nodes,services", [(72, 8, 2, 8), (80, 1, 1, 8), (64, 4, 4, 8)]
)
def test_every_placement_is_consistent(slots, groups, nodes, services):
    torch.manual_seed(7)
    weight = torch.distributions.Pareto(1.0, 1.2).sample((5, 64))
    result = rebalance_experts(weight, slots, groups, nodes, services)
    phy2log, log2phy, logcnt = result.phy2log, result.log2phy, result.logcnt
    assert phy2log.shape == (5, slots)
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == slots).all()
    for layer in range(5):
        for expert in range(64):
            replicas = [s for s in log2phy[layer, expert].tolist() if s >= 0]
            assert len(replicas) == logcnt[layer, expert]
            assert all(phy2log[layer, s] == expert for s in replicas)
        if groups % nodes == 0 and nodes > 1:  # hierarchical: a group's replicas stay on a node
            per_node = slots // nodes
            node_of_group: dict[int, int] = {}
            for s, expert in enumerate(phy2log[layer].tolist()):
                group = expert // (64 // groups)
                assert node_of_group.setdefault(group, s // per_node) == s // per_node


def test_redundant_slots_flatten_a_skewed_load():
    torch.manual_seed(7)
    ranks = torch.arange(1, 65, dtype=torch.float32)
    weight = torch.stack([(1.0 / ranks)[torch.randperm(64)] for _ in range(4)]) * 1e4
    contiguous = torch.arange(64).expand(4, 64)
    before = imbalance(weight, contiguous, 8)
    after = imbalance(weight, rebalance_experts(weight, 72, 1, 1, 8).phy2log, 8)
    assert before.mean() > 1.5
    assert after.max() <= 1.15


def test_bad_shapes_are_refused_before_any_work():
    weight = torch.ones(2, 12)
    with pytest.raises(ValueError, match="do not divide"):
        rebalance_experts(weight, 15, 4, 2, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        rebalance_experts(weight, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="layers, experts"):
        rebalance_experts(torch.ones(12), 16, 4, 2, 8)
