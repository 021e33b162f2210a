"""The model commands fall back to when none is given: tiny-llama, made once."""

from __future__ import annotations

import os
from pathlib import Path

from engine.make_model import preset_config, write_model


def default_model_dir() -> Path:
    root = Path(os.environ.get("YINIAN_CACHE", Path.home() / ".cache" / "yinian"))
    return root / "models" / "tiny-llama"


def ensure_default_model() -> Path:
    folder = default_model_dir()
    if not (folder / "model.safetensors").is_file():
        write_model(folder, preset_config("tiny-llama"), seed=0)
    return folder
