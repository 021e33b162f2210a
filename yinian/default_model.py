"""The model commands fall back to when none is given: pydoc-llama, a Llama of
about a million parameters trained on the interpreter's own documentation
(`python -m yinian.train_default_model`), committed with its tokenizer in
yinian/models/pydoc-llama. It writes English-like text about Python; the
random-weight presets (`yinian make-model`) remain for benchmarks."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "models" / "pydoc-llama"


def default_model_dir() -> Path:
    return DEFAULT_MODEL


def ensure_default_model() -> Path:
    if not (DEFAULT_MODEL / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {DEFAULT_MODEL}; "
            "train it with: python -m yinian.train_default_model"
        )
    return DEFAULT_MODEL
