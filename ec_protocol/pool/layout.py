"""The pool file format, shared by the daemon (which writes it) and clients (which verify it).

A pool file `<shm_dir>/ecd-<engine_id>.pool` is laid out as:

    [0, 4096)                      header: identity and geometry, CRC-protected
    [4096, 4096 + slots * 512)     slot table: one record per entry the pool can hold
    [data_offset, file_size)       num_blocks blocks of block_size_bytes; data_offset is
                                   aligned to 2 MiB so huge pages can back the data

The header's magic is written last at creation, so a half-written header never verifies. A slot
record describes one READY entry (key, extents, tensor spec, checksum) in the first bytes of its
512-byte slot; it is written with one pwrite, mark included, and a CRC covers what follows the
mark and CRC, so after a daemon crash every record is either whole or ignored (see
ec_daemon/core/pool.py). The slot table is sized from what a pool can hold
(Geometry.for_capacity), so a pool file is its capacity plus at most about 1.6%, or 2 MiB. This
module is pure Python (no torch) so the daemon can use it without importing torch.

Layout version 2 (this one) replaced version 1's 1 KiB records, one per block; a version 1 file
is refused at adoption and kept for inspection.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import struct
import sys
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# The dtypes are the format's too (their codes are stored in slot records); they live below the
# API's values (ec_protocol.types), which size a tensor with them, and are named here as well.
from ec_protocol.dtypes import DTYPES as DTYPES
from ec_protocol.dtypes import tensor_nbytes as tensor_nbytes

MAGIC = b"ECDPOOL1"
LAYOUT_VERSION = 2
HEADER_SIZE = 4096
SLOT_SIZE = 512  # divides the page size: a record never straddles a page
DATA_ALIGNMENT = 2 << 20
POOL_FILE_PREFIX = "ecd-"
POOL_FILE_SUFFIX = ".pool"

MAX_KEY_BYTES = 256
MAX_ENGINE_ID_BYTES = 128
MAX_COMPAT_KEY_BYTES = 1024
MAX_NDIM = 8
# Extents are stored as 32-bit block numbers.
MAX_BLOCKS = (1 << 32) - 1
# Unless told how many entries a pool must hold, the header area (header and slot table, up to
# the data's 2 MiB-aligned offset) of a pool is 1/HEADER_AREA_SHARE of its capacity rounded down to
# whole 2 MiB, and at least 2 MiB (4088 slots, which the alignment costs anyway), with at most
# MAX_AUTO_SLOTS slots: a file is its capacity plus at most ~1.6%, or 2 MiB. That is one slot per
# 32 KiB of capacity: an encoder output is rarely smaller (one image is tens of rows of several
# KiB), and a pool full of smaller entries evicts to free a slot.
HEADER_AREA_SHARE = 64
MAX_AUTO_SLOTS = 65536

# Use with fullmatch: `$` would also match before a final newline ("pool\n").
ENGINE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}

# magic, version, header_size, uuid, block_size, num_blocks, data_offset, slot_table_offset,
# num_slots, slot_size, file_size, created_ns, engine_id_len, compat_key_len, engine_id, compat_key
_HEADER = struct.Struct(f"<8sII16sQQQQQIQQII{MAX_ENGINE_ID_BYTES}s{MAX_COMPAT_KEY_BYTES}s")
_HEADER_CRC = struct.Struct("<I")
_HEADER_CRC_OFFSET = _HEADER.size

# A slot record: mark, crc (of the rest of the record), then the fixed fields: commit_seq, nbytes,
# checksum, key_len, dtype_code, ndim, n_extents; then shape (ndim int64), extents (n_extents
# pairs of uint32 start, count), key. Its length depends on the entry; the slot's bytes after it
# are ignored (they may hold an older, longer record).
_SLOT_MARK = struct.Struct("<I")
_SLOT_MARK_CRC = struct.Struct("<II")
_SLOT_FIXED = struct.Struct("<QQQHBBH")
_SLOT_HEAD = _SLOT_MARK_CRC.size + _SLOT_FIXED.size
SLOT_READY_MARK = 0x59444552  # "REDY"
SLOT_FREE_MARK = 0
# A record whose entry was removed (deleted, dropped) while a reader held its lock pin: the
# daemon cannot erase it under the lock, so it marks it over the READY mark, and neither a reader
# (a miss) nor a restarted daemon (its blocks stay out of use until the lock goes, the entry is
# not adopted) takes it for the entry (docs/design.md §5).
SLOT_DOOMED_MARK = 0x4D4F4F44  # "DOOM"
assert _HEADER.size + _HEADER_CRC.size <= HEADER_SIZE and HEADER_SIZE % SLOT_SIZE == 0
assert struct.calcsize("I") == _SLOT_MARK.size


class LayoutError(ValueError):
    """A pool file (or a value destined for one) does not match the format."""


def pool_file_name(engine_id: str) -> str:
    return f"{POOL_FILE_PREFIX}{engine_id}{POOL_FILE_SUFFIX}"


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def max_extents(key_len: int, ndim: int) -> int:
    """How many extents the slot record of an entry with this key and shape has room for: the
    allocator never splits the entry further (19 with a 256-byte key and 8 dimensions, 49 with a
    64-byte key and 2)."""
    return (SLOT_SIZE - _SLOT_HEAD - 8 * ndim - key_len) // 8


@dataclass(frozen=True)
class Geometry:
    """Sizes of a pool, derived from the request; two opens agree iff their geometries are equal."""

    block_size_bytes: int
    num_blocks: int
    num_slots: int

    @classmethod
    def for_capacity(
        cls, block_size_bytes: int, capacity_bytes: int, entries: int | None
    ) -> Geometry:
        """The geometry of a new pool: capacity_bytes // block_size_bytes blocks, and a slot for
        each of `entries` entries, or when None the slots that fill its header area (see
        HEADER_AREA_SHARE); never more slots than blocks."""
        num_blocks = capacity_bytes // block_size_bytes
        if entries is None:
            capacity = num_blocks * block_size_bytes
            share = capacity // HEADER_AREA_SHARE // DATA_ALIGNMENT * DATA_ALIGNMENT
            slots = (max(DATA_ALIGNMENT, share) - HEADER_SIZE) // SLOT_SIZE
            entries = min(slots, MAX_AUTO_SLOTS)
        return cls(block_size_bytes, num_blocks, min(num_blocks, entries))

    @property
    def slot_table_offset(self) -> int:
        return HEADER_SIZE

    @property
    def data_offset(self) -> int:
        return align_up(HEADER_SIZE + self.num_slots * SLOT_SIZE, DATA_ALIGNMENT)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.num_blocks * self.block_size_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_size_bytes

    @property
    def overhead_bytes(self) -> int:
        """What the file holds beyond its blocks: the header and the slot table, 2 MiB-aligned."""
        return self.data_offset


def most_overhead(capacity_bytes: int, entries: int | None) -> int:
    """The most a pool of this capacity adds to its file (header, slot table, alignment),
    whatever its block size (one-byte blocks would have the most slots)."""
    return Geometry.for_capacity(1, capacity_bytes, entries).overhead_bytes


@dataclass(frozen=True)
class Header:
    pool_uuid: uuid.UUID
    geometry: Geometry
    engine_id: str
    compat_key: str
    created_ns: int

    def pack(self) -> bytes:
        """The header page; its magic is zero so it can be written before it is valid."""
        g = self.geometry
        engine_id = self.engine_id.encode()
        compat = self.compat_key.encode()
        body = _HEADER.pack(
            b"\0" * len(MAGIC),
            LAYOUT_VERSION,
            HEADER_SIZE,
            self.pool_uuid.bytes,
            g.block_size_bytes,
            g.num_blocks,
            g.data_offset,
            g.slot_table_offset,
            g.num_slots,
            SLOT_SIZE,
            g.file_size,
            self.created_ns,
            len(engine_id),
            len(compat),
            engine_id,
            compat,
        )
        crc = zlib.crc32(MAGIC + body[len(MAGIC) :])
        return (body + _HEADER_CRC.pack(crc)).ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, page: bytes) -> Header:
        """Parse and verify a header page; LayoutError says what did not verify."""
        if len(page) < HEADER_SIZE:
            raise LayoutError(f"header is {len(page)} bytes, expected {HEADER_SIZE}")
        fields = _HEADER.unpack_from(page)
        (magic, version, header_size, raw_uuid, block_size, num_blocks, data_offset) = fields[:7]
        (slot_offset, num_slots, slot_size, file_size, created_ns) = fields[7:12]
        (engine_id_len, compat_len, engine_id, compat) = fields[12:]
        if magic != MAGIC:
            raise LayoutError(f"bad magic {magic!r}, expected {MAGIC!r}: not an ecd pool file")
        if version != LAYOUT_VERSION:
            raise LayoutError(
                f"pool file layout {version}, this build reads layout {LAYOUT_VERSION} (the file "
                f"was written by {'an older' if version < LAYOUT_VERSION else 'a newer'} ecd): "
                "its entries cannot be read; remove the file to let the pool be created anew"
            )
        (crc,) = _HEADER_CRC.unpack_from(page, _HEADER_CRC_OFFSET)
        if crc != zlib.crc32(page[:_HEADER_CRC_OFFSET]):
            raise LayoutError("header checksum does not match: the header was overwritten")
        geometry = Geometry(block_size, num_blocks, num_slots)
        expected = (HEADER_SIZE, SLOT_SIZE, geometry.slot_table_offset, geometry.data_offset)
        found = (header_size, slot_size, slot_offset, data_offset)
        if found != expected or file_size != geometry.file_size:
            raise LayoutError(f"inconsistent header geometry {found}, expected {expected}")
        return cls(
            pool_uuid=uuid.UUID(bytes=raw_uuid),
            geometry=geometry,
            engine_id=engine_id[:engine_id_len].decode(),
            compat_key=compat[:compat_len].decode(),
            created_ns=created_ns,
        )


@dataclass(frozen=True)
class SlotRecord:
    """What survives a daemon crash of one READY entry."""

    key: bytes
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    commit_seq: int
    extents: tuple[tuple[int, int], ...]

    def pack(self) -> bytes:
        """The whole record, its READY mark included, for one write."""
        flat = [v for extent in self.extents for v in extent]
        body = (
            _SLOT_FIXED.pack(
                self.commit_seq,
                self.nbytes,
                self.checksum,
                len(self.key),
                DTYPES[self.dtype][0],
                len(self.shape),
                len(self.extents),
            )
            + struct.pack(f"<{len(self.shape)}q{len(flat)}I", *self.shape, *flat)
            + self.key
        )
        if _SLOT_MARK_CRC.size + len(body) > SLOT_SIZE:
            raise LayoutError(
                f"record of key {self.key!r} with {len(self.extents)} extents does not fit a slot"
            )
        return _SLOT_MARK_CRC.pack(SLOT_READY_MARK, zlib.crc32(body)) + body

    @classmethod
    def unpack(cls, slot: bytes, offset: int = 0) -> SlotRecord | None:
        """The record in a slot (the slot at `offset` of a slot table) if its mark says READY
        and its CRC verifies, else None (free, erased, or not a whole record)."""
        fields = read_record(slot, offset)
        if fields is None:
            return None
        key, dtype, shape, nbytes, checksum, commit_seq, flat = fields
        extents = tuple(zip(flat[0::2], flat[1::2], strict=True))
        return cls(key, dtype, shape, nbytes, checksum, commit_seq, extents)


# A slot record as read, before it is a SlotRecord: (key, dtype, shape, nbytes, checksum,
# commit_seq, extents), the extents flat (start, count, start, count, ...). A restart reads one
# per entry, 100,000 in a large pool: such a tuple costs a fraction of a SlotRecord (a frozen
# dataclass sets each field through object.__setattr__; docs/performance.md, *A warm restart*).
RecordFields = tuple[bytes, str, tuple[int, ...], int, int, int, tuple[int, ...]]
# Slots' bytes as read: a bytes, or a view of a buffer read into again and again (a slot table
# read a part at a time); what is read from them never keeps a view of them.
SlotBytes = bytes | bytearray | memoryview


def read_record(slot: SlotBytes, offset: int = 0) -> RecordFields | None:
    """The fields of the record in a slot (the slot at `offset` of a slot table) if its mark
    says READY and its CRC verifies, else None (a slot cut short included): what
    SlotRecord.unpack makes a SlotRecord of."""
    return _record_at(slot, offset, len(slot))


def slots_marked(table: SlotBytes, mark: int = SLOT_READY_MARK) -> list[int]:
    """The slots of a slot table whose mark says READY (or `mark`), found by their 4-byte marks
    alone (in C, however many slots are free): the only slots that can hold such a record."""
    if len(table) % SLOT_SIZE:
        raise LayoutError(f"a slot table of {len(table)} bytes is not whole slots")
    native = int.from_bytes(_SLOT_MARK.pack(mark), sys.byteorder)  # as the table's bytes read
    marks = memoryview(table).cast("I")[:: SLOT_SIZE // _SLOT_MARK.size]  # in native order
    return list(itertools.compress(range(len(marks)), map(native.__eq__, marks)))


def slots_written(table: SlotBytes) -> int:
    """How many slots of a slot table are not free (their mark is not SLOT_FREE_MARK): those
    that hold a READY or doomed record, and any written over by someone else."""
    if len(table) % SLOT_SIZE:
        raise LayoutError(f"a slot table of {len(table)} bytes is not whole slots")
    marks = memoryview(table).cast("I")[:: SLOT_SIZE // _SLOT_MARK.size]
    return len(marks) - marks.tolist().count(SLOT_FREE_MARK)


def read_slot_table(
    table: SlotBytes, first_slot: int = 0, mark: int = SLOT_READY_MARK
) -> list[tuple[int, RecordFields]]:
    """The whole records of a slot table (or of its slots from `first_slot` on) with their
    slots: what read_record finds in each slot, read only where a READY mark (or `mark`) is."""
    return _read_records(table, slots_marked(table, mark), SLOT_SIZE, first_slot, mark)


# A slot record's mark, CRC and fixed fields, unpacked in one call.
_SLOT_HEAD_FIELDS = struct.Struct(f"<{_SLOT_MARK_CRC.format[1:]}{_SLOT_FIXED.format[1:]}")
assert _SLOT_HEAD_FIELDS.size == _SLOT_HEAD


def _read_records(
    buf: SlotBytes, indexes: Iterable[int], stride: int, base: int = 0, mark: int = SLOT_READY_MARK
) -> list[tuple[int, RecordFields]]:
    """The whole records at `index * stride` in `buf` for each index (each with a record
    head's bytes from there), with their indexes plus `base`: read_record of each (of records
    marked `mark`)."""
    records: list[tuple[int, RecordFields]] = []
    append, record_at, size = records.append, _record_at, len(buf)
    for index in indexes:
        fields = record_at(buf, index * stride, size, mark)
        if fields is not None:
            append((base + index, fields))
    return records


def _record_at(
    buf: SlotBytes,
    offset: int,
    size: int,
    wanted_mark: int = SLOT_READY_MARK,
    unpack_head: Callable[[SlotBytes, int], tuple[int, ...]] = _SLOT_HEAD_FIELDS.unpack_from,
    crc32: Callable[[SlotBytes], int] = zlib.crc32,
) -> RecordFields | None:
    """The record at `offset` of `buf` (`size` bytes long) if it is marked `wanted_mark` (READY
    unless a restart looks for doomed records), or None. Called once per READY slot at a
    restart (100,000 in a large pool) and once per lock pin on the vLLM scheduler thread: its
    constants are bound as defaults, looked up once (docs/performance.md, *A warm restart*)."""
    if size - offset < _SLOT_HEAD:
        return None
    mark, crc, commit_seq, nbytes, checksum, key_len, dtype_code, ndim, n_extents = unpack_head(
        buf, offset
    )
    if mark != wanted_mark:
        return None
    tail = _slot_tail(ndim, n_extents, key_len)
    dtype = DTYPE_BY_CODE.get(dtype_code)
    start = offset + _SLOT_HEAD
    if tail is None or dtype is None:
        return None
    end = start + tail.size
    if end > size or crc != crc32(buf[offset + _SLOT_MARK_CRC.size : end]):
        return None
    values = tail.unpack_from(buf, start)  # shape, extents, key
    return (values[-1], dtype, values[:ndim], nbytes, checksum, commit_seq, values[ndim:-1])


# Bounded: a slot table written over by someone else could name any sizes.
@functools.lru_cache(maxsize=1024)
def _slot_tail(ndim: int, n_extents: int, key_len: int) -> struct.Struct | None:
    """What follows a slot record's fixed fields: its shape, extents and key; None when no
    record can be so (more than MAX_NDIM dimensions, or longer than a slot). One per shape of
    record: a pool's records share few (its keys' lengths times its entries' shapes)."""
    if ndim > MAX_NDIM or _SLOT_HEAD + 8 * ndim + 8 * n_extents + key_len > SLOT_SIZE:
        return None
    return struct.Struct(f"<{ndim}q{2 * n_extents}I{key_len}s")


def file_at(path: str) -> tuple[int, int] | None:
    """Which file is at `path` now (device, inode), None if none: a pool recreated reuses its
    path, so the path alone does not say which file a client or a pin holds."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def slot_offset(index: int) -> int:
    return HEADER_SIZE + index * SLOT_SIZE
