"""Hugging Face transformers as the correctness oracle for tiny random models."""

from __future__ import annotations

import inspect

import torch

# Tiny configs of every supported architecture (the presets cover three).
ARCH_CONFIGS: dict[str, dict] = {
    "llama-tied": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 384,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """transformers' generate on one prompt alone, greedy."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _cache_name(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.x."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def hf_logits(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Logits of every prompt position, then of `steps` greedy decode steps (with KV cache)."""
    name = _cache_name(model)
    out = model(torch.tensor([prompt]), use_cache=True)
    logits = [out.logits[0].float()]
    token = out.logits[0, -1].argmax()
    for _ in range(steps):
        out = model(token.view(1, 1), use_cache=True, **{name: getattr(out, name)})
        logits.append(out.logits[0].float())
        token = out.logits[0, -1].argmax()
    return logits
