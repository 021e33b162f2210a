"""A step's inputs as rank 0 sends them to the other ranks: one small header and
two flat buffers (int64: token ids, positions, cache slots, sampled rows, ...;
int32: query starts, sequence lengths, block tables), once per step, never per
layer. Every rank lays the buffers out with the same `Layout` and reads them
back with `unpack`.

They go point to point, not as a collective: rank 0 hands a step to every rank
and goes on (with a pipeline, it starts the next step while later stages still
work on this one); each rank takes its steps in order."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention import AttentionMetadata

FORWARD, STOP, STATS = 1, 2, 3
STATS_TAG = 7  # replies to STATS, apart from the steps' own messages
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
        return Layout([t, t, t, self.num_sampled, p, p], 2)

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


class StepSender:
    """Rank 0's side: each step to every other rank, without waiting for them."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._inflight: list = []  # (work, tensors) of earlier sends, kept alive

    def send(self, shape: StepShape, d64: torch.Tensor, d32: torch.Tensor) -> None:
        header = torch.tensor(
            [FORWARD, shape.total, shape.batch, shape.num_pending, shape.max_blocks,
             shape.num_sampled], dtype=torch.int64, device=d64.device,
        )  # fmt: skip
        self._post([header, d64, d32])

    def stop(self, device: torch.device) -> None:
        self._post([_op(STOP, device)])
        self.drain()

    def stats(self, device: torch.device) -> list[list[float]]:
        """Every other rank's (busy seconds, collective seconds, steps), after the
        steps sent before this call."""
        self._post([_op(STATS, device)])
        out = []
        for rank in range(1, self.world_size):
            reply = torch.empty(3, dtype=torch.float64, device=device)
            dist.recv(reply, rank, tag=STATS_TAG)
            out.append(reply.tolist())
        return out

    def _post(self, tensors: list[torch.Tensor]) -> None:
        self._inflight = [(w, t) for w, t in self._inflight if not w.is_completed()]
        for rank in range(1, self.world_size):
            for t in tensors:
                self._inflight.append((dist.isend(t, rank), t))

    def drain(self) -> None:
        for work, _ in self._inflight:
            work.wait()
        self._inflight = []


def _op(op: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = op
    return header


def receive(device: torch.device, on_stats=None):
    """The other ranks: the next step from rank 0, as (shape, d64, d32); None: stop.
    A request for statistics is answered with `on_stats()` on the way."""
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64, device=device)
        dist.recv(header, 0)
        op, *values = header.tolist()
        if op != STATS:
            break
        reply = torch.tensor(on_stats(), dtype=torch.float64, device=device)
        dist.send(reply, 0, tag=STATS_TAG)
    if op == STOP:
        return None
    shape = StepShape(*values)
    d64 = torch.empty(shape.wide.size, dtype=torch.int64, device=device)
    d32 = torch.empty(shape.narrow.size, dtype=torch.int32, device=device)
    dist.recv(d64, 0)
    dist.recv(d32, 0)
    return shape, d64, d32
