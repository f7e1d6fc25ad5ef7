"""PoolIndex alone, with a fake journal and a recording event sink: states, single flight, the
order of journal writes, eviction through the policy, and restore."""

from __future__ import annotations

import dataclasses

import pytest
from core_testing import FakeClock, spec

from ec_client.layout import Geometry, RecordFields, SlotRecord, read_record
from ec_client.types import EntryState, EventType, Extent, Status
from ec_daemon.eviction import FIFOPolicy, LRUPolicy
from ec_daemon.index import PoolIndex

BLOCK = 1024


class FakeJournal:
    """Records the slot writes and erasures, in order, with what the index showed at the time."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []
        self.records: dict[int, SlotRecord] = {}

    def write_slot(self, slot: int, record: SlotRecord) -> None:
        self.ops.append(("write", slot))
        self.records[slot] = record

    def erase_slot(self, slot: int) -> None:
        self.ops.append(("erase", slot))
        self.records.pop(slot, None)


class Sink:
    """Records events, and for each whether the journal held the key's record at that moment."""

    def __init__(self, journal: FakeJournal) -> None:
        self.journal = journal
        self.events: list[tuple[EventType, bytes]] = []
        self.journaled_at_event: list[bool] = []

    def __call__(self, type: EventType, key: bytes, nbytes: int) -> None:
        self.events.append((type, key))
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


def test_single_flight_answers_pending_to_others_and_the_same_extents_to_the_producer() -> None:
    index, _, _ = make_index()
    first = index.allocate(b"k", spec(BLOCK), "a", "encoder-a")
    assert index.allocate(b"k", spec(BLOCK), "b", "encoder-b").status is Status.PENDING
    again = index.allocate(b"k", spec(BLOCK), "a", "encoder-a")
    assert again.status is Status.ALLOCATED and again.entry is first.entry


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
            (1, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 2, ((1, 1),))),
        ],
        [
            (0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((0, 1),))),
            (0, SlotRecord(b"b", "uint8", (BLOCK,), BLOCK, 0, 2, ((1, 1),))),
        ],
        [(0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((0, 2),)))],
        [(0, SlotRecord(b"a", "uint8", (BLOCK,), BLOCK, 0, 1, ((7, 2),)))],
    ],
    ids=["a key twice", "a slot twice", "extents larger than the size", "past the pool's end"],
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
        # Every field, as the entry was committed, but for its producer's (gone with the old
        # daemon) and the times (the restart's).
        assert dataclasses.asdict(after) == {
            **dataclasses.asdict(before),
            "session_id": "",
            "producer": "(restored)",
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


def test_stats_count_states_pins_and_bytes() -> None:
    index, _, _ = make_index()
    put(index, b"ready", 2)
    index.pin(b"ready")
    index.allocate(b"pending", spec(BLOCK), "s", "p")
    stats = index.stats("")
    assert (stats.entries_ready, stats.entries_pending, stats.entries_pinned) == (1, 1, 1)
    assert (stats.pins, stats.bytes_ready, stats.free_blocks) == (1, 2 * BLOCK, 5)
    assert stats.num_blocks == 8 and stats.commits == 1 and stats.hits == 1


def test_check_finds_a_block_held_twice() -> None:
    index, _, _ = make_index()
    put(index, b"k", 1)
    entry = index.get(b"k")
    assert entry is not None
    entry.extents = (Extent(0, 1), Extent(0, 1))
    with pytest.raises(AssertionError):
        index.check()
