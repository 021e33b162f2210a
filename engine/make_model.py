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
from engine.loader import random_tensor
from engine.models.hf_names import hf_weight_targets
from engine.models.mtp import has_mtp
from engine.presets import PRESETS, TINY_PRESETS, preset_config  # noqa: F401 - named from here too
from engine.tokenizer_builder import write_tokenizer

_TOKENIZER_STYLE = {"llama": "llama3", "mistral": "llama3"}  # by model_type; default qwen
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_BYTES = 2 * 1024**3


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
    mtp = has_mtp(config)  # a DeepSeek-V3 preset's multi-token prediction layer, last
    targets = hf_weight_targets(config, mtp=mtp)
    shapes = _target_shapes(config, targets, mtp)
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


def _target_shapes(config: ModelConfig, targets, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Shape of each checkpoint tensor, read off a model built on the meta device."""
    from engine.models import CausalLM

    with torch.device("meta"):
        model = CausalLM(config, mtp=mtp)
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: tuple(t.view(params[t.param]).shape) for name, t in targets.items()}
