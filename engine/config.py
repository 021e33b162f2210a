"""Engine options, validated on construction (vLLM's names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

from basis.flags import not_a_flag, setting
from engine.step_time_model import profile_names

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_QUANTIZATIONS = ("none",)  # weights run in --dtype; no quantized kernels yet
_POLICIES = ("fcfs", "priority")
_KERNELS = ("auto", "triton", "torch")
_BACKUPS = ("all", "reused")
_RUNNERS = ("model", "mock")
_SPECULATIVE = ("ngram", "trie", "mtp")


@dataclass(slots=True)
class EngineConfig:
    dtype: str = setting(
        "auto",
        "weights and activations: auto (the checkpoint's), float32, bfloat16 or float16",
        choices=_DTYPES,
    )
    device: str = setting("auto", "cuda, cuda:N or cpu (auto: cuda when available)")
    load_format: str = setting(
        "auto",
        "safetensors, or dummy (random weights: config and tokenizer only)",
        choices=_LOAD_FORMATS,
    )
    quantization: str = setting(
        "none",
        "weight quantization: none is supported (weights run in --dtype); a quantized "
        "checkpoint (fp8, awq, gptq, ...) is refused",
        choices=_QUANTIZATIONS,
    )
    seed: int = setting(0, "seed for dummy weights and unseeded sampling")
    block_size: int = setting(16, "tokens per KV cache block")
    # KV cache size: a block count, or a fraction of free device memory (CUDA) /
    # a byte budget (CPU) when num_gpu_blocks is None.
    num_gpu_blocks: int | None = setting(
        None, "KV cache blocks (default: sized from memory, see the next two)"
    )
    gpu_memory_utilization: float = setting(
        0.9, "fraction of the GPU's memory the engine may use (weights, KV cache, graphs)"
    )
    cpu_kv_cache_bytes: int = setting(256 * 1024 * 1024, "KV cache bytes on the CPU")
    max_model_len: int | None = setting(
        None, "context length served (default: the model's max_position_embeddings)"
    )
    max_num_seqs: int = setting(256, "sequences in one batch at most")
    max_num_batched_tokens: int = setting(8192, "tokens in one step at most")
    enable_chunked_prefill: bool = setting(True, "split long prompts over several steps")
    max_prefill_chunk: int | None = setting(None, "cap on one sequence's prompt tokens per step")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of equal prefixes")
    host_kv_cache_gb: float | None = setting(
        None,
        "host tier of the KV cache, in GiB: blocks that leave the device wait here to be "
        "reused (default: a fifth of the available host memory, at most 16; 0: off)",
    )
    host_kv_backup: str | None = setting(
        None,
        "what the host tier copies: all (every block the device frees, at once) or reused "
        "(blocks a prompt has hit, when the device evicts them). Default: all when "
        "--host-kv-cache-gb is given or the tier holds at least the device pool's blocks; "
        "reused otherwise, so that a tier smaller than the device pool does not copy every "
        "request's KV only to evict it",
        choices=_BACKUPS,
    )
    scheduling_policy: str = setting(
        "fcfs", "fcfs, or priority (lower value first)", choices=_POLICIES
    )
    # "auto": Triton kernels on CUDA, torch references on CPU; "triton": kernels
    # everywhere (CPU through Triton's interpreter); "torch": references everywhere.
    kernels: str = setting(
        "auto", "auto (Triton on CUDA, torch on CPU), triton or torch", choices=_KERNELS
    )
    enforce_eager: bool = setting(False, "no CUDA graphs")
    graph_prompt_rows: bool = setting(
        True,
        "run a step of short prompt chunks (a short prompt, a few tokens after a long cached "
        "prefix) in the decode CUDA graphs, a row per token, where the rows' extra attention "
        "reads cost less than launching the eager pass (ModelRunner.rows_pay)",
    )
    piece_graphs: bool | None = setting(
        None,
        "run a step with prompt tokens (up to 2,048) as CUDA graphs cut at the attention, "
        "which runs eagerly between them (engine/piece_graphs.py; dense attention models on "
        "one rank; default: on for CUDA)",
    )
    tensor_parallel_size: int = setting(
        1, "ranks a layer's weights are split over (one process and device each)"
    )
    pipeline_parallel_size: int = setting(1, "stages the layers are split over")
    # Run every prefill shape bucket once at start-up (CUDA kernels only), so that
    # no request waits for kernel compilation or autotuning.
    warmup: bool = setting(True, "run every prefill shape once at start-up (CUDA)")
    # Queue each step on the device before reading the last one back, so host work
    # overlaps device work (None: on for CUDA, off on CPU where nothing overlaps).
    async_scheduling: bool | None = setting(
        None, "queue each step before reading the last one back (default: on for CUDA)"
    )
    # Ping-pong: one micro-batch's attention runs while another's tokens are with
    # the experts (pays with expert services; engine/micro_batch.py).
    micro_batches: int = setting(
        1, "split a step into this many micro-batches when it has enough tokens (1: off)"
    )
    micro_batch_decode_tokens: int = setting(32, "an all-decode step splits from this many tokens")
    micro_batch_prefill_tokens: int = setting(512, "any other step splits from this many tokens")
    # A mock runner reads no weights: each step takes a modelled time and answers with
    # deterministic tokens, the KV cache and its events as with a model, so the
    # services around an engine are measured on any machine (engine/mock_runner.py).
    model_runner: str = setting(
        "model",
        "model (run the checkpoint's weights) or mock (no weights: each step sleeps "
        "--mock-step-ms plus --mock-token-us a token, and answers with deterministic tokens)",
        choices=_RUNNERS,
    )
    mock_step_ms: float = setting(5.0, "mock runner: each step's fixed time, ms")
    mock_token_us: float = setting(20.0, "mock runner: each new token's time in a step, us")
    mock_device: str | None = setting(
        None,
        "mock runner: a fitted device profile (h200) whose roofline of the model's weights, KV "
        "reads and FLOPs gives each step's time, in place of --mock-step-ms/--mock-token-us",
    )
    mock_time_scale: float = setting(
        1.0, "mock runner: every step takes this many times its modelled time (slows a simulation)"
    )
    # Output text for every request (the engine API's users read it); False: only for
    # requests with stop strings, which the engine must find (a mesh's workers: the
    # gateway detokenizes what they stream).
    detokenize: bool = not_a_flag(lambda: True)
    # Speculative decoding without a draft model (engine/speculative.py).
    speculative_method: str | None = setting(
        None,
        "draft tokens and verify them in one step: ngram (prompt lookup in the request's own "
        "tokens), trie (that, then the worker's recent requests) or mtp (a DeepSeek-V3 "
        "checkpoint's multi-token prediction layer); off by default",
        choices=_SPECULATIVE,
    )
    num_speculative_tokens: int = setting(4, "speculative decoding: drafts per sequence a step")
    prompt_lookup_min: int = setting(2, "speculative decoding: shortest suffix a draft matches")
    prompt_lookup_max: int = setting(5, "speculative decoding: longest suffix a draft matches")
    # Benchmarks only: skews routing so expert balancing has something to balance.
    router_skew: float = setting(
        0.0,
        "adds s*log(1/rank) to each MoE router's logits, ranks a seeded per-layer "
        "shuffle of the experts: Zipf-shaped expert load (0: off)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported; supported: "
                f"{', '.join(_QUANTIZATIONS)} (weights run in --dtype)"
            )
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.kernels not in _KERNELS:
            raise ValueError(f"kernels must be one of {_KERNELS}, got {self.kernels!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.micro_batch_decode_tokens < 1 or self.micro_batch_prefill_tokens < 1:
            raise ValueError("micro-batch token thresholds must be >= 1")
        if self.model_runner not in _RUNNERS:
            raise ValueError(f"model_runner must be one of {_RUNNERS}, got {self.model_runner!r}")
        if self.mock_step_ms < 0 or self.mock_token_us < 0:
            raise ValueError("mock_step_ms and mock_token_us must be >= 0")
        if not self.mock_time_scale > 0:
            raise ValueError(f"mock_time_scale must be > 0, got {self.mock_time_scale}")
        if self.mock_device is not None and self.mock_device not in profile_names():
            known = ", ".join(profile_names())
            raise ValueError(f"mock_device {self.mock_device!r} is not a profile; known: {known}")
        if self.router_skew < 0:
            raise ValueError(f"router_skew must be >= 0, got {self.router_skew}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {self.num_gpu_blocks}")
        if self.host_kv_cache_gb is not None and self.host_kv_cache_gb < 0:
            raise ValueError(f"host_kv_cache_gb must be >= 0, got {self.host_kv_cache_gb}")
        if self.host_kv_backup is not None and self.host_kv_backup not in _BACKUPS:
            raise ValueError(
                f"host_kv_backup must be one of {_BACKUPS}, got {self.host_kv_backup!r}"
            )
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")
        self._check_speculation()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _check_speculation(self) -> None:
        if self.speculative_method is None:
            return
        if self.speculative_method not in _SPECULATIVE:
            raise ValueError(
                f"speculative_method must be one of {_SPECULATIVE}, got {self.speculative_method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError("num_speculative_tokens must be below max_num_batched_tokens")
        conflicts = {
            "pipeline_parallel_size": self.pipeline_parallel_size != 1,
            "model_runner": self.model_runner != "model",
            "async_scheduling": self.async_scheduling is True,  # the next step waits for this
        }
        for name, clash in conflicts.items():
            if clash:
                raise ValueError(
                    f"speculative decoding does not run with {name}={getattr(self, name)!r}"
                )

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**options)
