"""Lock pins: pins on READY entries that the kernel keeps, taken with no round trip.

docs/design.md §5. Every slot of a pool file's slot table has one lock byte: the first byte of
its record. A reader pins an entry by taking a *shared* open-file-description lock (Linux
`F_OFD_SETLK`) on that byte, then reads the record and checks it is the entry it wants. The
daemon erases a slot's record (to evict, delete or reuse the entry's blocks) only while it holds
the byte's *exclusive* lock, which the kernel refuses at once while anyone holds it shared. So:

- a reader that locked the slot and found its key in a whole record (mark READY, CRC) reads
  bytes that stay that entry's until it unlocks: the daemon cannot erase the record meanwhile,
  and blocks are reused only after their record was erased;
- a reader that locked a slot the daemon erased (a stale view) finds a free mark, another key or
  a record being written (its CRC fails): a miss, never another entry's bytes;
- a reader that tries while the daemon holds the exclusive lock is refused at once: a miss.

The kernel drops a process's locks when it dies, at once (no lease to wait for), and the locks
belong to the file, not to the daemon: a pin taken before a daemon restart holds after it. Locks
are advisory: they change nothing about who may map, read or write the file.

Locks of one open file description do not stack (locking a byte twice is once), so `SlotPins`
counts a process's pins per slot and unlocks at the last. Many pins (`pin_many`) lock a run of
neighbouring slots with one range lock and read its records with one read; the range covers the
record bytes between the lock bytes, which nobody else locks, and an unlock drops whole records,
so a slot's record bytes are locked exactly while its lock byte is. This module is torch-free:
the daemon uses its primitives too.

A pin still reads its slot's record under the lock, every time, but it need not parse it
again: `SlotPins` keeps the last records it checked (read ahead off the hot path, as the view
hears of a commit, or checked by an earlier pin), and a record whose bytes are exactly one it
checked is the same record, parsed the same way (parsing is a function of the bytes and the
file's geometry alone).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ec_protocol.pool.fd_passing import open_pool_file
from ec_protocol.pool.layout import (
    HEADER_SIZE,
    SLOT_SIZE,
    Header,
    LayoutError,
    file_at,
    read_record,
    slot_offset,
    slots_marked,
)
from ec_protocol.types import Extent, TensorSpec

log = logging.getLogger("ec_client")

# Linux's open-file-description lock commands (fcntl.h); Python's fcntl module lacks the names.
F_OFD_GETLK = 36
F_OFD_SETLK = 37
# struct flock: l_type, l_whence, l_start, l_len, l_pid (which must be 0 for OFD locks)
_FLOCK = struct.Struct("hhqqi4x")

# Slots a scan of the slot table reads at a time (SlotPins.ready): 512 KiB.
SCAN_SLOTS = 1024

# Records kept checked, per SlotPins: the most recent commits' and hits' (about 1 KiB each),
# enough for the entries of many steps of a busy engine, few enough to cost nothing to keep.
CHECKED_RECORDS = 1024


def _set(fd: int, kind: int, slot: int, length: int) -> bool:
    """Take (or drop) a lock on `length` bytes from `slot`'s lock byte on; False if another
    description holds a conflicting lock."""
    start = HEADER_SIZE + slot * SLOT_SIZE  # slot_offset, inline: a lock pin's cost
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock_shared(fd: int, slot: int, slots: int = 1) -> bool:
    """A reader's pin on `slots` slots from `slot` on, in one call (one range, from the first
    lock byte to the last: the record bytes between them are locked too, and nobody else ever
    locks those); False while the daemon is erasing one of them."""
    return _set(fd, fcntl.F_RDLCK, slot, (slots - 1) * SLOT_SIZE + 1)


def lock_exclusive(fd: int, slot: int) -> bool:
    """The daemon's claim on the slot before it erases the record; False while a reader holds
    a pin on it."""
    return _set(fd, fcntl.F_WRLCK, slot, 1)


def unlock(fd: int, slot: int, slots: int = 1) -> None:
    """Drop this description's locks on `slots` whole records from `slot` on, in one call: the
    lock bytes and the record bytes a range taken by `lock_shared` covered with them."""
    _set(fd, fcntl.F_UNLCK, slot, slots * SLOT_SIZE)


def runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct slots as (first, count) runs of consecutive ones: what one unlock each drops."""
    found: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if found and found[-1][0] + found[-1][1] == slot:
            found[-1] = (found[-1][0], found[-1][1] + 1)
        else:
            found.append((slot, 1))
    return found


def locked_slots(fd: int, num_slots: int) -> set[int]:
    """The slots some other open file description holds a lock on (pins, seen from the
    daemon): one F_OFD_GETLK per locked range, not per slot."""
    found: set[int] = set()
    start, end = slot_offset(0), slot_offset(num_slots)
    while start < end:
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, end - start, 0)
        answer = fcntl.fcntl(fd, F_OFD_GETLK, query)
        kind, _, at, length, _ = _FLOCK.unpack(answer)
        if kind == fcntl.F_UNLCK:
            break
        stop = end if length == 0 else min(end, at + length)
        first = max(0, -(-(at - slot_offset(0)) // SLOT_SIZE))  # the first lock byte in range
        found.update(range(first, (stop - 1 - slot_offset(0)) // SLOT_SIZE + 1))
        start = stop
    return found


@dataclass(slots=True)
class PinnedEntry:
    """What a lock pin found in its slot: the entry a reader may copy out until it unpins."""

    key: bytes
    extents: tuple[Extent, ...]
    spec: TensorSpec
    checksum: int  # CRC-32 its producer stored, 0 for none


@dataclass(slots=True)
class _Held:
    entry: PinnedEntry
    count: int


@dataclass(slots=True)
class _Checked:
    """A slot's record as read and checked once: its bytes, and the entry they parsed as."""

    raw: bytes
    entry: PinnedEntry


def _count(held: _Held | None, key: bytes) -> PinnedEntry | None:
    """One more pin of `key` on a slot this process holds as `held` (None: not held), if it
    holds that slot for `key` (locked by us, its record cannot have changed since it was
    checked). Under the pins' lock."""
    if held is None or held.entry.key != key:
        return None
    held.count += 1
    return held.entry


class SlotPins:
    """This process's lock pins on one pool file, counted per slot.

    Opened read-only: a reader needs no write access to take shared locks or read records.
    Thread-safe. Closing the file drops every lock it holds, so `close` waits for nothing: call
    it only once no copy reads under these pins (the pool was recreated, or the client ends).
    """

    def __init__(self, path: str, pool_uuid: str) -> None:
        """LayoutError if the file at `path` is not the pool `pool_uuid` (recreated since);
        OSError if it cannot be opened (fd_passing.open_pool_file)."""
        self._fd = open_pool_file(path, pool_uuid, writable=False)
        try:
            self.header = Header.unpack(os.pread(self._fd, HEADER_SIZE, 0))
            if self.header.pool_uuid != uuid.UUID(pool_uuid):
                raise LayoutError(f"{path} is pool {self.header.pool_uuid}, not {pool_uuid}")
        except BaseException:
            os.close(self._fd)
            raise
        self.pool_uuid = pool_uuid
        self.path = path
        held = os.fstat(self._fd)
        self.file_id = (held.st_dev, held.st_ino)  # which file, whatever is at the path now
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._checked: dict[int, _Checked] = {}  # oldest first, at most CHECKED_RECORDS
        self._retired = False
        g = self.header.geometry  # what a pin checks a record against, looked up once
        self._num_slots, self._num_blocks, self._block_size = (
            g.num_slots,
            g.num_blocks,
            g.block_size_bytes,
        )

    def pin(self, slot: int, key: bytes) -> PinnedEntry | None:
        """Pin the entry `key` in `slot`; what its record says (extents, spec, checksum), or
        None when the slot does not hold it now (a miss)."""
        if not 0 <= slot < self._num_slots:
            return None
        with self._lock:
            if self._retired or self._fd < 0:
                return None
            held = self._held.get(slot)
            if held is None and lock_shared(self._fd, slot):
                held = self._check(slot, self._records_bytes(slot, 1), key)
            return _count(held, key)

    def pin_many(self, wanted: Sequence[tuple[int, bytes]]) -> list[PinnedEntry | None]:
        """`pin` of each (slot, key), in order, in one hold of the lock. The slots not held yet
        are locked and read one run of consecutive slots at a time (entries committed together
        hold neighbouring slots): one lock and one read for a run, not one per slot."""
        if len(wanted) == 1:  # a single get's: no runs to find
            return [self.pin(*wanted[0])]
        with self._lock:
            if self._retired or self._fd < 0:
                return [None] * len(wanted)
            fresh = {
                slot: key
                for slot, key in wanted
                if 0 <= slot < self._num_slots and slot not in self._held
            }
            for first, count in runs(fresh):
                slots: Iterable[int] = range(first, first + count)
                if not lock_shared(self._fd, first, count):
                    # The daemon is erasing one of them: lock the others one by one.
                    slots = [s for s in slots if count > 1 and lock_shared(self._fd, s)]
                raws = self._records_bytes(first, count)
                for slot in slots:
                    at = (slot - first) * SLOT_SIZE
                    self._check(slot, raws[at : at + SLOT_SIZE], fresh[slot])
            return [_count(self._held.get(slot), key) for slot, key in wanted]

    def _check(self, slot: int, raw: bytes, key: bytes) -> _Held | None:
        """A slot just locked, whose bytes are `raw`: held (with no pin counted yet) if they are
        a whole record of `key` that fits the pool, else unlocked (None). Under the lock."""
        checked = self._checked.get(slot)
        if checked is not None and checked.raw == raw:  # the bytes checked before: no parse
            entry: PinnedEntry | None = checked.entry if checked.entry.key == key else None
        else:
            entry = self._parse(raw, key)
            if entry is not None:
                self._keep(slot, raw, entry)
        if entry is None:
            unlock(self._fd, slot)
            return None
        held = self._held[slot] = _Held(entry, 0)
        return held

    def read_ahead(self, slot: int, key: bytes) -> None:
        """Read and check the record of `key` in `slot` now, so that a later pin that finds
        the same bytes there skips the parse: for a thread off the hot path (the view's, as it
        hears the entry was committed). It takes no lock on the slot: what it reads counts only
        for a pin that reads the very same bytes under its own."""
        with self._lock:  # the file stays open while it is read
            if self._fd < 0 or not 0 <= slot < self._num_slots:
                return
            raw = self._records_bytes(slot, 1)
        entry = self._parse(raw, key)
        if entry is not None:
            with self._lock:
                if self._fd >= 0:  # not closed meanwhile
                    self._keep(slot, raw, entry)

    def ready(self, first: int, most: int) -> tuple[list[tuple[int, bytes]], int | None]:
        """The slots and keys of up to `most` READY records from slot `first` on, as their
        records read now, with no lock taken (a pin checks its record again), and the slot to
        scan on from: None once the table was read to its end. Only the records it answers
        are parsed: the others are passed over by their marks."""
        found: list[tuple[int, bytes]] = []
        slot = first
        while len(found) < most:
            count = min(SCAN_SLOTS, self._num_slots - slot)
            if count <= 0:
                return found, None
            with self._lock:  # the file stays open while it is read
                raw = self._records_bytes(slot, count) if self._fd >= 0 else b""
            if len(raw) != count * SLOT_SIZE:  # closed, or cut short: nothing more to find
                return found, None
            scanned = count
            for at in slots_marked(raw):
                if len(found) == most:
                    scanned = at  # the next batch begins here
                    break
                fields = read_record(raw, at * SLOT_SIZE)
                if fields is not None:
                    found.append((slot + at, fields[0]))
            slot += scanned
        return found, slot if slot < self._num_slots else None

    def unpin(self, slot: int) -> None:
        """Give one pin back; the lock goes with the slot's last. Only once every copy made under
        the pin has landed."""
        self.unpin_many((slot,))

    def unpin_many(self, slots: Iterable[int]) -> None:
        """Give one pin back on each of `slots` (a slot named twice gives two back). The locks
        whose last pin went are dropped one run of consecutive slots at a time: entries
        committed together hold neighbouring slots, and a step's loads are unlocked together."""
        with self._lock:
            last: list[int] = []
            for slot in slots:
                held = self._held.get(slot)
                if held is None:  # closed meanwhile: its locks went with the file
                    continue
                held.count -= 1
                if held.count == 0:
                    del self._held[slot]
                    last.append(slot)
            if self._fd >= 0:
                for first, count in runs(last):
                    unlock(self._fd, first, count)
            if self._retired and not self._held:
                self._close()

    def still_at_path(self) -> bool:
        """Whether the file at the path is still the one these pins opened (not dropped and
        recreated since); False once closed."""
        return self._fd >= 0 and file_at(self.path) == self.file_id

    def held(self) -> int:
        """Slots this process holds locked."""
        with self._lock:
            return len(self._held)

    def retire(self) -> None:
        """No new pins (a newer file replaced this one): close once the last pin is given back."""
        with self._lock:
            self._retired = True
            if not self._held:
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()
            self._held.clear()

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._checked.clear()

    def _keep(self, slot: int, raw: bytes, entry: PinnedEntry) -> None:
        """Remember a checked record (under the lock), the oldest forgotten past the limit."""
        self._checked.pop(slot, None)
        self._checked[slot] = _Checked(raw, entry)
        if len(self._checked) > CHECKED_RECORDS:
            del self._checked[next(iter(self._checked))]

    def _records_bytes(self, first: int, count: int) -> bytes:
        """The bytes of `count` slots from `first` on (under the lock, the file open). Read with
        pread, not through a mapping: a pool file truncated by someone else is then a miss here,
        not a SIGBUS (vLLM's scheduler process maps no pool). A read that fails reads nothing,
        as a truncated file's reads short: misses, whose locks `_check` drops (raised, it would
        leave the slots just locked with no pin counted, never unlocked)."""
        try:
            return os.pread(self._fd, count * SLOT_SIZE, HEADER_SIZE + first * SLOT_SIZE)
        except OSError as error:
            log.debug("ecd: reading slot records %d-%d failed: %s", first, first + count, error)
            return b""

    def _parse(self, raw: bytes, key: bytes) -> PinnedEntry | None:
        """The entry `key` if `raw`, a slot's bytes, hold a whole record of it that fits the
        pool; anything else is a miss."""
        fields = read_record(raw)
        if fields is None or fields[0] != key:
            return None
        _, dtype, shape, nbytes, checksum, _, flat = fields
        blocks, num_blocks = -(-nbytes // self._block_size), self._num_blocks
        if len(flat) == 2:  # one extent, as nearly every entry has: a hit's cost, kept short
            start, count = flat
            if count != blocks or start + count > num_blocks:
                return None
            extents: tuple[Extent, ...] = (Extent(start, count),)
        else:
            extents = tuple(map(Extent, flat[0::2], flat[1::2]))
            if sum(e.count for e in extents) != blocks or any(e.end > num_blocks for e in extents):
                return None
        return PinnedEntry(key, extents, TensorSpec(shape, dtype, nbytes), checksum)
