from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "role", "model", "block_size", "max_num_seqs", "kv_blocks_total", "metrics_address", "transports", "host", "device", "kv_layout", "tensor_parallel_size", "pipeline_parallel_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: str
    model: str
    block_size: int
    max_num_seqs: int
    kv_blocks_total: int
    metrics_address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    host: str
    device: str
    kv_layout: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., metrics_address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., kv_layout: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_seconds", "nats_subject_prefix")
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NATS_SUBJECT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    nats_subject_prefix: str
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ..., nats_subject_prefix: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "block_hashes", "tenant", "exclude_workers", "block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tenant: str
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., tenant: _Optional[str] = ..., exclude_workers: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("worker_id", "address", "matched_blocks", "prefill_worker_id", "prefill_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    matched_blocks: int
    prefill_worker_id: str
    prefill_address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., prefill_worker_id: _Optional[str] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "ready", "seconds_since_report", "num_requests_running", "num_requests_waiting", "kv_cache_usage")
    INFO_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    ready: bool
    seconds_since_report: float
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., ready: _Optional[bool] = ..., seconds_since_report: _Optional[float] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ...) -> None: ...

class PlacementSettings(_message.Message):
    __slots__ = ("max_waiting", "request_tokens", "memory_tokens", "host_hit_weight", "shared_hit_weight", "retry_after_seconds", "disagg_min_tokens", "heartbeat_timeout_seconds")
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHARED_HIT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_waiting: int
    request_tokens: float
    memory_tokens: float
    host_hit_weight: float
    shared_hit_weight: float
    retry_after_seconds: float
    disagg_min_tokens: int
    heartbeat_timeout_seconds: float
    def __init__(self, max_waiting: _Optional[int] = ..., request_tokens: _Optional[float] = ..., memory_tokens: _Optional[float] = ..., host_hit_weight: _Optional[float] = ..., shared_hit_weight: _Optional[float] = ..., retry_after_seconds: _Optional[float] = ..., disagg_min_tokens: _Optional[int] = ..., heartbeat_timeout_seconds: _Optional[float] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "placement")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    placement: PlacementSettings
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., placement: _Optional[_Union[PlacementSettings, _Mapping]] = ...) -> None: ...

class HoldersRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockHolders(_message.Message):
    __slots__ = ("block_hash", "gpu", "host", "shared")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    gpu: _containers.RepeatedScalarFieldContainer[str]
    host: _containers.RepeatedScalarFieldContainer[str]
    shared: bool
    def __init__(self, block_hash: _Optional[int] = ..., gpu: _Optional[_Iterable[str]] = ..., host: _Optional[_Iterable[str]] = ..., shared: _Optional[bool] = ...) -> None: ...

class HoldersResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ...) -> None: ...
