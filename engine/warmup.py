"""Prefill shapes run once at start-up, so that no request pays for kernel
compilation and autotuning.

The kernels pick their configuration per shape bucket (powers of two of the
batch size, the longest query, the row count) on first use; on a fresh machine
the first use also compiles every candidate. Left to the first requests, that
is seconds of stall in the middle of serving. `warm_up` runs the model once on
each step shape a power-of-two bucket can hold within the token budget (b
prompts of n tokens; one prompt beside b - 1 decode rows), every key and value
written to the null block 0, which no request reads. Decode shapes are covered
by the CUDA-graph capture that follows.

Each shape runs through one layer of each kind only (attention and MLP classes:
a dense and a MoE layer of DeepSeek, one layer of Llama): every layer of a kind
runs the same kernels at the same shapes, so the rest would only add the model's
compute. For Llama-3-8B on an H100 that compute was not what took the time: 176
shapes took 7.4 s with warm kernel caches through 32 layers or one (about 40 ms a
shape of first launches), 24-30 s cold (compiling); a deeper or wider model's
compute grows where that does not.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from engine.attention.metadata import AttentionMetadata
from kernels import ops

logger = logging.getLogger(__name__)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def warmup_shapes(max_tokens: int, max_seqs: int, max_len: int) -> list[list[int]]:
    """Each step's query lengths: b prompts of n tokens, and one prompt of up to n
    tokens beside b - 1 decode rows (a chunked-prefill step), for powers of two b and
    n >= 2 within the batch size and the model's length; every step fits the token
    budget, and every bucket (powers of two of the rows and of the longest query) a
    step within it can fall in is run."""
    lengths = _powers_of_two(min(max_tokens, max_len))
    uniform = [[n] * b for b in _powers_of_two(min(max_seqs, max_tokens)) for n in lengths
               if n >= 2 and b * n <= max_tokens]  # fmt: skip
    # the prompt takes what the decode rows leave of the budget, while that stays in
    # its length's bucket: a chunk of 8185 tokens beside 7 decode rows is bucket 8192
    mixed = [[m] + [1] * (b - 1) for b in _powers_of_two(max_seqs)[1:] for n in lengths
             if n >= 2 and (m := min(n, max_tokens - (b - 1))) > n // 2]  # fmt: skip
    return uniform + mixed


def layers_of_each_kind(layers) -> list[int]:
    """The index of the first layer of each kind (its attention's and MLP's classes)."""
    seen, keep = set(), []
    for i, layer in enumerate(layers):
        kind = (type(layer.self_attn), type(layer.mlp))
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    return keep


@contextlib.contextmanager
def fewer_layers(model, kv_caches: list):
    """The model with one layer of each kind while inside, and those layers' caches."""
    layers = model.layers
    keep = layers_of_each_kind(layers)
    model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    try:
        yield [kv_caches[i] for i in keep]
    finally:
        model.layers = layers


@torch.inference_mode()
def warm_up(runner, max_len: int) -> float:
    """Runs the model on every warm-up shape; returns the seconds it took."""
    cfg, dev = runner.config, runner.device
    shapes = warmup_shapes(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_len)
    start = time.perf_counter()
    with fewer_layers(runner.model, runner.kv_caches) as kv_caches:
        _run_shapes(runner, shapes, kv_caches)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d prefill shapes in %.1f s", len(shapes), seconds)
    return seconds


def _run_shapes(runner, shapes: list[list[int]], kv_caches: list) -> None:
    dev = runner.device
    for lens in shapes:
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        starts = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=positions % runner.block_size,  # block 0, the null block
            query_start_loc=starts,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(
                (len(lens), -(-max(lens) // runner.block_size)), dtype=torch.int32, device=dev
            ),
            query_lens_cpu=list(lens),
            seq_lens_cpu=list(lens),
        )
        with ops.using(runner.kernel_mode):
            hidden = runner.model(
                torch.zeros(len(positions), dtype=torch.long, device=dev),
                positions,
                kv_caches,
                meta,
                runner.backend,
            )
            runner.model.compute_logits(hidden.index_select(0, starts[1:].long() - 1))
