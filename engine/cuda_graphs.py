"""The whole decode step as one CUDA graph per batch-size bucket.

Every layer, the logits and the metadata reads are captured once per bucket
(1, 2, 4, 8, then every 16 up to the largest batch) over static input
buffers; a step with B sequences copies its inputs into the first B rows,
pads the rest onto the null block (slot 0, length 1) and replays the
smallest bucket that fits. Mixed prefill steps run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16, and max_batch itself."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return sorted({*small, *range(16, max_batch + 1, 16), max_batch})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_seq_len: int):
        self.runner = runner
        self.max_seq_len = max_seq_len
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        dev = runner.device
        max_blocks = -(-max_seq_len // runner.block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.epoch: int | None = None  # the expert backend's graph_epoch() they hold

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            query_lens_cpu=[1] * batch,
            # The kernels size their split count from this bound; each sequence's
            # real length is read on the device, so one graph serves every length.
            seq_lens_cpu=[self.max_seq_len] * batch,
        )

    def _step(self, batch: int) -> torch.Tensor:
        r = self.runner
        hidden = r.model(
            self.input_ids[:batch],
            self.positions[:batch],
            r.kv_caches,
            self._meta(batch),
            r.backend,
        )
        return r.model.compute_logits(hidden)

    def recapture(self, epoch: int) -> None:
        """Every bucket captured again (the expert backend changed what they hold); on
        the CPU, where nothing is captured (`run` steps eagerly), only the epoch."""
        self.graphs.clear()
        self.pool = None
        if self.runner.device.type == "cuda":
            self.capture()
        self.epoch = epoch

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        if self.epoch is None:
            self.epoch = self.runner.model.experts.graph_epoch()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):  # largest first: later ones reuse its pool
                for _ in range(2):  # compile and tune every kernel at this shape first
                    self._step(batch)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits = self._step(batch)
                self.pool = graph.pool()
                self.graphs[batch] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (batch %d..%d) in %.1f s",
            len(self.graphs),
            self.buckets[0],
            self.max_batch,
            time.monotonic() - start,
        )

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits of a decode step of `len(input_ids)` sequences."""
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        if bucket > batch:  # padded rows: one token on the null block
            self.input_ids[batch:bucket].zero_()
            self.positions[batch:bucket].zero_()
            self.slot_mapping[batch:bucket].zero_()
            self.seq_lens[batch:bucket].fill_(1)
            self.block_tables[batch:bucket, 0].zero_()
        if bucket not in self.graphs:  # not captured (CPU tests): the same step, eagerly
            return self._step(bucket)[:batch]
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch]
