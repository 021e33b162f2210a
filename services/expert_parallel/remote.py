"""The worker's remote expert backend: per MoE layer, each (token, k) pair goes
to a slot of its expert by the placement's `log2phy` (replicas in turn), the
rows of each expert service travel in one all-to-all, and `combine` puts the
returned outputs back in pair order and takes the weighted sum the fused MoE
kernel takes.

Exactness: a service computes an expert's rows with the same fused MoE
reference, rows in the order they were routed, so when an expert's pairs all
go to one slot the outputs are bit-identical to in-process compute. Pairs split
over replicas (or micro-batches) make smaller matmuls, whose float32 sums may
round differently in the last bit (~1e-7 relative); greedy tokens stay equal.

Faults: a failed or timed-out collective aborts the group (which ends the
members' waits at once), the dispatches in flight are computed here from the
worker's own weights, and every later one too until the control loop
installs a new group at a step boundary; `on_failure` tells it to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.expert_backend import ExpertBackend, expert_rows
from kernels import ops
from kernels.reference import moe_sum
from services.expert_parallel import metrics
from services.expert_parallel.group import ExpertGroup
from services.expert_parallel.placement import Placement
from services.expert_parallel.step_record import StepRecord
from services.expert_parallel.wire import Transfer

logger = logging.getLogger(__name__)


@dataclass
class _Sent:
    moe: object
    hidden: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    transfer: Transfer | None = None  # None: computed locally in full (`out`)
    remote_pairs: torch.Tensor | None = None  # flat pair index of each result row
    local_pairs: torch.Tensor | None = None
    local_out: torch.Tensor | None = None
    out: torch.Tensor | None = None
    partial: bool = False  # the stream path: `transfer` answers with the layer's sum
    issued: float = field(default_factory=time.monotonic)


class RemoteExperts(ExpertBackend):
    def __init__(self, worker_id: str, moe_layers: list[int], on_failure: Callable[[], None],
                 tracer=None):  # fmt: skip
        self.worker_id = worker_id
        self.moe_index = {layer: i for i, layer in enumerate(moe_layers)}
        self.on_failure = on_failure
        self.group: ExpertGroup | None = None
        self.placement: Placement | None = None
        self.broken = False
        self._next: tuple[ExpertGroup | None, Placement] | None = None
        self._lock = threading.Lock()
        self._inflight: list[_Sent] = []
        self._turn = 0  # advances per dispatch: where each expert's replicas start
        self.record = StepRecord(worker_id, tracer)
        self._pairs: torch.Tensor | None = None  # [remote, local] on the device, this step
        self._moes: dict[int, object] = {}  # MoE layer index -> its module (the stream path)
        self._epoch = 0  # changes with what a captured step bakes in (group, placement, broken)

    # -- the control loop's side ---------------------------------------------
    def install(self, group: ExpertGroup | None, placement: Placement) -> None:
        """Routes by `placement` over `group` from the next step boundary on."""
        with self._lock:
            replaced, self._next = self._next, (group, placement)
        if replaced is not None and replaced[0] not in (None, group, self.group):
            replaced[0].close(graceful=True)  # formed, never used

    @property
    def applied_version(self) -> int:
        return self.placement.version if self.placement is not None else 0

    # -- the engine thread's side -----------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """A CUDA graph may capture the dispatches: computed here (no group, or it
        failed) or over the stream path; the mailboxes and collectives read counts on
        the host."""
        if self.group is None or self.broken or self.applied_version == 0:
            return True
        return bool(getattr(self.group.port, "partial", False))

    def graph_epoch(self) -> int | None:
        self._apply_pending()
        return self._epoch if self.graph_safe else None

    def after_replay(self) -> None:
        self._read_pairs()

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._next = self._next, None
        if pending is None:
            return
        old = self.group
        self.group, self.placement = pending
        self.broken = False
        self._epoch += 1
        if self.group is not None and hasattr(self.group.port, "guard"):
            self.group.port.guard(self._stand_in, self._member_lost)
        if old is not None and old is not self.group:
            old.close(graceful=True)
        metrics.PLACEMENT_VERSION.labels(worker=self.worker_id).set(self.applied_version)

    def begin_step(self) -> None:
        self._apply_pending()
        if self.group is not None and hasattr(self.group.port, "begin_step"):
            self.group.port.begin_step()  # the stream path takes its slots in step order
        self.record.begin(self.applied_version)

    def end_step(self) -> None:
        for sent in self._inflight:  # a micro-batch that failed left these
            self._settle(sent)
        self._inflight.clear()
        if not (self._pairs is not None and self._pairs.is_cuda
                and torch.cuda.is_current_stream_capturing()):  # fmt: skip
            self._read_pairs()
        self.record.end()

    def _read_pairs(self) -> None:
        """The stream path's pairs, counted on the device: read once a step."""
        if self._pairs is not None:
            remote, local = self._pairs.tolist()
            self.record.tokens(remote, local)
            self._pairs.zero_()

    def dispatch(self, moe, hidden, topk_weights, topk_ids):
        started = time.monotonic()
        sent = _Sent(moe, hidden, topk_weights, topk_ids)
        try:
            self._send(sent)
        except Exception as exc:  # an aborted group refuses new work
            self._fail(f"dispatch: {exc}")
            sent.transfer = None
        if sent.transfer is None and sent.out is None:  # no group (yet), or it failed
            sent.out = ops.fused_moe(hidden, moe.w13, moe.w2, topk_weights, topk_ids)
            self.record.tokens(0, topk_ids.numel())
        self._inflight.append(sent)
        self.record.dispatched(time.monotonic() - started)
        return sent

    def combine(self, sent: _Sent) -> torch.Tensor:
        self._inflight.remove(sent)
        return self._settle(sent)

    # -- inside ------------------------------------------------------------
    def _send(self, sent: _Sent) -> None:
        group, placement = self.group, self.placement
        if group is None or placement is None or placement.version == 0 or self.broken:
            return
        layer = self.moe_index[sent.moe.layer_index]
        flat = sent.ids.reshape(-1)
        self._turn += 1
        slots = placement.route(layer, flat, self._turn)
        member = torch.where(slots >= 0, slots // placement.slots_per_member, -1)
        if getattr(group.port, "partial", False):
            self._send_partial(sent, group, layer, member)
            return
        remote = (member >= 0).nonzero().view(-1)
        if remote.numel() == 0:
            return
        order = torch.argsort(member[remote], stable=True)
        pairs = remote[order]
        counts = torch.bincount(member[pairs], minlength=len(group.members)).tolist()
        top_k = sent.ids.shape[1]
        rows = sent.hidden[pairs // top_k]
        sent.transfer = group.port.send(layer, counts, rows, flat[pairs])
        sent.remote_pairs = pairs
        local = (member < 0).nonzero().view(-1)
        if local.numel():  # computed here while the services work on the rest
            sent.local_pairs = local
            sent.local_out = expert_rows(sent.hidden[local // top_k], sent.moe.w13,
                                         sent.moe.w2, flat[local])  # fmt: skip
        self.record.tokens(remote.numel(), local.numel())

    def _send_partial(self, sent: _Sent, group, layer: int, member: torch.Tensor) -> None:
        """The stream path: every member gets every token and its own pairs' expert ids
        (-1 for the others'), and answers with its part of the layer; the pairs no
        member holds are this worker's part. No device value is read here."""
        shape = sent.ids.shape
        ranks = torch.arange(len(group.members), device=member.device)[:, None]
        member_ids = torch.where(member[None, :] == ranks, sent.ids.reshape(1, -1), -1)
        sent.transfer = group.port.send(layer, sent.hidden, sent.weights,
                                        member_ids.view(len(group.members), *shape))  # fmt: skip
        sent.partial = True
        self._moes[layer] = sent.moe  # what a stand-in for a lost member computes with
        if self._pairs is None or self._pairs.device != member.device:
            self._pairs = torch.zeros(2, dtype=torch.int64, device=member.device)
        self._pairs[0] += (member >= 0).sum()  # in place, no host read: a graph may hold it
        self._pairs[1] += (member < 0).sum()
        if self.placement.has_local(layer):  # experts no member holds: computed here
            mine = torch.where(member < 0, sent.ids.reshape(-1), -1).view(shape)
            sent.local_out = ops.fused_moe(sent.hidden, sent.moe.w13, sent.moe.w2,
                                           sent.weights, mine.contiguous())  # fmt: skip

    def _settle(self, sent: _Sent) -> torch.Tensor:
        if sent.out is not None:
            return sent.out
        called = time.monotonic()
        ready = sent.transfer.done()
        try:
            results = sent.transfer.wait()
        except Exception as exc:
            self._fail(f"combine: {exc}")
            sent.out = ops.fused_moe(sent.hidden, sent.moe.w13, sent.moe.w2, sent.weights,
                                     sent.ids)  # fmt: skip
            return sent.out
        finished = time.monotonic()
        self.record.combined(finished - called, finished - sent.issued, ready)
        if sent.partial:  # the stream path: the members' parts, added up, plus ours
            sent.out = results if sent.local_out is None else results.add_(sent.local_out)
            return sent.out
        tokens, top_k = sent.ids.shape
        pair_out = torch.empty(tokens * top_k, sent.hidden.shape[1], dtype=sent.hidden.dtype,
                               device=sent.hidden.device)  # fmt: skip
        pair_out[sent.remote_pairs] = results
        if sent.local_pairs is not None:
            pair_out[sent.local_pairs] = sent.local_out
        sent.out = moe_sum(pair_out.view(tokens, top_k, -1), sent.weights)
        return sent.out

    def _stand_in(self, layer: int, tokens, weights, ids) -> torch.Tensor:
        """A lost stream member's part of a dispatch, from this worker's experts (the
        stand-in's thread, services/expert_parallel/stream_stand_in.py)."""
        moe = self._moes[layer]
        return ops.fused_moe(tokens, moe.w13, moe.w2, weights, ids.contiguous())

    def _member_lost(self, member: int) -> None:
        """A stream member died (the watchdog's or the engine thread): its stand-in
        answers what is in flight; the next dispatches are computed here until the
        control loop forms a new group, which replaces this one at a step boundary
        (closing it mid-step would leave the stream's waits unanswered)."""
        metrics.FALLBACKS.labels(worker=self.worker_id).inc()
        self.record.fell_back()
        if not self.broken:
            self.broken = True
            self._epoch += 1  # a captured step would still send to the lost member
            logger.warning("expert service %d stopped answering; computing experts locally "
                           "until a new group is formed", member + 1)  # fmt: skip
            self.on_failure()

    def _fail(self, why: str) -> None:
        metrics.FALLBACKS.labels(worker=self.worker_id).inc()
        self.record.fell_back()
        if self.broken:
            return
        self.broken = True
        self._epoch += 1
        logger.warning("expert group failed (%s); computing experts locally until a new "
                       "group is formed", why)  # fmt: skip
        # A stream group stays open until the next one replaces it at a step boundary:
        # a dispatch already queued waits on its members' answers (a GPU's stream does)
        if self.group is not None and not getattr(self.group.port, "partial", False):
            self.group.close(graceful=False)
        self.on_failure()
