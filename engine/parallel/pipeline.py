"""What moves between pipeline stages: each stage's output (hidden states and the
residual) to the same tensor rank of the next stage, and the last stage's
logits of the sampled rows back to rank 0, which samples. Sends never wait for
the receiver, so a stage is free for its next step as soon as it has sent."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel.state import ParallelState


class StageLink:
    def __init__(self, state: ParallelState, hidden_size: int, dtype, device):
        self.state = state
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sends: list = []  # (work, tensor): kept alive until done

    def _keep(self, work, tensor) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        self._sends.append((work, tensor))

    def send_carried(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        dst = self.state.stage_rank(self.state.pp_stage + 1)
        for t in (x.contiguous(), residual.contiguous()):
            self._keep(dist.isend(t, dst), t)

    def recv_carried(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.state.stage_rank(self.state.pp_stage - 1)
        x = torch.empty(total, self.hidden_size, dtype=self.dtype, device=self.device)
        residual = torch.empty_like(x)
        dist.recv(x, src)
        dist.recv(residual, src)
        return x, residual

    def send_logits(self, logits: torch.Tensor) -> None:
        logits = logits.contiguous()
        self._keep(dist.isend(logits, 0), logits)

    def drain(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []


class PendingLogits:
    """Rank 0: the logits of a step's sampled rows, on their way from the last stage."""

    def __init__(self, state: ParallelState, rows: int, vocab_size: int, device):
        self.buffer = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        last_stage_first_rank = (state.pp_size - 1) * state.tp_size
        self.work = dist.irecv(self.buffer, last_stage_first_rank)
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            self.work.wait()
            self._done = True
        return self.buffer


class PipelinedSample:
    """A pipelined step's sampling, as stepping.py uses a PendingSample: `result()`
    waits for the last stage's logits, then samples on rank 0."""

    tokens = None  # nothing on the device to read ahead from: no step runs ahead

    def __init__(self, seqs, logits: PendingLogits, sampler, masks=None):
        self.seqs = seqs
        self.logits = logits
        self.sampler = sampler
        self.masks = masks

    def wait(self) -> None:
        self.logits.wait()

    def result(self):
        return self.sampler.launch(self.logits.wait(), self.seqs, self.masks).result()
