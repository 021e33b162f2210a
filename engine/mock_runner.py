"""A runner without a model: each step takes the time a step is modelled to take
on a modelled device (queued behind the steps before it; its tokens are read back
once it is done there) and samples its tokens from a fixed table
of random logits, chosen by each sequence's last prompt token and length, so a
prompt always gets the same answer. The modelled time is linear (--mock-step-ms,
--mock-token-us) or a fitted GPU's (--mock-device: engine/step_time_model.py),
times --mock-time-scale. Everything around it is the engine's own:
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
from engine.step_time_model import DeviceProfile, ModelCosts, StepTimeModel

_ROWS = 61  # rows of the logits table (prime: lengths spread over all of them)


class _NoModel:
    """What stands on `runner.model` until the runner is closed (None then)."""


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
        # the mock's steps never write it: memory the OS hands out only where something
        # touches it (a block loaded from a tier or received from a prefill worker)
        self.kv_caches = list(
            torch.empty(
                (self.kv_spec.num_layers, *self.kv_spec.layer_shape(self.num_blocks)),
                dtype=self.dtype,
            ).unbind(0)
        )
        self.model: _NoModel | None = _NoModel()
        self.sampler = Sampler(self.device, config.seed)
        table = torch.Generator().manual_seed(config.seed)
        self.logits = torch.randn(_ROWS, model_config.vocab_size, generator=table) * 4
        self.step_seconds = config.mock_step_ms / 1e3
        self.token_seconds = config.mock_token_us / 1e6
        self.time_scale = config.mock_time_scale
        self.time_model = None  # modelled on a device's profile (the GPU's bf16), if named
        if config.mock_device is not None:
            profile = DeviceProfile.load(config.mock_device)
            self.time_model = StepTimeModel(ModelCosts.of(model_config), profile)
        self.num_tokens_processed = 0
        self.busy_seconds, self.steps = 0.0, 0
        self.device_free_at = 0.0  # when the modelled device is done with what was queued

    def launch(
        self,
        seqs: list[Sequence],
        num_new: list[int],
        block_tables: list[list[int]],
        force_eager: bool = False,
        layer_hook=None,
    ) -> PendingSample | None:
        """Samples the step's tokens and queues the step on a modelled device: it
        runs once the steps queued before it have, for its modelled time; its
        tokens are read back (`wait`, `result`) when it is done there."""
        total = sum(num_new)
        self.num_tokens_processed += total
        sampled = [s for s, n in zip(seqs, num_new) if s.num_computed_tokens + n == s.num_tokens]
        seconds = self.modelled_seconds(seqs, num_new, len(sampled))
        self.device_free_at = max(time.perf_counter(), self.device_free_at) + seconds
        self.busy_seconds += seconds
        self.steps += 1
        if layer_hook is not None:  # a KV handoff: every layer is "written" now
            for layer in range(len(self.kv_caches)):
                layer_hook(layer)
        if not sampled:
            return None
        rows = torch.tensor([(s.prompt_token_ids[-1] * 31 + s.num_tokens) % _ROWS for s in sampled])
        logits = self.logits.index_select(0, rows)
        return _Modelled(
            self.sampler.launch(logits, sampled, masks_for(sampled)), self.device_free_at
        )

    def modelled_seconds(self, seqs: list[Sequence], num_new: list[int], sampled: int) -> float:
        if self.time_model is None:
            seconds = self.step_seconds + sum(num_new) * self.token_seconds
        else:
            rows = [(n, s.num_computed_tokens) for s, n in zip(seqs, num_new)]
            seconds = self.time_model.seconds(rows, sampled)
        return seconds * self.time_scale

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


class _Modelled:
    """A step's sampled tokens, read back once the modelled device has run the step."""

    def __init__(self, sample: PendingSample, done_at: float):
        self._sample, self._done_at = sample, done_at
        self.seqs, self.tokens = sample.seqs, sample.tokens

    def finish(self) -> _Modelled:
        self._sample.finish()
        return self

    def wait(self) -> None:
        left = self._done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def token_ids(self) -> list[int]:
        self.wait()
        return self._sample.token_ids()

    def result(self):
        self.wait()
        return self._sample.result()
