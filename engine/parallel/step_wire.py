"""A step's inputs as rank 0 sends them to the other ranks: one small header and
two flat buffers (int64: token ids, positions, cache slots, sampled rows, ...;
int32: query starts, sequence lengths, block tables), broadcast once per step,
never per layer. Every rank lays the buffers out with the same `Layout` and
reads them back with `unpack`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention import AttentionMetadata

FORWARD, STOP = 1, 2
_HEADER = 6  # op, total tokens, batch, pending tokens, max blocks, sampled rows


class Layout:
    """Consecutive segments of one flat buffer, each starting `align` elements apart."""

    def __init__(self, lengths: list[int], align: int):
        self.bounds = []
        at = 0
        for n in lengths:
            self.bounds.append((at, at + n))
            at += -(-n // align) * align
        self.size = max(at, 1)

    def views(self, buffer):
        return [buffer[a:b] for a, b in self.bounds]


@dataclass(frozen=True, slots=True)
class StepShape:
    total: int  # tokens in the step
    batch: int
    num_pending: int  # tokens whose id only the device knows (async scheduling)
    max_blocks: int
    num_sampled: int

    @property
    def wide(self) -> Layout:  # ids, positions, slots, sampled rows, pending rows, sources
        t, p = self.total, self.num_pending
        return Layout([t, t, t, self.batch, p, p], 2)

    @property
    def narrow(self) -> Layout:  # query starts, sequence lengths, block tables
        return Layout([self.batch + 1, self.batch, self.batch * self.max_blocks], 4)


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor


def unpack(
    shape: StepShape, d64: torch.Tensor, d32: torch.Tensor, query_lens=None, seq_lens_cpu=None
) -> StepTensors:
    """The step's tensors as views of the two buffers; the host-side lengths are
    read back from them unless given."""
    ids, positions, slots, rows, _, _ = shape.wide.views(d64)
    query_start, seq_lens, tables = shape.narrow.views(d32)
    if query_lens is None:
        starts = query_start.tolist()
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        seq_lens_cpu = seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables.view(shape.batch, shape.max_blocks),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens_cpu),
    )
    return StepTensors(ids, positions, meta, rows[: shape.num_sampled])


def send(shape: StepShape, d64: torch.Tensor, d32: torch.Tensor, group=None) -> None:
    """Rank 0: the step to every other rank (of `group`)."""
    header = torch.tensor(
        [FORWARD, shape.total, shape.batch, shape.num_pending, shape.max_blocks,
         shape.num_sampled], dtype=torch.int64, device=d64.device,
    )  # fmt: skip
    dist.broadcast(header, 0, group=group)
    dist.broadcast(d64, 0, group=group)
    dist.broadcast(d32, 0, group=group)


def send_stop(device: torch.device, group=None) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = STOP
    dist.broadcast(header, 0, group=group)


def receive(
    device: torch.device, group=None
) -> tuple[StepShape, torch.Tensor, torch.Tensor] | None:
    """The other ranks: the next step from rank 0 (None: stop)."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, 0, group=group)
    op, *values = header.tolist()
    if op == STOP:
        return None
    shape = StepShape(*values)
    d64 = torch.empty(shape.wide.size, dtype=torch.int64, device=device)
    d32 = torch.empty(shape.narrow.size, dtype=torch.int32, device=device)
    dist.broadcast(d64, 0, group=group)
    dist.broadcast(d32, 0, group=group)
    return shape, d64, d32
