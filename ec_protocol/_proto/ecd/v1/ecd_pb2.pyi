from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PRODUCER: _ClassVar[Role]
    ROLE_CONSUMER: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]

class ItemStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATUS_UNSPECIFIED: _ClassVar[ItemStatus]
    ITEM_OK: _ClassVar[ItemStatus]
    ITEM_ALLOCATED: _ClassVar[ItemStatus]
    ITEM_EXISTS: _ClassVar[ItemStatus]
    ITEM_PENDING: _ClassVar[ItemStatus]
    ITEM_NO_SPACE: _ClassVar[ItemStatus]
    ITEM_HIT: _ClassVar[ItemStatus]
    ITEM_MISS: _ClassVar[ItemStatus]
    ITEM_INVALID_ARGUMENT: _ClassVar[ItemStatus]
    ITEM_NOT_FOUND: _ClassVar[ItemStatus]
    ITEM_FAILED_PRECONDITION: _ClassVar[ItemStatus]
    ITEM_PERMISSION_DENIED: _ClassVar[ItemStatus]
    ITEM_RESOURCE_EXHAUSTED: _ClassVar[ItemStatus]

class EntryState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENTRY_STATE_UNSPECIFIED: _ClassVar[EntryState]
    ENTRY_ABSENT: _ClassVar[EntryState]
    ENTRY_PENDING: _ClassVar[EntryState]
    ENTRY_READY: _ClassVar[EntryState]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_SNAPSHOT: _ClassVar[EventType]
    EVENT_SYNCED: _ClassVar[EventType]
    EVENT_COMMITTED: _ClassVar[EventType]
    EVENT_EVICTED: _ClassVar[EventType]
    EVENT_ABORTED: _ClassVar[EventType]
    EVENT_DELETED: _ClassVar[EventType]
    EVENT_POOL_DROPPED: _ClassVar[EventType]
    EVENT_PENDING: _ClassVar[EventType]
ROLE_UNSPECIFIED: Role
ROLE_PRODUCER: Role
ROLE_CONSUMER: Role
ROLE_BOTH: Role
ROLE_ADMIN: Role
ITEM_STATUS_UNSPECIFIED: ItemStatus
ITEM_OK: ItemStatus
ITEM_ALLOCATED: ItemStatus
ITEM_EXISTS: ItemStatus
ITEM_PENDING: ItemStatus
ITEM_NO_SPACE: ItemStatus
ITEM_HIT: ItemStatus
ITEM_MISS: ItemStatus
ITEM_INVALID_ARGUMENT: ItemStatus
ITEM_NOT_FOUND: ItemStatus
ITEM_FAILED_PRECONDITION: ItemStatus
ITEM_PERMISSION_DENIED: ItemStatus
ITEM_RESOURCE_EXHAUSTED: ItemStatus
ENTRY_STATE_UNSPECIFIED: EntryState
ENTRY_ABSENT: EntryState
ENTRY_PENDING: EntryState
ENTRY_READY: EntryState
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_SNAPSHOT: EventType
EVENT_SYNCED: EventType
EVENT_COMMITTED: EventType
EVENT_EVICTED: EventType
EVENT_ABORTED: EventType
EVENT_DELETED: EventType
EVENT_POOL_DROPPED: EventType
EVENT_PENDING: EventType

class Extent(_message.Message):
    __slots__ = ("start", "count")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("shape", "dtype", "nbytes")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "pid", "role")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    role: Role
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("boot_epoch", "session_id", "lease_ttl_ms", "max_batch")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    session_id: str
    lease_ttl_ms: int
    max_batch: int
    def __init__(self, boot_epoch: _Optional[str] = ..., session_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("boot_epoch", "lease_ttl_ms")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    lease_ttl_ms: int
    def __init__(self, boot_epoch: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("boot_epoch", "aborted", "released")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    aborted: int
    released: int
    def __init__(self, boot_epoch: _Optional[str] = ..., aborted: _Optional[int] = ..., released: _Optional[int] = ...) -> None: ...

class OpenPoolRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "block_size_bytes", "capacity_bytes", "compat_key", "ephemeral", "max_entries", "reopen", "cluster_namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REOPEN_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    block_size_bytes: int
    capacity_bytes: int
    compat_key: str
    ephemeral: bool
    max_entries: int
    reopen: bool
    cluster_namespace: str
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., block_size_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., compat_key: _Optional[str] = ..., ephemeral: _Optional[bool] = ..., max_entries: _Optional[int] = ..., reopen: _Optional[bool] = ..., cluster_namespace: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("engine_id", "path", "block_size_bytes", "num_blocks", "data_offset", "file_size", "pool_uuid", "compat_key", "max_entries", "cluster_namespace")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOL_UUID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    path: str
    block_size_bytes: int
    num_blocks: int
    data_offset: int
    file_size: int
    pool_uuid: str
    compat_key: str
    max_entries: int
    cluster_namespace: str
    def __init__(self, engine_id: _Optional[str] = ..., path: _Optional[str] = ..., block_size_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data_offset: _Optional[int] = ..., file_size: _Optional[int] = ..., pool_uuid: _Optional[str] = ..., compat_key: _Optional[str] = ..., max_entries: _Optional[int] = ..., cluster_namespace: _Optional[str] = ...) -> None: ...

class OpenPoolReply(_message.Message):
    __slots__ = ("boot_epoch", "pool", "created", "fd_ticket")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    FD_TICKET_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    pool: PoolInfo
    created: bool
    fd_ticket: str
    def __init__(self, boot_epoch: _Optional[str] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., created: _Optional[bool] = ..., fd_ticket: _Optional[str] = ...) -> None: ...

class DropPoolRequest(_message.Message):
    __slots__ = ("engine_id", "force", "session_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    force: bool
    session_id: str
    def __init__(self, engine_id: _Optional[str] = ..., force: _Optional[bool] = ..., session_id: _Optional[str] = ...) -> None: ...

class DropPoolReply(_message.Message):
    __slots__ = ("boot_epoch", "entries_dropped")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    entries_dropped: int
    def __init__(self, boot_epoch: _Optional[str] = ..., entries_dropped: _Optional[int] = ...) -> None: ...

class AllocateItem(_message.Message):
    __slots__ = ("key", "tensor")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tensor: TensorSpec
    def __init__(self, key: _Optional[bytes] = ..., tensor: _Optional[_Union[TensorSpec, _Mapping]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    items: _containers.RepeatedCompositeFieldContainer[AllocateItem]
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[AllocateItem, _Mapping]]] = ...) -> None: ...

class AllocateResult(_message.Message):
    __slots__ = ("key", "status", "message", "extents", "runs", "allocation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    status: ItemStatus
    message: str
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    runs: _containers.RepeatedScalarFieldContainer[int]
    allocation: int
    def __init__(self, key: _Optional[bytes] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., message: _Optional[str] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., runs: _Optional[_Iterable[int]] = ..., allocation: _Optional[int] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[AllocateResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[AllocateResult, _Mapping]]] = ...) -> None: ...

class CommitItem(_message.Message):
    __slots__ = ("key", "checksum", "allocation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    checksum: int
    allocation: int
    def __init__(self, key: _Optional[bytes] = ..., checksum: _Optional[int] = ..., allocation: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    items: _containers.RepeatedCompositeFieldContainer[CommitItem]
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ...) -> None: ...

class ItemResult(_message.Message):
    __slots__ = ("key", "status", "message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    status: ItemStatus
    message: str
    def __init__(self, key: _Optional[bytes] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "keys", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait_ms: int
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class AcquireResult(_message.Message):
    __slots__ = ("key", "status", "message", "lease_id", "extents", "tensor", "checksum", "runs")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    status: ItemStatus
    message: str
    lease_id: int
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    tensor: TensorSpec
    checksum: int
    runs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., message: _Optional[str] = ..., lease_id: _Optional[int] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., tensor: _Optional[_Union[TensorSpec, _Mapping]] = ..., checksum: _Optional[int] = ..., runs: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[AcquireResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[AcquireResult, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseResult(_message.Message):
    __slots__ = ("lease_id", "status", "message")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    status: ItemStatus
    message: str
    def __init__(self, lease_id: _Optional[int] = ..., status: _Optional[_Union[ItemStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "releases", "commits", "aborts", "acquires", "allocates", "misses", "hits", "local_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATES_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: str
    releases: _containers.RepeatedScalarFieldContainer[int]
    commits: _containers.RepeatedCompositeFieldContainer[CommitItem]
    aborts: _containers.RepeatedScalarFieldContainer[bytes]
    acquires: _containers.RepeatedScalarFieldContainer[bytes]
    allocates: _containers.RepeatedCompositeFieldContainer[AllocateItem]
    misses: int
    hits: _containers.RepeatedScalarFieldContainer[bytes]
    local_only: bool
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., releases: _Optional[_Iterable[int]] = ..., commits: _Optional[_Iterable[_Union[CommitItem, _Mapping]]] = ..., aborts: _Optional[_Iterable[bytes]] = ..., acquires: _Optional[_Iterable[bytes]] = ..., allocates: _Optional[_Iterable[_Union[AllocateItem, _Mapping]]] = ..., misses: _Optional[int] = ..., hits: _Optional[_Iterable[bytes]] = ..., local_only: _Optional[bool] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("boot_epoch", "releases", "commits", "aborts", "acquires", "allocates", "pool_uuid")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATES_FIELD_NUMBER: _ClassVar[int]
    POOL_UUID_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    releases: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    commits: _containers.RepeatedCompositeFieldContainer[ItemResult]
    aborts: _containers.RepeatedCompositeFieldContainer[ItemResult]
    acquires: _containers.RepeatedCompositeFieldContainer[AcquireResult]
    allocates: _containers.RepeatedCompositeFieldContainer[AllocateResult]
    pool_uuid: str
    def __init__(self, boot_epoch: _Optional[str] = ..., releases: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ..., commits: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., aborts: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ..., acquires: _Optional[_Iterable[_Union[AcquireResult, _Mapping]]] = ..., allocates: _Optional[_Iterable[_Union[AllocateResult, _Mapping]]] = ..., pool_uuid: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("engine_id", "keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResult(_message.Message):
    __slots__ = ("key", "state", "nbytes", "pins")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    state: EntryState
    nbytes: int
    pins: int
    def __init__(self, key: _Optional[bytes] = ..., state: _Optional[_Union[EntryState, str]] = ..., nbytes: _Optional[int] = ..., pins: _Optional[int] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[LookupResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[LookupResult, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("engine_id", "keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("engine_id", "keys")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("boot_epoch", "results")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    results: _containers.RepeatedCompositeFieldContainer[ItemResult]
    def __init__(self, boot_epoch: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ItemResult, _Mapping]]] = ...) -> None: ...

class EntryInfo(_message.Message):
    __slots__ = ("key", "state", "tensor", "extents", "pins", "producer", "checksum", "age_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    state: EntryState
    tensor: TensorSpec
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    pins: int
    producer: str
    checksum: int
    age_s: float
    def __init__(self, key: _Optional[bytes] = ..., state: _Optional[_Union[EntryState, str]] = ..., tensor: _Optional[_Union[TensorSpec, _Mapping]] = ..., extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ..., pins: _Optional[int] = ..., producer: _Optional[str] = ..., checksum: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListEntriesRequest(_message.Message):
    __slots__ = ("engine_id", "limit", "start_after")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    limit: int
    start_after: bytes
    def __init__(self, engine_id: _Optional[str] = ..., limit: _Optional[int] = ..., start_after: _Optional[bytes] = ...) -> None: ...

class ListEntriesReply(_message.Message):
    __slots__ = ("boot_epoch", "entries", "truncated")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    entries: _containers.RepeatedCompositeFieldContainer[EntryInfo]
    truncated: bool
    def __init__(self, boot_epoch: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[EntryInfo, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("engine_id", "capacity_bytes", "block_size_bytes", "num_blocks", "free_blocks", "free_extents", "largest_free_extent", "entries_pending", "entries_ready", "entries_pinned", "pins", "hits", "misses", "evictions", "no_space", "commits", "aborts", "bytes_ready", "compat_key", "reserved_bytes", "max_entries", "remote_hits", "remote_misses", "remote_bytes", "remote_seconds_bounds", "remote_seconds_counts", "remote_seconds_sum", "held_blocks", "remote_reads", "entries_locked", "ephemeral", "evictions_for_space", "evictions_for_entries")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_EXTENT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_PENDING_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_READY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_PINNED_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READY_FIELD_NUMBER: _ClassVar[int]
    COMPAT_KEY_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MISSES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SECONDS_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SECONDS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_READS_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_LOCKED_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FOR_SPACE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FOR_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    capacity_bytes: int
    block_size_bytes: int
    num_blocks: int
    free_blocks: int
    free_extents: int
    largest_free_extent: int
    entries_pending: int
    entries_ready: int
    entries_pinned: int
    pins: int
    hits: int
    misses: int
    evictions: int
    no_space: int
    commits: int
    aborts: int
    bytes_ready: int
    compat_key: str
    reserved_bytes: int
    max_entries: int
    remote_hits: int
    remote_misses: int
    remote_bytes: int
    remote_seconds_bounds: _containers.RepeatedScalarFieldContainer[float]
    remote_seconds_counts: _containers.RepeatedScalarFieldContainer[int]
    remote_seconds_sum: float
    held_blocks: int
    remote_reads: int
    entries_locked: int
    ephemeral: bool
    evictions_for_space: int
    evictions_for_entries: int
    def __init__(self, engine_id: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., block_size_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., free_extents: _Optional[int] = ..., largest_free_extent: _Optional[int] = ..., entries_pending: _Optional[int] = ..., entries_ready: _Optional[int] = ..., entries_pinned: _Optional[int] = ..., pins: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., no_space: _Optional[int] = ..., commits: _Optional[int] = ..., aborts: _Optional[int] = ..., bytes_ready: _Optional[int] = ..., compat_key: _Optional[str] = ..., reserved_bytes: _Optional[int] = ..., max_entries: _Optional[int] = ..., remote_hits: _Optional[int] = ..., remote_misses: _Optional[int] = ..., remote_bytes: _Optional[int] = ..., remote_seconds_bounds: _Optional[_Iterable[float]] = ..., remote_seconds_counts: _Optional[_Iterable[int]] = ..., remote_seconds_sum: _Optional[float] = ..., held_blocks: _Optional[int] = ..., remote_reads: _Optional[int] = ..., entries_locked: _Optional[int] = ..., ephemeral: _Optional[bool] = ..., evictions_for_space: _Optional[int] = ..., evictions_for_entries: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("boot_epoch", "uptime_s", "max_bytes", "reserved_bytes", "sessions", "lease_expiries", "pools", "version", "capacity_bytes", "cluster", "refused")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    uptime_s: float
    max_bytes: int
    reserved_bytes: int
    sessions: int
    lease_expiries: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    version: str
    capacity_bytes: int
    cluster: ClusterStats
    refused: _containers.RepeatedCompositeFieldContainer[RefusedPool]
    def __init__(self, boot_epoch: _Optional[str] = ..., uptime_s: _Optional[float] = ..., max_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., version: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., cluster: _Optional[_Union[ClusterStats, _Mapping]] = ..., refused: _Optional[_Iterable[_Union[RefusedPool, _Mapping]]] = ...) -> None: ...

class RefusedPool(_message.Message):
    __slots__ = ("engine_id", "path", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    path: str
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., path: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("master", "connected", "error", "published", "already_stored", "unpublishable", "gone", "publish_failures", "dropped", "lookup_failures", "claims", "claims_lost", "waits_hit", "waits_missed", "leader", "leader_changes", "publishes_retried", "republished", "republish_batches", "last_republish")
    MASTER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    UNPUBLISHABLE_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FAILURES_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_LOST_FIELD_NUMBER: _ClassVar[int]
    WAITS_HIT_FIELD_NUMBER: _ClassVar[int]
    WAITS_MISSED_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_CHANGES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_RETRIED_FIELD_NUMBER: _ClassVar[int]
    REPUBLISHED_FIELD_NUMBER: _ClassVar[int]
    REPUBLISH_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_REPUBLISH_FIELD_NUMBER: _ClassVar[int]
    master: str
    connected: bool
    error: str
    published: int
    already_stored: int
    unpublishable: int
    gone: int
    publish_failures: int
    dropped: int
    lookup_failures: int
    claims: int
    claims_lost: int
    waits_hit: int
    waits_missed: int
    leader: str
    leader_changes: int
    publishes_retried: int
    republished: int
    republish_batches: int
    last_republish: float
    def __init__(self, master: _Optional[str] = ..., connected: _Optional[bool] = ..., error: _Optional[str] = ..., published: _Optional[int] = ..., already_stored: _Optional[int] = ..., unpublishable: _Optional[int] = ..., gone: _Optional[int] = ..., publish_failures: _Optional[int] = ..., dropped: _Optional[int] = ..., lookup_failures: _Optional[int] = ..., claims: _Optional[int] = ..., claims_lost: _Optional[int] = ..., waits_hit: _Optional[int] = ..., waits_missed: _Optional[int] = ..., leader: _Optional[str] = ..., leader_changes: _Optional[int] = ..., publishes_retried: _Optional[int] = ..., republished: _Optional[int] = ..., republish_batches: _Optional[int] = ..., last_republish: _Optional[float] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("engine_id", "snapshot", "include_pending")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PENDING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    snapshot: bool
    include_pending: bool
    def __init__(self, engine_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., include_pending: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("boot_epoch", "type", "engine_id", "key", "nbytes", "slot")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: str
    type: EventType
    engine_id: str
    key: bytes
    nbytes: int
    slot: int
    def __init__(self, boot_epoch: _Optional[str] = ..., type: _Optional[_Union[EventType, str]] = ..., engine_id: _Optional[str] = ..., key: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...
