"""The client library's values: what it sends and what the daemon answers, as plain dataclasses."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ec_client.layout import tensor_nbytes

Key = str | bytes


def key_bytes(key: Key) -> bytes:
    """Keys travel as bytes; a str key (e.g. an mm_hash hex digest) is its UTF-8 encoding."""
    return key.encode() if isinstance(key, str) else key


class Status(enum.Enum):
    """The outcome of one item of a batched call."""

    OK = "ok"
    ALLOCATED = "allocated"
    EXISTS = "exists"
    PENDING = "pending"
    NO_SPACE = "no_space"
    HIT = "hit"
    MISS = "miss"
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    FAILED_PRECONDITION = "failed_precondition"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"

    @property
    def is_error(self) -> bool:
        return self in _ERRORS


_ERRORS = {
    Status.INVALID_ARGUMENT,
    Status.NOT_FOUND,
    Status.FAILED_PRECONDITION,
    Status.PERMISSION_DENIED,
    Status.RESOURCE_EXHAUSTED,
}


class EntryState(enum.Enum):
    ABSENT = "absent"
    PENDING = "pending"
    READY = "ready"


class EventType(enum.Enum):
    SNAPSHOT = "snapshot"
    SYNCED = "synced"
    COMMITTED = "committed"
    EVICTED = "evicted"
    ABORTED = "aborted"
    DELETED = "deleted"
    POOL_DROPPED = "pool_dropped"


class Role(enum.Enum):
    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"
    ADMIN = "admin"


@dataclass(frozen=True, order=True, slots=True)
class Extent:
    """`count` blocks from block `start`."""

    start: int
    count: int


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class AllocateItem:
    """One entry to allocate. nbytes defaults to what shape and dtype imply."""

    key: Key
    shape: tuple[int, ...]
    dtype: str
    nbytes: int | None = None

    @property
    def spec(self) -> TensorSpec:
        nbytes = self.nbytes if self.nbytes is not None else tensor_nbytes(self.shape, self.dtype)
        return TensorSpec(tuple(self.shape), self.dtype, nbytes)


@dataclass(frozen=True)
class PoolInfo:
    engine_id: str
    path: str
    block_size_bytes: int
    num_blocks: int
    data_offset: int
    file_size: int
    pool_uuid: str
    compat_key: str
    max_entries: int
    created: bool


@dataclass(frozen=True)
class AllocateResult:
    key: bytes
    status: Status
    message: str
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class ItemResult:
    key: bytes
    status: Status
    message: str


@dataclass(frozen=True)
class AcquireResult:
    key: bytes
    status: Status
    message: str
    lease_id: int
    extents: tuple[Extent, ...]
    spec: TensorSpec | None  # set on HIT
    checksum: int


@dataclass(frozen=True)
class LeaseResult:
    lease_id: int
    status: Status
    message: str


@dataclass(frozen=True)
class LookupResult:
    key: bytes
    state: EntryState
    nbytes: int
    pins: int


@dataclass(frozen=True)
class EntryInfo:
    key: bytes
    state: EntryState
    spec: TensorSpec
    extents: tuple[Extent, ...]
    pins: int
    producer: str
    checksum: int
    age_s: float


@dataclass(frozen=True)
class PoolStats:
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


@dataclass(frozen=True)
class Stats:
    boot_epoch: str
    uptime_s: float
    max_bytes: int
    reserved_bytes: int
    sessions: int
    lease_expiries: int
    version: str
    pools: tuple[PoolStats, ...]


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    engine_id: str
    key: bytes
    nbytes: int
    boot_epoch: str
