"""After sampling: append each token, detokenize it, decide whether the
sequence stops, and assemble the per-request outputs.

Stop order follows vLLM: a stop token id, then EOS (unless ignored), then a
stop string in the new text (see TextStream), then a structured output that
is complete, then max_tokens and the context length. A token its grammar
forbids (the sampler's mask rules it out) ends the sequence with an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sequence import FinishReason, Logprob, Sequence


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics
    error: str | None = None
    kv_transfer_params: dict = field(default_factory=dict)
    delta: bool = False  # outputs carry only what is new since the last one
    hold_seconds: float | None = None  # prefill role: keep the blocks this long when done

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens


def process_token(
    seq: Sequence,
    token_id: int,
    token_logprob: float,
    top_logprobs: dict[int, Logprob] | None,
    max_model_len: int,
) -> None:
    """Appends one sampled token and finishes the sequence if it should stop."""
    params = seq.params
    seq.append_token(token_id)
    seq.cumulative_logprob += token_logprob
    if top_logprobs is not None:
        seq.logprobs.append(top_logprobs)
    stop_string = seq.text_stream.append(token_id, seq.num_output_tokens)
    if seq.grammar is not None and not seq.grammar.accept(token_id):
        seq.finish(FinishReason.ERROR, error=f"structured output broke: {seq.grammar.error}")
        return
    if token_id in params.stop_token_ids:
        seq.finish(FinishReason.STOP, stop_reason=token_id)
        return
    if not params.ignore_eos and token_id in seq.eos_token_ids:
        seq.finish(FinishReason.STOP)
        return
    if stop_string is not None:
        seq.finish(FinishReason.STOP, stop_reason=stop_string)
        return
    if seq.grammar is not None and seq.grammar.terminated:  # the structure is complete
        seq.finish(FinishReason.STOP)
        return
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        seq.finish(FinishReason.LENGTH)
    elif len(seq.all_token_ids) >= max_model_len:  # not num_tokens: a token may be pending
        seq.finish(FinishReason.LENGTH)


def make_output(state: RequestState) -> RequestOutput:
    finished = state.finished
    if finished and state.metrics.finished_time is None:
        state.metrics.finished_time = time.monotonic()
    firsts = [s.first_token_time for s in state.seqs if s.first_token_time is not None]
    if firsts:
        state.metrics.first_token_time = min(firsts)
    outputs = [_completion(s, state.delta) for s in state.seqs]
    errors = [s.error for s in state.seqs if s.error]
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=outputs,
        finished=finished,
        num_cached_tokens=state.num_cached_tokens,
        error=state.error or (errors[0] if errors else None),
        metrics=state.metrics,
        kv_transfer_params=state.kv_transfer_params,
    )


def _completion(s: Sequence, delta: bool) -> CompletionOutput:
    text = s.text_stream.visible(s.is_finished)
    tokens, chars = s.num_emitted_tokens if delta else 0, s.num_emitted_chars if delta else 0
    want_logprobs = s.params.logprobs is not None
    out = CompletionOutput(
        index=s.index,
        text=text[chars:],
        token_ids=s.output_token_ids[tokens:],
        cumulative_logprob=s.cumulative_logprob if want_logprobs else None,
        logprobs=s.logprobs[tokens:] if want_logprobs else None,
        finish_reason=s.finish_reason.value if s.finish_reason else None,
        stop_reason=s.stop_reason,
    )
    if delta:
        s.num_emitted_tokens, s.num_emitted_chars = s.num_output_tokens, len(text)
    return out
