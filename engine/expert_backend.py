"""Where a MoE layer's routed experts run: the one narrow interface the model
calls per MoE layer and micro-batch.

    handle = experts.dispatch(moe, hidden, topk_weights, topk_ids)
    ...  # other work: the other micro-batch's attention, shared experts
    out = experts.combine(handle)  # [T, hidden], the weighted sum over the top-k

`LocalExperts` is the in-process path (the fused MoE kernel on this process's
weights); a remote backend (services/expert_parallel) sends the tokens to
expert services instead. The engine knows nothing of how a backend moves
tensors; a backend gets step boundaries to switch its placement at.
"""

from __future__ import annotations

import torch

from kernels import ops


class ExpertBackend:
    # Whether a CUDA graph may capture dispatch and combine.
    graph_safe = True
    # Whether dispatch adds the pairs to moe.expert_load itself (else the layer does).
    counts_load = False
    # Whether dispatch's output includes the layer's shared experts (moe.shared_weights()).
    runs_shared = False

    def graph_epoch(self) -> int | None:
        """Before a captured step replays (its begin_step does not run): applies what
        changed since the last step and returns a number that changes whenever a
        capture would bake in something else; None while no graph may hold the
        experts (the step then runs eagerly)."""
        return 0 if self.graph_safe else None

    def after_replay(self) -> None:
        """A captured step ran (its end_step did not)."""

    def begin_step(self) -> None:
        """A step starts: nothing of the last one is in flight (a placement may change)."""

    def end_step(self) -> None:
        """The step's last combine is done."""

    def dispatch(self, moe, hidden, topk_weights, topk_ids):
        """Sends each token's hidden state to its top-k experts of layer `moe`
        (a SparseMoE: its `layer_index` and, for local compute, `w13`/`w2`)."""
        raise NotImplementedError

    def combine(self, handle) -> torch.Tensor:
        """The routed experts' output of a dispatch: sum_k w_k * expert_k(x)."""
        raise NotImplementedError


class LocalExperts(ExpertBackend):
    """Today's path: every routed expert in this process, one fused MoE call, which also
    counts the experts' load and runs the layer's shared experts, inside its kernels."""

    counts_load = True
    runs_shared = True

    def dispatch(self, moe, hidden, topk_weights, topk_ids):
        return ops.fused_moe(hidden, moe.w13, moe.w2, topk_weights, topk_ids, moe.expert_load,
                             moe.shared_weights())  # fmt: skip

    def combine(self, handle) -> torch.Tensor:
        return handle


LOCAL_EXPERTS = LocalExperts()


def expert_rows(hidden, w13, w2, expert_ids) -> torch.Tensor:
    """Unweighted expert outputs of rows [n, H] for their expert ids [n] (each an
    index into w13/w2): the fused MoE with top-1 and weight 1, so the rows of one
    expert are computed together and in order, exactly as the full fused MoE
    computes them. What an expert service (or a worker for the pairs it keeps)
    returns for the worker's weighted sum (`kernels.reference.moe_sum`)."""
    ones = torch.ones(expert_ids.shape[0], 1, dtype=torch.float32, device=hidden.device)
    return ops.fused_moe(hidden, w13, w2, ones, expert_ids.view(-1, 1).contiguous())
