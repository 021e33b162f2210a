"""Model folders for the GPU scripts, written into a run's scratch folder.

A tiny preset (`engine.make_model.TINY_PRESETS`) gets seeded random weights, so
two engines (or two runs) load the same values; a full-size preset gets its
config and tokenizer only and loads with dummy weights (speed does not depend
on the values).
"""

from __future__ import annotations

from pathlib import Path

from engine.make_model import TINY_PRESETS, preset_config, write_model


def preset_folder(root: Path, preset: str, seed: int = 1) -> tuple[Path, str]:
    """(the model folder, its engine load format)."""
    folder = root / preset
    tiny = preset in TINY_PRESETS
    if not (folder / "config.json").is_file():
        write_model(folder, preset_config(preset), seed=seed, weights=tiny)
    return folder, "auto" if tiny else "dummy"
