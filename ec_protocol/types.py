"""The values of the ecd API, declared once: what clients send and what the daemon answers.

Plain dataclasses and enums, free of torch and gRPC, so that the daemon's core speaks in the same
values as the clients (it imports this module, as it imports `layout`), and each value is mapped
to and from its protobuf message in one place on each side (ec_daemon.server.service,
ec_client.control._wire).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ec_protocol.dtypes import tensor_nbytes

Key = str | bytes


def key_bytes(key: Key) -> bytes:
    """Keys travel as bytes; a str key (e.g. an mm_hash hex digest) is its UTF-8 encoding."""
    return key.encode() if isinstance(key, str) else key


class Status(enum.Enum):
    """The outcome of one item of a batched call (the proto's ItemStatus without its prefix)."""

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
    """Where an entry is in its life: PENDING (allocated, being written) -> READY (committed)."""

    ABSENT = "absent"
    PENDING = "pending"
    READY = "ready"


class EventType(enum.Enum):
    """What a Watch event says. SNAPSHOT and SYNCED exist only on a stream; the others are what
    the daemon's core publishes as entries change. PENDING reaches only watchers that ask for
    it (include_pending): an entry was allocated, its producer is writing it."""

    SNAPSHOT = "snapshot"
    SYNCED = "synced"
    COMMITTED = "committed"
    EVICTED = "evicted"
    ABORTED = "aborted"
    DELETED = "deleted"
    POOL_DROPPED = "pool_dropped"
    PENDING = "pending"


class Role(enum.Enum):
    """What a session may do: producers Allocate, Commit and Abort; consumers Acquire and
    Release; BOTH may do either; ADMIN sessions (operator tools) neither. Operator RPCs (Evict,
    Delete, DropPool, Stats, ...) take no session and are governed by access lists instead."""

    PRODUCER = "producer"
    CONSUMER = "consumer"
    BOTH = "both"
    ADMIN = "admin"


@dataclass(frozen=True, order=True, slots=True, init=False)
class Extent:
    """`count` blocks from block `start`."""

    start: int
    count: int

    def __init__(self, start: int, count: int) -> None:
        # The frozen dataclass's own __init__, but through the slots' descriptors, not two calls
        # of object.__setattr__: a third the cost, and a restart builds 100,000 extents
        # (docs/performance.md, *A warm restart*).
        _set_start(self, start)
        _set_count(self, count)

    @property
    def end(self) -> int:
        return self.start + self.count


_set_start = Extent.__dict__["start"].__set__
_set_count = Extent.__dict__["count"].__set__


@dataclass(slots=True)
class TensorSpec:
    """Shape and dtype of a stored tensor, so a consumer can rebuild it without the model.
    Slotted, not frozen: built per item on the hot path (see ItemResult); never changed."""

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
    cluster_namespace: str = ""  # shared through the daemon's Mooncake Store under it; "" not
    # What this OpenPool's reply gave to redeem for the pool's file on the daemon's fd channel
    # (ec_protocol/pool/fd_passing.py); "" for none. Good once, for seconds: no part of the value.
    fd_ticket: str = field(default="", compare=False, repr=False)


# The results of item calls are built once per item on both sides of every hot-path call, so
# they are plain slotted dataclasses: a frozen one costs several times as much to build
# (docs/performance.md, Per-item costs). Treat them as values all the same.


@dataclass(slots=True)
class ItemResult:
    """One item's answer to a batched call: its status and, for errors, what was wrong."""

    key: bytes
    status: Status
    message: str


# One Commit as it goes on the wire: (key, checksum, allocation); a checksum of 0 means none, an
# allocation of 0 the session's PENDING allocation of the key, whichever it is.
CommitItem = tuple[bytes, int, int]


@dataclass(slots=True)
class AllocateResult(ItemResult):
    extents: tuple[Extent, ...]  # ALLOCATED: where to write, in order
    # ALLOCATED: which allocation this is; a Commit naming it commits it and no later one
    allocation: int = 0


@dataclass(slots=True)
class AcquireResult(ItemResult):
    """On HIT: the pin's lease (release it once the bytes are read), where the bytes are, and
    what they hold; zero and empty otherwise."""

    lease_id: int
    extents: tuple[Extent, ...]
    spec: TensorSpec | None
    checksum: int


@dataclass(slots=True)
class LeaseResult:
    """Release's answer for one lease (pins are named by lease, not by key)."""

    lease_id: int
    status: Status
    message: str


# StepRequest.hits carries at most this many keys, and StepRequest.misses at most this many
# misses, whatever the daemon's --max-batch (limits of the protocol, so that a client needs no
# word from the daemon to keep to them): a client owing more sends the rest in its next Step.
# Bounded so that no caller can drive the daemon's counters far with one call.
MAX_HITS_PER_STEP = 4096
MAX_MISSES_PER_STEP = MAX_HITS_PER_STEP


@dataclass(frozen=True)
class StepResult:
    """A Step's answers, part by part, each in the order of its items."""

    releases: list[LeaseResult]
    commits: list[ItemResult]
    aborts: list[ItemResult]
    acquires: list[AcquireResult]
    allocates: list[AllocateResult]
    # The pool file whose blocks the acquires' and allocates' extents name (PoolInfo.pool_uuid);
    # "" when the daemon could not say (the pool recreated while the Step ran).
    pool_uuid: str = ""


@dataclass(slots=True)
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
    compat_key: str
    reserved_bytes: int  # the pool file: capacity_bytes plus its header and slot table
    max_entries: int
    remote_hits: int
    remote_misses: int
    remote_bytes: int
    remote_seconds_bounds: tuple[float, ...]  # a histogram of remote hits' seconds: bounds,
    remote_seconds_counts: tuple[int, ...]  # the count under each (and one over the last),
    remote_seconds_sum: float  # and their sum
    held_blocks: int  # blocks of removed entries still pinned, locked or written (not free yet)
    remote_reads: int  # transfer-engine reads started by pulls (one per remote hit)
    entries_locked: int  # slots readers hold lock pins on now (docs/design.md §5)
    ephemeral: bool = False  # dropped when the last session that opened it ends (§3)
    # Of `evictions`, those that made room for an allocation: its blocks, or only a slot, the
    # slot table full while the blocks were free (the rest are operators' Evicts).
    evictions_for_space: int = 0
    evictions_for_entries: int = 0


@dataclass(frozen=True)
class ClusterStats:
    """The daemon's part in a Mooncake Store (`ecd serve --store-master`): whether it is
    connected, and what became of the commits of its shared pools."""

    master: str  # --store-master: HOST:PORT, or etcd://HOST:PORT[;...] of several masters
    connected: bool
    error: str  # why it is not connected; empty when it is
    published: int
    already_stored: int  # the store had the key: not written again
    unpublishable: int  # not 2-D, or a dtype the format lacks: stays on its node
    gone: int  # evicted or removed before its turn
    publish_failures: int
    dropped: int  # the queue was full
    lookup_failures: int  # remote lookups or reads not made: the master did not answer
    # Single flight across the cluster (docs/design.md §13): pending markers this node wrote for
    # its producers, and those it found another node's (both encode); its askers' waits for
    # another node's producer that ended in a remote hit (an encode saved) or in a miss.
    claims: int = 0
    claims_lost: int = 0
    waits_hit: int = 0
    waits_missed: int = 0
    # The master that serves (with several, the leader it last saw), how often the lead passed
    # to another master, and publishes the master did not answer, queued again once it did.
    leader: str = ""
    leader_changes: int = 0
    publishes_retried: int = 0
    # The directory come back (docs/design.md §13): entries published again after the store lost
    # them (counted in `published` too), the batches that offered them, and when the last walk
    # that put any ended (Unix time; 0: never).
    republished: int = 0
    republish_batches: int = 0
    last_republish: float = 0.0


@dataclass(frozen=True)
class RefusedPool:
    """A pool file the daemon refused to serve (it did not verify at adoption, or changed under
    the daemon), kept in place for inspection until it is removed (`ecd drop` removes it)."""

    engine_id: str
    path: str
    reason: str  # why it was refused


@dataclass(frozen=True)
class Stats:
    boot_epoch: str
    uptime_s: float
    max_bytes: int  # the budget: what capacity_bytes may reach
    capacity_bytes: int  # of all pools together
    reserved_bytes: int  # bytes of all pool files together
    sessions: int
    lease_expiries: int
    version: str
    pools: tuple[PoolStats, ...]
    cluster: ClusterStats | None = None  # None without a store
    refused: tuple[RefusedPool, ...] = ()  # Stats of every pool: the pool files refused


@dataclass(frozen=True)
class WatchEvent:
    type: EventType
    engine_id: str
    key: bytes
    nbytes: int
    boot_epoch: str
    slot: int | None = None  # the entry's slot (local SNAPSHOT, PENDING, COMMITTED): lock pins
