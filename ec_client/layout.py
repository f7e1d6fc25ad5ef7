"""The pool file format, shared by the daemon (which writes it) and clients (which verify it).

A pool file `<shm_dir>/ecd-<engine_id>.pool` is laid out as:

    [0, 4096)                      header: identity and geometry, CRC-protected
    [4096, 4096 + slots * 1024)    slot table: one record per entry the pool can hold
    [data_offset, file_size)       num_blocks blocks of block_size_bytes; data_offset is
                                   aligned to 2 MiB so huge pages can back the data

The header's magic is written last at creation, so a half-written header never verifies. A slot
record describes one READY entry (key, extents, tensor spec, checksum); its mark is written last
and cleared first, and a CRC covers the rest, so after a daemon crash every record is either whole
or ignored. This module is pure Python (no torch) so the daemon can use it without importing torch.
"""

from __future__ import annotations

import math
import re
import struct
import uuid
import zlib
from dataclasses import dataclass

MAGIC = b"ECDPOOL1"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
SLOT_SIZE = 1024
DATA_ALIGNMENT = 2 << 20
POOL_FILE_PREFIX = "ecd-"
POOL_FILE_SUFFIX = ".pool"

MAX_KEY_BYTES = 256
MAX_ENGINE_ID_BYTES = 128
MAX_COMPAT_KEY_BYTES = 1024
MAX_NDIM = 8
# A slot record has room for this many extents; the allocator never splits an entry further.
MAX_EXTENTS_PER_ENTRY = 40

ENGINE_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# torch dtype name -> (code stored in slot records, itemsize). Codes are part of the file format:
# never renumber, only append.
DTYPES: dict[str, tuple[int, int]] = {
    "uint8": (1, 1),
    "int8": (2, 1),
    "int16": (3, 2),
    "int32": (4, 4),
    "int64": (5, 8),
    "float16": (6, 2),
    "bfloat16": (7, 2),
    "float32": (8, 4),
    "float64": (9, 8),
    "bool": (10, 1),
    "float8_e4m3fn": (11, 1),
    "float8_e5m2": (12, 1),
    "float8_e4m3fnuz": (13, 1),
    "float8_e5m2fnuz": (14, 1),
    "uint16": (15, 2),
    "uint32": (16, 4),
    "uint64": (17, 8),
    "complex64": (18, 8),
    "complex128": (19, 16),
}
DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}

# magic, version, header_size, uuid, block_size, num_blocks, data_offset, slot_table_offset,
# num_slots, slot_size, file_size, created_ns, engine_id_len, compat_key_len, engine_id, compat_key
_HEADER = struct.Struct(f"<8sII16sQQQQQIQQII{MAX_ENGINE_ID_BYTES}s{MAX_COMPAT_KEY_BYTES}s")
_HEADER_CRC = struct.Struct("<I")
_HEADER_CRC_OFFSET = _HEADER.size

# mark, crc, key_len, dtype_code, ndim, n_extents, reserved, nbytes, checksum, commit_seq, shape,
# key, extents (start, count pairs)
_SLOT = struct.Struct(f"<IIHBBHHQQQ{MAX_NDIM}q{MAX_KEY_BYTES}s{2 * MAX_EXTENTS_PER_ENTRY}Q")
SLOT_READY_MARK = 0x59444552  # "REDY"
SLOT_FREE_MARK = 0
assert _SLOT.size <= SLOT_SIZE and _HEADER.size + _HEADER_CRC.size <= HEADER_SIZE


class LayoutError(ValueError):
    """A pool file (or a value destined for one) does not match the format."""


def pool_file_name(engine_id: str) -> str:
    return f"{POOL_FILE_PREFIX}{engine_id}{POOL_FILE_SUFFIX}"


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype][1]


@dataclass(frozen=True)
class Geometry:
    """Sizes of a pool, derived from the request; two opens agree iff their geometries are equal."""

    block_size_bytes: int
    num_blocks: int
    num_slots: int

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
            raise LayoutError(f"layout version {version}, this build reads {LAYOUT_VERSION}")
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
        """The record with its mark zero; the writer sets the mark (4 bytes) after the rest."""
        flat = [v for extent in self.extents for v in extent]
        body = _SLOT.pack(
            SLOT_FREE_MARK,
            0,
            len(self.key),
            DTYPES[self.dtype][0],
            len(self.shape),
            len(self.extents),
            0,
            self.nbytes,
            self.checksum,
            self.commit_seq,
            *self.shape,
            *([0] * (MAX_NDIM - len(self.shape))),
            self.key,
            *flat,
            *([0] * (2 * MAX_EXTENTS_PER_ENTRY - len(flat))),
        ).ljust(SLOT_SIZE, b"\0")
        crc = zlib.crc32(body[8:])
        return body[:4] + struct.pack("<I", crc) + body[8:]

    @classmethod
    def unpack(cls, record: bytes) -> SlotRecord | None:
        """The record if its mark says READY and its CRC verifies, else None (free or torn)."""
        fields = _SLOT.unpack_from(record)
        mark, crc, key_len, dtype_code, ndim, n_extents = fields[:6]
        if mark != SLOT_READY_MARK or crc != zlib.crc32(record[8:SLOT_SIZE]):
            return None
        if dtype_code not in DTYPE_BY_CODE or ndim > MAX_NDIM or n_extents > MAX_EXTENTS_PER_ENTRY:
            return None
        nbytes, checksum, commit_seq = fields[7:10]
        shape = tuple(fields[10 : 10 + ndim])
        key = fields[10 + MAX_NDIM][:key_len]
        flat = fields[11 + MAX_NDIM : 11 + MAX_NDIM + 2 * n_extents]
        extents = tuple(zip(flat[0::2], flat[1::2], strict=True))
        return cls(key, DTYPE_BY_CODE[dtype_code], shape, nbytes, checksum, commit_seq, extents)


def slot_offset(index: int) -> int:
    return HEADER_SIZE + index * SLOT_SIZE
