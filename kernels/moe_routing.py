"""Triton MoE routing: softmax + top-k (+ renormalisation), and the block
alignment that groups (token, k) pairs by expert for the grouped GEMM.

moe_align follows the vLLM/SGLang `moe_align_block_size` layout: pair indices
sorted by expert, each expert's run padded to a multiple of block_m with the
sentinel T * top_k, one expert id per block (-1 past the last used block) and
the padded total. Buffers are sized from host-known upper bounds and nothing
is read back to the host, so both ops can be captured in CUDA graphs. The
order of pairs within an expert comes from atomics and is not deterministic;
the GEMMs compute each row independently, so the results are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.selection import Selector, next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, T, E, stride_t,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    col_mask = cols < E
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    x = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_mask[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # Padding columns sit below every probability, taken ones below those.
    p = tl.where(col_mask[None, :], p, -1.0)
    k_cols = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        # Ties go to the lowest expert id.
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_w = tl.where(k_cols == i, best[:, None], top_w)
        top_i = tl.where(k_cols == i, idx[:, None], top_i)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + k_cols
    mask = row_mask[:, None] & (k_cols < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i.to(ids_ptr.dtype.element_ty), mask=mask)


def routing_outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights float32 [T, k], expert ids int64 [T, k]) for a routing kernel to fill."""
    tokens = logits.shape[0]
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    return weights, torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)


def _route_launch(logits, top_k, renormalize, *, block_t: int, num_warps: int):
    tokens, experts = logits.shape
    weights, ids = routing_outputs(logits, top_k)
    if tokens == 0:
        return weights, ids
    block_t = min(block_t, next_power_of_2(tokens))
    _route_kernel[(triton.cdiv(tokens, block_t),)](
        logits, weights, ids, tokens, experts, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t,
        BLOCK_E=max(16, next_power_of_2(experts)), BLOCK_K=next_power_of_2(top_k),
        num_warps=num_warps,
    )  # fmt: skip
    return weights, ids


# Token rows per program: the routing kernels (this one, grouped_topk) hold every expert of a
# row in registers.
ROWWISE_CONFIGS = [
    {"block_t": 4, "num_warps": 4},
    {"block_t": 1, "num_warps": 1},
    {"block_t": 2, "num_warps": 2},
    {"block_t": 8, "num_warps": 4},
    {"block_t": 16, "num_warps": 8},
]

_route_selector = Selector(
    "moe_route",
    {"rowwise": _route_launch},
    {"rowwise": ROWWISE_CONFIGS},
    lambda logits, top_k, renormalize: (
        min(next_power_of_2(logits.shape[0]), 1 << 16),
        logits.shape[1],
        top_k,
        str(logits.dtype),
    ),  # fmt: skip
)


def check_router_layout(router_logits: torch.Tensor) -> int:
    """Router logits [T, E] with a unit last stride and 1..MAX_EXPERTS experts: E."""
    if router_logits.stride(1) != 1:
        raise ValueError(f"router_logits needs unit last stride, got {router_logits.stride()}")
    experts = router_logits.shape[1]
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"number of experts must be in [1, {MAX_EXPERTS}], got {experts}")
    return experts


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in float32, top-k, optional renormalisation, in one kernel.

    Returns (weights float32 [T, k], expert ids int64 [T, k]) ordered by
    decreasing weight, like torch.topk.
    """
    if router_logits.dim() != 2 or router_logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"router_logits must be [T, E] in {FLOAT_DTYPES}, got "
                         f"{router_logits.dtype} {tuple(router_logits.shape)}")  # fmt: skip
    experts = check_router_layout(router_logits)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in [1, {experts}], got {top_k!r}")
    return _route_selector(router_logits, top_k, bool(renormalize))


@triton.jit
def _pair_ids(ids_ptr, offs, N, E):
    """The pairs' expert ids (0 where out of range) and which are in range."""
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32)
    valid = (offs < N) & (ids >= 0) & (ids < E)
    return tl.where(valid, ids, 0), valid


@triton.jit
def _padded_runs(counts, BLOCK_M: tl.constexpr):
    """Each expert's run padded to whole blocks: (padded, ends, total)."""
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    return padded, tl.cumsum(padded, axis=0), tl.sum(padded, axis=0)


@triton.jit
def _store_block_experts(expert_ids_ptr, blocks, ends, e_mask, total, num_blocks,
                         BLOCK_M: tl.constexpr):  # fmt: skip
    start = blocks * BLOCK_M
    # A block belongs to the expert whose padded run contains its first row.
    passed = (ends[None, :] <= start[:, None]) & e_mask[None, :]
    expert = tl.where(start < total, tl.sum(passed.to(tl.int32), axis=1), -1)
    tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit
def _place_pairs(ids, valid, offs, cursor_ptr, sorted_ptr):
    pos = tl.atomic_add(cursor_ptr + ids, 1, mask=valid, sem="relaxed")
    tl.store(sorted_ptr + pos, offs, mask=valid)


@triton.jit
def _add_load(load_ptr, hist, experts, e_mask, COUNT: tl.constexpr):
    """Adds a histogram of pairs to the experts' int64 load counters (if COUNT)."""
    if COUNT:
        tl.atomic_add(load_ptr + experts, hist.to(tl.int64), mask=e_mask & (hist > 0),
                      sem="relaxed")  # fmt: skip


@triton.jit
def _count_kernel(
    ids_ptr, counts_ptr, sorted_ptr, load_ptr, N, E, sorted_len,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    # Every slot starts as padding; the scatter overwrites the real ones.
    tl.store(sorted_ptr + offs, N, mask=offs < sorted_len)
    ids, valid = _pair_ids(ids_ptr, offs, N, E)
    # A per-chunk histogram in shared memory, then one global atomic per expert.
    hist = tl.histogram(ids, BLOCK_E, mask=valid)
    experts = tl.arange(0, BLOCK_E)
    tl.atomic_add(counts_ptr + experts, hist, mask=(experts < E) & (hist > 0), sem="relaxed")
    _add_load(load_ptr, hist, experts, experts < E, COUNT)


@triton.jit
def _scan_kernel(
    counts_ptr, cursor_ptr, expert_ids_ptr, total_ptr, E, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    # Every program redoes the (tiny) scan over experts rather than loop over blocks.
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < E
    counts = tl.load(counts_ptr + experts, mask=e_mask, other=0)
    padded, ends, total = _padded_runs(counts, BLOCK_M)
    if tl.program_id(0) == 0:
        tl.store(cursor_ptr + experts, ends - padded, mask=e_mask)
        tl.store(total_ptr, total)
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    _store_block_experts(expert_ids_ptr, blocks, ends, e_mask, total, num_blocks, BLOCK_M)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, N, E, CHUNK: tl.constexpr):
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids, valid = _pair_ids(ids_ptr, offs, N, E)
    _place_pairs(ids, valid, offs, cursor_ptr, sorted_ptr)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, cursor_ptr, sorted_ptr, expert_ids_ptr, total_ptr, load_ptr, N, E, sorted_len,
    num_blocks, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr, FILL: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    # The three kernels above in one program, for the few pairs of a decode step: one
    # launch instead of four (the counters need no zeroing: nothing is counted globally).
    offs = tl.arange(0, BLOCK_N)
    ids, valid = _pair_ids(ids_ptr, offs, N, E)
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < E
    hist = tl.histogram(ids, BLOCK_E, mask=valid)
    _add_load(load_ptr, hist, experts, e_mask, COUNT)
    padded, ends, total = _padded_runs(hist, BLOCK_M)
    tl.store(total_ptr, total)
    tl.store(cursor_ptr + experts, ends - padded, mask=e_mask)
    for first in range(0, sorted_len, FILL):
        slots = first + tl.arange(0, FILL)
        tl.store(sorted_ptr + slots, N, mask=slots < sorted_len)
    for first in range(0, num_blocks, BLOCK_B):
        blocks = first + tl.arange(0, BLOCK_B)
        _store_block_experts(expert_ids_ptr, blocks, ends, e_mask, total, num_blocks, BLOCK_M)
    # The padding and the cursors are written before any pair is placed.
    tl.debug_barrier()
    _place_pairs(ids, valid, offs, cursor_ptr, sorted_ptr)


# Up to this many (token, k) pairs one program aligns them all (decode steps: 170 tokens at
# top-6); more take the three kernels, whose programs share the pairs.
ONE_PROGRAM_PAIRS = 1024


def check_load(load: torch.Tensor | None, num_experts: int, device: torch.device) -> None:
    """An expert load counter (None, or contiguous int64 [num_experts] on device)."""
    if load is None:
        return
    if load.shape != (num_experts,) or load.dtype != torch.int64 or not load.is_contiguous():
        raise ValueError(f"load must be contiguous int64 [{num_experts}], got {load.dtype} "
                         f"{tuple(load.shape)}")  # fmt: skip
    if load.device != device:
        raise ValueError(f"load is on {load.device}, the expert ids on {device}")


def align_bounds(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(padded length, number of blocks) upper bounds: at most min(E, pairs) experts pad."""
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    return num_blocks * block_m, num_blocks


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, load: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the T * k (token, k) pairs by expert, padding each expert to a multiple of block_m.

    Returns int32 (sorted_ids [num_blocks * block_m], pair index = token * k + j, padding
    and unused tail = T * k; expert_ids [num_blocks], -1 for unused blocks; total [1], the
    padded length actually used). Ids outside [0, num_experts) are dropped. load, if given
    (int64 [num_experts]), gets each expert's count of pairs added.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in INDEX_DTYPES or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32/int64 [T, k], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")  # fmt: skip
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    check_load(load, num_experts, topk_ids.device)
    device = topk_ids.device
    n = topk_ids.numel()
    count = load is not None
    sorted_len, num_blocks = align_bounds(n, num_experts, block_m)
    sorted_ids = torch.empty(sorted_len, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = max(16, next_power_of_2(num_experts))
    block_b = max(16, 4096 // block_e)
    if n <= ONE_PROGRAM_PAIRS:
        scratch = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
        cursor, total = scratch[:num_experts], scratch[-1:]
        _align_one_program_kernel[(1,)](
            topk_ids, cursor, sorted_ids, expert_ids, total, load if count else scratch, n,
            num_experts, sorted_len, num_blocks, BLOCK_N=max(16, next_power_of_2(n)),
            BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_B=block_b, FILL=1024, COUNT=count,
            num_warps=4,
        )  # fmt: skip
        return sorted_ids, expert_ids, total
    scratch = torch.zeros(2 * num_experts + 1, dtype=torch.int32, device=device)
    counts, cursor, total = scratch[:num_experts], scratch[num_experts:-1], scratch[-1:]
    # Enough pairs per program to amortise the histogram over all experts.
    chunk = min(max(next_power_of_2(n), 16), 1024)
    grid = (triton.cdiv(max(sorted_len, n), chunk),)
    _count_kernel[grid](topk_ids, counts, sorted_ids, load if count else scratch, n,
                        num_experts, sorted_len, CHUNK=chunk, BLOCK_E=block_e, COUNT=count,
                        num_warps=4)  # fmt: skip
    _scan_kernel[(triton.cdiv(num_blocks, block_b),)](
        counts, cursor, expert_ids, total, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=block_b, num_warps=4,
    )  # fmt: skip
    if n:
        _scatter_kernel[(triton.cdiv(n, chunk),)](topk_ids, cursor, sorted_ids, n, num_experts,
                                                  CHUNK=chunk, num_warps=4)  # fmt: skip
    return sorted_ids, expert_ids, total
