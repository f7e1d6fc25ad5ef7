"""Random sequences of every core operation, checking the invariants after each step:

- free blocks + blocks held by entries == num_blocks, and no block or slot is in two places;
- a PENDING entry stays until its producer commits or aborts it, it is deleted, or the producer's
  lease runs out: eviction never takes it;
- a pinned entry stays READY and in place until it is released or deleted;
- every READY entry's recorded bytes length matches what its producer allocated;
- an entry a reader holds a lock pin on (a real shared lock on its slot, docs/design.md §5) keeps
  its record in the file and its blocks, which no other entry is given, until it is unlocked,
  however it is removed meanwhile (evicted, deleted, its pool's space needed);
- a slot a reader with a stale view holds locked (free, or an entry's) is neither written nor
  erased meanwhile: a commit records its entry in another slot (or, with none, stays PENDING);
  only the mark of an entry's record removed meanwhile turns doomed.
"""

from __future__ import annotations

import os
import shutil
import struct

from core_testing import FakeClock, make_store, open_pool, spec
from ecd_testing import new_shm_dir
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from ec_protocol.pool.layout import SLOT_DOOMED_MARK, SLOT_READY_MARK, SLOT_SIZE, slot_offset
from ec_protocol.pool.slot_locks import PinnedEntry, SlotPins, lock_shared, unlock
from ec_protocol.types import EntryState, EventType, Extent, Role, Status

BLOCK = 512
BLOCKS = 32  # small, so that a few allocations fill the pool and eviction runs often
TTL = 10.0
KEYS = st.sampled_from([b"k%d" % i for i in range(10)])


class StoreMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    @initialize(
        target=sessions, eviction=st.sampled_from(["lru", "fifo"]), slots=st.sampled_from([5, 32])
    )
    def setup(self, eviction: str, slots: int) -> MultipleResults[str]:
        self.shm_dir = new_shm_dir()
        self.clock = FakeClock()
        self.store = make_store(
            self.shm_dir, self.clock, eviction=eviction, entries_per_pool=slots, lease_ttl_s=TTL
        )
        info = open_pool(self.store, "p", BLOCK, BLOCKS * BLOCK)
        self.reader = SlotPins(info.path, info.pool_uuid)  # another process's, as it were
        self.prober = os.open(info.path, os.O_RDONLY)  # a reader with a stale view, probing
        self.probe: tuple[int, bytes] | None = None  # the slot it holds locked, its bytes then
        self.num_slots = slots
        self.locks: list[tuple[int, PinnedEntry]] = []  # lock pins held: (slot, what they hold)
        self.pending: dict[bytes, tuple[str, tuple[Extent, ...]]] = {}  # key -> (session, extents)
        self.pins: dict[int, tuple[str, bytes]] = {}  # lease -> (session, key)
        self.deleted: set[int] = set()  # leases whose entry was deleted while pinned
        self.dead: set[str] = set()  # sessions closed or expired
        return multiple(*(self.store.open_session(n, 1, Role.BOTH) for n in ("a", "b")))

    def teardown(self) -> None:
        self.reader.close()
        os.close(self.prober)
        self.store.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    @rule(target=sessions)
    def open_session(self) -> str:
        return self.store.open_session("client", 1, Role.BOTH)

    @rule(
        sid=sessions,
        items=st.lists(st.tuples(KEYS, st.integers(1, 12), st.integers(0, BLOCK - 1)), max_size=3),
        commit=st.booleans(),
    )
    def allocate(self, sid: str, items: list[tuple[bytes, int, int]], commit: bool) -> None:
        """Allocate a batch (a partial last block included), and maybe commit it at once."""
        if sid in self.dead:
            return
        for key, blocks, extra in items:
            self._allocate_one(sid, key, blocks, (blocks - 1) * BLOCK + extra + 1)
        if commit:
            for key in [k for k, (owner, _) in self.pending.items() if owner == sid]:
                self._commit(key)

    def _allocate_one(self, sid: str, key: bytes, blocks: int, nbytes: int) -> None:
        [outcome] = self.store.allocate(sid, "p", [(key, spec(nbytes))])
        if outcome.status is Status.ALLOCATED:
            assert sum(e.count for e in outcome.extents) == blocks
            self.pending[key] = (sid, outcome.extents)
        elif outcome.status is Status.PENDING:
            assert key in self.pending
        elif outcome.status is Status.EXISTS:
            assert self.store.lookup("p", [key])[0].state is EntryState.READY

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self._commit(data.draw(st.sampled_from(sorted(self.pending))))

    def _commit(self, key: bytes) -> None:
        sid, extents = self.pending.pop(key)
        [outcome] = self.store.commit(sid, "p", [(key, 1, 0)])
        if outcome.status is Status.RESOURCE_EXHAUSTED and self.probe is not None:
            self.pending[key] = (sid, extents)  # no slot to record it in but the probed one
            return
        assert outcome.status is Status.OK

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        sid, _ = self.pending.pop(key)
        assert [o.status for o in self.store.abort(sid, "p", [key])] == [Status.OK]

    @rule(sid=sessions, key=KEYS)
    def acquire(self, sid: str, key: bytes) -> None:
        if sid in self.dead:
            return
        [result] = self.store.acquire(sid, "p", [key])
        if result.status is Status.HIT:
            self.pins[result.lease_id] = (sid, key)

    @rule(key=KEYS)
    def lock_pin(self, key: bytes) -> None:
        """A reader lock-pins an entry where its view says it is (a slot of the snapshot)."""
        slots = {
            e.key: e.slot
            for e in self.store.ready_snapshot("p")
            if e.type is EventType.SNAPSHOT and e.slot is not None
        }
        if key in slots:
            record = self.reader.pin(slots[key], key)
            assert record is not None and record.key == key  # nobody erases it meanwhile
            self.locks.append((slots[key], record))

    @rule(key=KEYS, slot=st.integers(0, 31))
    def lock_pin_a_stale_slot(self, key: bytes, slot: int) -> None:
        """A reader whose view is out of date: a hit only if the slot holds that very key."""
        record = self.reader.pin(slot, key)
        if record is not None:
            assert record.key == key
            self.locks.append((slot, record))

    @precondition(lambda self: self.probe is None)
    @rule(slot=st.integers(0, 31))
    def probe_a_slot(self, slot: int) -> None:
        """A reader whose view is out of date holds a slot's lock for the moment of one read
        (here, for a few steps): whatever the slot holds, free or an entry's record."""
        if slot < self.num_slots and lock_shared(self.prober, slot):
            self.probe = (slot, os.pread(self.prober, SLOT_SIZE, slot_offset(slot)))

    @precondition(lambda self: self.probe is not None)
    @rule()
    def probe_done(self) -> None:
        assert self.probe is not None
        unlock(self.prober, self.probe[0])
        self.probe = None

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        slot, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.reader.unpin(slot)

    @rule()
    def reclaim(self) -> None:
        self.store.reclaim()

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted(self.pins)))
        sid, _ = self.pins.pop(lease)
        assert [o.status for o in self.store.release(sid, [lease])] == [Status.OK]
        assert [o.status for o in self.store.release(sid, [lease])] == [Status.NOT_FOUND]

    @rule(key=KEYS)
    def evict(self, key: bytes) -> None:
        [outcome] = self.store.evict("p", [key])
        if outcome.status is Status.OK:
            assert key not in self.pending
            assert all(k != key or lease in self.deleted for lease, (_, k) in self.pins.items())

    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        [outcome] = self.store.delete("p", [key])
        if outcome.status is Status.OK:
            self.pending.pop(key, None)
            self.deleted.update(lease for lease, (_, k) in self.pins.items() if k == key)

    @rule(sid=consumes(sessions))
    def close_session(self, sid: str) -> None:
        if sid not in self.dead:
            self.store.close_session(sid)
        self._forget(sid)

    @rule(seconds=st.sampled_from([1.0, TTL / 2, TTL]), sid=sessions)
    def time_passes(self, seconds: float, sid: str) -> None:
        """Time passes; one session keeps itself alive, the others may expire."""
        if sid not in self.dead:
            self.store.keep_alive(sid)
        self.clock.advance(seconds)
        for end in self.store.expire_sessions():
            self._forget(end.session_id)

    def _forget(self, sid: str) -> None:
        self.dead.add(sid)
        self.pending = {k: v for k, v in self.pending.items() if v[0] != sid}
        self.pins = {k: v for k, v in self.pins.items() if v[0] != sid}

    @invariant()
    def blocks_and_slots_are_each_in_exactly_one_place(self) -> None:
        self.store.check()

    @invariant()
    def pending_entries_are_never_evicted(self) -> None:
        listed = {e.key: e for e in self.store.list_entries("p", b"", 1000)[0]}
        for key, (_, extents) in self.pending.items():
            assert listed[key].state is EntryState.PENDING
            assert listed[key].extents == extents

    @invariant()
    def locked_entries_keep_their_record_and_blocks(self) -> None:
        listed = self.store.list_entries("p", b"", 1000)[0]
        for slot, record in self.locks:
            assert self.reader.pin(slot, record.key) == record
            self.reader.unpin(slot)
            mine = {b for e in record.extents for b in range(e.start, e.end)}
            for entry in listed:
                if entry.extents != record.extents:
                    assert not mine & {b for e in entry.extents for b in range(e.start, e.end)}

    @invariant()
    def no_record_is_written_or_erased_under_a_readers_lock(self) -> None:
        """Only its mark may change, READY to doomed: the entry was removed meanwhile."""
        if self.probe is not None:
            slot, then = self.probe
            now = os.pread(self.prober, SLOT_SIZE, slot_offset(slot))
            if now != then:
                assert then[:4] == struct.pack("<I", SLOT_READY_MARK)
                assert now == struct.pack("<I", SLOT_DOOMED_MARK) + then[4:]

    @invariant()
    def pinned_entries_stay_until_released(self) -> None:
        for lease, (_, key) in self.pins.items():
            if lease not in self.deleted:
                [found] = self.store.lookup("p", [key])
                assert found.state is EntryState.READY and found.pins > 0


StoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_store_state_machine = StoreMachine.TestCase
