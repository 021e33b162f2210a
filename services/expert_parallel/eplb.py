"""DeepSeek's expert-parallel load balancer (EPLB): given each logical expert's
load per MoE layer, choose how many replicas each expert gets and which
physical slot (on which expert service) holds each replica.

Three greedy steps, per layer independently (anchors B1):

1. groups -> nodes: the load of each expert group is the sum of its experts';
   `balanced_packing` puts the groups onto nodes, the same number on each;
2. within a node: `replicate_experts` gives the node's spare slots one at a
   time to the expert with the highest load per replica;
3. replicas -> services: each replica carries load / replica count, and the
   node's replicas are packed onto its services, the same number on each.

Hierarchical when the expert groups divide evenly over the nodes, global
(one group, one node) otherwise. Results:

- `phy2log[L, R]`: the logical expert each physical slot holds; slot s lives
  on service s // (R / G);
- `log2phy[L, E, maxcnt]`: each expert's slots, -1 padded;
- `logcnt[L, E]`: each expert's replica count.

Greedy longest-processing-time packing, not optimal; no anti-affinity (two
replicas of an expert may share a service); migration cost is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class EplbResult:
    phy2log: torch.Tensor  # [L, R] int64
    log2phy: torch.Tensor  # [L, E, maxcnt] int64, -1 padded
    logcnt: torch.Tensor  # [L, E] int64


def _descending(loads: np.ndarray) -> list[int]:
    """Indices by load, highest first. Equal loads come in torch.sort's order (not
    stable), as in DeepSeek's implementation, so the placements are the same."""
    return torch.from_numpy(loads).sort(descending=True).indices.tolist()


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs the n items of each row into `num_packs` packs of exactly n / num_packs
    items, heaviest item first into the lightest pack that still has room.
    Returns (pack of each item, its position in the pack), both [X, n]."""
    rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not pack evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:  # nothing to balance: item i is pack i
        return torch.arange(n).expand(rows, n).clone(), torch.zeros(rows, n, dtype=torch.int64)
    pack = torch.empty(rows, n, dtype=torch.int64)
    rank = torch.empty(rows, n, dtype=torch.int64)
    # float32 sums, as the loads come: which pack is lightest must not depend on
    # rounding that the same algorithm elsewhere (torch, float32) does not do.
    for row, loads in enumerate(weight.float().numpy()):
        pack_load = [np.float32(0.0)] * num_packs
        pack_items = [0] * num_packs
        for item in _descending(loads):
            open_packs = [p for p in range(num_packs) if pack_items[p] < per_pack]
            best = min(open_packs, key=lambda p: pack_load[p])  # ties: the lowest pack
            pack[row, item], rank[row, item] = best, pack_items[best]
            pack_load[best] += loads[item]
            pack_items[best] += 1
    return pack, rank


def replicate_experts(
    weight: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gives each of the n experts of a row one slot, then each spare slot to the
    expert whose load per replica is highest. Returns (expert of each slot
    [X, num_slots], the replica's index among its expert's [X, num_slots],
    replica count of each expert [X, n])."""
    rows, n = weight.shape
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    slot_expert = torch.empty(rows, num_slots, dtype=torch.int64)
    slot_rank = torch.zeros(rows, num_slots, dtype=torch.int64)
    counts = torch.ones(rows, n, dtype=torch.int64)
    slot_expert[:, :n] = torch.arange(n)
    for row, loads in enumerate(weight.float().numpy()):
        count = np.ones(n, dtype=np.float32)
        for slot in range(n, num_slots):
            hottest = int(np.argmax(loads / count))  # ties: the lowest id
            slot_expert[row, slot] = hottest
            slot_rank[row, slot] = int(count[hottest])
            count[hottest] += 1
        counts[row] = torch.from_numpy(count.astype(np.int64))
    return slot_expert, slot_rank, counts


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a permutation."""
    inverse = torch.empty_like(permutation)
    inverse.scatter_(1, permutation, torch.arange(permutation.shape[1]).expand_as(permutation))
    return inverse


def _hierarchical(
    weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_services: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, experts = weight.shape
    group_size = experts // num_groups
    groups_per_node = num_groups // num_nodes
    services_per_node = num_services // num_nodes
    slots_per_service = num_slots // num_services
    # 1. groups -> nodes. Renumber experts node-major ("node order"): node 0's
    # groups first, each group's experts contiguous.
    group_load = weight.view(layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    group_start = (group_node * groups_per_node + group_rank) * group_size
    log_to_ordered = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)
    ordered_to_log = _inverse(log_to_ordered)
    # 2. replicas within each node: one row per (layer, node).
    node_load = weight.gather(-1, ordered_to_log).view(layers * num_nodes, experts // num_nodes)
    slot_ordered, slot_rank, ordered_count = replicate_experts(node_load, num_slots // num_nodes)
    # 3. a node's replicas -> its services; a replica carries its expert's share.
    replica_load = (node_load / ordered_count).gather(-1, slot_ordered)
    service, position = balanced_packing(replica_load, services_per_node)
    slot_of_replica = service * slots_per_service + position
    replica_of_slot = _inverse(slot_of_replica)
    slot_ordered = slot_ordered.gather(-1, replica_of_slot).view(layers, num_nodes, -1)
    node_offset = (torch.arange(num_nodes) * (experts // num_nodes)).view(1, -1, 1)
    slot_ordered = (slot_ordered + node_offset).flatten(-2)
    phy2log = ordered_to_log.gather(-1, slot_ordered)
    phy_rank = slot_rank.gather(-1, replica_of_slot).view(layers, -1)
    logcnt = ordered_count.view(layers, -1).gather(-1, log_to_ordered)
    return phy2log, phy_rank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_services: int
) -> EplbResult:
    """The EPLB placement of `num_slots` physical slots (a multiple of
    `num_services`) for the load `weight[L, E]`.

    Hierarchical when `num_groups` is a multiple of `num_nodes`, global otherwise."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got {tuple(weight.shape)}")
    layers, experts = weight.shape
    if num_services < 1 or num_slots % num_services:
        raise ValueError(f"{num_slots} slots do not divide over {num_services} services")
    if num_slots < experts:
        raise ValueError(f"{num_slots} slots cannot hold {experts} experts")
    if num_nodes < 1 or num_services % num_nodes:
        raise ValueError(f"{num_services} services do not divide over {num_nodes} nodes")
    weight = weight.float().cpu()
    if num_groups >= 1 and experts % num_groups == 0 and num_groups % num_nodes == 0:
        phy2log, phy_rank, logcnt = _hierarchical(
            weight, num_slots, num_groups, num_nodes, num_services
        )
    else:
        phy2log, phy_rank, logcnt = _hierarchical(weight, num_slots, 1, 1, num_services)
    max_count = int(logcnt.max())
    log2phy = torch.full((layers, experts * max_count), -1, dtype=torch.int64)
    log2phy.scatter_(-1, phy2log * max_count + phy_rank, torch.arange(num_slots).expand(layers, -1))
    return EplbResult(phy2log, log2phy.view(layers, experts, max_count), logcnt)


def service_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_services: int) -> torch.Tensor:
    """Expected load of each service per layer, [L, G], when each expert's tokens
    are spread evenly over its replicas (as the workers route them)."""
    layers, num_slots = phy2log.shape
    counts = torch.zeros_like(weight, dtype=torch.float32)
    counts.scatter_add_(1, phy2log, torch.ones(layers, num_slots))
    per_slot = (weight.float() / counts.clamp(min=1)).gather(1, phy2log)
    return per_slot.view(layers, num_services, -1).sum(-1)


def imbalance(weight: torch.Tensor, phy2log: torch.Tensor, num_services: int) -> torch.Tensor:
    """max / mean service load, per layer [L] (1.0 is perfect balance)."""
    loads = service_loads(weight, phy2log, num_services)
    return loads.max(-1).values / loads.mean(-1).clamp(min=1e-12)
