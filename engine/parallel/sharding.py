"""What one tensor-parallel rank holds of a model.

A rank's model is the full model with fewer attention heads, narrower MLPs and
experts, and a range of the vocabulary: `ShardPlan.config` says so, and the
model is built from it as it would be for any config. Each checkpoint tensor
is cut the same way when it is read (only the rank's part is read):

- rows (column-parallel): q, q_b, kv_b, gate and up projections, split evenly;
- columns (row-parallel, summed after): o and down projections;
- key/value heads: split, or, with more ranks than heads, one head per group of
  ranks;
- vocabulary rows: the embedding and the LM head;
- everything else (norms, routers, MLA's latent projection) whole on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from basis.model_config import ModelConfig
from engine.parallel.comm import vocab_range

_ROWS = ("q_proj.weight", "q_proj.bias", "q_b_proj.weight", "kv_b_proj.weight",
         "gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")  # fmt: skip
_COLS = ("o_proj.weight", "down_proj.weight", "w2.weight")
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class ShardPlan:
    full: ModelConfig
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        c, t = self.full, self.tp_size
        if t < 1 or not 0 <= self.tp_rank < t:
            raise ValueError(f"tensor rank {self.tp_rank} of {t}")
        for name, value in (("num_attention_heads", c.num_attention_heads),
                            ("intermediate_size", c.intermediate_size),
                            ("moe_intermediate_size", c.moe_intermediate_size)):  # fmt: skip
            if value % t:
                raise ValueError(
                    f"tensor_parallel_size {t} does not divide the model's {name} ({value})"
                )
        kv = c.num_key_value_heads
        if not c.is_mla and kv % t and t % kv:
            raise ValueError(
                f"tensor_parallel_size {t} neither divides nor is a multiple of the model's "
                f"{kv} key/value heads"
            )

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's key/value heads, [start, stop)."""
        kv, t = self.full.num_key_value_heads, self.tp_size
        if kv >= t:
            per = kv // t
            return self.tp_rank * per, (self.tp_rank + 1) * per
        head = self.tp_rank // (t // kv)  # replicated: one head for every t/kv ranks
        return head, head + 1

    @property
    def vocab(self) -> tuple[int, int]:
        return vocab_range(self.full.vocab_size, self.tp_size, self.tp_rank)

    @property
    def config(self) -> ModelConfig:
        """The config this rank's model is built from."""
        c, t = self.full, self.tp_size
        if t == 1:
            return c
        start, stop = self.kv_heads
        vocab_start, vocab_stop = self.vocab
        return dataclasses.replace(
            c,
            num_attention_heads=c.num_attention_heads // t,
            num_key_value_heads=c.num_key_value_heads if c.is_mla else stop - start,
            intermediate_size=c.intermediate_size // t,
            moe_intermediate_size=c.moe_intermediate_size // t,
            vocab_size=vocab_stop - vocab_start,
        )

    def index(self, hf_name: str, full_shape: tuple[int, ...]) -> tuple:
        """Where this rank's part of checkpoint tensor `hf_name` lies in the full one
        (() for all of it)."""
        if self.tp_size == 1:
            return ()
        t, r = self.tp_size, self.tp_rank
        if hf_name.endswith(_VOCAB):
            return (slice(*self.vocab),)
        if hf_name.endswith(_KV) and not self.full.is_mla:
            d = self.full.head_dim
            start, stop = self.kv_heads
            return (slice(start * d, stop * d),)
        if hf_name.endswith(_ROWS):
            share = full_shape[0] // t
            return (slice(r * share, (r + 1) * share),)
        if hf_name.endswith(_COLS):
            share = full_shape[1] // t
            return (slice(None), slice(r * share, (r + 1) * share))
        return ()

    def full_shape(self, hf_name: str, shard_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The full tensor's shape, from this rank's part of it (for dummy weights,
        made whole and then cut, so every rank holds what one rank would)."""
        if self.tp_size == 1:
            return tuple(shard_shape)
        shape = list(shard_shape)
        if hf_name.endswith(_VOCAB):
            shape[0] = self.full.vocab_size
        elif hf_name.endswith(_KV) and not self.full.is_mla:
            shape[0] = self.full.num_key_value_heads * self.full.head_dim
        elif hf_name.endswith(_ROWS):
            shape[0] *= self.tp_size
        elif hf_name.endswith(_COLS):
            shape[1] *= self.tp_size
        return tuple(shape)
