"""`yinian make-model`: Hugging Face checkpoint folders with seeded random
weights and a real tokenizer.

Tiny presets (a few MB, for CPU tests) are written with their weights. The
full-size presets are written as config and tokenizer only unless weights are
asked for; engines load them with load_format="dummy".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from basis.model_config import ModelConfig
from engine.deepseek_presets import DEEPSEEK_PRESETS
from engine.loader import random_tensor
from engine.models.hf_names import hf_weight_targets
from engine.tokenizer_builder import write_tokenizer

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict] = {
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE, original_max_position_embeddings=1024),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    "tiny-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    **DEEPSEEK_PRESETS,
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(_LLAMA3_ROPE),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

TINY_PRESETS = ("tiny-llama", "tiny-qwen3", "tiny-moe", "tiny-deepseek-v2", "tiny-deepseek-v3")
_TOKENIZER_STYLE = {"llama": "llama3", "mistral": "llama3"}  # by model_type; default qwen
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 2 * 1024**3


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return json.loads(json.dumps(PRESETS[name]))


def write_model(
    out_dir: str | Path,
    config: dict,
    seed: int = 0,
    weights: bool = True,
    dtype: str | None = None,
    tokenizer: bool = True,
) -> Path:
    """Writes config.json, generation_config.json, the tokenizer and (if asked) weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        config["torch_dtype"] = dtype
    config.setdefault("transformers_version", "4.56.0")
    if tokenizer:
        style = _TOKENIZER_STYLE.get(config.get("model_type", ""), "qwen")
        ids = write_tokenizer(out, config["vocab_size"], style=style, seed=seed)
        config["bos_token_id"] = ids["bos_token_id"]
        config["eos_token_id"] = ids["eos_token_id"]
    parsed = ModelConfig.from_dict(config)  # rejects what the engine could not load
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config.get("bos_token_id"), "do_sample": False}
    if config.get("eos_token_id") is not None:
        generation["eos_token_id"] = config["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if weights:
        _write_weights(out, parsed, _DTYPES[parsed.torch_dtype], seed)
    return out


def _write_weights(out: Path, config: ModelConfig, dtype: torch.dtype, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    targets = hf_weight_targets(config)
    shapes = _target_shapes(config, targets)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        tensor = random_tensor(name, shape, generator, "cpu", dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {
        "metadata": {
            "total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())
        },
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _target_shapes(config: ModelConfig, targets) -> dict[str, tuple[int, ...]]:
    """Shape of each checkpoint tensor, read off a model built on the meta device."""
    from engine.models import CausalLM

    with torch.device("meta"):
        model = CausalLM(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: tuple(t.view(params[t.param]).shape) for name, t in targets.items()}
