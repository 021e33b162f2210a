"""The engine's narrow API: services use only what AsyncLLM exposes, the
scheduler's queues change only through the scheduler, and `close()` gives the
device memory back."""

from __future__ import annotations

import asyncio
import gc
import re
import weakref
from pathlib import Path

import pytest
from paths import ROOT

from engine import LLM, AsyncLLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _refs(tensors) -> list[weakref.ref]:
    return [weakref.ref(t) for t in tensors]


def test_close_frees_weights_and_kv_cache(model_dir):
    llm = LLM(model_dir("tiny-llama"), dtype="float32", device="cpu")
    assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
    caches = _refs(llm.engine.kv_caches)
    weights = _refs(llm.engine.runner.model.parameters())
    assert caches and weights
    llm.close()
    gc.collect()
    assert all(r() is None for r in caches), "KV cache tensors still alive"
    assert all(r() is None for r in weights), "weights still alive"
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[1, 2, 3]], GREEDY)


def test_async_close_ends_streams_and_frees_memory(model_dir):
    llm = AsyncLLM.from_model(model_dir("tiny-llama"), dtype="float32", device="cpu")
    caches = _refs(llm.kv_caches)
    facts = llm.facts
    assert facts.num_layers == 2 and facts.block_size == 16 and facts.num_kv_blocks > 1

    async def main():
        outs = [o async for o in llm.generate([1, 2, 3], GREEDY, "r1")]
        assert outs[-1].finished
        llm.close()
        with pytest.raises(RuntimeError):
            async for _ in llm.generate([1, 2, 3], GREEDY, "r2"):
                pass

    asyncio.run(main())
    gc.collect()
    assert all(r() is None for r in caches)


# What only the engine may touch: AsyncLLM's engine, the scheduler's queues.
_FORBIDDEN = [
    (re.compile(r"\._engine\b"), "AsyncLLM's private engine"),
    (re.compile(r"\bengine\.engine\b"), "the engine behind an AsyncLLM"),
    (re.compile(r"\.scheduler\._(waiting|running)\b"), "the scheduler's private queues"),
    (
        re.compile(r"\.scheduler\.(waiting|running)\.(append|remove|insert|pop|sort|clear)"),
        "editing the scheduler's queues",
    ),
]


def test_nothing_outside_the_engine_reaches_into_it():
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("engine", ".git") or rel == Path(__file__).relative_to(ROOT):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in _FORBIDDEN:
                if pattern.search(line):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    assert not found, "\n".join(found)


def test_only_the_scheduler_edits_its_queues():
    """Inside the engine too: other modules go through the scheduler's methods."""
    found = []
    for path in (ROOT / "engine").rglob("*.py"):
        if path.name == "scheduler.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(
                r"\._(waiting|running)\b|\.(waiting|running)\.(append|remove|insert)", line
            ):
                found.append(f"{path.name}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
