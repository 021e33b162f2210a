"""The model's shape, read from a Hugging Face `config.json`.

Accepts both the 4.x spelling (`rope_theta` + `rope_scaling`, `num_experts`)
and the 5.x one (`rope_parameters`, `num_local_experts`). DeepSeek-V2/V3 add
multi-head latent attention (MLA) and their own expert routing; their fields
are read by `basis.deepseek_config`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from basis.deepseek_config import DEEPSEEK_ARCHITECTURES, deepseek_fields

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    *DEEPSEEK_ARCHITECTURES,
)

_DTYPES = {"float32", "bfloat16", "float16"}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q, k, v projections
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str = "silu"
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # DeepSeek expert routing: shared experts beside the routed ones; scores by
    # softmax or sigmoid (+ a per-expert bias for the choice only); experts in
    # n_group groups of which topk_group are kept; weights scaled by
    # routed_scaling_factor.
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention; kv_lora_rank == 0 means ordinary attention.
    # head_dim is then the rotary width (qk_rope_head_dim), as in transformers.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary pairs are adjacent dims (x0, x1), (x2, x3), ...
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def latent_dim(self) -> int:
        """MLA: what the cache holds per token and layer, the latent and its rotary part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.qk_head_dim

    @property
    def kv_size(self) -> int:
        """Keys of one token (for MLA, the per-head keys the prefill expands to)."""
        return self.num_key_value_heads * self.qk_head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale. DeepSeek's yarn multiplies it by mscale(factor,
        mscale_all_dim) squared: 1.59 for V2-Lite, 1.87 for V3 (the rotary
        table's own attention factor is a different number, 1.0 for both)."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope_scaling or {}
        factor, mscale_all_dim = float(rope.get("factor", 1.0)), rope.get("mscale_all_dim")
        if self.is_mla and rope.get("rope_type") == "yarn" and mscale_all_dim and factor > 1:
            scale *= (0.1 * float(mscale_all_dim) * math.log(factor) + 1.0) ** 2
        return scale

    def check_token_ids(self, token_ids) -> None:
        """ValueError for an id that is not an int in [0, vocab_size)."""
        vocab = self.vocab_size
        # the common case at C speed (an 8k-token prompt in well under a millisecond)
        if set(map(type, token_ids)) <= {int} and (
            not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab)
        ):
            return
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")

    def context_length(self, max_model_len: int | None = None) -> int:
        """The context a deployment serves: `max_model_len` if given, never past
        what the model was trained for."""
        limit = self.max_position_embeddings
        return min(max_model_len or limit, limit)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def attention_parameters(self) -> int:
        """One layer's attention matrices."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.is_mla:
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        q_rank = self.q_lora_rank
        q = h * self.q_size if q_rank is None else h * q_rank + q_rank * self.q_size
        kv = h * self.latent_dim + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        return q + kv + heads * self.v_head_dim * h

    def moe_parameters(self, experts: int) -> int:
        """A MoE layer's matrices with `experts` of its routed experts (and all shared)."""
        h, w = self.hidden_size, self.moe_intermediate_size
        return (experts + self.n_shared_experts) * 3 * h * w + self.num_experts * h

    def num_parameters(self) -> int:
        """Parameter count (matrices), used for memory planning and roofline figures."""
        h, layers = self.hidden_size, self.num_hidden_layers
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.moe_parameters(self.num_experts)
        attn = self.attention_parameters()
        body = sum(attn + (moe_mlp if self.is_moe_layer(i) else dense_mlp) for i in range(layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return body + embed

    def active_parameters(self) -> int:
        """Parameters one token's decode reads: every layer's attention, dense MLPs,
        shared experts, routers, its top-k routed experts and the LM head (of the
        input embedding only its own row, left out). The batch-1 bandwidth floor."""
        h, layers = self.hidden_size, self.num_hidden_layers
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.moe_parameters(self.num_experts_per_tok)
        attn = self.attention_parameters()
        body = sum(attn + (moe_mlp if self.is_moe_layer(i) else dense_mlp) for i in range(layers))
        return body + self.vocab_size * h

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quantized = cfg.get("quantization_config")
        if quantized:
            method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
            raise ValueError(
                f"the checkpoint is quantized ({method}); only unquantized weights are served "
                "(float32, bfloat16 or float16)"
            )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"config.json lacks required field {key!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        extra = deepseek_fields(arch, cfg, heads) if arch in DEEPSEEK_ARCHITECTURES else {}
        # MLA: transformers' head_dim is the rotary width.
        head_dim = extra.get("qk_rope_head_dim") or cfg.get("head_dim") or hidden // heads
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only silu is supported")
        rope_theta, rope_scaling = _rope(cfg)
        layers = int(cfg["num_hidden_layers"])
        num_experts, moe_layers = _moe_layout(arch, cfg, layers)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if extra else int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act="silu",
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)) if num_experts else 0,
            moe_intermediate_size=_expert_width(arch, cfg) if num_experts else 0,
            # transformers' DeepSeek-V2 never renormalises, whatever norm_topk_prob says.
            norm_topk_prob=arch == "MixtralForCausalLM"
            or (arch != "DeepseekV2ForCausalLM" and bool(cfg.get("norm_topk_prob", False))),
            moe_layers=moe_layers,
            torch_dtype=dtype if dtype in _DTYPES else "float32",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
            **extra,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a model folder: {path.name} not found")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        config = cls.from_dict(cfg)
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        return config


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind == "yarn":
        if "factor" not in scaling:
            raise ValueError("rope_scaling of type yarn lacks 'factor'")
        original = scaling.get("original_max_position_embeddings")
        original = original or cfg.get("max_position_embeddings", 2048)
        return theta, dict(scaling, rope_type="yarn", original_max_position_embeddings=original)
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3, yarn")
    required = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in required:
        if key not in scaling:
            raise ValueError(f"rope_scaling of type llama3 lacks {key!r}")
    return theta, dict(scaling, rope_type="llama3")


def _moe_layout(arch: str, cfg: dict, layers: int) -> tuple[int, tuple[int, ...]]:
    if arch == "MixtralForCausalLM":
        return int(cfg.get("num_local_experts", 8)), tuple(range(layers))
    if arch == "Qwen3MoeForCausalLM":
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        moe = tuple(
            i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
        )
        return experts, moe
    if arch in DEEPSEEK_ARCHITECTURES:
        # transformers: MoE from layer first_k_dense_replace on (moe_layer_freq is not read).
        experts = int(cfg.get("n_routed_experts") or 0)
        first = int(cfg.get("first_k_dense_replace") or 0)
        return experts, tuple(range(first, layers)) if experts else ()
    return 0, ()


def _expert_width(arch: str, cfg: dict) -> int:
    if arch == "MixtralForCausalLM":
        return int(cfg["intermediate_size"])
    return int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
