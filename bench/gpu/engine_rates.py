"""What the engine scripts measure of an `LLM`: decode steps at a batch size and
context (tokens/s, ms/step), and offline throughput of random prompts; the
random prompts themselves.

Decode is measured in steps of `LLMEngine.step` once every sequence has finished
its prefill, a few steps after warming up that batch size; the requests are
aborted after, so the next measurement starts from an empty engine.
"""

from __future__ import annotations

import logging
import time

import torch

from bench.gpu.models import preset_folder
from engine import LLM, SamplingParams


def sync(llm: LLM) -> None:
    if llm.engine.facts.device.type == "cuda":
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(vocab - 1000, vocab // 2), (n, length), generator=g).tolist()


def start_decode(llm: LLM, batch: int, context: int, steps: int) -> None:
    """Queues `batch` prompts of `context` tokens, enough to decode `steps` more tokens
    each, runs their prefills and three decode steps at this batch size."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    prompts = random_prompts(batch, context, engine.model_config.vocab_size, seed=batch)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    while any(s.in_prefill for s in engine.scheduler.waiting + engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step(finished_only=True)


def abort_all(llm: LLM) -> None:
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)


def decode_rate(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Tokens/s of pure decode steps for `batch` sequences at about `context` tokens."""
    start_decode(llm, batch, context, steps)
    sync(llm)
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step(finished_only=True)
    sync(llm)
    elapsed = time.perf_counter() - start
    abort_all(llm)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_ms": elapsed / steps * 1e3,
        "tokens_per_s": batch * steps / elapsed,
    }


def worker_llm(section, preset: str, **options) -> LLM:
    """The preset's engine with the worker's defaults (256 sequences, 8,192 tokens a step,
    4k context): bf16 on its kernels on the GPU, float32 on the torch references in a dry
    run; `options` override them. The engine's INFO lines (graph captures, tuning) go to
    stderr, so a run's log shows what its warm-up cost."""
    engine_log = logging.getLogger("engine")
    if not engine_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        engine_log.addHandler(handler)
        engine_log.setLevel(logging.INFO)
    folder, load_format = preset_folder(section.tmp, preset)
    defaults = dict(dtype="bfloat16" if section.cuda else "float32", device=section.device,
                    load_format=load_format, kernels="auto" if section.cuda else "torch",
                    max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)  # fmt: skip
    return LLM(folder, **(defaults | options))


def offline_throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int,
                       seed: int = 7) -> dict:  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed=seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    sync(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(llm)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_s": elapsed,
        "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + num_prompts * input_len) / elapsed,
    }
