"""Drafts from DeepSeek-V3's multi-token prediction layer (`models/mtp.py`).

After every step the layer runs over the step's rows whose KV was kept: row
p pairs the main model's final hidden state there with the token at p + 1
(known by then: a prompt's next token, a kept draft, or the token just
sampled), which fills the layer's own KV cache (a separate cache in the same
block layout, so the tiers and transfers never see it). The output at a
decoding sequence's last row predicts the token after its new one: its first
draft. Further drafts chain the layer on its own output, a row at a time.

Drafts are guesses the next step verifies, so nothing here can change an
output: where the layer's KV is stale (blocks from the prefix cache, another
worker or the host tier, the block boundary of a shared prefix) drafts are
only kept less often."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from engine.parallel import comm
from engine.sequence import Sequence
from engine.step_inputs import prepare_step
from kernels import ops


class _Shifted:
    """A sequence's tokens read one place on (`prepare_step` feeds position p the
    token at p + 1), or, for a chained draft, one token at a given position."""

    def __init__(self, tokens: list[int], offset: int):
        self.tokens, self.offset = tokens, offset

    def __len__(self) -> int:
        return self.offset + len(self.tokens)

    def __getitem__(self, span: slice) -> list[int]:
        return self.tokens[span.start - self.offset : span.stop - self.offset]


def _rows(position: int, tokens, count: int, table: list[int]) -> SimpleNamespace:
    """What `prepare_step` reads of a sequence: `count` rows from `position`, the last
    of them sampled."""
    return SimpleNamespace(num_computed_tokens=position, all_token_ids=tokens,
                           draft_token_ids=(), num_tokens=position + count,
                           pending_token=None, table=table)  # fmt: skip


class MTPDrafts:
    def __init__(self, runner):
        self.runner = runner
        spec = dataclasses.replace(runner.kv_spec, num_layers=1)
        self.cache = spec.allocate(runner.num_blocks, runner.device)[0]
        self._step = None

    def record(self, seqs: list[Sequence], num_new: list[int], tables, hidden: torch.Tensor):
        """A step's sequences (before it ran), block tables and final hidden states."""
        before = [s.num_computed_tokens for s in seqs]
        self._step = (list(seqs), list(num_new), before, tables, hidden)

    def _forward(self, rows: list, hidden: torch.Tensor):
        """The layer over `rows` (`_rows`) from `hidden`: each sequence's predicted next
        token and the layer's output at its last row."""
        r = self.runner
        model = r.model
        counts = [x.num_tokens - x.num_computed_tokens for x in rows]
        inputs = prepare_step(rows, counts, [x.table for x in rows], r.block_size, r.device)
        with ops.using(r.kernel_mode):
            embedded = comm.vocab_embedding(inputs.input_ids, model.embed_tokens,
                                            model.full_vocab_size)  # fmt: skip
            out, normed = model.mtp(embedded, hidden, inputs.positions, model.cos_sin,
                                    self.cache, inputs.meta, r.backend)  # fmt: skip
            last = inputs.sample_rows
            tokens = model.compute_logits(normed.index_select(0, last)).argmax(dim=-1).tolist()
        return tokens, out.index_select(0, last)

    @torch.inference_mode()
    def propose(self, want: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Runs the layer over the last step's kept rows; up to `want[seq]` drafts for
        each sequence asked for (a decoding one, its last row in that step)."""
        step, self._step = self._step, None
        if step is None:
            return {}
        seqs, num_new, before, tables, hidden = step
        rows, sources, last_of, table_of = [], [], {}, {}
        start = 0
        for seq, n, c0, table in zip(seqs, num_new, before, tables):
            keep = min(n, seq.num_computed_tokens - c0, len(seq.all_token_ids) - 1 - c0)
            if keep > 0 and not seq.is_finished:
                shifted = _Shifted(seq.all_token_ids, -1)  # position p reads token p + 1
                rows.append(_rows(c0, shifted, keep, table))
                sources.extend(range(start, start + keep))
                last_of[seq], table_of[seq] = len(rows) - 1, table
            start += n
        if not rows:
            return {}
        at = torch.tensor(sources, dtype=torch.long, device=hidden.device)
        tokens, out = self._forward(rows, hidden.index_select(0, at))
        drafts = {s: [tokens[last_of[s]]] for s, k in want.items() if k > 0 and s in last_of}
        # chained: the layer's own output and its last draft, one position on, while
        # the sequence's blocks reach that far
        state = {s: out[last_of[s]] for s in drafts}
        chain = [s for s in drafts if want[s] > 1]
        while chain:
            position = {s: s.num_computed_tokens + len(drafts[s]) - 1 for s in chain}
            size = self.runner.block_size
            chain = [s for s in chain if position[s] // size < len(table_of[s])]
            if not chain:
                break
            rows = [_rows(position[s], _Shifted([drafts[s][-1]], position[s]), 1, table_of[s])
                    for s in chain]  # fmt: skip
            tokens, out = self._forward(rows, torch.stack([state[s] for s in chain]))
            for i, s in enumerate(chain):
                drafts[s].append(tokens[i])
                state[s] = out[i]
            chain = [s for s in chain if len(drafts[s]) < want[s]]
        return drafts
