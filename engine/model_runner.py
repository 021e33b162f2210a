"""Runs the model for one scheduled batch: builds the flat inputs and the
attention metadata from the block tables, runs the forward pass, and samples
for the sequences that reached the end of their known tokens."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from basis.model_config import ModelConfig
from engine import piece_graphs, step_inputs
from engine.attention import get_backend
from engine.config import EngineConfig
from engine.grammar import masks_for
from engine.host_memory_ahead import HostMemoryAhead
from engine.kv_cache_spec import KVCacheSpec
from engine.loader import load_model
from engine.models.mtp import has_mtp
from engine.moe_settings import apply_moe_settings
from engine.mtp_drafts import MTPDrafts
from engine.parallel import comm
from engine.parallel import state as parallel_state
from engine.parallel.comm import agree_min
from engine.parallel.launcher import Followers, config_options
from engine.parallel.pipeline import PendingLogits, PipelinedSample, StageLink
from engine.parallel.sharding import ShardPlan
from engine.parallel.stages import StagePlan
from engine.sampler import PendingSample, Sampler
from engine.sequence import Sequence
from engine.startup import StartupPhases
from engine.step_inputs import StepInputs, prepare_step
from kernels import ops

_CONTEXT_BYTES = 512 << 20  # the CUDA context's memory, outside the allocator

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def graph_rows(config: EngineConfig) -> int:
    """The decode graphs' largest batch: a row per sequence, and with speculative
    decoding a row per draft too (verify steps replay them as rows), up to 512."""
    rows = config.max_num_seqs
    if config.speculative_method is not None:
        rows = max(rows, min(rows * (1 + config.num_speculative_tokens), 512))
    return rows


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    return _DTYPES[model_config.torch_dtype if name == "auto" else name]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        model_dir: str | Path | None,
        host_memory: HostMemoryAhead | None = None,
    ):
        """`host_memory`: the host tier's memory, started once the KV cache exists and
        allocated while the runner warms up (engine/host_memory_ahead.py)."""
        self.model_config = model_config
        self.config = config
        self.startup = StartupPhases()  # where its start-up went (engine/startup.py)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config)
        self.block_size = config.block_size
        # A parallel engine: rank 0 (this process, unless a follower made it) starts
        # the other ranks; every rank builds only its shard of the model.
        self.followers = None
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        if world > 1 and parallel_state.current().world_size == 1:
            self.followers = Followers(
                config_options(config), model_dir, config.tensor_parallel_size,
                config.pipeline_parallel_size, self.device,
            )  # fmt: skip
        if self.followers is not None:
            self.startup.mark("ranks")
        state = parallel_state.current()
        self.parallel = state.world_size > 1
        self.shard = ShardPlan(model_config, state.tp_size, state.tp_rank)
        shard_config = self.shard.config
        self.stage = None  # a pipeline stage: its layers only
        if state.pp_size > 1:
            self.stage = StagePlan(model_config.num_hidden_layers, state.pp_size, state.pp_stage)
        mtp = config.speculative_method == "mtp"
        if mtp and not has_mtp(model_config):
            raise ValueError("speculative_method 'mtp' needs a DeepSeek-V3 checkpoint with a "
                             "multi-token prediction layer (num_nextn_predict_layers)")  # fmt: skip
        if mtp and self.parallel:
            raise ValueError("speculative_method 'mtp' needs tensor_parallel_size 1")
        self.model = load_model(
            model_dir, shard_config, self.device, self.dtype, config.load_format, config.seed,
            shard=self.shard if self.parallel else None, stage=self.stage, mtp=mtp,
        )  # fmt: skip
        self.model.full_vocab_size = model_config.vocab_size
        apply_moe_settings(self.model, config)
        self.startup.mark("weights")
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.kernel_mode = config.kernels
        if config.kernels == "auto":
            self.kernel_mode = "triton" if self.device.type == "cuda" else "torch"
        if self.kernel_mode == "triton":
            from kernels.cuda_ops import register

            register()
        self.backend = get_backend(self.kernel_mode)
        self.kv_spec = KVCacheSpec.for_model(shard_config, self.block_size, self.dtype)
        if self.stage is not None:
            first, stop = self.stage.layers
            self.kv_spec = dataclasses.replace(self.kv_spec, num_layers=stop - first)
            self.link = StageLink(state, model_config.hidden_size, self.dtype, self.device)
        self.num_blocks = config.num_gpu_blocks or self._blocks_that_fit()
        if self.parallel:  # every rank's cache has the same blocks: the fewest that fit
            self.num_blocks = agree_min(self.num_blocks, self.device)
        if mtp and not config.num_gpu_blocks:  # the MTP layer's cache: one layer more
            layers = self.kv_spec.num_layers
            self.num_blocks = max(2, self.num_blocks * layers // (layers + 1))
        self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
        self.mtp_drafts = MTPDrafts(self) if mtp else None
        self.startup.mark("kv cache")
        if host_memory is not None and not self.parallel:
            host_memory.start(self.kv_caches)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.kv_spec.bytes_per_block / 2**20,
        )
        self.sampler = Sampler(self.device, config.seed)
        self.num_tokens_processed = 0  # tokens the model has run on, over the engine's life
        self.busy_seconds, self.steps = 0.0, 0  # time in `launch`, and launches
        self.graphs = self.pieces = None
        max_len = model_config.context_length(config.max_model_len)
        if self.parallel:  # the other ranks step only when rank 0 sends them a step
            return
        if config.warmup and self.device.type == "cuda" and self.kernel_mode == "triton":
            from engine.warmup import warm_up

            warm_up(self, max_len)
            self.startup.mark("warm-up")
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.mtp_drafts is None  # the MTP layer reads every step's hidden states
            and getattr(self.backend, "graph_safe", False)
        ):
            from engine.cuda_graphs import DecodeGraphs

            if host_memory is not None and host_memory.started:
                host_memory.settle()  # no other CUDA call may overlap a capture
                self.startup.mark("host tier")
            self.graphs = DecodeGraphs(self, graph_rows(config), max_len)
            with ops.using(self.kernel_mode):
                self.graphs.capture()
            self.startup.mark("graphs")
        with ops.using(self.kernel_mode):
            self.pieces = piece_graphs.make(self, config, max_len, host_memory)
        if self.pieces is not None and self.pieces.graphs:
            self.startup.mark("piece graphs")

    def set_expert_backend(self, experts) -> None:
        """Where the routed experts run from the next step on (engine/expert_backend.py).
        The decode graphs are captured again before their next replay, through it;
        while it cannot be captured (`graph_epoch()` None) the steps run eagerly."""
        if self.parallel:
            raise ValueError("expert services need tensor and pipeline parallel sizes of 1")
        self.model.set_expert_backend(experts)
        if self.graphs is not None:
            self.graphs.epoch = None

    def parallel_stats(self) -> list[dict]:
        """Per rank (rank 0 first): seconds spent computing steps and in collectives,
        and steps run; with a pipeline, 1 - busy / wall time is a stage's bubble."""
        rows = [[self.busy_seconds, comm.CLOCK.seconds, self.steps]]
        if self.followers is not None:
            rows += self.followers.stats()
        tp = parallel_state.current().tp_size
        return [
            {"rank": r, "stage": r // tp, "busy_seconds": b, "collective_seconds": c,
             "steps": int(n)}
            for r, (b, c, n) in enumerate(rows)
        ]  # fmt: skip

    def on_fatal(self, callback) -> None:
        if self.followers is not None:
            self.followers.on_failure = callback

    def close(self) -> None:
        """Frees the device memory: graphs, weights and the KV cache (the list is
        emptied in place, so every holder of it lets go)."""
        self.graphs = self.pieces = None
        self.model = None
        self.kv_caches.clear()
        if self.followers is not None:
            self.followers.close()
            self.followers = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- KV cache ------------------------------------------------------------
    def _blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return self.kv_spec.blocks_in(self.config.cpu_kv_cache_bytes)
        # This engine's share of the device is gpu_memory_utilization of it, less what
        # this process holds (weights, workspaces); other processes on the device (a
        # second worker) count only through what is still free.
        free, total = torch.cuda.mem_get_info(self.device)
        own = torch.cuda.memory_reserved(self.device) + _CONTEXT_BYTES
        c = self.model_config
        # Activations of the largest step: a generous per-token estimate, plus logits.
        width = max(c.intermediate_size, c.moe_intermediate_size * max(1, c.num_experts_per_tok))
        per_token = (8 * c.hidden_size + 4 * width + 2 * (c.q_size + 2 * c.kv_size)) * 4
        reserve = self.config.max_num_batched_tokens * per_token
        if piece_graphs.applies(self, self.config):
            # their pool and buffers, beside an eager step's
            reserve += min(self.config.max_num_batched_tokens, piece_graphs.MAX_TOKENS) * per_token
        reserve += self.config.max_num_seqs * c.vocab_size * 4 * 4 + (1 << 30)
        budget = min(total * self.config.gpu_memory_utilization - own, free) - reserve
        blocks = int(budget // self.kv_spec.bytes_per_block)
        if blocks < 2:
            raise ValueError(
                "not enough device memory for the KV cache; lower max_num_batched_tokens or "
                "raise gpu_memory_utilization"
            )
        return blocks

    # -- one step ------------------------------------------------------------
    def prepare(
        self,
        seqs: list[Sequence],
        num_new: list[int],
        block_tables: list[list[int]],
        as_rows: bool = False,
    ) -> StepInputs:
        """The step's inputs on the device (`prepare_step`)."""
        return prepare_step(seqs, num_new, block_tables, self.block_size, self.device,
                            self.followers, as_rows)  # fmt: skip

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, layer_hook=None) -> torch.Tensor:
        """Final hidden states of every row of the step (always eager)."""
        self.num_tokens_processed += int(inputs.input_ids.shape[0])
        with ops.using(self.kernel_mode):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                              self.backend, layer_hook)  # fmt: skip

    @torch.inference_mode()
    def launch(
        self,
        seqs: list[Sequence],
        num_new: list[int],
        block_tables: list[list[int]],
        force_eager: bool = False,
        layer_hook=None,
    ) -> PendingSample | None:
        """Queues the step on the device and returns its sampled tokens, not yet read
        back (None when no sequence samples this step). Grammar masks are filled
        by the sampler, after the forward pass is queued. `layer_hook`, when given, is
        called with each layer's index once the step has written its KV (a KV handoff;
        the step then runs eagerly)."""
        start = time.perf_counter()
        try:
            eager = force_eager or layer_hook is not None
            return self._launch(seqs, num_new, block_tables, eager, layer_hook)
        finally:
            self.busy_seconds += time.perf_counter() - start
            self.steps += 1

    def rows_pay(self, seqs: list[Sequence], num_new: list[int]) -> bool:
        """Whether this step's prompt chunks run in the decode graphs as rows
        (`step_inputs.rows_pay`; never without graphs or with the flag off)."""
        if self.graphs is None or not self.config.graph_prompt_rows:
            return False
        if not self.model.experts.graph_safe:
            return False
        per_token = self.kv_spec.bytes_per_token
        return step_inputs.rows_pay(seqs, num_new, self.graphs.max_batch, per_token,
                                    self.weight_bytes)  # fmt: skip

    def _launch(self, seqs, num_new, block_tables, force_eager, layer_hook):
        if getattr(self.backend, "split_decodes", None) is not None:
            seqs, num_new, block_tables = step_inputs.decodes_first(seqs, num_new, block_tables)
        as_rows = not force_eager and self.rows_pay(seqs, num_new)
        inputs = self.prepare(seqs, num_new, block_tables, as_rows)
        masks = masks_for(inputs.sample_seqs, self.device)
        rows = int(inputs.input_ids.shape[0])
        if (
            self.graphs is not None
            and not force_eager
            and inputs.meta.decode_only
            and rows <= self.graphs.max_batch
            and self._graphs_ready()
        ):
            self.num_tokens_processed += rows
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            self.model.experts.after_replay()
            if not inputs.sample_seqs:
                return None
            if len(inputs.sample_seqs) < rows:  # rows of prompt chunks sample nothing
                logits = logits.index_select(0, inputs.sample_rows)
            return self.sampler.launch(logits, inputs.sample_seqs, masks)
        if self.stage is not None:
            return self._launch_stage(inputs, masks)
        if self.pieces is not None and not force_eager and rows <= self.pieces.max_tokens:
            self.num_tokens_processed += rows
            with ops.using(self.kernel_mode):
                hidden = self.pieces.run(inputs.input_ids, inputs.positions, inputs.meta,
                                         self.backend)  # fmt: skip
        else:
            hidden = self.forward(inputs, layer_hook)
        if self.mtp_drafts is not None:
            self.mtp_drafts.record(seqs, num_new, block_tables, hidden)
        if not inputs.sample_seqs:
            return None
        with ops.using(self.kernel_mode):
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        return self.sampler.launch(logits, inputs.sample_seqs, masks)

    def _graphs_ready(self) -> bool:
        """Whether this step may replay a decode graph: the expert backend can be
        captured, and the graphs were captured under what it is now (a new expert
        group or placement is captured again here, at a step boundary)."""
        epoch = self.model.experts.graph_epoch()
        if epoch is None:
            return False
        if epoch != self.graphs.epoch:
            with ops.using(self.kernel_mode):
                self.graphs.recapture(epoch)
        return True

    def _launch_stage(self, inputs: StepInputs, masks) -> PipelinedSample | None:
        """Pipeline stage 0: its layers, then the next stage's input; the logits come
        back from the last stage when the step is read back."""
        self.num_tokens_processed += int(inputs.input_ids.shape[0])
        with ops.using(self.kernel_mode):
            carried = self.model.forward_stage(
                inputs.input_ids, None, inputs.positions, self.kv_caches, inputs.meta, self.backend
            )
        self.link.send_carried(*carried)
        if not inputs.sample_seqs:
            return None
        state = parallel_state.current()
        logits = PendingLogits(state, len(inputs.sample_seqs), self.model_config.vocab_size,
                               self.device)  # fmt: skip
        return PipelinedSample(inputs.sample_seqs, logits, self.sampler, masks)
