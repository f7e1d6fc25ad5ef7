"""The entries of one pool: their states, their blocks, eviction and single flight.

Lifecycle of an entry:

    allocate -> PENDING --commit--> READY --(pins drop to 0, space needed)--> evicted
                   |                  |
                 abort / lease out   delete / evict / pool dropped

- PENDING: blocks reserved, the producer writes them; invisible to consumers, never evicted.
  Allocating the key again answers PENDING (wait, don't encode twice), or, for the producer's own
  session, the same extents again (a retried Allocate is harmless).
- READY: the bytes are immutable until the entry is removed. Evictable while nobody pins it.
- A READY entry removed while pinned (Delete, or its pool dropped with force) leaves the index at
  once but keeps its blocks until its last pin is released, so a consumer never reads blocks that
  were handed to someone else.
- Readers also pin READY entries with no round trip, by a shared lock on the slot's lock byte
  (docs/design.md §5, ec_protocol/pool/slot_locks.py), which this index never sees until it tries to
  erase the slot's record: the journal's `erase_slot` takes the byte's exclusive lock first and
  refuses while a reader holds it. So eviction passes over locked entries (as over pinned
  ones), and a locked entry that is removed anyway (Delete) leaves the index at once but keeps
  its record and its blocks (`_locked`) until `reclaim` finds the lock gone and erases it.
- An entry whose blocks a transfer engine is writing (a remote hit read from the cluster's
  store: `writing`) that is removed however it is (the read given up on, an operator's Delete,
  ...) leaves the index at once (its waiters see it go) but its blocks are *held* until the
  engine is done with them (`writes_over`).

Invariant (`check`): free blocks + blocks held by entries (indexed, removed-but-pinned,
removed-but-locked, or held while being written) == num_blocks, and no block is in two places.
A removed entry's blocks are free only once its record is erased: a restart never adopts an
entry whose blocks belong to someone else, and a reader never locks a record whose blocks do.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ec_daemon.core.allocator import ExtentAllocator
from ec_daemon.core.eviction import EvictionPolicy
from ec_protocol.pool.layout import Geometry, RecordFields, SlotRecord, max_extents
from ec_protocol.types import EntryState, EventType, Extent, PoolStats, Status, TensorSpec


@dataclass(eq=False, slots=True)
class Entry:
    key: bytes
    spec: TensorSpec
    extents: tuple[Extent, ...]
    slot: int
    session_id: str  # the producer's session, which alone may commit or abort it
    producer: str  # the producer's client name, for operators
    created_at: float
    state: EntryState = EntryState.PENDING
    pins: int = 0
    checksum: int = 0
    committed_at: float = 0.0
    commit_seq: int = 0
    removed: bool = False  # left the index while pinned: blocks return at the last unpin
    # Its slot record is in the pool file (committed, not erased yet): readers may lock-pin it,
    # and its blocks are not free until the record is erased.
    recorded: bool = False
    writing: bool = False  # a transfer engine writes its blocks: removal holds them till it ends
    # Which allocation of the key this is: a Commit naming another (the key removed and
    # allocated again since) must not make this one READY before its bytes are written.
    allocation: int = 0
    # Removed while its record could not be erased (a reader holds the lock pin): the record is
    # marked doomed, so that no reader pins it any more and a restart does not adopt it.
    doomed: bool = False

    @property
    def blocks(self) -> int:
        return sum(e.count for e in self.extents)


@dataclass(slots=True)
class Outcome:
    """The result of one item: a status, a message for errors, and the entry where one applies."""

    status: Status
    message: str = ""
    entry: Entry | None = None


# The most a counter shows (StatsReply's uint64 fields, and the metrics, which show what Stats
# does): past it a counter stays there, saturated, where encoding it would fail every Stats.
# Per-Step bounds keep any caller far from it (MAX_HITS_PER_STEP, MAX_MISSES_PER_STEP); this is
# what holds whatever a count comes to.
COUNTER_MAX = 2**64 - 1


def saturated(count: int) -> int:
    return min(count, COUNTER_MAX)


@dataclass
class PoolCounters:
    """Monotonic counts since the daemon started (not persisted across restarts), saturating at
    COUNTER_MAX when shown (`shown`)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # all of them: for space, for entries, and an operator's Evict
    # Evicted to make room: blocks for an allocation, or only a slot, the slot table full with
    # blocks to spare (a pool of entries smaller than its slots were sized for: max_entries).
    evictions_for_space: int = 0
    evictions_for_entries: int = 0
    no_space: int = 0
    commits: int = 0
    aborts: int = 0
    remote_hits: int = 0  # entries read from the cluster's store
    remote_misses: int = 0  # reads from the store that fetched nothing
    remote_bytes: int = 0
    remote_reads: int = 0  # transfer-engine reads started for pulls

    def shown(self) -> PoolCounters:
        return PoolCounters(*(saturated(count) for count in dataclasses.astuple(self)))


# How many slots a commit tries for its record while readers hold them locked (the entry's own,
# then free ones): a reader locks a free slot for the moment of one read, so a second try nearly
# always succeeds; a bound keeps a reader that locks many from making every commit try them all.
MAX_SLOT_TRIES = 8

# Upper bounds (seconds) of the buckets of remote hits' latency: from an 8 MiB read over RDMA to
# a fetch that used up a long timeout.
REMOTE_SECONDS_BOUNDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Counts of observations under each bound, and over the last one, and their sum."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def _commit_seq(slot_and_fields: tuple[int, RecordFields]) -> int:
    return slot_and_fields[1][5]


def _in_commit_order(
    records: list[tuple[int, RecordFields]],
) -> tuple[list[tuple[int, RecordFields]], set[int]]:
    """The records, oldest commit first, and the slots they name; ValueError if one slot is
    named twice."""
    in_order = sorted(records, key=_commit_seq)
    slots = {slot for slot, _ in in_order}
    if len(slots) != len(in_order):
        twice = next(s for s, n in collections.Counter(s for s, _ in in_order).items() if n > 1)
        raise ValueError(f"slot table names slot {twice} twice")
    return in_order, slots


@dataclass(slots=True)
class _Adopted:
    """What a restore adopts from a slot table: the entries by key (oldest commit first), those
    set aside (superseded by a newer record of their key, or doomed), every extent, and the
    blocks of the entries."""

    entries: dict[bytes, Entry]
    superseded: list[Entry]
    used: list[tuple[int, int]]
    blocks: int

    def drop_doomed(self, doomed: Sequence[tuple[int, RecordFields]]) -> None:
        """Set aside the entries of doomed records (removed while a reader lock-pinned them),
        unless a newer record of their key took their place."""
        for slot, fields in doomed:
            entry = self.entries.get(fields[0])
            if entry is not None and entry.slot == slot:
                del self.entries[entry.key]
                entry.removed = entry.doomed = True
                self.superseded.append(entry)
                self.blocks -= entry.blocks


class SlotJournal(Protocol):
    """Where READY entries are recorded so they survive a daemon restart (the pool file)."""

    def write_slot(self, slot: int, record: SlotRecord) -> bool:
        """Write the record, unless a reader holds the slot's lock pin (then False, and the
        slot is left as it was)."""
        ...

    def erase_slot(self, slot: int) -> bool:
        """Erase the slot's record, unless a reader holds its lock pin (then False)."""
        ...

    def doom_slot(self, slot: int) -> None:
        """Mark the slot's record doomed, while a reader's lock pin keeps it from being erased:
        its entry was removed (no new pin takes it; a restart adopts its blocks as held, not
        the entry)."""
        ...

    def slot_locked(self, slot: int) -> bool:
        """Whether a reader holds the slot's lock pin now."""
        ...

    def locked_slots(self) -> set[int]:
        """The slots readers hold lock pins on now."""
        ...


class PoolIndex:
    def __init__(
        self,
        engine_id: str,
        geometry: Geometry,
        journal: SlotJournal,
        policy: EvictionPolicy,
        clock: Callable[[], float],
        emit: Callable[[EventType, bytes, int, int], None],
        allocations: Iterator[int] | None = None,
    ) -> None:
        """emit(type, key, nbytes, slot): tells watchers and waiters that a key is being written,
        became READY or went away (the store adds the pool and the boot epoch). allocations:
        the IDs of allocations, never one twice (by default 1, 2, ...; a daemon's pools share
        one sequence that starts anew at random each boot, so that a Commit from before a
        restart names no allocation made after it)."""
        self.engine_id = engine_id
        self.geometry = geometry
        self.counters = PoolCounters()
        self.remote_seconds = Histogram(REMOTE_SECONDS_BOUNDS)
        self._journal = journal
        self._policy = policy
        self._clock = clock
        self._emit = emit
        self._allocator = ExtentAllocator(geometry.num_blocks)
        self._entries: dict[bytes, Entry] = {}
        self._orphans: set[Entry] = set()  # removed while pinned
        self._locked: set[Entry] = set()  # removed while lock-pinned: record and blocks stay
        self._held: set[Entry] = set()  # removed while `writing`: blocks return at writes_over
        self._free_slots = list(range(geometry.num_slots - 1, -1, -1))
        self._evictable_blocks = 0  # blocks of READY entries with no pins
        self._evictable_entries = 0
        self._commit_seq = 0
        self._allocations = allocations if allocations is not None else itertools.count(1)

    # ---- restore -------------------------------------------------------------------------------

    def restore(
        self,
        records: Iterable[tuple[int, RecordFields]],
        doomed: Sequence[tuple[int, RecordFields]] = (),
    ) -> None:
        """Adopt into this new index the READY entries read from a pool file's slot table (by
        slot), oldest commit first; `doomed` are the records of entries removed while a reader
        lock-pinned them: not adopted, their blocks stay out of use until their reader lets go
        (or are freed now).

        Raises ValueError if records overlap each other or lie outside the pool, name a slot
        twice, or hold extents that do not match their size; the caller then refuses the whole
        pool rather than serve bytes two entries claim. Two records of one key are an entry
        deleted under a lock pin and put again: the newer is the entry. One pass, the tallies set
        once, the least built per entry: a restart with 100,000 entries waits on it
        (docs/performance.md, *A warm restart*).
        """
        in_order, slots = _in_commit_order([*records, *doomed])
        adopted = self._adopt(in_order)
        adopted.drop_doomed(doomed)
        self._allocator = ExtentAllocator.with_used(self.geometry.num_blocks, adopted.used)
        self._entries = adopted.entries
        # Oldest commit first: a key's place in the dict is its first record's, which is where
        # on_ready one record at a time would have left it too.
        self._policy.on_ready_many(adopted.entries)
        self._evictable_blocks, self._evictable_entries = adopted.blocks, len(adopted.entries)
        # Past every record's, doomed ones' included: a commit_seq is never given twice.
        self._commit_seq = _commit_seq(in_order[-1]) if in_order else 0
        self._free_slots = [s for s in range(self.geometry.num_slots - 1, -1, -1) if s not in slots]
        for entry in adopted.superseded:
            self._place(entry)

    def _adopt(self, in_order: list[tuple[int, RecordFields]]) -> _Adopted:
        """An entry for each record, oldest commit first: the newer record of a key supersedes
        the older. ValueError for extents that do not match their record's size."""
        now = self._clock()
        # One spec, and its size in blocks, for the entries of one shape, dtype and size (most
        # of a pool's): a spec is never changed, only replaced (PoolIndex.commit).
        specs: dict[tuple[tuple[int, ...], str, int], tuple[TensorSpec, int]] = {}
        entries: dict[bytes, Entry] = {}
        superseded: list[Entry] = []
        used: list[tuple[int, int]] = []  # every extent, as (start, count)
        blocks = 0
        for slot, (key, dtype, shape, nbytes, checksum, commit_seq, flat_extents) in in_order:
            spec_and_size = specs.get((shape, dtype, nbytes))
            if spec_and_size is None:
                spec_and_size = (TensorSpec(shape, dtype, nbytes), self.blocks_for(nbytes))
                specs[shape, dtype, nbytes] = spec_and_size
            spec, size = spec_and_size
            if len(flat_extents) == 2:  # one extent, as nearly every entry has
                start, count = flat_extents
                extents: tuple[Extent, ...] = (Extent(start, count),)
                used.append((start, count))
                matches = count == size
            else:
                pairs = list(zip(flat_extents[0::2], flat_extents[1::2], strict=True))
                extents = tuple(itertools.starmap(Extent, pairs))
                used += pairs
                matches = sum(flat_extents[1::2]) == size
            if not matches:
                raise ValueError(f"entry {key!r}: extents do not match {nbytes} bytes")
            older = entries.get(key)
            if older is not None:
                # The key was deleted while a reader lock-pinned it (its record stays until the
                # reader lets go) and put again: the newer record is the entry, the older one
                # waits for its reader as it did before the restart (or is erased now).
                older.removed = True
                superseded.append(older)
                blocks -= older.blocks
            # Entry's fields in their order (keywords cost this loop a sixth more)
            entries[key] = Entry(
                key,
                spec,
                extents,
                slot,
                "",  # session_id: none may commit or abort it
                "(restored)",  # producer
                now,  # created_at
                EntryState.READY,
                0,  # pins
                checksum,
                now,  # committed_at
                commit_seq,
                False,  # removed
                True,  # recorded
            )
            blocks += size
        return _Adopted(entries, superseded, used, blocks)

    # ---- producer side -------------------------------------------------------------------------

    def blocks_for(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.geometry.block_size_bytes)

    def allocate(self, key: bytes, spec: TensorSpec, session_id: str, producer: str) -> Outcome:
        entry = self._entries.get(key)
        if entry is not None:
            if entry.state is EntryState.READY:
                return Outcome(Status.EXISTS, entry=entry)
            if entry.session_id != session_id:
                return Outcome(Status.PENDING, "another producer is writing this key", entry)
            if entry.spec != spec:
                return Outcome(
                    Status.FAILED_PRECONDITION,
                    f"this session already allocated the key as {entry.spec}, not {spec}",
                )
            return Outcome(Status.ALLOCATED, entry=entry)  # a retried Allocate
        blocks = self.blocks_for(spec.nbytes)
        if blocks > self.geometry.num_blocks:
            return Outcome(
                Status.INVALID_ARGUMENT,
                f"entry of {spec.nbytes} bytes needs {blocks} blocks of "
                f"{self.geometry.block_size_bytes} bytes; the pool has {self.geometry.num_blocks}",
            )
        extents = self._make_room(blocks, max_extents(len(key), len(spec.shape)))
        if extents is None:
            self.counters.no_space += 1
            return Outcome(
                Status.NO_SPACE,
                f"needs {blocks} blocks; {self._allocator.free_blocks} free and "
                f"{self._evictable_blocks} evictable (the rest is PENDING or pinned), "
                f"{len(self._free_slots)} of {self.geometry.num_slots} entry slots free",
            )
        entry = Entry(
            key=key,
            spec=spec,
            extents=tuple(extents),
            slot=self._free_slots.pop(),
            session_id=session_id,
            producer=producer,
            created_at=self._clock(),
            allocation=next(self._allocations),
        )
        self._entries[key] = entry
        self._emit(EventType.PENDING, key, spec.nbytes, entry.slot)
        return Outcome(Status.ALLOCATED, entry=entry)

    def commit(
        self,
        key: bytes,
        session_id: str,
        checksum: int,
        spec: TensorSpec | None = None,
        allocation: int = 0,
    ) -> Outcome:
        """PENDING -> READY. `spec`: what the entry turned out to hold, when its allocation did
        not know the shape and dtype (a pull knows only the size until it read the value's
        header); the same number of bytes. `allocation`: the allocation the bytes were written
        into (0: the session's PENDING one, whichever it is); another one is NOT_FOUND, and
        stays PENDING."""
        entry = self._entries.get(key)
        problem = self._not_pending_of(entry, session_id, "commit")
        if problem is not None or entry is None:
            return problem or Outcome(Status.NOT_FOUND)
        if allocation and allocation != entry.allocation:
            return Outcome(
                Status.NOT_FOUND,
                f"cannot commit allocation {allocation}: the key was removed and allocated again "
                f"since (allocation {entry.allocation}, PENDING); this commit's bytes are gone "
                "with the allocation they were written into",
            )
        if spec is not None and spec.nbytes != entry.spec.nbytes:
            return Outcome(
                Status.FAILED_PRECONDITION,
                f"cannot commit {spec.nbytes} bytes into an entry of {entry.spec.nbytes}",
            )
        spec = spec or entry.spec
        record = SlotRecord(
            key=key,
            dtype=spec.dtype,
            shape=spec.shape,
            nbytes=spec.nbytes,
            checksum=checksum,
            commit_seq=self._commit_seq + 1,
            extents=tuple((e.start, e.count) for e in entry.extents),
        )
        # The slot record is written before the entry becomes visible: anything a consumer can
        # see after a restart was READY before it.
        if not self._write_record(entry, record):
            return Outcome(
                Status.RESOURCE_EXHAUSTED,
                f"readers hold lock pins on the entry's slot and on {MAX_SLOT_TRIES - 1} free "
                "slots, so its record cannot be written; it stays PENDING: retry the commit",
            )
        entry.spec = spec
        self._commit_seq += 1
        entry.state = EntryState.READY
        entry.checksum = checksum
        entry.committed_at = self._clock()
        entry.commit_seq = self._commit_seq
        entry.recorded = True
        self._policy.on_ready(key)
        self._set_evictable(entry, True)
        self.counters.commits += 1
        self._emit(EventType.COMMITTED, key, entry.spec.nbytes, entry.slot)
        return Outcome(Status.OK, entry=entry)

    def abort(self, key: bytes, session_id: str) -> Outcome:
        entry = self._entries.get(key)
        problem = self._not_pending_of(entry, session_id, "abort")
        if problem is not None or entry is None:
            return problem or Outcome(Status.NOT_FOUND)
        self._remove(entry, EventType.ABORTED)
        self.counters.aborts += 1
        return Outcome(Status.OK, entry=entry)

    def writes_over(self, entry: Entry) -> None:
        """Nothing writes into the entry's blocks any more: if it was removed meanwhile, they
        are free again."""
        entry.writing = False
        if entry in self._held:
            self._place(entry)

    def _not_pending_of(self, entry: Entry | None, session_id: str, verb: str) -> Outcome | None:
        if entry is None:
            return Outcome(
                Status.NOT_FOUND,
                f"cannot {verb}: no PENDING entry with this key (never allocated, aborted, "
                "or its producer's lease ran out)",
            )
        if entry.state is not EntryState.PENDING:
            return Outcome(
                Status.FAILED_PRECONDITION,
                f"cannot {verb}: the entry is {entry.state.name}, expected PENDING",
            )
        if entry.session_id != session_id:
            return Outcome(
                Status.FAILED_PRECONDITION,
                f"cannot {verb}: the entry was allocated by another session ({entry.producer})",
            )
        return None

    # ---- consumer side -------------------------------------------------------------------------

    def pin(self, key: bytes, count_miss: bool = True) -> Outcome:
        """Acquire: a READY entry is pinned (HIT), a PENDING one answers PENDING, else MISS
        (counted, unless the caller counts the misses it finally answers: a Step's pulls)."""
        entry = self._entries.get(key)
        if entry is None:
            if count_miss:
                self.counters.misses += 1
            return Outcome(Status.MISS)
        if entry.state is EntryState.PENDING:
            return Outcome(Status.PENDING, "the producer has not committed it yet", entry)
        if entry.pins == 0:
            self._set_evictable(entry, False)
        entry.pins += 1
        self._policy.on_access(key)
        self.counters.hits += 1
        return Outcome(Status.HIT, entry=entry)

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins > 0:
            return
        if entry.removed:
            self._place(entry)
        else:
            self._set_evictable(entry, True)

    def touch(self, key: bytes) -> None:
        """A reader hit the entry under a lock pin, with no round trip (StepRequest.hits):
        recency for the policy, for a READY entry. Counted apart (`count_hit`): a Step refreshes
        its hits before its allocations, and counts them once nothing of it can fail."""
        if self.state(key) is EntryState.READY:
            self._policy.on_access(key)

    def count_hit(self, key: bytes) -> None:
        """Count a hit read under a lock pin, for a READY entry: a key the pool does not hold
        counts nothing, so that a client cannot count hits it never had (one read just before its
        entry went, a moment before the hit was sent, goes uncounted)."""
        if self.state(key) is EntryState.READY:
            self.counters.hits += 1

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def state(self, key: bytes) -> EntryState:
        entry = self._entries.get(key)
        return EntryState.ABSENT if entry is None else entry.state

    # ---- operator side -------------------------------------------------------------------------

    def evict(self, key: bytes) -> Outcome:
        """Drop a READY unpinned entry, as the eviction policy would."""
        entry = self._entries.get(key)
        if entry is None:
            return Outcome(Status.NOT_FOUND, "no entry with this key")
        if entry.state is EntryState.PENDING:
            return Outcome(
                Status.FAILED_PRECONDITION,
                "the entry is PENDING (being written); Delete drops it anyway (ecd delete)",
            )
        if entry.pins:
            return Outcome(
                Status.FAILED_PRECONDITION,
                f"the entry is pinned {entry.pins} time(s); Delete drops it anyway, its blocks "
                "going back at the last release (ecd delete)",
            )
        if not self._journal.erase_slot(entry.slot):
            return Outcome(
                Status.FAILED_PRECONDITION,
                "a reader holds a lock pin on the entry (it is being read); Delete drops it "
                "anyway, its blocks going back once the reader is done (ecd delete)",
            )
        entry.recorded = False
        self._remove(entry, EventType.EVICTED)
        self.counters.evictions += 1
        return Outcome(Status.OK, entry=entry)

    def delete(self, key: bytes) -> Outcome:
        """Drop an entry in any state; a pinned or lock-pinned one keeps its blocks until its
        last release or unlock."""
        entry = self._entries.get(key)
        if entry is None:
            return Outcome(Status.NOT_FOUND, "no entry with this key")
        self._remove(entry, EventType.DELETED)
        return Outcome(Status.OK, entry=entry)

    def drop_all(self) -> int:
        """Remove every entry, leaving the file alone: the pool is being dropped (its file is
        deleted) or refused (its file is kept as found, for inspection). Returns how many."""
        entries = list(self._entries.values())
        for entry in entries:
            entry.recorded = False  # the file goes (or stays as found): its records do not matter
            self._remove(entry, None)
        return len(entries)

    def reclaim(self) -> int:
        """Free what removed entries held once their readers' locks are gone (called
        periodically, and before an allocation evicts); returns how many entries wait on."""
        for entry in list(self._locked):
            self._place(entry)
        return len(self._locked)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def stats(self, compat_key: str) -> PoolStats:
        """The pool's occupancy and counters at this moment, for Stats and metrics."""
        entries = self._entries.values()
        ready = [e for e in entries if e.state is EntryState.READY]
        return PoolStats(
            engine_id=self.engine_id,
            capacity_bytes=self.geometry.capacity_bytes,
            block_size_bytes=self.geometry.block_size_bytes,
            num_blocks=self.geometry.num_blocks,
            free_blocks=self._allocator.free_blocks,
            free_extents=self._allocator.free_extents,
            largest_free_extent=self._allocator.largest_free_extent,
            entries_pending=len(entries) - len(ready),
            entries_ready=len(ready),
            entries_pinned=sum(1 for e in ready if e.pins),
            pins=self.pins(),
            bytes_ready=sum(e.spec.nbytes for e in ready),
            compat_key=compat_key,
            reserved_bytes=self.geometry.file_size,
            max_entries=self.geometry.num_slots,
            remote_seconds_bounds=self.remote_seconds.bounds,
            remote_seconds_counts=tuple(map(saturated, self.remote_seconds.counts)),
            remote_seconds_sum=self.remote_seconds.sum,
            held_blocks=sum(e.blocks for e in self._removed_not_free()),
            entries_locked=len(self._journal.locked_slots()),
            **dataclasses.asdict(self.counters.shown()),
        )

    def pins(self) -> int:
        """Pins outstanding, on indexed entries and on removed ones still pinned."""
        return sum(e.pins for e in self._entries.values()) + sum(e.pins for e in self._orphans)

    # ---- internals -----------------------------------------------------------------------------

    def _make_room(self, blocks: int, most_extents: int) -> list[Extent] | None:
        """Blocks in at most `most_extents` runs (what its slot record has room for) and a slot
        for a new entry, evicting in policy order; None if impossible.

        Nothing is evicted when even evicting every evictable entry could not make room.
        """
        if self._locked and self._allocator.free_blocks < blocks:
            self.reclaim()
        if self._allocator.free_blocks + self._evictable_blocks < blocks:
            return None
        if not self._free_slots and not self._evictable_entries:
            return None
        need = max(blocks - self._allocator.free_blocks, 0 if self._free_slots else 1)
        if need and not self._unlocked_enough(need):
            return None
        while True:
            if self._free_slots:
                extents = self._allocator.allocate(blocks, most_extents)
                if extents is not None:
                    return extents
            victim = self._victim()
            if victim is None:
                return None
            # For entries only where the blocks were there and a slot was not: the pool holds
            # entries smaller than its slots were sized for (asking for more would help).
            if not self._free_slots and self._allocator.free_blocks >= blocks:
                self.counters.evictions_for_entries += 1
            else:
                self.counters.evictions_for_space += 1
            self._remove(victim, EventType.EVICTED)
            self.counters.evictions += 1

    def _unlocked_enough(self, blocks: int) -> bool:
        """Whether evictable entries no reader locks hold `blocks` blocks together. One probe of
        the file's locks when none is held (the common case), else one per candidate."""
        if not self._journal.locked_slots():
            return True
        found = 0
        for key in self._policy.candidates():
            entry = self._entries[key]
            if entry.pins == 0 and not self._journal.slot_locked(entry.slot):
                found += entry.blocks
                if found >= blocks:
                    return True
        return False

    def _victim(self) -> Entry | None:
        """The policy's first choice among the entries nobody pins, its record already erased
        (which fails for the entries readers lock: they are passed over)."""
        for key in self._policy.candidates():
            entry = self._entries[key]
            if entry.pins == 0 and self._journal.erase_slot(entry.slot):
                entry.recorded = False
                return entry
        return None

    def _set_evictable(self, entry: Entry, evictable: bool) -> None:
        sign = 1 if evictable else -1
        self._evictable_blocks += sign * entry.blocks
        self._evictable_entries += sign

    def _remove(self, entry: Entry, event: EventType | None) -> None:
        del self._entries[entry.key]
        if entry.state is EntryState.READY:
            self._policy.on_removed(entry.key)
            if entry.pins == 0:
                self._set_evictable(entry, False)
        entry.removed = True
        self._place(entry)
        if event is not None:
            self._emit(event, entry.key, entry.spec.nbytes, entry.slot)

    def _removed_not_free(self) -> Iterator[Entry]:
        """The removed entries whose blocks are not free yet (Stats' `held_blocks`): each is in
        exactly one of these, by what keeps its blocks (`_place`)."""
        return itertools.chain(self._orphans, self._locked, self._held)

    def _place(self, entry: Entry) -> None:
        """Where a removed entry's blocks are now. Its record is erased first, as soon as no
        reader locks it (a restart must never adopt an entry whose blocks belong to someone
        else); the blocks are free once nothing pins, locks or writes them."""
        if entry.recorded:
            if self._journal.erase_slot(entry.slot):
                entry.recorded = False
            elif not entry.doomed:
                self._journal.doom_slot(entry.slot)
                entry.doomed = True
        for where in (self._orphans, self._locked, self._held):
            where.discard(entry)
        if entry.pins:
            self._orphans.add(entry)
        elif entry.recorded:
            self._locked.add(entry)
        elif entry.writing:
            self._held.add(entry)
        else:
            self._release_space(entry)

    def _write_record(self, entry: Entry, record: SlotRecord) -> bool:
        """Write the entry's slot record, into another free slot if a reader holds its own
        locked (False when MAX_SLOT_TRIES slots were). A reader whose view of the pool is stale
        locks a free slot (the entry it wants was evicted from there) for the moment of one
        read, and a record written meanwhile could be read half-written: the new READY mark
        over the old record's CRC and body, whole and valid, naming blocks that are someone
        else's now. The journal writes a record only under the slot's exclusive lock, so no
        reader reads one being written; the entry's slot is where its record lies, named by its
        COMMITTED event, so it may change until then."""
        tried = [entry.slot]
        while not self._journal.write_slot(tried[-1], record):
            if len(tried) == MAX_SLOT_TRIES or not self._free_slots:
                self._free_slots.extend(tried[1:])
                return False
            tried.append(self._free_slots.pop())
        self._free_slots.extend(tried[:-1])  # the entry's own slot too, if it moved
        entry.slot = tried[-1]
        return True

    def _release_space(self, entry: Entry) -> None:
        self._allocator.free(entry.extents)
        self._free_slots.append(entry.slot)

    def check(self) -> None:
        """Raise AssertionError unless every block and slot is in exactly one place."""
        self._allocator.check()
        holders = [*self._entries.values(), *self._removed_not_free()]
        held = sorted(e for entry in holders for e in entry.extents)
        runs = sorted(held + self._allocator.free_runs())
        assert sum(e.count for e in runs) == self.geometry.num_blocks
        for a, b in itertools.pairwise(runs):
            assert a.end <= b.start, f"block range {a} overlaps {b}"
        slots = [e.slot for e in holders] + self._free_slots
        assert sorted(slots) == list(range(self.geometry.num_slots)), "slot held twice or lost"
        evictable = [
            e for e in self._entries.values() if e.state is EntryState.READY and e.pins == 0
        ]
        assert self._evictable_blocks == sum(e.blocks for e in evictable)
        assert self._evictable_entries == len(evictable)
        assert all(e.pins > 0 and e.removed for e in self._orphans)
        assert all(e.pins == 0 and e.removed for e in self._held)
        assert all(e.pins == 0 and e.removed and e.recorded for e in self._locked)
        assert all(e.recorded == (e.state is EntryState.READY) for e in self._entries.values())
        assert all(e.pins >= 0 for e in holders)
