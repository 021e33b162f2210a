"""A runner without a model: each step sleeps the time a step is modelled to take
(a fixed part and a part per new token) and samples its tokens from a fixed table
of random logits, chosen by each sequence's last prompt token and length, so a
prompt always gets the same answer. Everything around it is the engine's own:
scheduling, the paged KV cache with its prefix hits, block events and tiers,
sampling parameters, grammars and logprobs. A mesh of mock workers measures what
the services cost, on any machine (`--model-runner mock`)."""

from __future__ import annotations

import time

import torch

from basis.model_config import ModelConfig
from engine.config import EngineConfig
from engine.grammar import masks_for
from engine.kv_cache_spec import KVCacheSpec
from engine.sampler import PendingSample, Sampler
from engine.sequence import Sequence

_ROWS = 61  # rows of the logits table (prime: lengths spread over all of them)


class _NoModel:
    """What the engine reaches on `runner.model`: the disaggregation's layer hook."""

    layer_hook = None


class MockRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir=None):
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError("the mock runner runs on one rank: tensor and pipeline sizes of 1")
        self.model_config = model_config
        self.config = config
        self.device = torch.device("cpu")
        self.dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.block_size = config.block_size
        self.kernel_mode, self.backend, self.graphs = "torch", None, None
        self.kv_spec = KVCacheSpec.for_model(model_config, self.block_size, self.dtype)
        self.num_blocks = config.num_gpu_blocks or self.kv_spec.blocks_in(config.cpu_kv_cache_bytes)
        self.kv_caches = self.kv_spec.allocate(self.num_blocks, self.device)
        self.model: _NoModel | None = _NoModel()
        self.sampler = Sampler(self.device, config.seed)
        table = torch.Generator().manual_seed(config.seed)
        self.logits = torch.randn(_ROWS, model_config.vocab_size, generator=table) * 4
        self.step_seconds = config.mock_step_ms / 1e3
        self.token_seconds = config.mock_token_us / 1e6
        self.num_tokens_processed = 0
        self.busy_seconds, self.steps = 0.0, 0

    def launch(
        self,
        seqs: list[Sequence],
        num_new: list[int],
        block_tables: list[list[int]],
        force_eager: bool = False,
    ) -> PendingSample | None:
        """Samples the step's tokens, then sleeps out the rest of its modelled time."""
        start = time.perf_counter()
        total = sum(num_new)
        self.num_tokens_processed += total
        sampled = [s for s, n in zip(seqs, num_new) if s.num_computed_tokens + n == s.num_tokens]
        out = None
        if sampled:
            rows = torch.tensor(
                [(s.prompt_token_ids[-1] * 31 + s.num_tokens) % _ROWS for s in sampled]
            )
            logits = self.logits.index_select(0, rows)
            out = self.sampler.launch(logits, sampled, masks_for(sampled))
        left = self.step_seconds + total * self.token_seconds - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        self.busy_seconds += time.perf_counter() - start
        self.steps += 1
        return out

    def parallel_stats(self) -> list[dict]:
        return [{"rank": 0, "stage": 0, "busy_seconds": self.busy_seconds,
                 "collective_seconds": 0.0, "steps": self.steps}]  # fmt: skip

    def on_fatal(self, callback) -> None:
        pass  # one process: nothing else can fail apart from it

    def set_expert_backend(self, experts) -> None:
        raise ValueError("the mock runner has no experts to serve from expert services")

    def close(self) -> None:
        self.model = None
        self.kv_caches.clear()
