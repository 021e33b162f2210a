"""Turns a step's logits into next tokens.

Rows are independent: penalties, logit bias, a grammar's token mask,
temperature, top-k/top-p/min-p and the random draw are applied per row, and
a seeded row draws its noise from its own generator, so its tokens do not
depend on what else is in the batch.
Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which
draws exactly from p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.grammar import MaskJob, apply_masks
from engine.sequence import Logprob, Sequence

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    token_logprobs: list[float]  # logprob of each chosen token under the raw model


class PendingSample:
    """A step's sampled tokens, still on the device: `tokens` feeds the next step's
    inputs there, and `result()` reads them back. On CUDA the copies to the host
    are queued right behind the sampling, so reading them waits for this step
    only, not for steps queued after it."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, wanted: list[int], extra):
        self.seqs = seqs
        self.tokens = tokens
        self._wanted = wanted
        self._event = None
        host = [tokens, *extra]
        if tokens.is_cuda:
            copies = []
            for t in host:
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                copies.append(pinned.copy_(t, non_blocking=True))
            host = copies
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = host
        self._token_ids: list[int] | None = None

    def wait(self) -> None:
        """Until the step that sampled these tokens (and all queued before it) is done."""
        if self._event is not None:
            self._event.synchronize()

    def token_ids(self) -> list[int]:
        """The sampled tokens, one per row, read back once."""
        if self._token_ids is None:
            self.wait()
            self._token_ids = self._host[0].tolist()
        return self._token_ids

    def finish(self) -> PendingSample:
        """Itself: every part of its sampling is queued already."""
        return self

    def result(self) -> SampleResult:
        seqs, wanted = self.seqs, self._wanted
        token_ids = self.token_ids()
        logprobs = [None] * len(seqs)
        token_logprobs = [0.0] * len(seqs)  # only computed for rows that asked for logprobs
        if wanted:
            chosen_lp, ranks, top_vals, top_ids = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(wanted):
                token_logprobs[i] = chosen_lp[j]
                n = seqs[i].params.logprobs
                entry = {
                    tid: Logprob(val, r + 1)
                    for r, (tid, val) in enumerate(zip(top_ids[j][:n], top_vals[j][:n]))
                }
                entry.setdefault(token_ids[i], Logprob(chosen_lp[j], ranks[j]))
                logprobs[i] = entry
        return SampleResult(token_ids, logprobs, token_logprobs)


class DeferredSample:
    """A step's sampling whose grammar masks the mask thread is still filling: its
    `tokens` exist on the device already, written once `finish()` has queued the
    masks and the draw (before the next step is launched, since that reads
    `tokens`; reading the sample back finishes it too)."""

    def __init__(self, sampler, logits, seqs, masks, wanted, raw_logprobs):
        self.seqs = seqs
        self.tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        self._parts = (sampler, logits, seqs, masks, wanted, raw_logprobs)
        self._done: PendingSample | None = None
        self._error: Exception | None = None

    def finish(self) -> DeferredSample:
        """Applies the masks once filled and queues the draw (once). What fails here
        is raised where the sample is read back (`wait`, `token_ids`, `result`)."""
        if self._parts is not None:
            sampler, *parts = self._parts
            self._parts = None
            with torch.inference_mode():  # as the step was launched
                try:
                    self._done = sampler._finish(*parts)
                    self.tokens.copy_(self._done.tokens, non_blocking=True)
                except Exception as exc:  # noqa: BLE001 - the step fails when it is read
                    self._error = exc
                    self.tokens.zero_()  # a token the next step may read, never garbage
        return self

    def _finished(self) -> PendingSample:
        self.finish()
        if self._error is not None:
            raise self._error
        return self._done

    def wait(self) -> None:
        self._finished().wait()

    def token_ids(self) -> list[int]:
        return self._finished().token_ids()

    def result(self) -> SampleResult:
        return self._finished().result()


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: MaskJob | None = None
    ) -> SampleResult:
        """logits: [N, V] float32, row i belonging to seqs[i]."""
        return self.launch(logits, seqs, masks).result()

    def launch(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: MaskJob | None = None
    ) -> PendingSample | DeferredSample:
        """Queues the sampling of every row on the device; nothing waits for it.
        A sequence's tokens still pending count as output (for min_tokens), as do, in
        a run of rows of one sequence (its drafts' rows), the rows before each.
        `masks`: the grammar bitmasks of the constrained rows (grammar.masks_for).
        Where the step before this one ran ahead of its constrained rows, their masks
        are filled on the mask thread meanwhile (`MaskJob.start`) and the rest is
        queued by the returned sample's `finish()`."""
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wanted else None
        made = _made(seqs)
        if masks is not None or any(
            s.params.needs_penalties or s.params.logit_bias or m < s.params.min_tokens
            for s, m in zip(seqs, made)
        ):
            logits = logits.clone()
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.needs_penalties:
                _apply_penalties(logits[row], seq)
            if p.logit_bias:
                bias = _on(logits, list(p.logit_bias.values()), logits.dtype)
                logits[row].index_add_(0, _on(logits, list(p.logit_bias)), bias)
            if made[row] < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else seq.eos_token_ids)
                if banned:
                    logits[row].index_fill_(0, _on(logits, sorted(banned)), _NEG_INF)
        if masks is not None and masks.start():
            return DeferredSample(self, logits, seqs, masks, wanted, raw_logprobs)
        return self._finish(logits, seqs, masks, wanted, raw_logprobs)

    def _finish(self, logits, seqs, masks, wanted, raw_logprobs) -> PendingSample:
        if masks is not None:  # last: no bias or penalty may revive a forbidden token
            apply_masks(logits, masks, _on(logits, masks.rows))
        chosen = self._choose(logits, seqs)
        extra = ()
        if wanted:
            at = _on(logits, wanted)
            rows = raw_logprobs.index_select(0, at)
            chosen_lp = rows.gather(1, chosen.index_select(0, at)[:, None]).squeeze(1)
            ranks = (rows > chosen_lp[:, None]).sum(-1) + 1
            top_n = max(seqs[i].params.logprobs for i in wanted)
            top_vals, top_ids = rows.topk(max(top_n, 1), dim=-1)
            extra = (chosen_lp, ranks, top_vals, top_ids)
        return PendingSample(seqs, chosen, wanted, extra)

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        chosen = logits.argmax(dim=-1)
        if all(s.params.greedy for s in seqs):
            return chosen
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        at = _on(logits, rows)
        probs = _filtered_probs(logits.index_select(0, at), [seqs[i].params for i in rows])
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if seqs[i].generator is None]
        if unseeded:
            drawn = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise.index_copy_(
                0, _on(logits, unseeded), drawn.exponential_(generator=self.generator)
            )
        for j, i in enumerate(rows):
            if seqs[i].generator is not None:
                noise[j].exponential_(generator=seqs[i].generator)
        return chosen.index_copy_(0, at, (probs / noise).argmax(dim=-1))


def _made(seqs: list[Sequence]) -> list[int]:
    """Each row's output tokens before it: its sequence's, and its place in a run of
    rows of that sequence."""
    made, prev, run = [], None, 0
    for seq in seqs:
        run = run + 1 if seq is prev else 0
        prev = seq
        made.append(seq.num_output_tokens + seq.num_pending + run)
    return made


def _on(like: torch.Tensor, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a tensor on `like`'s device. On CUDA it goes through pinned memory
    without blocking: a plain copy from pageable memory would wait for the device to
    finish everything queued, which async scheduling must not do."""
    if like.device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=like.device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(like.device, non_blocking=True)


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    temps = _on(logits, [p.temperature for p in params], logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[1]
        ks = _on(logits, [k if k > 0 else vocab for k in top_ks])
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (ks.clamp(max=vocab) - 1)[:, None])
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):  # decided on the host: no device sync
        top_ps = _on(logits, [p.top_p for p in params], probs.dtype)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0 for p in params):
        min_ps = _on(logits, [p.min_p for p in params], probs.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """vLLM's semantics: repetition over prompt and output, presence/frequency over output."""
    p = seq.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_token_ids)), device=row.device)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if seq.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(seq.output_token_ids, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
