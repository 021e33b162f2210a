"""Ping-pong micro-batches: a step's batch split at sequence boundaries into
two (or more) micro-batches that take turns, so that one micro-batch's
attention runs while another's tokens are with the experts (the multi-stage
pipeline inside a step; MegaScale-Infer's ping-pong, vLLM's DBO).

Each micro-batch is a generator over the layers (`CausalLM.layer_stream`)
that yields right after it dispatched a MoE layer's tokens; the driver
resumes them in turn, so the schedule per MoE layer is

    A: attention, dispatch | B: attention, dispatch | A: combine, next layer ...

A split pays only with enough tokens (thresholds as vLLM's
`--dbo-decode-token-threshold` / `--dbo-prefill-token-threshold`); below them,
or with fewer sequences than parts, the step runs whole.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata


@dataclass(frozen=True, slots=True)
class MicroBatch:
    rows: slice  # its rows of the flat step
    meta: AttentionMetadata  # its sequences only


@dataclass(frozen=True, slots=True)
class MicroBatchPolicy:
    parts: int = 2
    decode_tokens: int = 32  # an all-decode step splits from this many tokens
    prefill_tokens: int = 512  # any other step from this many

    def __post_init__(self) -> None:
        if self.parts < 2:
            raise ValueError(f"micro-batches need at least 2 parts, got {self.parts}")
        if self.decode_tokens < 1 or self.prefill_tokens < 1:
            raise ValueError("micro-batch token thresholds must be >= 1")

    def split(self, meta: AttentionMetadata) -> list[MicroBatch] | None:
        """The step's micro-batches, balanced by tokens; None: run it whole."""
        lens = meta.query_lens_cpu
        total = sum(lens)
        threshold = self.decode_tokens if meta.decode_only else self.prefill_tokens
        if total < threshold or len(lens) < self.parts:
            return None
        # Cut at the sequence boundary nearest each even share of the tokens,
        # leaving every part at least one sequence.
        ends = list(itertools.accumulate(lens))  # row after each sequence
        cuts: list[int] = []
        for j in range(1, self.parts):
            lo = (cuts[-1] if cuts else 0) + 1
            hi = len(lens) - (self.parts - j)
            target = total * j / self.parts
            cuts.append(min(range(lo, hi + 1), key=lambda c: abs(ends[c - 1] - target)))
        starts = [0, *cuts]
        stops = [*cuts, len(lens)]
        return [_part(meta, a, b, ends) for a, b in zip(starts, stops)]


def _part(meta: AttentionMetadata, first: int, stop: int, ends: list[int]) -> MicroBatch:
    row0 = ends[first - 1] if first else 0
    row1 = ends[stop - 1]
    sub = dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping[row0:row1],
        query_start_loc=meta.query_start_loc[first : stop + 1] - row0,
        seq_lens=meta.seq_lens[first:stop],
        block_tables=meta.block_tables[first:stop],
        query_lens_cpu=meta.query_lens_cpu[first:stop],
        seq_lens_cpu=meta.seq_lens_cpu[first:stop],
        prefix_slots=None,  # a layer that needs it computes it for these sequences
        leading_decodes=None,  # counted again for these sequences
    )
    return MicroBatch(slice(row0, row1), sub)


def run_micro_batches(model, input_ids, positions, kv_caches, meta, backend, parts, layer_hook):
    """Runs the step whole (parts None) or as ping-pong micro-batches; returns the
    final hidden states of every row, in the step's order."""
    if parts is None:
        parts = [MicroBatch(slice(0, input_ids.shape[0]), meta)]
    finished = [0] * len(model.layers)

    def layer_done(i: int) -> None:
        # The KV handoff hook sees a layer once every micro-batch has written it.
        finished[i] += 1
        if finished[i] == len(parts) and layer_hook is not None:
            layer_hook(i)

    streams = [
        model.layer_stream(
            input_ids[p.rows], positions[p.rows], kv_caches, p.meta, backend, layer_done
        )
        for p in parts
    ]
    outputs: list[torch.Tensor | None] = [None] * len(parts)
    running = list(range(len(parts)))
    while running:
        for j in list(running):
            try:
                next(streams[j])
            except StopIteration as done:
                outputs[j] = done.value
                running.remove(j)
    return outputs[0] if len(parts) == 1 else torch.cat(outputs)
