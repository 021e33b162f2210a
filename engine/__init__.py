"""yinian's inference core: models, paged KV cache, continuous batching, sampling.

from engine import LLM, SamplingParams
llm = LLM(model="path/to/hf-folder")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562): `import engine.config` and the command line's help
# need no torch.
_WHERE = {
    "SamplingParams": "basis.sampling_params",
    "StructuredOutput": "basis.structured_output",
    "AsyncLLM": "engine.async_llm",
    "EngineConfig": "engine.config",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "Logprob": "engine.sequence",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what type checkers and editors see
    from basis.sampling_params import SamplingParams as SamplingParams
    from basis.structured_output import StructuredOutput as StructuredOutput
    from engine.async_llm import AsyncLLM as AsyncLLM
    from engine.config import EngineConfig as EngineConfig
    from engine.llm import LLM as LLM
    from engine.llm_engine import LLMEngine as LLMEngine
    from engine.outputs import CompletionOutput as CompletionOutput
    from engine.outputs import RequestOutput as RequestOutput
    from engine.sequence import Logprob as Logprob
