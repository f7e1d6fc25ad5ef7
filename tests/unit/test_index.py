"""PoolIndex alone, with a fake journal and a recording event sink: states, single flight, the
order of journal writes, eviction through the policy, and restore."""

from __future__ import annotations

import dataclasses

import pytest
from core_testing import FakeClock, spec

from ec_daemon.core.eviction import FIFOPolicy, LRUPolicy
from ec_daemon.core.index import COUNTER_MAX, MAX_SLOT_TRIES, PoolIndex
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.pool.layout import Geometry, RecordFields, SlotRecord, read_record
from ec_protocol.types import EntryState, EventType, Extent, Status

BLOCK = 1024


class FakeJournal:
    """Records the slot writes, erasures and doom marks, in order, with what the index showed at
    the time. `locked` stands for the slots readers hold lock pins on: their records cannot be
    erased; `doomed` for the records marked doomed."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []
        self.records: dict[int, SlotRecord] = {}
        self.locked: set[int] = set()
        self.doomed: set[int] = set()

    def write_slot(self, slot: int, record: SlotRecord) -> bool:
        if slot in self.locked:
            return False
        self.ops.append(("write", slot))
        self.records[slot] = record
        self.doomed.discard(slot)
        return True

    def erase_slot(self, slot: int) -> bool:
        if slot in self.locked:
            return False
        self.ops.append(("erase", slot))
        self.records.pop(slot, None)
        self.doomed.discard(slot)
        return True

    def doom_slot(self, slot: int) -> None:
        self.ops.append(("doom", slot))
        self.doomed.add(slot)

    def slot_locked(self, slot: int) -> bool:
        return slot in self.locked

    def locked_slots(self) -> set[int]:
        return set(self.locked)

    def lock(self, key: bytes) -> int:
        """A reader's lock pin on the slot holding `key`'s record; returns the slot."""
        [slot] = [s for s, r in self.records.items() if r.key == key]
        self.locked.add(slot)
        return slot


class Sink:
    """Records events, and for each whether the journal held the key's record at that moment."""

    def __init__(self, journal: FakeJournal) -> None:
        self.journal = journal
        self.events: list[tuple[EventType, bytes]] = []
        self.slots: list[int] = []
        self.journaled_at_event: list[bool] = []

    def __call__(self, type: EventType, key: bytes, nbytes: int, slot: int) -> None:
        self.events.append((type, key))
        self.slots.append(slot)
        self.journaled_at_event.append(any(r.key == key for r in self.journal.records.values()))


def make_index(
    blocks: int = 8, slots: int = 8, lru: bool = True
) -> tuple[PoolIndex, FakeJournal, Sink]:
    journal = FakeJournal()
    sink = Sink(journal)
    policy = LRUPolicy() if lru else FIFOPolicy()
    index = PoolIndex("p", Geometry(BLOCK, blocks, slots), journal, policy, FakeClock(), sink)
    return index, journal, sink


def as_read(records: list[tuple[int, SlotRecord]]) -> list[tuple[int, RecordFields]]:
    """The records as a restart reads them from the pool file's slot table."""
    read = [(slot, read_record(record.pack())) for slot, record in records]
    assert all(fields is not None for _, fields in read)
    return [(slot, fields) for slot, fields in read if fields is not None]


def read_back(
    journal: FakeJournal,
) -> tuple[list[tuple[int, RecordFields]], list[tuple[int, RecordFields]]]:
    """What a restart reads from the journal: its READY records and its doomed ones."""
    records = sorted(journal.records.items())
    return (
        as_read([(slot, r) for slot, r in records if slot not in journal.doomed]),
        as_read([(slot, r) for slot, r in records if slot in journal.doomed]),
    )


def put(index: PoolIndex, key: bytes, blocks: int, session: str = "s") -> None:
    assert index.allocate(key, spec(blocks * BLOCK), session, "producer").status is Status.ALLOCATED
    assert index.commit(key, session, 0).status is Status.OK


def test_an_allocated_entry_is_pending_and_invisible_to_pins() -> None:
    index, journal, _ = make_index()
    index.allocate(b"k", spec(BLOCK), "s", "producer")
    assert index.state(b"k") is EntryState.PENDING
    assert index.pin(b"k").status is Status.PENDING
    assert journal.ops == []  # nothing a restart could adopt


def test_commit_journals_the_entry_before_telling_watchers() -> None:
    index, journal, sink = make_index()
    put(index, b"k", 2)
    assert sink.events == [(EventType.PENDING, b"k"), (EventType.COMMITTED, b"k")]
    assert sink.journaled_at_event == [False, True]
    [record] = journal.records.values()
    assert record.key == b"k" and record.extents == ((0, 2),)


def test_an_evicted_entry_is_erased_from_the_journal_before_watchers_hear_of_it() -> None:
    index, _, sink = make_index(blocks=2, slots=2)
    put(index, b"old", 2)
    index.allocate(b"new", spec(2 * BLOCK), "s", "producer")
    assert sink.events[-2:] == [(EventType.EVICTED, b"old"), (EventType.PENDING, b"new")]
    assert sink.journaled_at_event[-2] is False


def test_a_removed_entry_is_erased_from_the_journal_before_its_blocks_are_reused() -> None:
    index, journal, _ = make_index(blocks=2, slots=2)
    put(index, b"old", 2)
    index.allocate(b"new", spec(2 * BLOCK), "s", "producer")  # evicts old, reuses its blocks
    assert journal.ops == [("write", 0), ("erase", 0)]
    index.check()


def test_a_commit_whose_slot_a_reader_holds_locked_records_the_entry_in_a_free_one() -> None:
    index, journal, sink = make_index()
    allocated = index.allocate(b"k", spec(BLOCK), "s", "producer").entry
    assert allocated is not None
    first = allocated.slot
    journal.locked.add(first)  # a reader probing the slot with a stale view
    assert index.commit(b"k", "s", 0).status is Status.OK
    [(slot, record)] = journal.records.items()
    assert slot != first and record.key == b"k" and allocated.slot == slot
    assert sink.slots[-1] == slot  # the COMMITTED event names where the record is
    index.check()  # the slot it left is free again, the one it took is the entry's


def test_a_commit_whose_slots_readers_all_hold_locked_stays_pending_saying_why() -> None:
    index, journal, _ = make_index(slots=MAX_SLOT_TRIES + 1)
    index.allocate(b"k", spec(BLOCK), "s", "producer")
    journal.locked.update(range(MAX_SLOT_TRIES + 1))
    outcome = index.commit(b"k", "s", 0)
    assert outcome.status is Status.RESOURCE_EXHAUSTED and "lock pins" in outcome.message
    assert index.state(b"k") is EntryState.PENDING and journal.records == {}
    journal.locked.clear()  # the readers let go: the commit goes through when retried
    assert index.commit(b"k", "s", 0).status is Status.OK
    index.check()


def test_single_flight_answers_pending_to_others_and_the_same_extents_to_the_producer() -> None:
    index, _, _ = make_index()
    first = index.allocate(b"k", spec(BLOCK), "a", "encoder-a")
    assert index.allocate(b"k", spec(BLOCK), "b", "encoder-b").status is Status.PENDING
    again = index.allocate(b"k", spec(BLOCK), "a", "encoder-a")
    assert again.status is Status.ALLOCATED and again.entry is first.entry


def test_a_commit_of_an_earlier_allocation_of_a_key_allocated_again_is_not_found() -> None:
    index, journal, _ = make_index()
    first = index.allocate(b"k", spec(BLOCK), "s", "producer").entry
    index.delete(b"k")  # an operator drops it while its producer is still writing
    second = index.allocate(b"k", spec(BLOCK), "s", "producer").entry
    assert first is not None and second is not None
    assert first.allocation != second.allocation
    # The first put's commit, late: the second allocation's bytes are not written yet.
    late = index.commit(b"k", "s", 0, allocation=first.allocation)
    assert late.status is Status.NOT_FOUND and "allocated again" in late.message
    assert index.state(b"k") is EntryState.PENDING and journal.ops == []
    assert index.commit(b"k", "s", 0, allocation=second.allocation).status is Status.OK


def test_a_retried_allocate_answers_the_same_allocation_and_a_commit_by_key_alone_any() -> None:
    index, _, _ = make_index()
    first = index.allocate(b"k", spec(BLOCK), "s", "producer").entry
    again = index.allocate(b"k", spec(BLOCK), "s", "producer").entry
    assert first is not None and again is first
    assert index.commit(b"k", "s", 0).status is Status.OK  # allocation 0: the one PENDING


def test_allocation_ids_come_from_the_sequence_the_index_is_given() -> None:
    journal = FakeJournal()
    index = PoolIndex(
        "p", Geometry(BLOCK, 8, 8), journal, LRUPolicy(), FakeClock(), Sink(journal), iter([7, 9])
    )
    ids = [index.allocate(k, spec(BLOCK), "s", "p").entry for k in (b"a", b"b")]
    assert [e.allocation for e in ids if e is not None] == [7, 9]


def test_allocating_a_ready_key_answers_exists() -> None:
    index, _, _ = make_index()
    put(index, b"k", 1)
    assert index.allocate(b"k", spec(BLOCK), "other", "x").status is Status.EXISTS


def test_the_policy_chooses_the_victim_and_pinned_entries_are_skipped() -> None:
    index, _, sink = make_index(blocks=3, slots=8)
    for key in (b"a", b"b", b"c"):
        put(index, key, 1)
    index.pin(b"a")  # a is the oldest but pinned: b goes first
    index.allocate(b"d", spec(BLOCK), "s", "producer")
    assert (EventType.EVICTED, b"b") in sink.events
    assert [index.state(k) for k in (b"a", b"b", b"c")] == [
        EntryState.READY,
        EntryState.ABSENT,
        EntryState.READY,
    ]


def test_an_allocation_that_cannot_fit_evicts_nothing_and_counts_no_space() -> None:
    index, _, sink = make_index(blocks=4)
    put(index, b"pinned", 2)
    index.pin(b"pinned")
    put(index, b"free", 1)
    outcome = index.allocate(b"big", spec(4 * BLOCK), "s", "producer")
    assert outcome.status is Status.NO_SPACE
    assert index.state(b"free") is EntryState.READY
    assert index.counters.no_space == 1
    assert not any(t is EventType.EVICTED for t, _ in sink.events)


def test_an_eviction_for_blocks_counts_as_for_space() -> None:
    index, _, _ = make_index(blocks=2, slots=8)
    put(index, b"a", 2)
    put(index, b"b", 1)  # a goes: its blocks were needed, slots were free
    assert (index.counters.evictions_for_space, index.counters.evictions_for_entries) == (1, 0)


def test_an_eviction_for_a_slot_with_blocks_to_spare_counts_as_for_entries() -> None:
    index, _, _ = make_index(blocks=8, slots=2)
    for key in (b"a", b"b", b"c"):  # c needs a slot: a goes, with 6 blocks free
        put(index, key, 1)
    assert index.state(b"a") is EntryState.ABSENT
    assert (index.counters.evictions_for_space, index.counters.evictions_for_entries) == (0, 1)


def test_an_eviction_for_a_slot_where_blocks_lacked_too_counts_as_for_space() -> None:
    index, _, _ = make_index(blocks=2, slots=2)
    for key in (b"a", b"b", b"c"):
        put(index, key, 1)
    assert (index.counters.evictions_for_space, index.counters.evictions_for_entries) == (1, 0)


def test_an_operators_evict_counts_as_neither_space_nor_entries() -> None:
    index, _, _ = make_index()
    put(index, b"a", 1)
    assert index.evict(b"a").status is Status.OK
    counters = index.counters
    assert (counters.evictions, counters.evictions_for_space, counters.evictions_for_entries) == (
        1,
        0,
        0,
    )


def test_an_entry_removed_while_pinned_keeps_its_blocks_until_the_last_unpin() -> None:
    index, _, _ = make_index(blocks=4)
    put(index, b"k", 4)
    pinned = index.pin(b"k").entry
    assert pinned is not None
    index.delete(b"k")
    assert index.state(b"k") is EntryState.ABSENT
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.NO_SPACE
    index.unpin(pinned)
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.ALLOCATED
    index.check()


def test_eviction_passes_over_an_entry_a_reader_holds_a_lock_pin_on() -> None:
    index, journal, sink = make_index(blocks=3, slots=8)
    for key in (b"a", b"b", b"c"):
        put(index, key, 1)
    journal.lock(b"a")  # a is the oldest, but being read: b goes first
    index.allocate(b"d", spec(BLOCK), "s", "producer")
    assert (EventType.EVICTED, b"b") in sink.events
    assert index.state(b"a") is EntryState.READY
    index.check()


def test_an_allocation_that_only_locked_entries_could_make_room_for_evicts_nothing() -> None:
    index, journal, sink = make_index(blocks=4)
    put(index, b"locked", 2)
    journal.lock(b"locked")
    put(index, b"free", 1)
    assert index.allocate(b"big", spec(3 * BLOCK), "s", "producer").status is Status.NO_SPACE
    assert index.state(b"free") is EntryState.READY
    assert not any(t is EventType.EVICTED for t, _ in sink.events)
    index.check()


def test_an_operator_evict_of_a_locked_entry_is_refused_saying_why() -> None:
    index, journal, _ = make_index()
    put(index, b"k", 1)
    journal.lock(b"k")
    outcome = index.evict(b"k")
    assert outcome.status is Status.FAILED_PRECONDITION and "lock pin" in outcome.message
    assert index.state(b"k") is EntryState.READY


def test_a_locked_entry_deleted_keeps_its_record_and_blocks_until_the_lock_drops() -> None:
    index, journal, sink = make_index(blocks=4)
    put(index, b"k", 4)
    slot = journal.lock(b"k")
    index.delete(b"k")
    assert index.state(b"k") is EntryState.ABSENT and (EventType.DELETED, b"k") in sink.events
    assert slot in journal.records  # still readable by the reader holding it
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.NO_SPACE
    assert index.reclaim() == 1
    journal.locked.clear()  # the reader is done
    assert index.reclaim() == 0
    assert slot not in journal.records
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.ALLOCATED
    index.check()


def test_a_locked_entry_deleted_has_its_record_marked_doomed_once() -> None:
    index, journal, _ = make_index(blocks=4)
    put(index, b"k", 4)
    slot = journal.lock(b"k")
    index.delete(b"k")
    assert journal.ops[-1] == ("doom", slot) and slot in journal.doomed
    index.reclaim()  # still locked: tried again, not marked again
    assert journal.ops.count(("doom", slot)) == 1
    journal.locked.clear()
    index.reclaim()
    assert journal.ops[-1] == ("erase", slot) and slot not in journal.doomed


def test_an_unlocked_entry_deleted_is_erased_not_doomed() -> None:
    index, journal, _ = make_index(blocks=4)
    put(index, b"k", 4)
    index.delete(b"k")
    assert [op for op, _ in journal.ops] == ["write", "erase"]


def test_a_pinned_and_locked_entry_removed_keeps_its_blocks_until_both_are_gone() -> None:
    index, journal, _ = make_index(blocks=4)
    put(index, b"k", 4)
    pinned = index.pin(b"k").entry
    assert pinned is not None
    journal.lock(b"k")
    index.delete(b"k")
    index.unpin(pinned)
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.NO_SPACE
    journal.locked.clear()
    assert index.allocate(b"x", spec(BLOCK), "s", "p").status is Status.ALLOCATED
    index.check()


@pytest.mark.parametrize("reader", ["pinned", "lock-pinned"])
def test_a_removed_entrys_blocks_count_as_held_until_they_are_free(reader: str) -> None:
    index, journal, _ = make_index(blocks=8)
    put(index, b"k", 3)
    pinned = index.pin(b"k").entry if reader == "pinned" else None
    if reader == "lock-pinned":
        journal.lock(b"k")
    index.delete(b"k")
    stats = index.stats("")
    assert (stats.held_blocks, stats.free_blocks, stats.entries_ready) == (3, 5, 0)
    if pinned is not None:
        index.unpin(pinned)
    journal.locked.clear()
    index.reclaim()
    stats = index.stats("")
    assert (stats.held_blocks, stats.free_blocks) == (0, 8)
    index.check()


def test_a_hit_under_a_lock_pin_refreshes_recency_and_counts_apart() -> None:
    index, _, sink = make_index(blocks=2, slots=8)
    put(index, b"a", 1)
    put(index, b"b", 1)
    index.touch(b"a")  # a read a moment ago: b is now the least recently used
    assert index.counters.hits == 0  # counted apart, once its Step cannot fail
    index.allocate(b"c", spec(BLOCK), "s", "producer")
    assert (EventType.EVICTED, b"b") in sink.events and index.state(b"a") is EntryState.READY
    index.count_hit(b"a")
    assert index.counters.hits == 1


def test_a_hit_naming_no_ready_entry_counts_nothing() -> None:
    index, _, _ = make_index(blocks=2, slots=8)
    index.allocate(b"pending", spec(BLOCK), "s", "producer")
    for key in (b"absent", b"pending"):
        index.touch(key)
        index.count_hit(key)
    assert index.counters.hits == 0


def test_counters_saturate_at_what_stats_can_carry() -> None:
    index, _, _ = make_index()
    index.counters.misses = COUNTER_MAX + 12345
    index.counters.hits = 7
    stats = index.stats("")
    assert (stats.misses, stats.hits) == (COUNTER_MAX, 7)
    assert pb.PoolStats(misses=stats.misses).SerializeToString()  # what StatsReply carries


def test_restore_adopts_records_oldest_commit_first() -> None:
    index, journal, _ = make_index()
    put(index, b"old", 1)
    put(index, b"new", 1)
    restored, _, _ = make_index(lru=False)
    restored.restore(as_read(sorted(journal.records.items(), reverse=True)))
    assert [restored.state(k) for k in (b"old", b"new")] == [EntryState.READY] * 2
    restored.allocate(b"fill", spec(7 * BLOCK), "s", "p")  # evicts the oldest commit: old
    assert restored.state(b"old") is EntryState.ABSENT
    assert restored.state(b"new") is EntryState.READY
    restored.check()


def test_restore_refuses_records_that_overlap() -> None:
    index, _, _ = make_index()
    record = SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((0, 1),))
    twin = SlotRecord(b"b", "uint8", (BLOCK,), BLOCK, 0, 2, ((0, 1),))
    with pytest.raises(ValueError):
        index.restore(as_read([(0, record), (1, twin)]))


@pytest.mark.parametrize(
    "records",
    [
        [
            (0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((0, 1),))),
            (0, SlotRecord(b"b", "uint8", (BLOCK,), BLOCK, 0, 2, ((1, 1),))),
        ],
        [(0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((0, 2),)))],
        [(0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((7, 2),)))],
    ],
    ids=["a slot twice", "extents larger than the size", "past the pool's end"],
)
def test_restore_refuses_a_slot_table_that_does_not_verify(
    records: list[tuple[int, SlotRecord]],
) -> None:
    index, _, _ = make_index()
    with pytest.raises(ValueError):
        index.restore(as_read(records))


def test_a_restored_index_holds_what_was_committed_and_goes_on_from_there() -> None:
    index, journal, _ = make_index(blocks=16, slots=6)
    for key, blocks in ((b"a", 1), (b"b", 3), (b"c", 2), (b"d", 1)):
        put(index, key, blocks)
    index.evict(b"b")
    restored, journal_after, _ = make_index(blocks=16, slots=6)
    restored.restore(as_read(list(journal.records.items())))
    restored.check()
    for key in (b"a", b"c", b"d"):
        before, after = index.get(key), restored.get(key)
        assert before is not None and after is not None
        # Every field, as the entry was committed, but for its producer's and its allocation's
        # (gone with the old daemon: a READY entry is committed by nobody) and the times (the
        # restart's).
        assert dataclasses.asdict(after) == {
            **dataclasses.asdict(before),
            "session_id": "",
            "producer": "(restored)",
            "allocation": 0,
            "created_at": restored._clock(),
            "committed_at": restored._clock(),
        }
    assert restored.get(b"b") is None
    stats = restored.stats("")
    assert (stats.free_blocks, stats.entries_ready) == (12, 3)
    put(restored, b"e", 3)  # in the blocks and slot b left, with the next commit_seq
    e = restored.get(b"e")
    assert e is not None and e.commit_seq == 5
    assert journal_after.records[e.slot].commit_seq == 5
    restored.check()


def deleted_under_a_lock_and_put_again() -> tuple[list[tuple[int, SlotRecord]], int]:
    """The slot table left by a key deleted while a reader locked it, then put again: two
    records of the key. Returns the records and the older one's slot."""
    index, journal, _ = make_index()
    put(index, b"k", 2)
    old_slot = journal.lock(b"k")
    assert index.delete(b"k").status is Status.OK  # its record stays: the reader holds it
    put(index, b"k", 3)
    assert sorted(r.key for r in journal.records.values()) == [b"k", b"k"]
    return sorted(journal.records.items()), old_slot


@pytest.mark.parametrize("still_locked", [True, False])
def test_restore_of_a_key_deleted_under_a_lock_and_put_again_adopts_the_newer_record(
    still_locked: bool,
) -> None:
    records, old_slot = deleted_under_a_lock_and_put_again()
    restored, journal, _ = make_index()
    journal.records = dict(records)
    if still_locked:  # locks outlive the daemon: the reader may still hold it
        journal.locked.add(old_slot)
    restored.restore(as_read(records))  # not refused
    entry = restored.get(b"k")
    assert entry is not None and entry.slot != old_slot and entry.blocks == 3
    assert entry.commit_seq == max(r.commit_seq for _, r in records)
    restored.check()
    # The older record's blocks are the reader's until it lets go, then free again.
    assert restored.stats("").free_blocks == (3 if still_locked else 5)
    assert (old_slot in journal.records) is still_locked
    journal.locked.clear()
    assert restored.reclaim() == 0
    assert restored.stats("").free_blocks == 5 and old_slot not in journal.records
    restored.check()
    restored.allocate(b"fill", spec(5 * BLOCK), "s", "p")  # every free block, a free slot
    restored.check()


@pytest.mark.parametrize("still_locked", [True, False])
def test_restore_does_not_adopt_an_entry_deleted_under_a_lock(still_locked: bool) -> None:
    index, journal, _ = make_index(blocks=8)
    put(index, b"k", 3)
    put(index, b"other", 2)
    slot = journal.lock(b"k")
    index.delete(b"k")
    restored, after, _ = make_index(blocks=8)
    after.records = dict(journal.records)
    after.locked = set(journal.locked) if still_locked else set()  # locks outlive the daemon
    restored.restore(*read_back(journal))
    assert restored.get(b"k") is None and restored.state(b"other") is EntryState.READY
    restored.check()
    # Its blocks are the reader's until it lets go, then free again.
    assert restored.stats("").free_blocks == (3 if still_locked else 6)
    assert (slot in after.records) is still_locked
    after.locked.clear()
    assert restored.reclaim() == 0
    assert restored.stats("").free_blocks == 6 and slot not in after.records
    restored.check()


def test_restore_of_a_doomed_record_and_its_key_put_again_adopts_the_new_entry() -> None:
    index, journal, _ = make_index()
    put(index, b"k", 2)
    old_slot = journal.lock(b"k")
    index.delete(b"k")
    put(index, b"k", 3)
    restored, after, _ = make_index()
    after.records, after.locked = dict(journal.records), {old_slot}
    restored.restore(*read_back(journal))
    entry = restored.get(b"k")
    assert entry is not None and entry.slot != old_slot and entry.blocks == 3
    assert restored.stats("").free_blocks == 3  # 8 less the new entry's 3 and the reader's 2
    restored.check()


def test_stats_count_states_pins_and_bytes() -> None:
    index, _, _ = make_index()
    put(index, b"ready", 2)
    index.pin(b"ready")
    index.allocate(b"pending", spec(BLOCK), "s", "p")
    stats = index.stats("")
    assert (stats.entries_ready, stats.entries_pending, stats.entries_pinned) == (1, 1, 1)
    assert (stats.pins, stats.bytes_ready, stats.free_blocks) == (1, 2 * BLOCK, 5)
    assert stats.num_blocks == 8 and stats.commits == 1 and stats.hits == 1


def test_stats_count_the_slots_readers_lock() -> None:
    index, journal, _ = make_index()
    put(index, b"a", 1)
    put(index, b"b", 1)
    journal.lock(b"a")
    assert index.stats("").entries_locked == 1


def test_check_finds_a_block_held_twice() -> None:
    index, _, _ = make_index()
    put(index, b"k", 1)
    entry = index.get(b"k")
    assert entry is not None
    entry.extents = (Extent(0, 1), Extent(0, 1))
    with pytest.raises(AssertionError):
        index.check()
