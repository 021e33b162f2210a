from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("block_hash", "holder")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    holder: str
    def __init__(self, block_hash: _Optional[int] = ..., holder: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("tenant", "block_hash", "parent_hash", "layer", "data", "checksum", "dtype", "shape")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    block_hash: int
    parent_hash: int
    layer: int
    data: bytes
    checksum: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., layer: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("tenant", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...
