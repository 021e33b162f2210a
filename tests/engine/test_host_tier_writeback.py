"""The host tier as a write-back (`host_kv_backup="reused"`, the default for a
tier smaller than the device pool): nothing is copied while the device has
room, a block no prompt reused is never copied, and a reused block the device
evicts is served from the host with the outputs of recomputing."""

from __future__ import annotations

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
OPTS = dict(device="cpu", dtype="float32", host_kv_cache_gb=0.05, host_kv_backup="reused")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[(seed * 37 + i * 11 + j * 5) % 470 + 1 for j in range(length)] for i in range(n)]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_nothing_moves_while_the_device_has_room(model_dir):
    llm = LLM(model_dir("tiny-llama"), num_gpu_blocks=200, **OPTS)
    batch = prompts(4, 100, seed=1)
    for _ in range(3):  # reused, but never evicted
        llm.generate(batch, GREEDY)
    assert llm.get_stats()["host_kv_bytes_to_host"] == 0


def test_blocks_nobody_reused_are_not_copied_when_evicted(model_dir):
    llm = LLM(model_dir("tiny-llama"), num_gpu_blocks=30, **OPTS)
    llm.generate(prompts(12, 100, seed=2), GREEDY)  # 72 blocks through a 29-block pool
    assert llm.get_stats()["host_kv_bytes_to_host"] == 0


def test_reused_blocks_evicted_come_back_from_the_host(model_dir):
    folder = model_dir("tiny-llama")
    hot, fillers = prompts(2, 100, seed=3), prompts(8, 100, seed=4)
    want = tokens(LLM(folder, device="cpu", dtype="float32", host_kv_cache_gb=0,
                      enable_prefix_caching=False).generate(hot, GREEDY))  # fmt: skip
    llm = LLM(folder, num_gpu_blocks=30, **OPTS)
    assert tokens(llm.generate(hot, GREEDY)) == want
    assert tokens(llm.generate(hot, GREEDY)) == want  # a device hit: now reused
    llm.generate(fillers, GREEDY)  # evicts them: written back
    stats = llm.get_stats()
    assert stats["host_kv_bytes_to_host"] > 0
    again = llm.generate(hot, GREEDY)
    assert tokens(again) == want
    assert llm.get_stats()["prefix_cache_host_hit_tokens"] >= 2 * 6 * 16 - 32
