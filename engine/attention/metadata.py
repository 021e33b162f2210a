"""What an attention layer needs to know about the flat batch of one step."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] and,
    after this step, seq_lens[i] cached tokens in the blocks of block_tables[i]."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Cache slots of every sequence's cached prefix, in order; computed on first use by
    # a layer that reads the prefix itself (MLA's expanded form), shared by the others.
    prefix_slots: torch.Tensor | None = None
    leading_decodes: int | None = None  # `num_decodes`, once counted

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu) if self.query_lens_cpu else 0

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu) if self.seq_lens_cpu else 0

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_decodes(self) -> int:
        """Leading sequences with one new token each (`step_inputs.decodes_first`),
        counted on first use and kept (every layer asks)."""
        if self.leading_decodes is None:
            self.leading_decodes = sum(1 for _ in takewhile(lambda n: n == 1, self.query_lens_cpu))
        return self.leading_decodes
