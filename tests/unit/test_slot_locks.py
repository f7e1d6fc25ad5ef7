"""Lock pins' primitives (ec_protocol/pool/slot_locks.py) on a real pool file: real OFD locks, no
daemon.

Two open file descriptions in one process conflict as two processes would (OFD locks belong to
the description), so the daemon's side is a PoolFile (its own read-write description) and each
reader a SlotPins (a read-only one). Proven here: a shared lock refuses the exclusive one and
only its own byte; pins count per slot, and giving many back drops exactly the locks whose last
pin went; many pins lock a run of slots at once, miss only what they cannot pin, and each
unpin frees exactly its slot; a pin is a miss, and leaves no lock, whenever the slot does not
hold a whole record of the key that fits the pool, or while the exclusive lock is held; the
daemon writes no record into a slot a reader holds locked; `locked_slots` lists exactly the
locked slots; a retired SlotPins closes with its last pin. A record checked once (read ahead, or
by an earlier pin) is not parsed again while the slot holds the same bytes, and is never taken
for bytes that changed.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ecd_testing import count_record_parses

from ec_daemon.core.pool import PoolFile
from ec_protocol.pool import slot_locks
from ec_protocol.pool.layout import SLOT_SIZE, Geometry, SlotRecord, slot_offset
from ec_protocol.pool.slot_locks import (
    PinnedEntry,
    SlotPins,
    lock_exclusive,
    lock_shared,
    locked_slots,
    runs,
    unlock,
)
from ec_protocol.types import Extent, TensorSpec

BLOCK = 4096
GEOMETRY = Geometry(BLOCK, num_blocks=64, num_slots=8)


def pinned(record: SlotRecord) -> PinnedEntry:
    """What a lock pin of the slot holding `record` answers."""
    extents = tuple(Extent(start, count) for start, count in record.extents)
    spec = TensorSpec(record.shape, record.dtype, record.nbytes)
    return PinnedEntry(record.key, extents, spec, record.checksum)


def record(key: bytes, start: int = 0, nbytes: int = 3 * BLOCK) -> SlotRecord:
    blocks = -(-nbytes // BLOCK)
    return SlotRecord(key, "uint8", (nbytes,), nbytes, 0, 1, ((start, blocks),))


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[PoolFile]:
    """A pool file whose slots 0..7 hold entries k0..k7 (3 blocks each, back to back)."""
    pool = PoolFile.create(tmp_path, "p", GEOMETRY, "model", 0o600, None)
    for slot in range(GEOMETRY.num_slots):
        pool.write_slot(slot, record(f"k{slot}".encode(), start=3 * slot))
    yield pool
    pool.close()


@pytest.fixture
def pins(pool: PoolFile) -> Iterator[SlotPins]:
    pins = SlotPins(str(pool.path), str(pool.header.pool_uuid))
    yield pins
    pins.close()


def key(slot: int) -> bytes:
    return f"k{slot}".encode()


def test_a_shared_lock_refuses_the_exclusive_one_and_a_free_byte_grants_it(pool: PoolFile) -> None:
    reader = os.open(pool.path, os.O_RDONLY)
    other_reader = os.open(pool.path, os.O_RDONLY)
    daemon = os.open(pool.path, os.O_RDWR)
    try:
        assert lock_shared(reader, 3)
        assert lock_shared(other_reader, 3)  # readers share
        assert not lock_exclusive(daemon, 3)
        assert lock_exclusive(daemon, 2) and lock_exclusive(daemon, 4)  # only its own byte
        unlock(daemon, 2)
        unlock(daemon, 4)
        unlock(reader, 3)
        assert not lock_exclusive(daemon, 3)  # the other reader still holds it
        unlock(other_reader, 3)
        assert lock_exclusive(daemon, 3)
        assert not lock_shared(reader, 3)  # and the exclusive one refuses readers
    finally:
        for fd in (reader, other_reader, daemon):
            os.close(fd)


def test_the_daemon_writes_no_record_into_a_slot_a_reader_holds_locked(
    pool: PoolFile, pins: SlotPins
) -> None:
    assert pool.erase_slot(6)  # free, as a stale view still takes it for k6's
    reader = os.open(pool.path, os.O_RDONLY)
    try:
        assert lock_shared(reader, 6)  # the reader probing it
        assert not pool.write_slot(6, record(b"new", start=30))
        unlock(reader, 6)
    finally:
        os.close(reader)
    assert pins.pin(6, b"new") is None  # nothing was written
    assert pool.write_slot(6, record(b"new", start=30))  # once it let go
    assert pins.pin(6, b"new") == pinned(record(b"new", start=30))


def test_pinning_a_slot_twice_and_unpinning_once_keeps_its_lock(
    pool: PoolFile, pins: SlotPins
) -> None:
    assert pins.pin(5, key(5)) == pinned(record(key(5), start=15))
    assert pins.pin(5, key(5)) == pinned(record(key(5), start=15))
    assert pins.held() == 1
    pins.unpin(5)
    assert pool.slot_locked(5)
    assert not pool.erase_slot(5)
    assert pins.pin(5, key(5)) is not None  # the record is still there, whole
    pins.unpin(5)
    pins.unpin(5)
    assert pins.held() == 0
    assert not pool.slot_locked(5)
    assert pool.erase_slot(5)
    assert pins.pin(5, key(5)) is None  # erased: a miss


def test_runs_are_the_distinct_slots_in_consecutive_stretches() -> None:
    assert runs([]) == []
    assert runs([5, 3, 4, 4, 9, 0, 10]) == [(0, 1), (3, 3), (9, 2)]


def test_unpinning_many_drops_exactly_the_locks_whose_last_pin_went(
    pool: PoolFile, pins: SlotPins
) -> None:
    for slot in (1, 2, 3, 4, 6):
        assert pins.pin(slot, key(slot)) is not None
    assert pins.pin(3, key(3)) is not None  # a second pin of slot 3
    pins.unpin_many([6, 1, 2, 3, 4])  # slots 1-4 one run, slot 3 keeps its other pin
    assert pool.locked_slots() == {3}
    assert pins.held() == 1
    pins.unpin_many([3, 5])  # a slot not pinned (5) changes nothing
    assert pool.locked_slots() == set()
    assert pins.held() == 0


def test_pinning_many_locks_a_run_of_slots_and_unpinning_one_frees_exactly_it(
    pool: PoolFile, pins: SlotPins
) -> None:
    found = pins.pin_many([(slot, key(slot)) for slot in (1, 2, 3, 4)])
    assert found == [pinned(record(key(s), start=3 * s)) for s in (1, 2, 3, 4)]
    assert pool.locked_slots() == {1, 2, 3, 4}
    assert not pool.erase_slot(2)
    pins.unpin(2)
    assert pool.locked_slots() == {1, 3, 4}
    assert pool.erase_slot(2)
    assert not pool.erase_slot(1) and not pool.erase_slot(3)
    pins.unpin_many([1, 3, 4])
    assert not _any_byte_locked(pool)  # the run's lock covered record bytes too: all gone


def test_pinning_many_while_the_daemon_erases_one_slot_of_a_run_pins_the_others(
    pool: PoolFile, pins: SlotPins
) -> None:
    daemon = os.open(pool.path, os.O_RDWR)
    try:
        assert lock_exclusive(daemon, 3)
        found = pins.pin_many([(slot, key(slot)) for slot in (2, 3, 4)])
        assert found == [pinned(record(key(2), start=6)), None, pinned(record(key(4), start=12))]
        assert pins.held() == 2
        unlock(daemon, 3)
        assert pool.locked_slots() == {2, 4}  # none was left on the slot it could not pin
    finally:
        os.close(daemon)


def test_pinning_many_answers_in_order_with_misses_and_counts_each_pin(
    pool: PoolFile, pins: SlotPins
) -> None:
    wanted = [(5, key(5)), (1, b"other"), (5, key(5)), (GEOMETRY.num_slots, key(0)), (6, key(6))]
    five, six = pinned(record(key(5), start=15)), pinned(record(key(6), start=18))
    assert pins.pin_many(wanted) == [five, None, five, None, six]
    assert pool.locked_slots() == {5, 6}  # slot 1 held another key: unlocked again
    pins.unpin_many([5, 6])
    assert pool.locked_slots() == {5}  # its second pin
    pins.unpin(5)
    assert pool.locked_slots() == set()
    assert pins.held() == 0


@pytest.mark.parametrize("slots", [[4], [4, 5, 6]], ids=["one", "a run"])
def test_a_pin_whose_record_cannot_be_read_is_a_miss_and_leaves_no_lock(
    pool: PoolFile, pins: SlotPins, monkeypatch: pytest.MonkeyPatch, slots: list[int]
) -> None:
    def failing_pread(fd: int, length: int, offset: int) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(slot_locks.os, "pread", failing_pread)
    assert pins.pin_many([(slot, key(slot)) for slot in slots]) == [None] * len(slots)
    assert pins.held() == 0
    assert not _any_byte_locked(pool)


def _any_byte_locked(pool: PoolFile) -> bool:
    """Whether any other description holds a lock on any byte of the slot table."""
    probe = os.open(pool.path, os.O_RDONLY)
    try:
        start, end = slot_offset(0), slot_offset(GEOMETRY.num_slots)
        query = slot_locks._FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, end - start, 0)
        answer = fcntl.fcntl(probe, slot_locks.F_OFD_GETLK, query)
        return bool(slot_locks._FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)
    finally:
        os.close(probe)


def test_a_pin_holds_the_record_against_erasure_until_unpinned(
    pool: PoolFile, pins: SlotPins
) -> None:
    assert pins.pin(2, key(2)) is not None
    assert not pool.erase_slot(2)
    assert _record_at(pool, 2) == record(key(2), start=6)
    assert pool.erase_slot(3)  # a neighbour is not held by it
    pins.unpin(2)
    assert pool.erase_slot(2)


def _patch(pool: PoolFile, at: int, data: bytes) -> None:
    """Write into the file as another process would."""
    fd = os.open(pool.path, os.O_RDWR)
    try:
        os.pwrite(fd, data, at)
    finally:
        os.close(fd)


def _record_at(pool: PoolFile, slot: int) -> SlotRecord | None:
    fd = os.open(pool.path, os.O_RDONLY)
    try:
        return SlotRecord.unpack(os.pread(fd, SLOT_SIZE, slot_offset(slot)))
    finally:
        os.close(fd)


def _tear(pool: PoolFile) -> None:
    """Flip one byte of slot 1's key: its CRC no longer matches."""
    at = slot_offset(1) + len(record(key(1)).pack()) - 1
    _patch(pool, at, b"\xff")


MISSES: dict[str, Callable[[PoolFile], object]] = {
    "another key": lambda pool: pool.write_slot(1, record(b"someone-else", start=3)),
    "a free slot": lambda pool: _patch(pool, slot_offset(1), b"\0" * SLOT_SIZE),
    "an erased slot": lambda pool: pool.erase_slot(1),
    "a torn record": _tear,
    "extents past the pool": lambda pool: pool.write_slot(
        1, record(key(1), start=GEOMETRY.num_blocks - 2)
    ),
    "extents not its size": lambda pool: pool.write_slot(
        1, SlotRecord(key(1), "uint8", (BLOCK,), BLOCK, 0, 1, ((3, 2),))
    ),
    "two extents, one past the pool": lambda pool: pool.write_slot(
        1, two_extents(key(1), (3, 1), (GEOMETRY.num_blocks - 1, 2))
    ),
    "two extents not its size": lambda pool: pool.write_slot(
        1, two_extents(key(1), (3, 1), (30, 1))
    ),
}


def two_extents(key: bytes, first: tuple[int, int], second: tuple[int, int]) -> SlotRecord:
    """A record of 3 blocks' bytes in two extents, as a fragmented pool allocates them."""
    return SlotRecord(key, "uint8", (3 * BLOCK,), 3 * BLOCK, 0, 1, (first, second))


def test_a_pin_of_an_entry_in_two_extents_answers_both(pool: PoolFile, pins: SlotPins) -> None:
    entry = two_extents(key(1), (3, 1), (30, 2))
    pool.write_slot(1, entry)
    assert pins.pin(1, key(1)) == pinned(entry)


@pytest.mark.parametrize("case", MISSES)
def test_a_pin_of_a_slot_not_holding_a_whole_fitting_record_of_the_key_is_a_miss_and_leaves_no_lock(
    pool: PoolFile, pins: SlotPins, case: str
) -> None:
    MISSES[case](pool)
    assert pins.pin(1, key(1)) is None
    assert pins.held() == 0
    assert not pool.slot_locked(1)
    assert pool.locked_slots() == set()
    assert pins.pin(0, key(0)) is not None  # the others are unaffected


def test_a_pin_of_a_slot_out_of_range_is_a_miss(pins: SlotPins) -> None:
    assert pins.pin(GEOMETRY.num_slots, key(0)) is None
    assert pins.pin(-1, key(0)) is None
    assert pins.held() == 0


def test_a_pin_while_the_exclusive_lock_is_held_is_a_miss_and_leaves_no_lock(
    pool: PoolFile, pins: SlotPins
) -> None:
    daemon = os.open(pool.path, os.O_RDWR)
    try:
        assert lock_exclusive(daemon, 4)
        assert pins.pin(4, key(4)) is None
        assert pins.held() == 0
        unlock(daemon, 4)
        assert not pool.slot_locked(4)
        assert pins.pin(4, key(4)) is not None
    finally:
        os.close(daemon)


def test_locked_slots_lists_exactly_the_locked_slots(pool: PoolFile, pins: SlotPins) -> None:
    assert pool.locked_slots() == set()
    other = SlotPins(str(pool.path), str(pool.header.pool_uuid))
    try:
        for slot in (0, 3, 4):
            assert pins.pin(slot, key(slot)) is not None
        for slot in (4, 7):  # another reader, overlapping on 4; the last slot too
            assert other.pin(slot, key(slot)) is not None
        assert pool.locked_slots() == {0, 3, 4, 7}
        pins.unpin(4)
        assert pool.locked_slots() == {0, 3, 4, 7}  # the other reader still holds 4
        other.unpin(4)
        pins.unpin(0)
        assert pool.locked_slots() == {3, 7}
        # Seen from any description that holds none itself, the daemon's read-only view too.
        probe = os.open(pool.path, os.O_RDONLY)
        try:
            assert locked_slots(probe, GEOMETRY.num_slots) == {3, 7}
        finally:
            os.close(probe)
        other.close()  # closing drops every lock it held
        assert pool.locked_slots() == {3}
    finally:
        other.close()
    pins.unpin(3)
    assert pool.locked_slots() == set()


def test_retire_closes_the_file_once_the_last_pin_is_given_back(
    pool: PoolFile, pins: SlotPins
) -> None:
    assert pins.pin(1, key(1)) is not None
    assert pins.pin(6, key(6)) is not None
    pins.retire()
    assert pool.locked_slots() == {1, 6}  # retiring drops no pin
    pins.unpin(1)
    assert pool.locked_slots() == {6}
    assert pins.pin(6, key(6)) is None  # retired: no new pins, not even of a slot held
    assert pool.locked_slots() == {6}
    pins.unpin(6)
    assert pool.locked_slots() == set()
    assert pins.pin(2, key(2)) is None  # closed: every pin is a miss
    assert pool.locked_slots() == set()


def test_retire_with_no_pins_closes_at_once(pool: PoolFile, pins: SlotPins) -> None:
    pins.retire()
    assert pins.pin(0, key(0)) is None
    assert pool.locked_slots() == set()


# ---- records checked once: read ahead, or by an earlier pin ---------------------------------


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    return count_record_parses(monkeypatch)


def test_a_pin_of_a_record_read_ahead_parses_nothing(
    pool: PoolFile, pins: SlotPins, parses: list[bytes]
) -> None:
    pins.read_ahead(2, key(2))
    assert parses == [key(2)]
    assert pins.pin(2, key(2)) == pinned(record(key(2), start=6))
    assert parses == [key(2)]  # the slot's bytes were read under the lock, and were the same
    assert pool.slot_locked(2)


def test_a_second_pin_of_the_same_record_parses_it_no_more(
    pool: PoolFile, pins: SlotPins, parses: list[bytes]
) -> None:
    assert pins.pin(3, key(3)) is not None
    pins.unpin(3)
    assert pins.pin(3, key(3)) == pinned(record(key(3), start=9))
    assert parses == [key(3)]


@pytest.mark.parametrize("case", MISSES)
def test_a_record_changed_since_it_was_read_ahead_is_a_miss(
    pool: PoolFile, pins: SlotPins, parses: list[bytes], case: str
) -> None:
    pins.read_ahead(1, key(1))
    MISSES[case](pool)
    assert pins.pin(1, key(1)) is None
    assert len(parses) == 2  # the new bytes were parsed, not taken for the old record
    assert pins.held() == 0
    assert not pool.slot_locked(1)


def test_a_record_read_ahead_answers_only_for_its_own_key(
    pool: PoolFile, pins: SlotPins, parses: list[bytes]
) -> None:
    pins.read_ahead(4, key(4))
    assert pins.pin(4, key(5)) is None
    assert parses == [key(4)]
    assert not pool.slot_locked(4)


def test_reading_ahead_a_slot_that_holds_another_key_keeps_nothing(
    pool: PoolFile, pins: SlotPins, parses: list[bytes]
) -> None:
    pins.read_ahead(4, key(5))  # a stale hint: slot 4 holds k4
    assert pins.pin(4, key(4)) == pinned(record(key(4), start=12))
    assert parses == [key(4), key(4)]  # nothing was kept for it: parsed again


def test_the_records_kept_checked_are_the_newest_few(
    pool: PoolFile, pins: SlotPins, parses: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slot_locks, "CHECKED_RECORDS", 2)
    for slot in (0, 1, 2):
        pins.read_ahead(slot, key(slot))
    for slot in (2, 1, 0):
        assert pins.pin(slot, key(slot)) is not None
    assert parses == [key(0), key(1), key(2), key(0)]  # slot 0's was forgotten first


def test_reading_ahead_after_close_reads_nothing(pins: SlotPins, parses: list[bytes]) -> None:
    pins.close()
    pins.read_ahead(0, key(0))
    pins.read_ahead(GEOMETRY.num_slots, key(0))
    assert parses == []


def test_ready_lists_the_ready_records_a_batch_at_a_time_and_where_to_go_on(
    pool: PoolFile, pins: SlotPins
) -> None:
    _tear(pool)  # slot 1: marked READY, its record does not verify
    assert pool.erase_slot(4)  # evicted
    assert pins.ready(0, 3) == ([(0, key(0)), (2, key(2)), (3, key(3))], 5)
    assert pins.ready(5, 3) == ([(5, key(5)), (6, key(6)), (7, key(7))], None)
    assert pins.ready(7, 3) == ([(7, key(7))], None)
    assert pins.held() == 0  # it pins nothing
