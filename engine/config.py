"""Engine options, validated on construction (vLLM's names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_POLICIES = ("fcfs", "priority")
_KERNELS = ("auto", "triton", "torch")


@dataclass(slots=True)
class EngineConfig:
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    load_format: str = "auto"
    seed: int = 0  # for dummy weights and unseeded sampling
    block_size: int = 16
    # KV cache size: a block count, or a fraction of free device memory (CUDA) /
    # a byte budget (CPU) when num_gpu_blocks is None.
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 256 * 1024 * 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    max_prefill_chunk: int | None = None  # cap on one sequence's prompt tokens per step
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # "auto": Triton kernels on CUDA, torch references on CPU; "triton": kernels
    # everywhere (CPU through Triton's interpreter); "torch": references everywhere.
    kernels: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    # Run every prefill shape bucket once at start-up (CUDA kernels only), so that
    # no request waits for kernel compilation or autotuning.
    warmup: bool = True
    # Queue each step on the device before reading the last one back, so host work
    # overlaps device work (None: on for CUDA, off on CPU where nothing overlaps).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
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
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {self.num_gpu_blocks}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**options)
