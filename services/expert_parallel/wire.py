"""The per-layer data path between a worker (rank 0) and its expert services
(ranks 1..N) over one torch.distributed process group: tensors, no RPCs.

One dispatch is three all-to-alls, issued back to back without waiting:

1. header, [world, 4] int64: (kind, layer, rows, 0) from the worker to each
   member (members send zeros), so each member knows what follows;
2. payload: each member's rows, every row the token's hidden state and the
   logical expert id as bytes ([rows, hidden * itemsize + 8] uint8);
3. combine: each member's expert outputs, [rows, hidden], back to the worker
   in the order the rows came.

Members receive and answer in the order the worker issued, so several
dispatches (micro-batches) may be in flight; the backend's work queue runs
them in order. Gloo on CPU, NCCL on GPU (the same calls; untested here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KIND_ROWS = 1
KIND_LEAVE = 2
_HEADER = 4
_ID_BYTES = 8


def pack(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """[n, H] activations + [n] ids -> [n, H * itemsize + 8] bytes."""
    n = rows.shape[0]
    data = rows.contiguous().view(torch.uint8).view(n, -1)
    ids = expert_ids.to(torch.int64).contiguous().view(torch.uint8).view(n, _ID_BYTES)
    return torch.cat([data, ids], dim=1)


def unpack(
    payload: torch.Tensor, dtype: torch.dtype, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    n = payload.shape[0]
    width = hidden * torch.empty((), dtype=dtype).element_size()
    rows = payload[:, :width].contiguous().view(dtype).view(n, hidden)
    ids = payload[:, width:].contiguous().view(torch.int64).view(n)
    return rows, ids


def row_bytes(dtype: torch.dtype, hidden: int) -> int:
    return hidden * torch.empty((), dtype=dtype).element_size() + _ID_BYTES


@dataclass
class Transfer:
    """One dispatch in flight: its all-to-alls and the buffer the results land in."""

    works: list
    result: torch.Tensor  # [sum rows, H], rows grouped by member in rank order

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.result

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)


class WorkerPort:
    """Rank 0's end: sends rows to members, collects their results."""

    def __init__(self, pg, world: int, device: torch.device):
        self.pg, self.world, self.device = pg, world, device

    def send(self, layer: int, rows_per_member: list[int], rows: torch.Tensor,
             expert_ids: torch.Tensor) -> Transfer:  # fmt: skip
        """Each member's rows (grouped by member in rank order) and their expert ids."""
        payload, dtype, hidden = pack(rows, expert_ids), rows.dtype, rows.shape[1]
        header = torch.zeros(self.world, _HEADER, dtype=torch.int64, device=self.device)
        header[1:, 0] = KIND_ROWS
        header[1:, 1] = layer
        header[1:, 2] = torch.tensor(rows_per_member, dtype=torch.int64)
        heard = torch.empty_like(header)
        nothing = [0] * self.world
        splits = [0, *rows_per_member]
        empty_rows = payload.new_empty((0, payload.shape[1]))
        result = torch.empty(sum(rows_per_member), hidden, dtype=dtype, device=self.device)
        works = [
            self.pg.alltoall_base(heard.view(-1), header.view(-1), [], []),
            self.pg.alltoall_base(empty_rows, payload, nothing, splits),
            self.pg.alltoall_base(result, result.new_empty((0, hidden)), splits, nothing),
        ]
        return Transfer(works, result)

    def leave(self) -> None:
        """Tells every member this group is done (each ends its serving loop)."""
        header = torch.zeros(self.world, _HEADER, dtype=torch.int64, device=self.device)
        header[1:, 0] = KIND_LEAVE
        self.pg.alltoall_base(torch.empty_like(header).view(-1), header.view(-1), [], []).wait()


class MemberPort:
    """A member's end: receives a dispatch, answers with the expert outputs."""

    def __init__(self, pg, world: int, rank: int, device: torch.device, dtype: torch.dtype,
                 hidden: int):  # fmt: skip
        self.pg, self.world, self.rank = pg, world, rank
        self.device, self.dtype, self.hidden = device, dtype, hidden
        self.row_width = row_bytes(dtype, hidden)
        self._pending_rows = 0

    def receive(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(layer, rows [n, hidden], their expert ids [n]), or None when the worker left."""
        quiet = torch.zeros(self.world, _HEADER, dtype=torch.int64, device=self.device)
        heard = torch.empty_like(quiet)
        self.pg.alltoall_base(heard.view(-1), quiet.view(-1), [], []).wait()
        kind, layer, rows = (int(v) for v in heard[0, :3].tolist())
        if kind == KIND_LEAVE:
            return None
        if kind != KIND_ROWS:
            raise RuntimeError(f"unknown dispatch kind {kind} from the worker")
        payload = torch.empty(rows, self.row_width, dtype=torch.uint8, device=self.device)
        nothing = [0] * self.world
        splits = [rows] + [0] * (self.world - 1)
        self.pg.alltoall_base(payload, payload.new_empty((0, self.row_width)), splits,
                              nothing).wait()  # fmt: skip
        self._pending_rows = rows
        return layer, *unpack(payload, self.dtype, self.hidden)

    def reply(self, outputs: torch.Tensor) -> None:
        """The outputs of the last received rows, in their order."""
        if outputs.shape[0] != self._pending_rows:
            raise RuntimeError(f"{outputs.shape[0]} outputs for {self._pending_rows} rows")
        nothing = [0] * self.world
        splits = [outputs.shape[0]] + [0] * (self.world - 1)
        landing = outputs.new_empty((0, outputs.shape[1]))
        self.pg.alltoall_base(landing, outputs.contiguous(), nothing, splits).wait()
