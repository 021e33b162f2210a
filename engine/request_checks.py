"""What a request must be before the engine takes it: a prompt it can tokenize,
sampling params it can honour, and a length that fits the context and the KV
cache. Every failure is a ValueError, raised before anything changes."""

from __future__ import annotations

from basis.model_config import ModelConfig
from basis.sampling_params import SamplingParams


def tokenize(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids, not text")
        return tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
        )
    return list(prompt)


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    model_config: ModelConfig,
    max_model_len: int,
    tokenizer,
    kv,
) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    model_config.check_token_ids(prompt_ids)
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens, which leaves no room to generate "
            f"within the model's context length of {max_model_len}"
        )
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none")
    if params.structured_output is not None and tokenizer is None:
        raise ValueError("structured outputs need a tokenizer; this model has none")
    outside = [t for t in params.logit_bias if t >= model_config.vocab_size]
    if outside:
        raise ValueError(
            f"logit_bias names token ids outside the vocabulary "
            f"(size {model_config.vocab_size}): {outside[:5]}"
        )
    total = min(len(prompt_ids) + (params.max_tokens or max_model_len), max_model_len)
    if kv.blocks_needed(total) > kv.pool.num_usable_blocks:
        raise ValueError(
            f"the request needs up to {total} tokens of KV cache; the engine holds "
            f"{kv.pool.num_usable_blocks * kv.block_size}"
        )
