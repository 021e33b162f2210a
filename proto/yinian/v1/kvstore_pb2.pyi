from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_GPU: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_SHARED: _ClassVar[KvTier]
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_GPU: KvTier
KV_TIER_HOST: KvTier
KV_TIER_SHARED: KvTier

class ModelFingerprint(_message.Message):
    __slots__ = ("model_id", "dtype", "block_size", "layout", "num_layers", "format_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    block_size: int
    layout: str
    num_layers: int
    format_version: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., format_version: _Optional[int] = ...) -> None: ...

class BlockHolder(_message.Message):
    __slots__ = ("holder", "tier")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    holder: str
    tier: KvTier
    def __init__(self, holder: _Optional[str] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("block_hash", "holders")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    holders: _containers.RepeatedCompositeFieldContainer[BlockHolder]
    def __init__(self, block_hash: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[BlockHolder, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "fingerprint", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("locations", "shared_prefix_blocks")
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    shared_prefix_blocks: int
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., shared_prefix_blocks: _Optional[int] = ...) -> None: ...

class PutBlock(_message.Message):
    __slots__ = ("tenant", "fingerprint", "block_hash", "parent_hash", "data", "checksum")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    block_hash: int
    parent_hash: int
    data: bytes
    checksum: int
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "already_present", "rejected", "reasons", "rejected_hashes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    rejected: int
    reasons: _containers.RepeatedScalarFieldContainer[str]
    rejected_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., rejected: _Optional[int] = ..., reasons: _Optional[_Iterable[str]] = ..., rejected_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("tenant", "fingerprint", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "data", "checksum")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    parent_hash: int
    data: bytes
    checksum: int
    def __init__(self, block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "blocks", "bytes", "quota_bytes", "hit_blocks", "miss_blocks", "hit_tokens", "miss_tokens", "get_blocks", "get_misses", "stored_blocks", "evictions", "verification_failures", "rejected_puts")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GET_MISSES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    blocks: int
    bytes: int
    quota_bytes: int
    hit_blocks: int
    miss_blocks: int
    hit_tokens: int
    miss_tokens: int
    get_blocks: int
    get_misses: int
    stored_blocks: int
    evictions: int
    verification_failures: int
    rejected_puts: int
    def __init__(self, tenant: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., miss_tokens: _Optional[int] = ..., get_blocks: _Optional[int] = ..., get_misses: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., verification_failures: _Optional[int] = ..., rejected_puts: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tenants", "shared_tier_enabled", "redis_up", "shared_blocks", "shared_bytes", "capacity_bytes", "redis_errors", "redis_latency_mean_ms", "redis_latency_p99_ms")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_TIER_ENABLED_FIELD_NUMBER: _ClassVar[int]
    REDIS_UP_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDIS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REDIS_LATENCY_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    REDIS_LATENCY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    shared_tier_enabled: bool
    redis_up: bool
    shared_blocks: int
    shared_bytes: int
    capacity_bytes: int
    redis_errors: int
    redis_latency_mean_ms: float
    redis_latency_p99_ms: float
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., shared_tier_enabled: _Optional[bool] = ..., redis_up: _Optional[bool] = ..., shared_blocks: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., redis_errors: _Optional[int] = ..., redis_latency_mean_ms: _Optional[float] = ..., redis_latency_p99_ms: _Optional[float] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class RegionBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "offset")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    parent_hash: int
    offset: int
    def __init__(self, block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class PutFromRequest(_message.Message):
    __slots__ = ("tenant", "fingerprint", "region", "block_bytes", "blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    region: SharedRegion
    block_bytes: int
    blocks: _containers.RepeatedCompositeFieldContainer[RegionBlock]
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., region: _Optional[_Union[SharedRegion, _Mapping]] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RegionBlock, _Mapping]]] = ...) -> None: ...

class GetIntoRequest(_message.Message):
    __slots__ = ("tenant", "fingerprint", "region", "block_bytes", "block_hashes", "offsets")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    region: SharedRegion
    block_bytes: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., region: _Optional[_Union[SharedRegion, _Mapping]] = ..., block_bytes: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class GetIntoResponse(_message.Message):
    __slots__ = ("parent_hashes", "checksums")
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    parent_hashes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent_hashes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class LendRequest(_message.Message):
    __slots__ = ("tenant", "fingerprint", "block_bytes", "block_hashes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    fingerprint: ModelFingerprint
    block_bytes: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tenant: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., block_bytes: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class LendResponse(_message.Message):
    __slots__ = ("region", "offsets", "parent_hashes", "checksums", "lease_seconds")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    region: SharedRegion
    offsets: _containers.RepeatedScalarFieldContainer[int]
    parent_hashes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_seconds: float
    def __init__(self, region: _Optional[_Union[SharedRegion, _Mapping]] = ..., offsets: _Optional[_Iterable[int]] = ..., parent_hashes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...
