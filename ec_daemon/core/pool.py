"""A pool's shared-memory file, as the daemon creates, adopts and journals it.

The daemon never maps the file: it writes the header and slot records with pwrite and reads them
with pread. A mapping would turn a file truncated by another process into a SIGBUS that kills the
daemon; a pwrite past the end only extends the file. Tensor bytes are the clients' business.
"""

from __future__ import annotations

import errno
import os
import struct
import time
import uuid
from pathlib import Path

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_protocol.pool import life_marks
from ec_protocol.pool.layout import (
    HEADER_SIZE,
    MAGIC,
    SLOT_DOOMED_MARK,
    SLOT_FREE_MARK,
    SLOT_SIZE,
    Geometry,
    Header,
    LayoutError,
    RecordFields,
    SlotRecord,
    pool_file_name,
    read_slot_table,
    slot_offset,
    slots_marked,
    slots_written,
)
from ec_protocol.pool.slot_locks import lock_exclusive, locked_slots, unlock
from ec_protocol.units import format_size

_MARK = struct.Struct("<I")
SlotRecords = list[tuple[int, RecordFields]]  # records read from a slot table, by slot
# The name of an ephemeral pool's mark (docs/design.md §3), an empty file beside the pool's file:
# it outlives the daemon, so that a restarted one knows which adopted pools go with their
# sessions.
EPHEMERAL_MARK_SUFFIX = ".ephemeral"
DROPPED_MARK_SUFFIX = ".dropped"
MAX_DROPPED_BY = 512  # bytes of who dropped a pool kept in its mark
# The slot table is read this many slots at a time, into one buffer: read whole (51 MiB for
# 100,000 slots), it is as many new pages for the process to fault in, each costing microseconds
# on a VM (docs/performance.md, *A warm restart*).
_TABLE_CHUNK_SLOTS = 2048


def _read_slot_table(fd: int, num_slots: int) -> tuple[SlotRecords, SlotRecords, int]:
    """The whole records of the pool file's slot table, by slot (read_slot_table): the READY
    ones and the doomed ones, and how many slots hold no whole record but are not free either
    (a record written over or torn by another process: its entry is lost; or garbage over a
    free slot); LayoutError if the file ends within it."""
    records: SlotRecords = []
    doomed: SlotRecords = []
    unreadable = 0
    chunk = memoryview(bytearray(min(num_slots, _TABLE_CHUNK_SLOTS) * SLOT_SIZE))
    for first in range(0, num_slots, _TABLE_CHUNK_SLOTS):
        part = chunk[: min(num_slots - first, _TABLE_CHUNK_SLOTS) * SLOT_SIZE]
        got = os.preadv(fd, [part], slot_offset(first))
        if got != len(part):
            raise LayoutError(
                f"slot table is {first * SLOT_SIZE + got} bytes, expected {num_slots * SLOT_SIZE}"
            )
        ready = read_slot_table(part, first)
        gone = read_slot_table(part, first, SLOT_DOOMED_MARK)
        records += ready
        doomed += gone
        unreadable += slots_written(part) - len(ready) - len(gone)
    return records, doomed, unreadable


def creation_interrupted(path: Path) -> bool:
    """Whether the pool file at `path` was never finished: its magic, written last by `create`,
    is not there (a file shorter than it, or zeros where it goes: the file is zero-filled as it
    is allocated), and nothing else was written but the header `create` writes before the magic.
    Such a file was never served, so it never held an entry: a daemon killed while creating a
    pool leaves one, and it is no one's data to keep for inspection. A file whose magic was
    zeroed by someone else while it held entries has records in its slot table: not this. False
    for a file that cannot be read (adoption says why)."""
    try:
        with open(path, "rb") as file:
            head = file.read(HEADER_SIZE)
            if any(head[: len(MAGIC)]):
                return False
            if not any(head):
                return True  # created, perhaps allocated, nothing written yet
            geometry = Header.unpack(MAGIC + head[len(MAGIC) :]).geometry  # all but the magic
            file.seek(geometry.slot_table_offset)
            table = file.read(geometry.num_slots * SLOT_SIZE)
    except (OSError, LayoutError):
        return False
    return len(table) == geometry.num_slots * SLOT_SIZE and not slots_marked(table)


def not_the_pool_file(path: Path, engine_id: str) -> str | None:
    """Why the file at `path` does not read as the pool file of `engine_id` (its header does not
    verify, names another pool, or cannot be read), or None when it does."""
    try:
        with open(path, "rb") as file:
            header = Header.unpack(file.read(HEADER_SIZE))
    except OSError as exc:
        return f"cannot read it: {exc.strerror}"
    except LayoutError as exc:
        return str(exc)
    if header.engine_id != engine_id:
        return f"its header names pool {header.engine_id!r}"
    return None


class PoolFile:
    def __init__(self, path: Path, header: Header, fd: int) -> None:
        self.path = path
        self.header = header
        self._fd = fd
        held = os.fstat(fd)
        self.file_id = (held.st_dev, held.st_ino)  # which file, whatever is at the path now

    @classmethod
    def create(
        cls,
        shm_dir: Path,
        engine_id: str,
        geometry: Geometry,
        compat_key: str,
        mode: int,
        gid: int | None,
    ) -> PoolFile:
        """Create the file with all its pages allocated up front, then write a verified header.

        Allocating up front (posix_fallocate) turns a full tmpfs into a clean error now instead of
        a SIGBUS in some client later, and spares clients first-touch page faults.
        """
        path = shm_dir / pool_file_name(engine_id)
        _ephemeral_mark(path).unlink(missing_ok=True)  # a pool of this name before, not this one
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(path, flags, mode)
        try:
            os.fchmod(fd, mode)  # the umask must not narrow it
            if gid is not None:
                os.fchown(fd, -1, gid)
            try:
                os.posix_fallocate(fd, 0, geometry.file_size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG):
                    raise
                stat = os.statvfs(shm_dir)
                needed, free = geometry.file_size, stat.f_bavail * stat.f_frsize
                raise CoreError(
                    Code.RESOURCE_EXHAUSTED,
                    f"{shm_dir} is full: pool {engine_id!r} needs {format_size(needed)}, "
                    f"{format_size(free)} are free; enlarge it (docker --shm-size, a Kubernetes "
                    "emptyDir sizeLimit) or ask for a smaller capacity_bytes",
                    Reason.SHM_FULL,
                ) from exc
            header = Header(uuid.uuid4(), geometry, engine_id, compat_key, time.time_ns())
            os.pwrite(fd, header.pack(), 0)
            os.pwrite(fd, MAGIC, 0)  # last: until now the header cannot verify
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, header, fd)

    @classmethod
    def adopt(cls, path: Path) -> tuple[PoolFile, SlotRecords, SlotRecords, int]:
        """Open an existing pool file and read its READY records and its doomed ones, by slot,
        and count the slots that hold neither nor are free (_read_slot_table); LayoutError if
        it does not verify."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            header = Header.unpack(os.pread(fd, HEADER_SIZE, 0))
            size = os.fstat(fd).st_size
            if size < header.geometry.file_size:
                raise LayoutError(
                    f"file is {size} bytes, its header says {header.geometry.file_size}: truncated"
                )
            if path.name != pool_file_name(header.engine_id):
                raise LayoutError(f"header names engine {header.engine_id!r}, not this file")
            records, doomed, unreadable = _read_slot_table(fd, header.geometry.num_slots)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, header, fd), records, doomed, unreadable

    def verify(self) -> None:
        """Raise LayoutError if the file on disk no longer matches what the daemon created."""
        on_disk = Header.unpack(os.pread(self._fd, HEADER_SIZE, 0))
        if on_disk != self.header:
            raise LayoutError("header changed under the daemon")
        held = os.fstat(self._fd)
        if held.st_size < self.header.geometry.file_size:
            raise LayoutError(
                f"file is {held.st_size} bytes, expected {self.header.geometry.file_size}"
            )
        # Clients map the file by its path: one removed or replaced there is lost to them, however
        # intact the file the daemon still holds open.
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise LayoutError(f"{self.path} was removed") from None
        if (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
            raise LayoutError(f"{self.path} was replaced by another file")

    def open_for_client(self, writable: bool) -> int:
        """A new open of this file (close-on-exec), for a client it is handed to: never the
        daemon's own open file, whose slot locks a client's would merge with (a lock belongs to
        an open file description). LayoutError if the path holds another file now."""
        fd = os.open(self.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != self.file_id:
            os.close(fd)
            raise LayoutError(f"{self.path} was replaced by another file")
        return fd

    def write_slot(self, slot: int, record: SlotRecord) -> bool:
        """Write the slot's record, unless a reader holds a lock pin on it (then False, and
        nothing is written). docs/design.md §5: a record is written under the slot's exclusive
        lock, as it is erased, so that no reader reads one half-written (a read is not atomic
        against a write: it could find the new READY mark over the old record's body)."""
        # One pwrite of the whole record, its READY mark included. It cannot be torn by a
        # SIGKILL: the record lies within one page (slots are 512 bytes, aligned, and divide the
        # page size), and the kernel finishes copying a write into a page before the process can
        # die. A daemon crash leaves the old record or the new one, never a mix; the pool file is
        # in tmpfs, so there is no power loss to survive. Anything else that leaves a record
        # half-written (another process writing the table) fails the record's CRC, and the
        # record is then ignored at adoption.
        return self._write_locked(slot, record.pack())

    def erase_slot(self, slot: int) -> bool:
        """Erase the slot's record, unless a reader holds a lock pin on it (then False, and the
        record stays). docs/design.md §5: the record is erased under the slot's exclusive lock,
        so a reader that locks after it finds a free mark, and one that locked before keeps the
        entry whole."""
        return self._write_locked(slot, _MARK.pack(SLOT_FREE_MARK))

    def doom_slot(self, slot: int) -> None:
        """Mark the slot's record doomed: its entry was removed while a reader holds the lock
        pin that keeps the record from being erased (docs/design.md §5). Written without the
        exclusive lock, which the reader holds off, and safe without it: only the 4-byte mark
        changes, and a reader reading it meanwhile finds the READY mark over the entry's own
        record, whole (its blocks are kept until the record is erased), or a mark that is not
        READY (a miss). A restart then neither adopts the entry nor frees its blocks while the
        reader holds them."""
        os.pwrite(self._fd, _MARK.pack(SLOT_DOOMED_MARK), slot_offset(slot))

    def _write_locked(self, slot: int, data: bytes) -> bool:
        """Write `data` at the slot under its exclusive lock, as every change to a record is
        made; False (nothing written) while a reader holds a lock on it."""
        if not lock_exclusive(self._fd, slot):
            return False
        try:
            os.pwrite(self._fd, data, slot_offset(slot))
        finally:
            unlock(self._fd, slot)
        return True

    def slot_locked(self, slot: int) -> bool:
        """Whether a reader holds a lock pin on the slot now (a probe: it may change at once)."""
        if not lock_exclusive(self._fd, slot):
            return True
        unlock(self._fd, slot)
        return False

    def locked_slots(self) -> set[int]:
        """The slots readers hold lock pins on now."""
        return locked_slots(self._fd, self.header.geometry.num_slots)

    def life_marked(self, session_id: str) -> bool:
        """Whether the session's client holds its life mark on this file now (a probe, see
        ec_protocol/pool/life_marks.py)."""
        return self._fd >= 0 and life_marks.held(self._fd, session_id)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def mark_ephemeral(self) -> None:
        """Mark the pool ephemeral on disk; OSError if the mark cannot be made."""
        os.close(
            os.open(_ephemeral_mark(self.path), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        )

    def marked_ephemeral(self) -> bool:
        return _ephemeral_mark(self.path).exists()

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
        _ephemeral_mark(self.path).unlink(missing_ok=True)


def _ephemeral_mark(pool_path: Path) -> Path:
    return pool_path.with_name(pool_path.name + EPHEMERAL_MARK_SUFFIX)


def dropped_mark(pool_path: Path) -> Path:
    """Where the mark of a pool dropped while other clients held it goes (docs/design.md §3): a
    small file beside the pool's path, naming who dropped it, that outlives the daemon."""
    return pool_path.with_name(pool_path.name + DROPPED_MARK_SUFFIX)


def mark_dropped(pool_path: Path, by: str) -> None:
    """Write the dropped mark; OSError if it cannot be made."""
    fd = os.open(
        dropped_mark(pool_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
    )
    try:
        os.write(fd, by.encode()[:MAX_DROPPED_BY])
    finally:
        os.close(fd)


def read_dropped_mark(mark: Path) -> str:
    """Who dropped the pool, as its mark says ("" if it cannot be read)."""
    try:
        return mark.read_bytes()[:MAX_DROPPED_BY].decode(errors="replace")
    except OSError:
        return ""
