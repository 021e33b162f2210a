"""yinian's inference core: models, paged KV cache, continuous batching, sampling.

from engine import LLM, SamplingParams
llm = LLM(model="path/to/hf-folder")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""

from basis.sampling_params import SamplingParams
from basis.structured_output import StructuredOutput
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Logprob

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
]
