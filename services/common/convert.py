"""Engine objects to and from their wire messages."""

from __future__ import annotations

from basis.sampling_params import SamplingParams
from basis.structured_output import StructuredOutput
from proto.yinian.v1 import common_pb2

_FINISH = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        n=p.n,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=p.logit_bias,
    )
    so = p.structured_output
    if so is not None:
        msg.structured_output.CopyFrom(
            common_pb2.StructuredOutput(
                kind=so.kind, spec=so.spec, strict=so.strict, consumed_token_ids=so.consumed
            )
        )
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validates as the engine does: a bad value is a ValueError."""
    return SamplingParams(
        n=msg.n or 1,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        ),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias),
        structured_output=structured_from_proto(msg),
    )


def structured_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured_output"):
        return None
    so = msg.structured_output
    return StructuredOutput(so.kind, so.spec, so.strict, tuple(so.consumed_token_ids))


def finish_to_proto(reason: str | None) -> int:
    return _FINISH[reason]


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAMES.get(value)
