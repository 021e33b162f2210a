from proto.yinian.v1 import common_pb2 as _common_pb2
from proto.yinian.v1 import scheduler_pb2 as _scheduler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "tenant", "priority", "resume_token_ids", "prefill_worker_id", "prefill_address", "public_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    tenant: str
    priority: int
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_worker_id: str
    prefill_address: str
    public_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tenant: _Optional[str] = ..., priority: _Optional[int] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., public_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "finish_reason", "stop_reason", "prompt_tokens", "cached_tokens", "error", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PositionLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_reason: str
    prompt_tokens: int
    cached_tokens: int
    error: str
    timings: StageTimings
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class LinkUp(_message.Message):
    __slots__ = ("request", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    cancel: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LinkDown(_message.Message):
    __slots__ = ("chunks", "ends")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[GenerateChunk]
    ends: _containers.RepeatedCompositeFieldContainer[LinkEnd]
    def __init__(self, chunks: _Optional[_Iterable[_Union[GenerateChunk, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[LinkEnd, _Mapping]]] = ...) -> None: ...

class LinkEnd(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "transfer_seconds", "first_decode_seconds", "transfer_bytes", "transfer_blocks", "skipped_blocks", "prefill_worker_id", "transport")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    first_decode_seconds: float
    transfer_bytes: int
    transfer_blocks: int
    skipped_blocks: int
    prefill_worker_id: str
    transport: str
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., first_decode_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., transfer_blocks: _Optional[int] = ..., skipped_blocks: _Optional[int] = ..., prefill_worker_id: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "tenant", "skip_blocks", "decode_worker_id", "transport", "transport_target", "lease_seconds", "params", "dst_block_ids", "priority", "public_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_TARGET_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    skip_blocks: int
    decode_worker_id: str
    transport: str
    transport_target: bytes
    lease_seconds: float
    params: _common_pb2.SamplingParams
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    public_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., transport: _Optional[str] = ..., transport_target: _Optional[bytes] = ..., lease_seconds: _Optional[float] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., public_tokens: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("layers_sent", "num_blocks", "bytes", "transfer_seconds", "done", "lease_id", "error", "prefill_seconds", "first_token_id", "first_logprobs", "cached_tokens")
    LAYERS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layers_sent: int
    num_blocks: int
    bytes: int
    transfer_seconds: float
    done: bool
    lease_id: str
    error: str
    prefill_seconds: float
    first_token_id: int
    first_logprobs: _common_pb2.PositionLogprobs
    cached_tokens: int
    def __init__(self, layers_sent: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., done: _Optional[bool] = ..., lease_id: _Optional[str] = ..., error: _Optional[str] = ..., prefill_seconds: _Optional[float] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.PositionLogprobs, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
