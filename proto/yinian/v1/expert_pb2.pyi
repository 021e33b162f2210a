from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertBatch(_message.Message):
    __slots__ = ("layer", "expert_ids", "activations", "dtype", "hidden_size")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    activations: bytes
    dtype: str
    hidden_size: int
    def __init__(self, layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., activations: _Optional[bytes] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ...) -> None: ...

class ExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("worker_id", "num_layers", "num_experts", "counts")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_layers: int
    num_experts: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...
