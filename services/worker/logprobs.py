"""A sampled token's logprobs as the workers hand them on: the chosen token's
logprob and rank, and the top-N alternatives by rank (the decode service's
stream and the prefill service's first token alike)."""

from __future__ import annotations

Position = tuple[int, float, int, list[tuple[int, float, int]]]


def position(entry: dict, chosen: int, top_n: int) -> Position:
    """(chosen id, its logprob, its rank, [(id, logprob, rank) of the top-N by rank])
    of one position's logprobs (token id -> Logprob)."""
    lp = entry[chosen]
    top = sorted(
        ((tid, v.logprob, v.rank) for tid, v in entry.items() if v.rank <= top_n),
        key=lambda t: t[2],
    )
    return (chosen, lp.logprob, lp.rank, top)
