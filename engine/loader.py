"""Builds a CausalLM on its device and fills its weights.

`safetensors`: from the folder's `model.safetensors` or its sharded index,
checking every tensor's name and shape; anything missing, unexpected or of the
wrong shape is a ValueError naming it. `dummy`: seeded random weights made
directly on the device (vLLM's benchmarking mode), so a large model needs no
file. The random distribution is the one `make-model` writes.

With tensor parallelism (a `ShardPlan`), a rank reads only its part of each
tensor; dummy tensors are made whole and then cut, so ranks hold exactly the
parts of the weights one unsharded engine would.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from basis.model_config import ModelConfig
from engine.models import CausalLM
from engine.models.hf_names import hf_weight_targets, ignored_tensor, routed_expert_names
from engine.models.rotary import cos_sin_table

# Present in some checkpoints, never needed: rotary tables are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{model_dir}: shard(s) named in the index are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} holds no weights (*.safetensors); use load_format='dummy' for "
            "random weights"
        )
    return files


def iter_safetensors(
    files: list[Path], shard=None, keep=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor `keep` wants (all by default), cut to
    this rank's part with a `shard`; the others are not read."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                index = shard.index(name, tuple(part.get_shape()))
                yield name, part[index] if index else part[:]


def random_tensor(hf_name: str, shape, generator: torch.Generator, device, dtype) -> torch.Tensor:
    """The seeded random init both `make-model` and dummy loading use.

    Scaled so activations stay near unit size through every layer and the
    logits spread over a few units: tiny random models then give decisive
    argmaxes, which greedy comparisons against other implementations need.
    """
    t = torch.empty(shape, device=device, dtype=torch.float32)
    if hf_name.endswith("norm.weight"):
        t.normal_(1.0, 0.1, generator=generator)
    elif hf_name.endswith(".bias"):
        t.normal_(0.0, 0.1, generator=generator)
    elif hf_name.endswith("embed_tokens.weight"):
        t.normal_(0.0, 0.25, generator=generator)
    elif hf_name.endswith("e_score_correction_bias"):
        # Spread like the sigmoid scores it shifts, so some shifted scores go negative.
        t.normal_(0.0, 0.3, generator=generator)
    else:
        fan_in = shape[-1]
        std = (2.0 if hf_name == "lm_head.weight" else 1.0) / math.sqrt(fan_in)
        t.normal_(0.0, std, generator=generator)
    return t.to(dtype)


def dummy_expert(config: ModelConfig, names, moe_layer: int, expert: int, device, dtype,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The dummy (gate, up, down) of one routed expert of the `moe_layer`-th MoE layer,
    from a generator of its own: the same numbers in a worker and in an expert service
    that holds it, whichever other experts either makes."""
    h, w = config.hidden_size, config.moe_intermediate_size
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + moe_layer * 100_003 + expert)
    gate, up = (random_tensor(n, (w, h), generator, device, dtype) for n in names[:2])
    return gate, up, random_tensor(names[2], (h, w), generator, device, dtype)


class _DummyExperts:
    """The routed expert tensors among a load's targets: each expert's three made
    together when the first is asked for, each handed out once (then dropped)."""

    def __init__(self, config: ModelConfig, targets, seed: int):
        self.config, self.seed = config, seed
        self.where: dict[str, tuple[int, int, tuple, int]] = {}
        for moe_layer, layer in enumerate(sorted(config.moe_layers) if config.is_moe else ()):
            for expert, names in enumerate(routed_expert_names(config, layer)):
                if names[0] in targets:
                    for i, name in enumerate(names):
                        self.where[name] = (moe_layer, expert, names, i)
        self._made: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def take(self, name: str, device, dtype) -> torch.Tensor:
        moe_layer, expert, names, i = self.where[name]
        key = (moe_layer, expert)
        if key not in self._made:
            made = dummy_expert(self.config, names, moe_layer, expert, device, dtype, self.seed)
            self._made[key] = dict(enumerate(made))
        parts = self._made[key]
        tensor = parts.pop(i)
        if not parts:
            del self._made[key]
        return tensor


def _materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """`model.to_empty(device=device).to(dtype)` without either step's cost: each meta
    tensor becomes an empty one on the device, floating point ones in `dtype` (no float32
    copy first), made from its shape (torch's meta `empty_like` imports sympy on first use:
    a second of CPU in every engine process). Each name gets its own storage, as with
    `to_empty`."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty(t.shape, dtype=kind, device=device)

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(empty(param), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)


def build_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, layer_range=None,
    mtp: bool = False,
) -> CausalLM:  # fmt: skip
    with torch.device("meta"):
        model = CausalLM(config, layer_range, mtp)
    _materialize(model, device, dtype)
    tied = model.embed_tokens is not None and model.lm_head is not None
    if config.tie_word_embeddings and tied:  # _materialize gives each name its own storage
        model.lm_head = model.embed_tokens
    for module in model.modules():  # e.g. DeepSeek's routers stay float32
        for name in getattr(module, "float32_params", ()):
            param = getattr(module, name)
            if param is not None:
                param.data = param.data.float()
    # Rotary tables stay float32 whatever the weights' dtype.
    model.cos_sin = cos_sin_table(config, device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    model_dir: str | Path | None,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    shard=None,
    stage=None,
    mtp: bool = False,
) -> CausalLM:
    """`config` is what the model is built from (a rank's, with a `shard`); a `stage`
    (a StagePlan) builds and loads that pipeline stage's layers only; `mtp` loads
    DeepSeek-V3's multi-token prediction layer too."""
    if load_format != "dummy":
        if model_dir is None:
            raise ValueError("a model folder is required unless load_format='dummy'")
        files = safetensors_files(Path(model_dir))  # fail before allocating the model
    model = build_model(config, device, dtype, stage.layers if stage is not None else None, mtp)
    targets = hf_weight_targets(config, stage, mtp)
    params = dict(model.named_parameters(remove_duplicate=False))
    if load_format == "dummy":
        experts = _DummyExperts(config, targets, seed)
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        for hf_name, target in targets.items():
            view = target.view(params[target.param])
            shape = tuple(view.shape)
            if shard is not None:
                shape = shard.full_shape(hf_name, shape)
            if hf_name in experts.where:  # made per expert, as an expert service makes it
                whole = experts.take(hf_name, device, view.dtype)
            else:
                whole = random_tensor(hf_name, shape, generator, device, view.dtype)
            index = shard.index(hf_name, shape) if shard is not None else None
            view.copy_(whole[index] if index else whole)
        return model
    seen: set[str] = set()
    keep = (lambda n: n in targets or stage.owns(n)) if stage is not None else None
    for name, tensor in iter_safetensors(files, shard, keep):
        target = targets.get(name)
        if target is None:
            if (
                name.endswith(_IGNORED_SUFFIXES)
                or (name == "lm_head.weight" and config.tie_word_embeddings)
                or ignored_tensor(config, name)
            ):
                continue
            raise ValueError(f"unexpected tensor {name!r} in checkpoint for {config.architecture}")
        view = target.view(params[target.param])
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(view.shape)}"
            )
        view.copy_(tensor.to(device=device, dtype=view.dtype))
        seen.add(name)
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks tensor(s) {missing[:5]}{more}")
    return model
