"""A step with prompt tokens as CUDA graphs cut at the attention (`--piece-graphs`, on by
default on CUDA: on one H200 the default mesh's TTFT p50 at 16 req/s fell from 91.8 to
63.9 ms with them, bench/results/gate_s80_h200_pieces.json).

An eager step launches each layer's operators one by one from Python: on one H100
a step of 80 decodes and a 1,024-token prompt took 35.6 ms to launch for 28-41 ms
of device work (bench/results/launch_cost_s79.log), so below saturation such steps
wait on the host. Here the work between one layer's attention and the next (its
output projection, norms and MLP, then the next layer's norm, QKV projection,
rotary and cache write) is one graph per token-count bucket (16, 32, 64, 128, then
every 256 tokens up to 2,048; a larger step's device work outlasts its launch), L + 1
graphs a bucket over static buffers, and each attention runs eagerly between them with
the step's own metadata on its real rows. Padded rows read token 0 at position 0 and
write their keys and values to the null block (slot 0), like the decode graphs'
padding; every operator but the attention treats rows apart, so they leave the real
rows as they were.

With the launches this cheap, a mixed step's decodes go through the decode kernel
apart from its prompt chunks (the Triton backend's `split_decodes`), on every step.
Dense attention models on one rank (`supports`). On the CPU nothing is captured:
`run` steps through the same pieces eagerly (the tests' path).
"""

from __future__ import annotations

import logging
import time

import torch

from engine.models.decoder import CausalLM
from engine.models.layers import MLP, Attention
from engine.parallel import comm

logger = logging.getLogger(__name__)

BUCKET = 256  # token counts captured: every BUCKET up to the largest
MAX_TOKENS = 2048
# below BUCKET, powers of two from this: a step of a few dozen tokens padded to 256 rows
# would turn from reading the weights (about 3.5 ms for llama3-8b on an H200) into
# computing 256 rows (about 4.8 ms at the matmul rate)
SMALLEST = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from SMALLEST below BUCKET, then every BUCKET tokens, up to
    max_tokens rounded up to a bucket, MAX_TOKENS at most."""
    buckets, size = [], SMALLEST
    while size < BUCKET:
        buckets.append(size)
        size *= 2
    buckets += range(BUCKET, MAX_TOKENS + 1, BUCKET)
    last = next((i for i, b in enumerate(buckets) if b >= max_tokens), len(buckets) - 1)
    return buckets[: last + 1]


def supports(runner) -> bool:
    """A dense attention model, whole on one rank, stepped without micro-batches, with
    no multi-token predictor (which keeps a step's hidden states past the step)."""
    model = runner.model
    return (
        isinstance(model, CausalLM)
        and getattr(runner, "mtp_drafts", None) is None
        and model.embed_tokens is not None
        and model.norm is not None
        and runner.stage is None
        and not runner.parallel
        and model.micro_batching is None
        and all(
            isinstance(layer.self_attn, Attention) and isinstance(layer.mlp, MLP)
            for layer in model.layers
        )
    )


class PieceGraphs:
    def __init__(self, runner, max_tokens: int = MAX_TOKENS):
        self.runner = runner
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        model = runner.model
        attn = model.layers[0].self_attn
        n, dev, dtype = self.max_tokens, runner.device, runner.dtype
        hidden = model.embed_tokens.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        self.o = torch.zeros_like(self.q)  # each attention's output, read by the next piece
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        self.replays = 0  # steps run through the pieces

    def _piece(self, j: int, tokens: int) -> None:
        """Piece j of a step of `tokens` rows, from and into the static buffers: layer
        j-1's output projection, norms and MLP (j > 0), then layer j's norm, projection,
        rotary and cache write (j < L); the last piece ends with the final norm."""
        model = self.runner.model
        layers, rows = model.layers, slice(0, tokens)
        if j == 0:
            x = comm.vocab_embedding(self.input_ids[rows], model.embed_tokens,
                                     model.full_vocab_size)  # fmt: skip
            residual, h = x, layers[0].input_layernorm(x)
        else:
            prev = layers[j - 1]
            h = prev.self_attn.output(self.o[rows])
            h, residual = prev.post_attention_layernorm.add_forward(h, self.residual[rows])
            x = prev.mlp(h)
            if j == len(layers):
                self.hidden[rows].copy_(model.norm.add_forward(x, residual)[0])
                return
            h, residual = layers[j].input_layernorm.add_forward(x, residual)
        cache = self.runner.kv_caches[j]
        q, k, v = layers[j].self_attn.project(
            h, self.positions[rows], model.cos_sin, cache, self.slot_mapping[rows]
        )
        self.q[rows].copy_(q)
        self.k[rows].copy_(k)
        self.v[rows].copy_(v)
        self.residual[rows].copy_(residual)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket's pieces, largest bucket first (the others reuse its pool)."""
        start = time.monotonic()
        pieces = len(self.runner.model.layers) + 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                for _ in range(2):  # compile and tune every kernel at this shape first
                    for j in range(pieces):
                        self._piece(j, bucket)
                torch.cuda.synchronize()
                graphs = []
                for j in range(pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._piece(j, bucket)
                    self.pool = graph.pool()
                    graphs.append(graph)
                self.graphs[bucket] = graphs
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured %d piece graphs (%d buckets of up to %d tokens) in %.1f s",
                    pieces * len(self.buckets), len(self.buckets), self.max_tokens,
                    time.monotonic() - start)  # fmt: skip

    def run(self, input_ids, positions, meta, backend) -> torch.Tensor:
        """The final hidden states of a step of up to `max_tokens` rows."""
        tokens = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= tokens)
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        if bucket > tokens:  # padded rows: token 0 at position 0, written to the null block
            for buf in (self.input_ids, self.positions, self.slot_mapping):
                buf[tokens:bucket].zero_()
        graphs = self.graphs.get(bucket)  # None: not captured (the CPU), the pieces eagerly
        layers, caches = self.runner.model.layers, self.runner.kv_caches
        rows = slice(0, tokens)
        for j in range(len(layers) + 1):
            if graphs is not None:
                graphs[j].replay()
            else:
                self._piece(j, bucket)
            if j < len(layers):  # into the buffer the next piece reads
                backend.attend(self.q[rows], self.k[rows], self.v[rows], caches[j], meta,
                               layers[j].self_attn.scale, out=self.o[rows])  # fmt: skip
        self.replays += 1
        return self.hidden[rows]


def wanted(config, device: torch.device) -> bool:
    """Whether the flag asks for the pieces: `piece_graphs` None (the default) means on
    for CUDA; on the CPU they run only when asked (eagerly, padded: the tests' path)."""
    flag = device.type == "cuda" if config.piece_graphs is None else config.piece_graphs
    return flag and not config.enforce_eager


def applies(runner, config) -> bool:
    """Whether the runner gets piece graphs: the flag asks for them and the model is one
    they support (what `make` builds, and what the KV cache's reserve counts)."""
    return wanted(config, runner.device) and supports(runner)


def make(runner, config, max_len: int, host_memory=None):
    """The runner's piece graphs (captured on CUDA), or None where the flag is off or
    the model is not one they support; `max_len`: the decode graphs' length bound."""
    if not applies(runner, config):
        return None
    pieces = PieceGraphs(runner, config.max_num_batched_tokens)
    split = getattr(runner.backend, "split_mixed_steps", None)
    if split is not None:  # the launches are cheap enough now (see the backend)
        split(max_len)
    if runner.device.type == "cuda":
        if host_memory is not None and host_memory.started:
            host_memory.settle()  # no other CUDA call may overlap a capture
        pieces.capture()
    return pieces
