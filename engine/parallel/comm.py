"""The collectives the model calls; each is a no-op in an engine without
parallelism, so the model code reads the same either way.

- `tp_reduce`: the sum of a row-parallel product's partial results (after the
  attention output and the MLP/MoE down projections);
- `vocab_embedding`: a vocab-parallel embedding lookup (each rank holds a range
  of the vocabulary's rows);
- `gather_logits`: each rank's slice of the vocabulary's logits, joined on the
  tensor-parallel group's first rank (the one that samples).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.parallel.state import current


class _Clock:
    """Seconds this rank spent in collectives (host time: on the CPU the whole
    exchange; on CUDA what issuing it cost)."""

    seconds = 0.0


CLOCK = _Clock()


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        CLOCK.seconds += time.perf_counter() - start


def tp_reduce(x: torch.Tensor) -> torch.Tensor:
    state = current()
    if state.tp_size == 1:
        return x
    _timed(dist.all_reduce, x, group=state.tp_group)
    return x


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rank `tp_rank`'s rows of the vocabulary: equal shares, the last one shorter."""
    share = -(-vocab_size // tp_size)
    start = min(tp_rank * share, vocab_size)
    return start, min(start + share, vocab_size)


def vocab_embedding(input_ids: torch.Tensor, weight: torch.Tensor, vocab_size: int):
    state = current()
    if state.tp_size == 1:
        return F.embedding(input_ids, weight)
    start, stop = vocab_range(vocab_size, state.tp_size, state.tp_rank)
    mine = (input_ids >= start) & (input_ids < stop)
    x = F.embedding(torch.where(mine, input_ids - start, 0), weight)
    x = x * mine.unsqueeze(-1).to(x.dtype)
    _timed(dist.all_reduce, x, group=state.tp_group)
    return x


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[rows, vocab] logits on the group's first rank (None on the others)."""
    state = current()
    if state.tp_size == 1:
        return logits
    share = -(-vocab_size // state.tp_size)
    if logits.shape[-1] < share:  # the last rank's shorter slice
        logits = F.pad(logits, (0, share - logits.shape[-1]))
    first = state.tp_ranks[0]
    parts = [torch.empty_like(logits) for _ in range(state.tp_size)] if state.tp_rank == 0 else None
    _timed(dist.gather, logits.contiguous(), parts, dst=first, group=state.tp_group)
    if state.tp_rank != 0:
        return None
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def agree_min(value: int, device) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks each can hold)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
