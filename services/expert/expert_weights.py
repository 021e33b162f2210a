"""Reads single routed experts from a checkpoint: each expert's gate, up and
down projections, found by the same name table the engine loads with
(`engine/models/hf_names.py`), so an expert service holds exactly the
numbers a worker would. Only the checkpoint's headers are read up front."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from basis.model_config import ModelConfig
from engine.loader import dummy_expert, safetensors_files
from engine.models.hf_names import routed_expert_names


class ExpertWeights:
    """`dummy`: seeded random experts instead of the checkpoint's (benchmarks of
    full-size models without their weights), each the one a worker loading dummy
    weights makes for it (`engine.loader.dummy_expert`)."""

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
        self._names = {
            (layer, expert): names
            for layer in self.moe_layers
            for expert, names in enumerate(routed_expert_names(config, layer))
        }
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
        gate, up, down = dummy_expert(self.config, names, moe_layer, expert, device, dtype)
        return torch.cat([gate, up], dim=0).contiguous(), down.contiguous()
