"""The experts an expert service holds, per MoE layer, and their compute.

A placement change loads the new experts beside the held ones ("spare
slots": memory for both until the switch) and frees the old ones only when
the balancer says every worker has switched, so a worker still routing by
the old placement is never refused. Each layer's weights are one stacked
tensor swapped whole, so the serving threads read without locks.

Load counting (tokens per logical expert) runs only while collection is on:
statistics windows, off the rest of the time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from engine.expert_backend import expert_rows
from kernels import ops
from services.expert.expert_weights import ExpertWeights

# Row counts the expert kernels are warmed up at, by powers of two: up to a mailbox
# slot's (a larger dispatch comes in pieces of it; services/expert_parallel/mailbox.py).
WARM_ROWS = 4096


@dataclass(frozen=True)
class _Layer:
    experts: tuple[int, ...]  # logical ids held, in stacking order
    local: torch.Tensor  # [E] logical id -> index in the stack, -1 when not held
    w13: torch.Tensor  # [n, 2I, H]
    w2: torch.Tensor  # [n, H, I]


class ExpertStore:
    def __init__(self, weights: ExpertWeights, dtype: torch.dtype, device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device
        self.num_experts = weights.config.num_experts
        self._lock = threading.Lock()  # loads and frees, one at a time
        self._layers = [self._stack(layer, {}) for layer in range(weights.num_moe_layers)]
        self.held_version = 0
        self.generation = 0  # changes with any layer's stack (what a captured graph reads)
        self.collecting = False
        self._counts = torch.zeros(weights.num_moe_layers, self.num_experts, dtype=torch.int64)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def held(self) -> list[list[int]]:
        return [list(layer.experts) for layer in self._layers]

    def load(self, version: int, per_layer: list[list[int]]) -> int:
        """Adds the experts of `per_layer` not held yet; returns how many it read."""
        self._check(per_layer)
        loaded = 0
        with self._lock:
            for layer, wanted in enumerate(per_layer):
                current = self._layers[layer]
                new = [e for e in dict.fromkeys(wanted) if e not in current.experts]
                if not new:
                    continue
                tensors = {
                    e: (current.w13[i], current.w2[i]) for i, e in enumerate(current.experts)
                }
                for e in new:
                    tensors[e] = self.weights.read(layer, e, self.dtype, self.device)
                self._layers[layer] = self._stack(layer, tensors)
                self.generation += 1
                loaded += len(new)
            self.held_version = max(self.held_version, version)
            if loaded and self.device.type == "cuda":  # the CPU tunes nothing
                # the stack sizes served until the old experts go, and after
                self.warm({len(x.experts) for x in self._layers} | {len(w) for w in per_layer})
        return loaded

    def keep(self, per_layer: list[list[int]]) -> int:
        """Frees every expert not in `per_layer`; returns how many it freed."""
        self._check(per_layer)
        freed = 0
        with self._lock:
            for layer, wanted in enumerate(per_layer):
                current = self._layers[layer]
                kept = {e: (current.w13[i], current.w2[i]) for i, e in enumerate(current.experts)
                        if e in set(wanted)}  # fmt: skip
                if len(kept) != len(current.experts):
                    freed += len(current.experts) - len(kept)
                    self._layers[layer] = self._stack(layer, kept)
                    self.generation += 1
        return freed

    def compute(self, layer: int, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Unweighted outputs of each row's expert, in the rows' order."""
        held = self._layers[layer]
        local = held.local.to(expert_ids.device)[expert_ids]
        if rows.shape[0] and bool((local < 0).any()):
            missing = sorted(set(expert_ids[local < 0].tolist()))
            raise LookupError(f"MoE layer {layer}: experts {missing} are not held here")
        if rows.shape[0] == 0:  # this service got none of the step's tokens
            return rows.new_empty((0, rows.shape[1]))
        if self.collecting:
            self._counts[layer].index_add_(0, expert_ids.cpu(), torch.ones_like(expert_ids.cpu()))
        return expert_rows(rows, held.w13, held.w2, local)

    def compute_partial(self, layer: int, tokens: torch.Tensor, weights: torch.Tensor,
                        expert_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The weighted sum over the pairs of `expert_ids` [T, k] held here (-1: a pair
        of another service) of their experts' outputs, [T, H]: this service's part
        of the layer (the stream path). A pair routed here whose expert is not held
        would add nothing: on the CPU that is checked (a LookupError); on a GPU it
        would cost a host sync per layer, and the rollout keeps it from happening
        (experts are freed only once every worker routes by the new placement)."""
        held = self._layers[layer]
        ids = expert_ids.long()
        local = torch.where(ids >= 0, held.local.to(ids.device)[ids.clamp(min=0)], -1)
        if tokens.device.type == "cpu" and bool(((ids >= 0) & (local < 0)).any()):
            missing = sorted(set(ids[(ids >= 0) & (local < 0)].tolist()))
            raise LookupError(f"MoE layer {layer}: experts {missing} are not held here")
        if self.collecting:
            mine = ids[ids >= 0].cpu()
            self._counts[layer].index_add_(0, mine, torch.ones_like(mine))
        if not held.experts:
            return torch.zeros_like(tokens)
        return ops.fused_moe(tokens, held.w13, held.w2, weights, local.to(torch.int32))

    def warm(self, sizes: set[int], most_rows: int = WARM_ROWS) -> None:
        """Runs the expert kernels once at every power-of-two row count up to `most_rows`
        for stacks of each size in `sizes` (rows of pairs, as the mailbox path sends
        them, and tokens with all their pairs, as the stream path does): their tuning
        (seconds per shape on a fresh machine) then happens here, before the balancer
        hands the placement to the workers, not inside a dispatch whose timeout it
        would overrun."""
        biggest = max(self._layers, key=lambda x: len(x.experts))
        hidden = biggest.w13.shape[2]
        top_k = max(1, self.weights.config.num_experts_per_tok)
        with torch.inference_mode():
            for size in sorted(k for k in sizes if 0 < k <= len(biggest.experts)):
                w13, w2 = biggest.w13[:size], biggest.w2[:size]
                rows = 1
                while rows <= most_rows:
                    x = torch.zeros(rows, hidden, dtype=self.dtype, device=self.device)
                    ids = torch.arange(rows * top_k, device=self.device) % size
                    expert_rows(x, w13, w2, ids[:rows])  # the mailbox path: rows of pairs
                    weights = torch.ones(rows, top_k, device=self.device)
                    ops.fused_moe(x, w13, w2, weights, ids.view(rows, top_k).to(torch.int32))
                    rows *= 2
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def take_counts(self) -> torch.Tensor:
        """Tokens per (layer, logical expert) since the last call; resets."""
        counts, self._counts = self._counts, torch.zeros_like(self._counts)
        return counts

    def _check(self, per_layer: list[list[int]]) -> None:
        if len(per_layer) != self.num_layers:
            raise ValueError(f"expected experts for {self.num_layers} MoE layers, "
                             f"got {len(per_layer)}")  # fmt: skip
        for experts in per_layer:
            for e in experts:
                if not 0 <= e < self.num_experts:
                    raise ValueError(f"no expert {e}: the model has {self.num_experts}")

    def _stack(self, layer: int, tensors: dict[int, tuple]) -> _Layer:
        experts = tuple(sorted(tensors))
        local = torch.full((self.num_experts,), -1, dtype=torch.int64)
        local[list(experts)] = torch.arange(len(experts))
        if experts:
            w13 = torch.stack([tensors[e][0] for e in experts])
            w2 = torch.stack([tensors[e][1] for e in experts])
        else:
            config = self.weights.config
            h, w = config.hidden_size, config.moe_intermediate_size
            w13 = torch.empty(0, 2 * w, h, dtype=self.dtype, device=self.device)
            w2 = torch.empty(0, h, w, dtype=self.dtype, device=self.device)
        return _Layer(experts, local.to(self.device), w13, w2)
