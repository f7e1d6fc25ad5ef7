"""The pool file format: slot records that are whole or ignored, and a file that costs little
more than its capacity."""

from __future__ import annotations

import struct

import pytest

from ec_protocol.pool.layout import (
    MAX_KEY_BYTES,
    MAX_NDIM,
    SLOT_DOOMED_MARK,
    SLOT_SIZE,
    Geometry,
    LayoutError,
    SlotRecord,
    max_extents,
    read_record,
    read_slot_table,
    slots_marked,
)

MiB = 1 << 20


def record(key: bytes = b"mm-hash", ndim: int = 2, extents: int = 1) -> SlotRecord:
    return SlotRecord(
        key=key,
        dtype="bfloat16",
        shape=(3,) * (ndim - 1) + (256,),
        nbytes=2 * 256 * 3 ** (ndim - 1),
        checksum=0xDEADBEEF,
        commit_seq=42,
        extents=tuple((2 * i, 1) for i in range(extents)),
    )


def in_slot(packed: bytes, under: bytes = b"") -> bytes:
    """A slot holding `packed`, written over what it held before (`under`)."""
    slot = bytearray(under.ljust(SLOT_SIZE, b"\0"))
    slot[: len(packed)] = packed
    return bytes(slot)


def test_a_slot_record_reads_back_as_written() -> None:
    written = record(extents=3)
    assert SlotRecord.unpack(in_slot(written.pack())) == written


def test_the_longest_key_with_the_most_dimensions_fits_its_extents_and_no_more() -> None:
    most = max_extents(MAX_KEY_BYTES, MAX_NDIM)
    assert most >= 16
    widest = record(b"k" * MAX_KEY_BYTES, MAX_NDIM, most)
    assert SlotRecord.unpack(in_slot(widest.pack())) == widest
    with pytest.raises(LayoutError, match="does not fit a slot"):
        record(b"k" * MAX_KEY_BYTES, MAX_NDIM, most + 1).pack()


def test_a_record_written_over_a_longer_one_reads_back_as_itself() -> None:
    old = record(b"o" * 200, extents=20).pack()
    new = record(b"n", extents=1)
    assert SlotRecord.unpack(in_slot(new.pack(), under=old)) == new


def test_a_record_with_any_byte_changed_is_ignored() -> None:
    packed = record(extents=2).pack()
    for at in range(len(packed)):
        torn = bytearray(packed)
        torn[at] ^= 0x01
        assert SlotRecord.unpack(in_slot(bytes(torn))) is None, at


def test_an_erased_or_empty_slot_holds_no_record() -> None:
    packed = bytearray(record().pack())
    packed[:4] = b"\0\0\0\0"  # what erase_slot writes
    assert SlotRecord.unpack(in_slot(bytes(packed))) is None
    assert SlotRecord.unpack(bytes(SLOT_SIZE)) is None


def test_a_slot_cut_short_holds_no_record() -> None:
    packed = record().pack()  # a pread of a truncated file reads less than a slot
    for length in (0, 4, 8, 20, len(packed) - 1):
        assert read_record(packed[:length]) is None, length


def a_slot_table() -> tuple[bytes, set[int], list[tuple[int, SlotRecord]]]:
    """A slot table whose slots are free, READY, erased over a record, torn, written over a
    longer record, marked READY over nothing, or whole records of many shapes; the slots marked
    READY; and the records it holds, by slot."""
    whole = [record(f"k{i}".encode(), ndim=1 + i % MAX_NDIM, extents=1 + i % 5) for i in range(8)]
    erased = bytearray(record(b"erased").pack())
    erased[:4] = b"\0\0\0\0"  # what erase_slot writes
    torn = bytearray(record(b"torn", extents=3).pack())
    torn[-1] ^= 0x01
    over, longest = record(b"n"), record(b"last", extents=max_extents(4, 2))
    ready_mark = over.pack()[:4]
    slots = [
        b"",
        whole[0].pack(),
        bytes(erased),
        bytes(torn),
        in_slot(over.pack(), under=record(b"o" * 200, extents=20).pack()),
        ready_mark,
        *(r.pack() for r in whole[1:]),
        b"",
        longest.pack(),
    ]
    marked = {i for i, slot in enumerate(slots) if slot[:4] == ready_mark}
    held = [
        (1, whole[0]),
        (4, over),
        *((5 + i, r) for i, r in enumerate(whole) if i),
        (14, longest),
    ]
    return b"".join(in_slot(slot) for slot in slots), marked, held


def test_the_mark_scan_finds_every_slot_marked_ready_and_no_other() -> None:
    table, marked, _ = a_slot_table()
    assert slots_marked(table) == sorted(marked)


def test_reading_only_the_marked_slots_gives_exactly_what_reading_every_slot_gives() -> None:
    table, _, held = a_slot_table()
    slots = [table[i : i + SLOT_SIZE] for i in range(0, len(table), SLOT_SIZE)]
    assert [(i, r) for i, slot in enumerate(slots) if (r := SlotRecord.unpack(slot))] == held
    every_slot = [(i, f) for i, slot in enumerate(slots) if (f := read_record(slot)) is not None]
    assert read_slot_table(table) == every_slot
    assert [(i, SlotRecord.unpack(table, i * SLOT_SIZE)) for i, _ in every_slot] == held


def test_a_doomed_record_is_no_record_to_a_reader_and_is_found_by_a_scan_for_doomed_ones() -> None:
    packed = record(b"removed").pack()
    doomed = (struct.pack("<I", SLOT_DOOMED_MARK) + packed[4:]).ljust(SLOT_SIZE, b"\0")
    table = packed.ljust(SLOT_SIZE, b"\0") + doomed
    assert read_record(doomed) is None
    assert [slot for slot, _ in read_slot_table(table)] == [0]
    assert read_slot_table(table, 0, SLOT_DOOMED_MARK) == [(1, read_record(packed))]


def test_a_slot_table_of_part_of_a_slot_does_not_verify() -> None:
    table, _, _ = a_slot_table()
    with pytest.raises(LayoutError, match="not whole slots"):
        read_slot_table(table[:-1])


@pytest.mark.parametrize("block", [512, 4096, 7168, 14336])
@pytest.mark.parametrize("capacity", [100, 128, 130, 1024, 8192, 65536])
def test_a_pool_file_is_at_most_about_two_percent_larger_than_its_capacity(
    block: int, capacity: int
) -> None:
    geometry = Geometry.for_capacity(block, capacity * MiB, None)
    overhead = geometry.file_size - geometry.capacity_bytes
    assert (
        overhead <= max(2 * MiB, geometry.capacity_bytes // 64) <= 0.021 * geometry.capacity_bytes
    )


def test_a_pool_has_a_slot_for_every_32_kib_of_capacity_in_whole_2_mib_header_areas() -> None:
    small = Geometry.for_capacity(512, 100 * MiB, None)
    large = Geometry.for_capacity(4096, 1024 * MiB, None)
    assert (small.num_slots, small.data_offset) == ((2 * MiB - 4096) // SLOT_SIZE, 2 * MiB)
    assert (large.num_slots, large.data_offset) == ((16 * MiB - 4096) // SLOT_SIZE, 16 * MiB)
    assert Geometry.for_capacity(4096, 64 * 4096, None).num_slots == 64  # never above blocks
    assert Geometry.for_capacity(7168, 8192 * MiB, None).num_slots == 65536  # nor 65536


def test_a_pool_told_how_many_entries_it_holds_has_that_many_slots_within_its_blocks() -> None:
    assert Geometry.for_capacity(512, 1024 * MiB, 2).num_slots == 2
    assert Geometry.for_capacity(4096, 128 * MiB, 100_000).num_slots == 32768  # one per block
