"""An expert service's answers on the stream path (services/expert_parallel/
stream_member.py) as CUDA graphs: its compute of one dispatch is a few Triton
launches whose host cost (165-229 us a call on an H100, against 18-93 us of
kernels: bench/results/expert_member_compute_s76_h100.json) sits on the worker's
critical path, once per MoE layer.

A dispatch is keyed by (MoE layer, slot, tokens): its inputs are views at fixed
addresses of the worker's buffers. The first time a key comes it is computed
eagerly (which tunes the kernels); the second time its compute, the copy of the
part into the worker's buffer and the REPLIED flag's write are captured as one
graph and replayed from then on. The graphs go when the store's stacks change
(they read its weight tensors), and none is captured or replayed while the store
counts expert load (a host read). Dispatches of more than MAX_TOKENS tokens
(prefill chunks, rarely the same size twice) run eagerly, as does the CPU.
"""

from __future__ import annotations

import torch

from services.expert.expert_store import ExpertStore

MAX_TOKENS = 512


class PartialGraphs:
    def __init__(self, store: ExpertStore, member):
        self.store, self.member = store, member
        self.on_gpu = store.device.type == "cuda"
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple[int, int, int]] = set()
        self.generation = store.generation
        self.pool = None

    def answer(self, layer: int, tokens: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> None:  # fmt: skip
        """Computes this service's part of the dispatch just received and replies."""
        store, member = self.store, self.member
        if not self.on_gpu or store.collecting or tokens.shape[0] > MAX_TOKENS:
            member.reply(store.compute_partial(layer, tokens, weights, ids))
            return
        if store.generation != self.generation:  # new stacks: the graphs read the old ones
            self.graphs.clear()
            self.seen.clear()
            self.pool, self.generation = None, store.generation
        key = (layer, member.slot, tokens.shape[0])
        graph = self.graphs.get(key)
        if graph is None and key in self.seen:
            graph = self.graphs[key] = self._capture(layer, tokens, weights, ids)
        if graph is None:
            self.seen.add(key)
            member.reply(store.compute_partial(layer, tokens, weights, ids))
            return
        graph.replay()
        member.replied()

    def _capture(self, layer, tokens, weights, ids) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.member.reply(self.store.compute_partial(layer, tokens, weights, ids),
                              keep=True)  # fmt: skip
        self.pool = graph.pool()
        return graph
