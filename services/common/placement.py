"""Placement: the ready worker whose cost is lowest — the prompt tokens it would
have to compute (a prefix in its GPU tier is free, one in its host tier or in
the shared tier costs a fraction of recomputing: loading it) plus its load in
the same units (each request it runs or queues weighs `request_tokens` prompt
tokens, a device pool in use `memory_tokens` at most) — ties going to the least
loaded; when every worker is saturated, say so (the
gateway answers 429 with Retry-After) instead of queueing without bound.

Disaggregation is conditional: a request placed on a decode-role worker gets
a prefill worker too only when the part of its prompt the decode worker does
not already cache is at least `disagg_min_tokens` long; shorter prompts are
cheaper to prefill in place than to hand over.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import reduce
from operator import or_

from services.common.errors import Saturated, WorkerUnavailable
from services.common.kv_index import KvIndex
from services.common.registry import Registry, WorkerState

# the roles a request is placed on (a prefill worker is paired with a decode one)
SERVING_ROLES = ("colocated", "decode")


@dataclass(slots=True)
class PlacementPolicy:
    max_waiting: int | None = None  # per worker beyond max_num_seqs; None: max_num_seqs
    # Prompt tokens to compute that weigh as much as one more request running or queued
    # on a worker: a cached prefix draws a prompt to its worker only while that worker
    # is not this many tokens a request busier (a 512-token system prompt cached on one
    # worker of two must not draw every conversation there).
    request_tokens: float = 64.0
    # ... and as much as a device pool whose blocks are all held by requests (its
    # admissions wait for memory, its running requests risk preemption).
    memory_tokens: float = 2048.0
    # What loading a cached token costs, as a fraction of computing it.
    host_hit_weight: float = 0.1
    shared_hit_weight: float = 0.3
    retry_after: float = 1.0
    disagg_min_tokens: int = 512

    def capacity(self, w: WorkerState) -> int:
        return _capacity(w, self.max_waiting)


def _capacity(w: WorkerState, max_waiting: int | None) -> int:
    """Requests a worker may run and queue (PlacementPolicy.capacity)."""
    return w.max_num_seqs + (w.max_num_seqs if max_waiting is None else max_waiting)


@dataclass(slots=True)
class Decision:
    worker: WorkerState
    matched_blocks: int
    prefill: WorkerState | None = None
    refused_prefills: int = 0  # ready prefill workers whose KV layout differs
    # the longest prefix (blocks, in any of its tiers) an open worker holds: more than
    # `matched_blocks` when load outweighed the cache
    longest_blocks: int = 0


def _best(
    loads: dict,
    index: KvIndex,
    policy: PlacementPolicy,
    block_hashes,
    prompt_tokens: int,
    size: int | None,
    view: OpenWorkers | None = None,
) -> tuple[WorkerState, int]:
    """The worker of least cost, in prompt tokens: the prompt's work there (the tokens
    it must compute, plus what loading the blocks in its host tier or the shared tier
    costs in recomputed-token equivalents), plus its load (`request_tokens` a request
    running, queued or placed there since its last report, `memory_tokens` times the
    share of its device pool in use); ties to the less loaded, then to the first.
    `loads`: worker id -> (load, requests, order, worker) (`_loads`); `size`: their
    block size when they all have one. Workers whose prefixes count alike are found
    in one walk over the prompt (`KvIndex.prefix_groups`), not one walk each. Also
    returns the longest prefix (blocks) any of them holds. With `view` (the
    registry's OpenWorkers whose loads these are), its mask of their index bits
    and its least-loaded order spare a walk over every worker for each request."""
    host_w, shared_w = policy.host_hit_weight, policy.shared_hit_weight
    best_key, longest = None, 0
    if view is not None:
        groups = index.prefix_group_masks(block_hashes, view.mask_in(index))
    else:
        groups = index.prefix_groups(block_hashes, loads.keys())
    for (gpu, host, shared), ids in groups:
        cached_blocks, loaded_blocks = gpu + host + shared, host * host_w + shared * shared_w
        longest = max(longest, cached_blocks)
        if size is not None:  # one block size: the group's work is the same for each
            work = max(prompt_tokens - cached_blocks * size, 0) + size * loaded_blocks
            if view is None:
                cost, n, order, w = min(map(loads.__getitem__, ids))
            else:
                found = view.least_loaded(ids) if ids.bit_count() > _FEW else None
                if found is None:  # a small group, or one whose members are not the least
                    found = min(map(loads.__getitem__, index.holder_names(ids)))
                cost, n, order, w = found
            key = (work + cost, n, order, w)
            if best_key is None or key < best_key:
                best_key = key
            continue
        if view is not None:
            ids = index.holder_names(ids)
        for worker_id in ids:
            cost, n, order, w = loads[worker_id]
            block = w.block_size
            work = max(prompt_tokens - cached_blocks * block, 0) + block * loaded_blocks
            key = (work + cost, n, order, w)
            if best_key is None or key < best_key:
                best_key = key
    return best_key[3], longest


_FEW = 16  # a group this small is read member by member; a larger one in load order first


def _loads(workers: list[WorkerState], policy: PlacementPolicy) -> dict:
    """worker id -> (its load in prompt tokens, its requests, its order, the worker):
    the part of a worker's cost that is the same for every prompt."""
    per_request, per_memory = policy.request_tokens, policy.memory_tokens
    return {w.worker_id: _load(w, per_request, per_memory) for w in workers}


def _load(w: WorkerState, per_request: float, per_memory: float) -> tuple:
    """(its load in prompt tokens, its requests, its order, the worker)."""
    n = w.running + w.waiting + w.pending
    return (per_request * n + per_memory * w.kv_usage, n, w.seq, w)


def _block_size(sizes) -> tuple[int | None, int]:
    """Of the workers' distinct block sizes: the one they share (else None), and the
    largest."""
    return (next(iter(sizes)) if len(sizes) == 1 else None), max(sizes)


def _open(registry: Registry, policy: PlacementPolicy, roles, exclude) -> list[WorkerState]:
    """The ready workers of `roles`, not excluded and not at capacity, in one pass
    over the registry (it runs for every request, over every worker); raises when
    none is ready, or none is open."""
    since = registry.clock() - registry.heartbeat_timeout
    open_ = [
        w
        for w in registry.workers.values()
        if w.last_seen >= since
        and w.role in roles
        and w.worker_id not in exclude
        and w.load < policy.capacity(w)
    ]
    if not open_:
        if not any(w.role in roles and w.worker_id not in exclude for w in registry.ready()):
            raise WorkerUnavailable("no ready worker to serve the request")
        raise Saturated("every worker is at capacity", retry_after=policy.retry_after)
    return open_


class OpenWorkers:
    """The workers of some roles that are not at capacity, with their loads as
    `_loads` gives them, kept as the registry tells each change (a report, a
    placement, a registration) instead of read from every worker for every request.
    Readiness (a recent report) is checked on the worker chosen: one that missed its
    reports leaves until its next one."""

    def __init__(self, registry: Registry, policy: PlacementPolicy, roles):
        self.registry, self.roles = registry, roles
        self.loads: dict[str, tuple] = {}
        self.sizes: dict[int, int] = {}  # block size -> how many of `loads` have it
        # their bits in a KV index (`mask_in`), and their loads as a heap (`least_loaded`;
        # an entry is stale once its worker's load is another)
        self.index: KvIndex | None = None
        self.bits: dict[str, int] = {}
        self.mask, self.epoch = 0, -1
        self.heap: list[tuple] = []
        self.reweigh(policy)
        registry.readers.append(self)

    def reweigh(self, policy: PlacementPolicy) -> None:
        """Every worker's load again, under `policy`'s weights."""
        self.weights = _weights(policy)
        self.loads.clear()
        self.sizes.clear()
        self.bits.clear()
        self.mask, self.heap = 0, []
        for w in self.registry.workers.values():
            self._put(w)

    def mask_in(self, index: KvIndex) -> int:
        """The OR of the open workers' bits in `index` (kept as they change; read
        again when the index has freed a bit since, which another may now have)."""
        if index is not self.index or index.bit_epoch != self.epoch:
            self.index, self.epoch = index, index.bit_epoch
            self.bits = {wid: index.bit_of(wid) for wid in self.loads}
            self.mask = reduce(or_, self.bits.values(), 0)
        return self.mask

    def least_loaded(self, mask: int, limit: int = 32) -> tuple | None:
        """The least of the loads (as `_loads` gives them) of the open workers whose
        bits are in `mask` (bits of `mask_in`'s index), found in load order; None
        when more than `limit` less loaded workers are not in it (the group is best
        read member by member)."""
        heap, loads, bits = self.heap, self.loads, self.bits
        passed, found = [], None
        while heap and len(passed) <= limit:
            cost, n, order, worker_id = heap[0]
            load = loads.get(worker_id)
            if load is None or load[2] != order or load[0] != cost or load[1] != n:
                heapq.heappop(heap)  # stale
            elif bits[worker_id] & mask:
                found = load
                break
            else:
                passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found

    def changed(self, worker_id: str) -> None:
        self.drop(worker_id)
        w = self.registry.workers.get(worker_id)
        if w is not None:
            self._put(w)

    def _put(self, w: WorkerState) -> None:
        per_request, per_memory, max_waiting = self.weights
        if w.role in self.roles and w.load < _capacity(w, max_waiting):
            load = self.loads[w.worker_id] = _load(w, per_request, per_memory)
            self.sizes[w.block_size] = self.sizes.get(w.block_size, 0) + 1
            if self.index is not None:
                bit = self.bits[w.worker_id] = self.index.bit_of(w.worker_id)
                self.mask |= bit
            heapq.heappush(self.heap, (*load[:3], w.worker_id))
            if len(self.heap) > 4 * len(self.loads) + 64:  # mostly stale: start it again
                self.heap = [(*v[:3], k) for k, v in self.loads.items()]
                heapq.heapify(self.heap)

    def drop(self, worker_id: str) -> None:
        """Leaves out a worker until its state changes again."""
        old = self.loads.pop(worker_id, None)
        if old is not None:
            size = old[3].block_size
            self.sizes[size] -= 1
            if not self.sizes[size]:
                del self.sizes[size]
            bit = self.bits.pop(worker_id, 0)
            self.mask &= ~bit


def _weights(policy: PlacementPolicy) -> tuple:
    return (policy.request_tokens, policy.memory_tokens, policy.max_waiting)


def _view(registry: Registry, policy: PlacementPolicy, roles) -> OpenWorkers:
    """The registry's OpenWorkers for `roles` under `policy`'s weights."""
    for view in registry.readers:
        if isinstance(view, OpenWorkers) and view.roles == roles:
            if view.weights != _weights(policy):
                view.reweigh(policy)
            return view
    return OpenWorkers(registry, policy, roles)


def _place_first(registry, index, policy, block_hashes, prompt_tokens, roles):
    """`_best` over the open workers of `roles` (registry.readers' view), skipping any
    chosen one that missed its reports; None when no ready one is open."""
    view = _view(registry, policy, roles)
    since = registry.clock() - registry.heartbeat_timeout
    while view.loads:
        size, largest = _block_size(view.sizes)
        tokens = max(prompt_tokens, len(block_hashes) * largest)
        best, longest = _best(view.loads, index, policy, block_hashes, tokens, size, view)
        if best.last_seen >= since:
            return best, longest, tokens
        view.drop(best.worker_id)
    return None


def place(
    registry: Registry,
    index: KvIndex,
    policy: PlacementPolicy,
    block_hashes,
    prompt_tokens: int = 0,
    exclude=(),
    roles=SERVING_ROLES,
) -> Decision:
    chosen = None
    if not exclude:
        chosen = _place_first(registry, index, policy, block_hashes, prompt_tokens, roles)
    if chosen is None:  # a retry elsewhere, or none open: every worker read
        open_ = _open(registry, policy, roles, exclude)
        size, largest = _block_size({w.block_size for w in open_})
        tokens = max(prompt_tokens, len(block_hashes) * largest)
        best, longest = _best(_loads(open_, policy), index, policy, block_hashes, tokens, size)
    else:
        best, longest, tokens = chosen
    prompt_tokens = tokens
    registry.placed(best)
    # what the worker has itself or can load: only the rest needs a prefill
    decision = Decision(best, len(index.prefix_by_tier(best.worker_id, block_hashes)))
    decision.longest_blocks = longest
    uncached = prompt_tokens - decision.matched_blocks * best.block_size
    if best.role == "decode" and uncached >= policy.disagg_min_tokens:
        prefills = [
            w
            for w in registry.ready("prefill")
            if w.worker_id not in exclude and w.load < policy.capacity(w)
        ]
        # A prefill worker whose KV blocks are laid out otherwise (another tensor-parallel
        # size, dtype or model) cannot fill this worker's cache, nor can a handoff move
        # the blocks of a parallel worker (its rank 0 holds part of each): never paired,
        # the prompt is prefilled by its decode worker instead.
        compatible = [
            w for w in prefills
            if w.kv_layout == best.kv_layout and not (w.parallel or best.parallel)
        ]  # fmt: skip
        decision.refused_prefills = len(prefills) - len(compatible)
        prefills = compatible
        if prefills:
            size, _ = _block_size({w.block_size for w in prefills})
            decision.prefill, _ = _best(
                _loads(prefills, policy), index, policy, block_hashes, prompt_tokens, size
            )
            registry.placed(decision.prefill)
    return decision
