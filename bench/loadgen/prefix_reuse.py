"""How much of each prompt a prefix cache could have served, to compare with
what the server reports it served (`usage.prompt_tokens_details.cached_tokens`).

A request's ideal is the longest run of its leading full blocks that some
earlier request had already computed: one that had its first token (its
prompt's KV existed) by the time this request was sent. A server may beat it
(cached / ideal > 1) when a request sent at the same time finishes its prefill
while this one still waits; the upper bound counts every request sent earlier,
computed or not. At least one prompt token is always computed, as in the
engine. Only token-id prompts are measured (`--prompt-format ids`): the ids are
exactly what the server hashes.
"""

from __future__ import annotations

from basis.block_hash import hash_prompt_blocks


def ideal_cached_tokens(
    prompts: list[list[int]], sent: list[float], prefilled: list[float | None], block_size: int
) -> list[int]:
    """Per request: `sent` is when it was sent, `prefilled` when its first token came
    (None: it failed), on one clock."""
    hashes = [hash_prompt_blocks(p, block_size) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: sent[i])
    done = sorted((t, i) for i, t in enumerate(prefilled) if t is not None)
    known: set[int] = set()
    ideal = [0] * len(prompts)
    k = 0
    for j in order:
        while k < len(done) and done[k][0] <= sent[j]:
            known.update(hashes[done[k][1]])
            k += 1
        limit = (len(prompts[j]) - 1) // block_size
        count = 0
        for h in hashes[j][:limit]:
            if h not in known:
                break
            count += 1
        ideal[j] = count * block_size
    return ideal


def reuse_summary(requests, results, t0: float, block_size: int) -> dict:
    """Cached tokens as served and as ideal, summed over successful requests; empty
    when the prompts are not token ids."""
    prompts = [r.prompt for r in requests]
    if not all(isinstance(p, list) for p in prompts):
        return {}
    sent = [r.start_time - t0 for r in results]
    prefilled = [s + r.ttft if r.success else None for s, r in zip(sent, results)]
    ideal = ideal_cached_tokens(prompts, sent, prefilled, block_size)
    upper = ideal_cached_tokens(prompts, sent, sent, block_size)
    ok = [i for i, r in enumerate(results) if r.success]
    served = sum(results[i].cached_tokens for i in ok)
    best, most = sum(ideal[i] for i in ok), sum(upper[i] for i in ok)
    return {
        "cache_block_size": block_size,
        "prompt_tokens_total": sum(results[i].prompt_tokens for i in ok),
        "cached_tokens_total": served,
        "ideal_cached_tokens_total": best,
        "cached_of_ideal": served / best if best else None,
        "upper_cached_tokens_total": most,
        "cached_of_upper": served / most if most else None,
        "ideal_cached_tokens": ideal,
    }
