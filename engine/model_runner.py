"""Runs the model for one scheduled batch: builds the flat inputs and the
attention metadata from the block tables, runs the forward pass, and samples
for the sequences that reached the end of their known tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from basis.model_config import ModelConfig
from engine.attention import AttentionMetadata, get_backend
from engine.config import EngineConfig
from engine.kv_cache_spec import KVCacheSpec
from engine.loader import load_model
from engine.sampler import PendingSample, Sampler
from engine.sequence import Sequence
from kernels import ops

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat row whose logits each sampled sequence needs
    sample_seqs: list[Sequence]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    return _DTYPES[model_config.torch_dtype if name == "auto" else name]


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, model_dir: str | Path | None
    ):
        self.model_config = model_config
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.block_size
        self.model = load_model(
            model_dir, model_config, self.device, self.dtype, config.load_format, config.seed
        )
        self.kernel_mode = config.kernels
        if config.kernels == "auto":
            self.kernel_mode = "triton" if self.device.type == "cuda" else "torch"
        if self.kernel_mode == "triton":
            from kernels.cuda_ops import register

            register()
        self.backend = get_backend(self.kernel_mode)
        self.kv_spec = KVCacheSpec.for_model(model_config, self.block_size, self.dtype)
        self.num_blocks = config.num_gpu_blocks or self._blocks_that_fit()
        self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.kv_spec.bytes_per_block / 2**20,
        )
        self.sampler = Sampler(self.device, config.seed)
        self.num_tokens_processed = 0  # tokens the model has run on, over the engine's life
        self.graphs = None
        max_len = model_config.context_length(config.max_model_len)
        if config.warmup and self.device.type == "cuda" and self.kernel_mode == "triton":
            from engine.warmup import warm_up

            warm_up(self, max_len)
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and getattr(self.backend, "graph_safe", False)
        ):
            from engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.max_num_seqs, max_len)
            with ops.using(self.kernel_mode):
                self.graphs.capture()

    def close(self) -> None:
        """Frees the device memory: graphs, weights and the KV cache (the list is
        emptied in place, so every holder of it lets go)."""
        self.graphs = None
        self.model = None
        self.kv_caches.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- KV cache ------------------------------------------------------------
    def _blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return max(2, self.config.cpu_kv_cache_bytes // self.kv_spec.bytes_per_block)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        c = self.model_config
        # Activations of the largest step: a generous per-token estimate, plus logits.
        width = max(c.intermediate_size, c.moe_intermediate_size * max(1, c.num_experts_per_tok))
        per_token = (8 * c.hidden_size + 4 * width + 2 * (c.q_size + 2 * c.kv_size)) * 4
        reserve = self.config.max_num_batched_tokens * per_token
        reserve += self.config.max_num_seqs * c.vocab_size * 4 * 4 + (1 << 30)
        budget = total * self.config.gpu_memory_utilization - used - reserve
        blocks = int(budget // self.kv_spec.bytes_per_block)
        if blocks < 2:
            raise ValueError(
                "not enough device memory for the KV cache; lower max_num_batched_tokens or "
                "raise gpu_memory_utilization"
            )
        return blocks

    # -- one step ------------------------------------------------------------
    def prepare(
        self, seqs: list[Sequence], num_new: list[int], block_tables: list[list[int]]
    ) -> StepInputs:
        """The step's inputs on the device. Everything is staged in two host buffers
        (pinned on CUDA) and moved in two copies; a sequence's pending token (async
        scheduling) is read on the device from the step that sampled it."""
        bs, batch, total = self.block_size, len(seqs), sum(num_new)
        max_blocks = max(len(t) for t in block_tables)
        known = [
            min(n, len(s.all_token_ids) - s.num_computed_tokens) for s, n in zip(seqs, num_new)
        ]
        num_pending = total - sum(known)
        # int64: ids, positions, slots, sample rows, pending rows, their sources; int32:
        # query starts, sequence lengths, block tables. Segments start 16-byte aligned.
        wide = _Layout([total, total, total, batch, num_pending, num_pending], 2)
        narrow = _Layout([batch + 1, batch, batch * max_blocks], 4)
        pin = self.device.type == "cuda"
        h64 = torch.empty(wide.size, dtype=torch.int64, pin_memory=pin)
        h32 = torch.zeros(narrow.size, dtype=torch.int32, pin_memory=pin)
        ids, positions, slots, rows, pend_rows, pend_src = wide.views(h64.numpy())
        query_start, seq_lens, tables = narrow.views(h32.numpy())
        tables = tables.reshape(batch, max_blocks)
        sample_seqs: list[Sequence] = []
        source = None  # the in-flight step's sampled tokens (async scheduling)
        start = num_sampled = p = 0
        for i, (seq, n, k, table) in enumerate(zip(seqs, num_new, known, block_tables)):
            c = seq.num_computed_tokens
            ids[start : start + k] = seq.all_token_ids[c : c + k]
            if k < n:  # its last token is pending: known only on the device
                tensor, index = seq.pending_token
                if n - k != 1 or (source is not None and tensor is not source):
                    raise RuntimeError("a step may read one pending token per sequence, "
                                       "all from the step before it")  # fmt: skip
                source = tensor
                ids[start + k], pend_rows[p], pend_src[p] = 0, start + k, index
                p += 1
            positions[start : start + n] = np.arange(c, c + n)
            tables[i, : len(table)] = table
            seq_lens[i] = c + n
            start += n
            query_start[i + 1] = start
            if c + n == seq.num_tokens:
                rows[num_sampled] = start - 1
                num_sampled += 1
                sample_seqs.append(seq)
        row_of = np.repeat(np.arange(batch), num_new)
        slots[:] = tables[row_of, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        d64, d32 = h64.to(dev, non_blocking=True), h32.to(dev, non_blocking=True)
        ids_d, pos_d, slots_d, rows_d, pend_rows_d, pend_src_d = wide.views(d64)
        query_start_d, seq_lens_d, tables_d = narrow.views(d32)
        if source is not None:
            ids_d.index_copy_(0, pend_rows_d, source.index_select(0, pend_src_d))
        meta = AttentionMetadata(
            slot_mapping=slots_d,
            query_start_loc=query_start_d,
            seq_lens=seq_lens_d,
            block_tables=tables_d.view(batch, max_blocks),
            query_lens_cpu=list(num_new),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return StepInputs(ids_d, pos_d, meta, rows_d[:num_sampled], sample_seqs)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final hidden states of every row of the step (always eager)."""
        self.num_tokens_processed += int(inputs.input_ids.shape[0])
        with ops.using(self.kernel_mode):
            return self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend
            )

    @torch.inference_mode()
    def launch(
        self,
        seqs: list[Sequence],
        num_new: list[int],
        block_tables: list[list[int]],
        force_eager: bool = False,
    ) -> PendingSample | None:
        """Queues the step on the device and returns its sampled tokens, not yet read
        back (None when no sequence samples this step)."""
        inputs = self.prepare(seqs, num_new, block_tables)
        batch = len(seqs)
        if (
            self.graphs is not None
            and not force_eager
            and inputs.meta.decode_only
            and batch <= self.graphs.max_batch
        ):
            self.num_tokens_processed += batch
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            if not inputs.sample_seqs:
                return None
            if len(inputs.sample_seqs) < batch:  # a one-token prompt chunk samples nothing
                logits = logits.index_select(0, inputs.sample_rows)
            return self.sampler.launch(logits, inputs.sample_seqs)
        hidden = self.forward(inputs)
        if not inputs.sample_seqs:
            return None
        with ops.using(self.kernel_mode):
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        return self.sampler.launch(logits, inputs.sample_seqs)


class _Layout:
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
