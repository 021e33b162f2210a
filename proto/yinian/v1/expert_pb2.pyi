from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertServiceInfo(_message.Message):
    __slots__ = ("expert_id", "address", "model", "slots", "host", "device", "dtype", "num_moe_layers", "num_experts", "hidden_size", "metrics_address")
    EXPERT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    expert_id: str
    address: str
    model: str
    slots: int
    host: str
    device: str
    dtype: str
    num_moe_layers: int
    num_experts: int
    hidden_size: int
    metrics_address: str
    def __init__(self, expert_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., slots: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., num_moe_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class RegisterExpertResponse(_message.Message):
    __slots__ = ("report_interval_seconds",)
    REPORT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    report_interval_seconds: float
    def __init__(self, report_interval_seconds: _Optional[float] = ...) -> None: ...

class DeregisterExpertRequest(_message.Message):
    __slots__ = ("expert_id",)
    EXPERT_ID_FIELD_NUMBER: _ClassVar[int]
    expert_id: str
    def __init__(self, expert_id: _Optional[str] = ...) -> None: ...

class DeregisterExpertResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertMember(_message.Message):
    __slots__ = ("expert_id", "address", "host", "device")
    EXPERT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    expert_id: str
    address: str
    host: str
    device: str
    def __init__(self, expert_id: _Optional[str] = ..., address: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ExpertPlacement(_message.Message):
    __slots__ = ("version", "members", "slots_per_member", "num_moe_layers", "num_experts", "phy2log", "model")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PER_MEMBER_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    version: int
    members: _containers.RepeatedCompositeFieldContainer[ExpertMember]
    slots_per_member: int
    num_moe_layers: int
    num_experts: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[ExpertMember, _Mapping]]] = ..., slots_per_member: _Optional[int] = ..., num_moe_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class PlacementRequest(_message.Message):
    __slots__ = ("worker_id", "applied_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    applied_version: int
    def __init__(self, worker_id: _Optional[str] = ..., applied_version: _Optional[int] = ...) -> None: ...

class LostExperts(_message.Message):
    __slots__ = ("worker_id", "expert_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    expert_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., expert_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ExpertSet(_message.Message):
    __slots__ = ("version", "layer_offsets", "experts")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    layer_offsets: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., layer_offsets: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertSetResponse(_message.Message):
    __slots__ = ("loaded", "freed", "held")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    loaded: int
    freed: int
    held: int
    def __init__(self, loaded: _Optional[int] = ..., freed: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("group_id", "store_host", "store_port", "rank", "world_size", "backend", "dtype", "hidden_size", "model", "timeout_seconds", "mailbox")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    store_host: str
    store_port: int
    rank: int
    world_size: int
    backend: str
    dtype: str
    hidden_size: int
    model: str
    timeout_seconds: float
    mailbox: bytes
    def __init__(self, group_id: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., model: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., mailbox: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("version", "imbalance_before", "imbalance_after", "window_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    imbalance_before: _containers.RepeatedScalarFieldContainer[float]
    imbalance_after: _containers.RepeatedScalarFieldContainer[float]
    window_tokens: int
    def __init__(self, version: _Optional[int] = ..., imbalance_before: _Optional[_Iterable[float]] = ..., imbalance_after: _Optional[_Iterable[float]] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class ExpertStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertStatus(_message.Message):
    __slots__ = ("placement", "measured_imbalance", "service_tokens", "workers", "rebalances", "window_load")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REBALANCES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LOAD_FIELD_NUMBER: _ClassVar[int]
    placement: ExpertPlacement
    measured_imbalance: _containers.RepeatedScalarFieldContainer[float]
    service_tokens: _containers.RepeatedScalarFieldContainer[float]
    workers: _containers.RepeatedScalarFieldContainer[str]
    rebalances: int
    window_load: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, placement: _Optional[_Union[ExpertPlacement, _Mapping]] = ..., measured_imbalance: _Optional[_Iterable[float]] = ..., service_tokens: _Optional[_Iterable[float]] = ..., workers: _Optional[_Iterable[str]] = ..., rebalances: _Optional[int] = ..., window_load: _Optional[_Iterable[float]] = ...) -> None: ...

class ExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadCollection(_message.Message):
    __slots__ = ("on",)
    ON_FIELD_NUMBER: _ClassVar[int]
    on: bool
    def __init__(self, on: _Optional[bool] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("expert_id", "num_layers", "num_experts", "counts", "collecting", "held_version")
    EXPERT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    COLLECTING_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    expert_id: str
    num_layers: int
    num_experts: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    collecting: bool
    held_version: int
    def __init__(self, expert_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., collecting: _Optional[bool] = ..., held_version: _Optional[int] = ...) -> None: ...
