"""How long a step of a dense model takes on a GPU, for the mock runner: a
roofline over what the step reads and computes, with efficiencies fitted to
measured runs (`bench/fit_step_times.py` writes them under
engine/device_profiles/ from committed H200 results).

A step of rows (each: new tokens, tokens already in its KV cache) takes
    fixed + per_row * rows
    + max(weights read at the copy rate, the rows' matmul FLOPs at the matmul rate)
    + the decode rows' KV read at the copy rate
    + the prompt chunks' attention FLOPs at the attention rate,
    + prompt_step, if a row is a prompt chunk (such a step runs eagerly, outside the
      decode CUDA graphs: its launches, and whatever else the measured prompts took
      beyond the roofline),
each rate a measured ceiling times its fitted efficiency. MoE and MLA models
read and compute differently: the model refuses them (their mocks take the
linear --mock-step-ms / --mock-token-us time)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from basis.model_config import ModelConfig

PROFILES = Path(__file__).parent / "device_profiles"


@dataclass(frozen=True)
class DeviceProfile:
    """A GPU's ceilings (as measured beside the fitted runs) and the fitted rest."""

    name: str
    copy_gbps: float  # device copy bandwidth, GB/s
    matmul_tflops: float  # bf16 matmul rate, TFLOP/s
    weight_efficiency: float  # of copy_gbps, reading the weights (a decode step's matmuls)
    kv_efficiency: float  # of copy_gbps, decode attention reading the KV cache
    matmul_efficiency: float  # of matmul_tflops, a prompt's matmuls
    attention_efficiency: float  # of matmul_tflops, causal prompt attention
    fixed_ms: float  # every step: launches, norms of one row, sampling, the host's share
    per_row_us: float  # every row (a sequence in the step) beyond what the roofline counts
    prompt_step_ms: float  # a step with a prompt chunk in it, beyond the rest
    # the mesh's own part of a first token on that GPU's host (gateway, scheduler, the
    # worker's service, and back), for a simulator that leaves the services out
    service_ms: float = 0.0
    source: str = ""  # what it was fitted to

    @classmethod
    def load(cls, name: str) -> DeviceProfile:
        path = PROFILES / f"{name}.json"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json"))) or "none"
            raise ValueError(f"no device profile {name!r}; known: {known}")
        data = json.loads(path.read_text())
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


@dataclass(frozen=True)
class ModelCosts:
    """What a dense model reads and computes, per step and per token."""

    weight_bytes: float  # read by every step (the layers and the output head)
    flops_per_token: float  # the layers' matmuls for one token
    head_flops: float  # the output head, for each row that samples
    kv_bytes_per_token: float  # one token's keys and values over all layers
    attention_flops: float  # per query token per key token (QK^T and PV, all layers)

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int = 2) -> ModelCosts:
        if config.num_experts or config.kv_lora_rank:
            raise ValueError(
                "the step time model covers dense models with plain attention; MoE and MLA "
                "mocks take --mock-step-ms and --mock-token-us"
            )
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
        layers = config.num_hidden_layers * layer
        head = config.vocab_size * h
        return cls(
            weight_bytes=(layers + head) * dtype_bytes,
            flops_per_token=2.0 * layers,
            head_flops=2.0 * head,
            kv_bytes_per_token=2.0 * config.num_hidden_layers * kv * dtype_bytes,
            attention_flops=4.0 * config.num_hidden_layers * q,
        )


class StepTimeModel:
    def __init__(self, costs: ModelCosts, profile: DeviceProfile):
        self.costs, self.profile = costs, profile
        self._copy = profile.copy_gbps * 1e9
        self._flops = profile.matmul_tflops * 1e12

    def seconds(self, rows: list[tuple[int, int]], sampled: int | None = None) -> float:
        """A step's modelled time: `rows` as (new tokens, tokens cached before them);
        `sampled`: rows that sample (default: every row)."""
        decode_rows = decode_context = 0
        chunks = []
        for n, before in rows:
            if n == 1:
                decode_rows += 1
                decode_context += before + 1
            elif n:
                chunks.append((n, before))
        return self.step_seconds(decode_rows, decode_context, chunks, sampled)

    def step_seconds(
        self,
        decode_rows: int,
        decode_context: int,
        chunks: list[tuple[int, int]],
        sampled: int | None = None,
    ) -> float:
        """The same from totals (a simulator keeps them as its rows change):
        `decode_rows` rows of one new token whose KV caches, the new token's
        included, hold `decode_context` tokens in all; `chunks`, prompt chunks as
        (new tokens, tokens cached before them)."""
        c, p = self.costs, self.profile
        new = decode_rows + sum(n for n, _ in chunks)
        if not new:
            return 0.0
        rows = decode_rows + len(chunks)
        sampled = rows if sampled is None else sampled
        read = c.weight_bytes / (self._copy * p.weight_efficiency)
        flops = new * c.flops_per_token + sampled * c.head_flops
        compute = flops / (self._flops * p.matmul_efficiency)
        # a prompt chunk: each token attends to what is before it, causally
        attention = sum(n * (before + (n + 1) / 2) for n, before in chunks) * c.attention_flops
        kv_s = decode_context * c.kv_bytes_per_token / (self._copy * p.kv_efficiency)
        attention_s = attention / (self._flops * p.attention_efficiency)
        fixed = p.fixed_ms / 1e3 + rows * p.per_row_us / 1e6
        fixed += p.prompt_step_ms / 1e3 if attention else 0.0  # a prompt chunk is in it
        return fixed + max(read, compute) + kv_s + attention_s
