"""Speculative decoding without a draft model: a proposer guesses the next k
tokens of a decoding sequence from text already seen, one step computes the
sequence's last token and the k guesses together (k + 1 rows), and the guesses
are kept up to the first one the model disagrees with.

Verification is exact. Every row is sampled as a plain step would sample it
(greedy: argmax; otherwise the sampler's exact draw, with that row's own noise),
and draft i is kept while the token sampled at its row equals it. A draft is a
single token (its proposal probability is one), so keeping it exactly when the
sampled token equals it keeps it with probability p(draft), and the token
sampled at the first disagreeing row is distributed as p without the draft,
renormalized: speculative sampling's rule, so outputs keep their distribution.
The token sampled at the row after the last kept draft comes free.

Proposers:
- ngram: prompt lookup in the sequence's own tokens. The longest suffix of
  `prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred before;
  its most recent earlier occurrence's next k tokens are the drafts.
- trie: the same lookup over the worker's recent requests (`engine/draft_trie.py`).
- mtp: a DeepSeek-V3 checkpoint's multi-token prediction layer (`engine/mtp_drafts.py`).

A sequence gets drafts only when its sampling needs nothing beyond the row's
logits: not with penalties (they depend on the tokens before each row) or a
grammar (its mask must advance token by token), and not when its blocks are held
for a KV handoff. A seeded sampled request gets none either: rejected rows would
use up its generator's draws, and its tokens would then depend on the drafts.
Speculation runs steps one at a time (no async scheduling): the next step's
input depends on how many drafts were kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.draft_trie import DraftTrie
from engine.sequence import Sequence


def ngram_drafts(tokens: np.ndarray, k: int, shortest: int, longest: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (longest down to shortest tokens) that occurred before.

    One pass over the tokens finds where the last token occurred before; those
    places are then extended backwards a token at a time while they still match."""
    size = len(tokens)
    if size <= shortest:
        return []
    alive = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])  # ends of 1-token matches
    matched, best = 1, alive
    while alive.size and matched < longest:
        alive = alive[alive >= matched]
        alive = alive[tokens[alive - matched] == tokens[size - 1 - matched]]
        if alive.size:
            matched, best = matched + 1, alive
    if matched < shortest or not best.size:
        return []
    start = int(best[-1]) + 1
    return tokens[start : start + k].tolist()


def eligible(seq: Sequence) -> bool:
    """Whether the sequence's tokens may be drafted (see the module's docstring)."""
    return (
        not seq.params.needs_penalties
        and (seq.params.seed is None or seq.params.greedy)  # a seed gives the same tokens
        and seq.grammar is None
        and not seq.hold_blocks
        and not seq.is_finished
        and not seq.in_prefill
    )


@dataclass
class DraftStats:
    """Drafts proposed and kept since start, and kept by position (index i: the
    (i+1)-th draft of a step)."""

    steps: int = 0  # sequence-steps that verified at least one draft
    proposed: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)

    def record(self, drafts: int, kept: int) -> None:
        grow = drafts - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        self.steps += 1
        self.proposed += drafts
        self.accepted += kept
        for i in range(drafts):
            self.proposed_by_position[i] += 1
            self.accepted_by_position[i] += i < kept

    def as_dict(self) -> dict:
        rate = [a / p if p else 0.0 for a, p in
                zip(self.accepted_by_position, self.proposed_by_position)]  # fmt: skip
        return {
            "spec_draft_steps": self.steps,
            "spec_draft_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_acceptance_by_position": rate,
        }


class Drafter:
    """Proposes each decoding sequence's drafts after a step and settles them after
    the next one (the kept tokens, the KV of the rest rolled back)."""

    def __init__(self, method: str, k: int, shortest: int, longest: int, max_model_len: int,
                 mtp=None):  # fmt: skip
        """`method`: a checked `EngineConfig.speculative_method`."""
        self.k = k
        self.mtp = mtp  # the runner's MTPDrafts (method mtp)
        self.shortest, self.longest = shortest, longest
        self.max_model_len = max_model_len
        self.trie = DraftTrie(shortest, longest) if method == "trie" else None
        self.stats = DraftStats()

    @staticmethod
    def _tokens(seq: Sequence) -> np.ndarray:
        """The sequence's tokens as an array, kept on it and extended as it grows."""
        have, size = seq.token_array, len(seq.all_token_ids)
        if have is None or len(have) > size:
            have = np.asarray(seq.all_token_ids, dtype=np.int64)
        elif len(have) < size:
            have = np.concatenate([have, np.asarray(seq.all_token_ids[len(have) :], np.int64)])
        seq.token_array = have
        return have

    def budget(self, seq: Sequence) -> int:
        """Drafts the sequence may take: k, less what max_tokens and the context
        length leave after its next token."""
        made = seq.num_output_tokens + seq.num_pending
        left = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - made - 1)
        return max(0, min(self.k, left))

    def propose(self, seqs: list[Sequence]) -> None:
        """Each eligible sequence's drafts for its next step (others get none). With
        mtp, the layer runs over the whole last step first (its KV), sampled or not."""
        want = {}
        for seq in seqs:
            seq.draft_token_ids = []
            if eligible(seq):
                want[seq] = self.budget(seq)
        if self.mtp is not None:
            for seq, drafts in self.mtp.propose(want).items():
                seq.draft_token_ids = drafts
            return
        for seq, k in want.items():
            if k == 0:
                continue
            tokens = self._tokens(seq)
            drafts = ngram_drafts(tokens, k, self.shortest, self.longest)
            if not drafts and self.trie is not None:
                drafts = self.trie.drafts(tokens, k, seq.namespace)
            seq.draft_token_ids = drafts

    def settle(self, rows: list[Sequence], result, seqs: list[Sequence], computed: list[int]):
        """A verified step's sampled rows (a sequence's rows in a run: its last token's,
        then each draft's) as the tokens each sequence keeps: (seq, token, its logprob,
        top logprobs) in order. Each sequence's computed count (and its entry in
        `computed`, the step's) drops by the drafts it did not keep."""
        out, i = [], 0
        where = {id(s): j for j, s in enumerate(seqs)}
        while i < len(rows):
            seq = rows[i]
            drafts = seq.draft_token_ids
            kept = 0
            while kept < len(drafts) and result.token_ids[i + kept] == drafts[kept]:
                kept += 1
            for j in range(i, i + kept + 1):
                out.append((seq, result.token_ids[j], result.token_logprobs[j],
                            result.logprobs[j]))  # fmt: skip
            if drafts:
                self.stats.record(len(drafts), kept)
                rejected = len(drafts) - kept
                seq.num_computed_tokens -= rejected
                j = where.get(id(seq))
                if j is not None:
                    computed[j] -= rejected
            seq.draft_token_ids = []
            i += len(drafts) + 1
        return out

    def finished(self, seq: Sequence) -> None:
        """A sequence ended with its output: its tokens feed the trie."""
        if self.trie is not None:
            self.trie.add(self._tokens(seq), seq.namespace)
        seq.token_array = None
