"""A step's inputs on the device, built from the scheduled sequences and their
block tables, and the rule that decides whether a step's prompt chunks run in
the decode CUDA graphs as rows of their own."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.parallel import step_wire
from engine.parallel.step_wire import StepShape
from engine.sequence import Sequence


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # flat row whose logits each sampled sequence needs
    sample_seqs: list[Sequence]  # a sequence with drafts has a run of rows: 1 + its drafts


def prepare_step(
    seqs: list[Sequence],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    followers=None,
    as_rows: bool = False,
) -> StepInputs:
    """The step's inputs on `device`. Everything is staged in two host buffers
    (pinned on CUDA) and moved in two copies; a sequence's pending token (async
    scheduling) is read on the device from the step that sampled it (its sample's
    draw queued first, `finish()`); `followers`
    (the other ranks of a parallel engine) are sent the same step.

    `as_rows`: every new token is a row of its own, as in a decode step (query
    length 1, its sequence's block table, its position + 1 tokens cached): the
    attention layers write every row's K/V before any row attends, so a row
    sees the tokens before it in its chunk, and the step is exactly the prompt
    chunk's, in the shape the decode graphs replay."""
    bs, batch, total = block_size, len(seqs), sum(num_new)
    max_blocks = max(len(t) for t in block_tables)
    # a decode with drafts computes them after its last token (speculative decoding)
    drafts = [len(s.draft_token_ids) for s in seqs]
    known = [min(n, len(s.all_token_ids) + d - s.num_computed_tokens)
             for s, n, d in zip(seqs, num_new, drafts)]  # fmt: skip
    sampled = [s.num_computed_tokens + n == s.num_tokens + d
               for s, n, d in zip(seqs, num_new, drafts)]  # fmt: skip
    n_rows = total if as_rows else batch  # rows of the attention metadata
    n_sampled = sum(1 + d for d, yes in zip(drafts, sampled) if yes)
    shape = StepShape(total, n_rows, total - sum(known), max_blocks, n_sampled)
    # int64: ids, positions, slots, sample rows, pending rows, their sources; int32:
    # query starts, sequence lengths, block tables. Segments start 16-byte aligned.
    wide, narrow = shape.wide, shape.narrow
    pin = device.type == "cuda"
    h64 = torch.empty(wide.size, dtype=torch.int64, pin_memory=pin)
    h32 = torch.zeros(narrow.size, dtype=torch.int32, pin_memory=pin)
    ids, positions, slots, rows, pend_rows, pend_src = wide.views(h64.numpy())
    query_start, seq_lens, tables = narrow.views(h32.numpy())
    tables = tables.reshape(n_rows, max_blocks)
    sample_seqs: list[Sequence] = []
    source = None  # the in-flight step's sampled tokens (async scheduling)
    start = p = 0
    for i, (seq, n, k, table) in enumerate(zip(seqs, num_new, known, block_tables)):
        c = seq.num_computed_tokens
        known_ids = seq.all_token_ids[c : c + k]
        if drafts[i]:  # then its drafts (without copying the whole sequence's tokens)
            known_ids += seq.draft_token_ids[: k - len(known_ids)]
        ids[start : start + k] = known_ids
        if k < n:  # its last token is pending: known only on the device
            sample, index = seq.pending_token
            if n - k != 1 or (source is not None and sample is not source):
                raise RuntimeError("a step may read one pending token per sequence, "
                                   "all from the step before it")  # fmt: skip
            source = sample
            ids[start + k], pend_rows[p], pend_src[p] = 0, start + k, index
            p += 1
        positions[start : start + n] = np.arange(c, c + n)
        if as_rows:
            tables[start : start + n, : len(table)] = table
            seq_lens[start : start + n] = np.arange(c + 1, c + n + 1)
        else:
            tables[i, : len(table)] = table
            seq_lens[i] = c + n
            query_start[i + 1] = start + n
        start += n
        if sampled[i]:  # its last row, or its last token's and each draft's
            for row in range(start - 1 - drafts[i], start):
                rows[len(sample_seqs)] = row
                sample_seqs.append(seq)
    if as_rows:
        query_start[:] = np.arange(total + 1)
        row_of = np.arange(total)
    else:
        row_of = np.repeat(np.arange(batch), num_new)
    slots[:] = tables[row_of, positions // bs].astype(np.int64) * bs + positions % bs
    d64, d32 = h64.to(device, non_blocking=True), h32.to(device, non_blocking=True)
    ids_d, _, _, _, pend_rows_d, pend_src_d = wide.views(d64)
    if source is not None:
        # the step before's draw, held back by grammar masks, is queued only now: the
        # host staged this step meanwhile
        tokens = source.finish().tokens
        ids_d.index_copy_(0, pend_rows_d, tokens.index_select(0, pend_src_d))
    if followers is not None:  # the other ranks run the same step
        followers.send(shape, d64, d32)
    query_lens = [1] * total if as_rows else num_new
    t = step_wire.unpack(shape, d64, d32, query_lens, seq_lens.tolist())
    return StepInputs(t.input_ids, t.positions, t.meta, t.sample_rows, sample_seqs)


def decodes_first(seqs: list, num_new: list[int], tables: list) -> tuple[list, list, list]:
    """The step's sequences with the one-token ones first, each part in its order (the
    attention then runs them through the decode kernel, apart from the prompt chunks)."""
    if all(a == 1 or b != 1 for a, b in zip(num_new, num_new[1:])):
        return seqs, num_new, tables  # already so
    order = sorted(range(len(num_new)), key=lambda i: num_new[i] != 1)  # stable
    return [seqs[i] for i in order], [num_new[i] for i in order], [tables[i] for i in order]


def rows_pay(
    seqs: list[Sequence],
    num_new: list[int],
    max_rows: int,
    bytes_per_token: int,
    weight_bytes: int,
) -> bool:
    """Whether a step with prompt chunks runs in the decode graphs, a row per new
    token (`prepare_step(as_rows=True)`), rather than as the eager pass. Only if its
    tokens fit the largest graph (`max_rows`). Each row reads its whole prefix, where
    the eager pass reads a chunk's prefix about once: the rows cost reads, the eager
    pass costs launching op by op. With no decode in the step (a lone prefix hit,
    short prompts) nothing hides those launches: rows while their reads come to at
    most twice the weights' bytes. Beside decodes, under async scheduling the
    launches hide behind the step before: rows only while what they read beyond the
    eager pass stays within a quarter of the weights' bytes (a few tokens after a
    cached prefix, not a long prompt's tail)."""
    total = sum(num_new)
    if total > max_rows or total == len(seqs):
        return False
    pairs = list(zip(seqs, num_new))
    reads = sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in pairs)
    if reads * bytes_per_token > 2 * weight_bytes:
        return False
    if all(n > 1 for n in num_new):
        return True
    beyond = sum((n - 1) * s.num_computed_tokens + n * (n - 1) // 2 for s, n in pairs)
    return beyond * bytes_per_token * 4 <= weight_bytes
