"""Reads single routed experts from a checkpoint: each expert's gate, up and
down projections, found by the same name table the engine loads with
(`engine/models/hf_names.py`), so an expert service holds exactly the
numbers a worker would. Only the checkpoint's headers are read up front."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from basis.model_config import ModelConfig
from engine.loader import random_tensor, safetensors_files
from engine.models.hf_names import hf_weight_targets


class ExpertWeights:
    """`dummy`: seeded random experts instead of the checkpoint's (benchmarks of
    full-size models without their weights; the outputs then differ from a
    worker's own experts)."""

    def __init__(self, model_dir: str | Path, config: ModelConfig, dummy: bool = False):
        if not config.is_moe:
            raise ValueError(f"{model_dir} is not a mixture-of-experts model")
        self.config, self.dummy = config, dummy
        self.moe_layers = sorted(config.moe_layers)
        files = [] if dummy else safetensors_files(Path(model_dir))
        self._file_of: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    self._file_of[name] = path
        # (model layer, expert) -> checkpoint names of (gate, up, down)
        self._names: dict[tuple[int, int], list[str | None]] = {}
        width = config.moe_intermediate_size
        for name, target in hf_weight_targets(config).items():
            parts = target.param.split(".")
            if len(parts) != 4 or parts[2] != "mlp" or parts[3] not in ("w13", "w2"):
                continue
            layer, expert = int(parts[1]), target.index[0]
            names = self._names.setdefault((layer, expert), [None, None, None])
            if parts[3] == "w2":
                names[2] = name
            else:
                names[0 if target.index[1].start == 0 else 1] = name
            assert target.index[1:] in ((), (slice(0, width),), (slice(width, 2 * width),))
        missing = (
            []
            if dummy
            else [n for names in self._names.values() for n in names if n not in self._file_of]
        )
        if missing:
            raise ValueError(f"{model_dir}: checkpoint lacks expert tensor(s) {missing[:3]}")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def read(self, moe_layer: int, expert: int, dtype: torch.dtype, device) -> tuple:
        """(w13 [2I, H], w2 [H, I]) of one expert of the moe_layer-th MoE layer."""
        if not 0 <= moe_layer < self.num_moe_layers or not 0 <= expert < self.config.num_experts:
            raise ValueError(f"no expert {expert} in MoE layer {moe_layer}")
        names = self._names[(self.moe_layers[moe_layer], expert)]
        if self.dummy:
            return self._random(names, moe_layer, expert, dtype, device)
        gate, up, down = (self._tensor(n) for n in names)
        w13 = torch.cat([gate, up], dim=0).to(device=device, dtype=dtype).contiguous()
        return w13, down.to(device=device, dtype=dtype).contiguous()

    def _tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self._file_of[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def _random(self, names, moe_layer: int, expert: int, dtype, device) -> tuple:
        c = self.config
        h, w = c.hidden_size, c.moe_intermediate_size
        generator = torch.Generator(device=device).manual_seed(moe_layer * 100_003 + expert)
        gate, up = (random_tensor(n, (w, h), generator, device, dtype) for n in names[:2])
        down = random_tensor(names[2], (h, w), generator, device, dtype)
        return torch.cat([gate, up], dim=0).contiguous(), down.contiguous()
