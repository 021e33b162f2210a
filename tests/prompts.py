"""Prompts and what the engine answers to them, for tests that compare one way of
serving against another: random prompts, a plain engine's greedy texts, and the
logits of a prompt and its greedy decodes through the paged cache."""

from __future__ import annotations

import random

import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.kv_cache_manager import CachedPrefix
from engine.sequence import Sequence

PROMPT_LENGTHS = (1, 2, 15, 16, 17, 33, 64, 127, 200, 300)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def quoting_prompts(vocab: int, count: int = 12, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a segment of their own (what prompt lookup drafts from)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        head = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        seg = [rng.randrange(vocab) for _ in range(rng.randrange(3, 12))]
        out.append((head + seg * rng.randrange(2, 6))[:120])
    return out


def greedy_texts(folder, prompts, max_tokens: int) -> list[str]:
    """What a plain engine on the CPU answers to each prompt, greedy and past EOS: what a
    mesh's streams of the same prompts must equal."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(folder, device="cpu").generate(prompts, params)]


def engine_logits(engine: LLMEngine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Runs the engine's model on the prompt, then `steps` greedy decodes, through the
    paged cache; returns the logits of every row of each forward pass."""
    seq = Sequence("probe", "probe", 0, list(prompt), SamplingParams(), frozenset())
    model = engine.runner.model
    out = []
    new = len(prompt)
    cached: CachedPrefix | None = CachedPrefix()  # admitted with nothing cached
    for _ in range(steps + 1):
        assert engine.kv.allocate_slots(seq, new, cached)
        cached = None
        inputs = engine.runner.prepare([seq], [new], [engine.kv.block_ids(seq)])
        logits = model.compute_logits(engine.runner.forward(inputs))
        out.append(logits)
        seq.num_computed_tokens += new
        seq.append_token(int(logits[-1].argmax()))
        new = 1
    engine.kv.free(seq)
    return out
