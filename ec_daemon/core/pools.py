"""The pools a daemon serves: their files and indexes, the global budget, and the files refused.

One job: which pools exist. Adopt the files a previous daemon left in shm_dir, create new ones
within the budget, attach to existing ones (same geometry and compatibility key, or refused),
notice files changed under the daemon, forget and unlink. What lives inside a pool (entries,
pins, PENDING allocations of sessions) is the store's business: it tells the registry when a
pool goes, after undoing what sessions held in it.

A refused pool file (one that did not verify at adoption, or changed under the daemon) is left
in place for inspection, listed by Stats; OpenPool of its engine_id fails until an operator
removes the file, by hand or with DropPool (with force for a file that does not read as the
pool's).

The budget (max_bytes) bounds the pools' capacities together (their blocks, what clients ask for
in capacity_bytes), so a pool as large as the budget fits; each file also holds its header and
slot table, at most about 2% more (see ec_protocol.pool.layout), counted apart as reserved bytes.

A pool dropped (DropPool) while other sessions held it is remembered (`Dropped`), in memory and
by a mark beside its path: the client libraries of those sessions open their pools again by
themselves (after a restart, a lost lease, a replaced file), and must not make this one anew;
only an explicit OpenPool does (docs/design.md §3).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.eviction import POLICIES
from ec_daemon.core.index import PoolIndex
from ec_daemon.core.pool import (
    DROPPED_MARK_SUFFIX,
    PoolFile,
    creation_interrupted,
    dropped_mark,
    mark_dropped,
    not_the_pool_file,
    read_dropped_mark,
)
from ec_protocol.pool.layout import (
    ENGINE_ID_PATTERN,
    MAX_AUTO_SLOTS,
    POOL_FILE_PREFIX,
    POOL_FILE_SUFFIX,
    Geometry,
    LayoutError,
    pool_file_name,
)
from ec_protocol.types import EventType, PoolInfo, PoolStats, RefusedPool, WatchEvent
from ec_protocol.units import format_size

log = logging.getLogger("ecd.pools")


@dataclass(frozen=True)
class PoolSettings:
    shm_dir: Path
    max_bytes: int  # the capacity of all pools together
    eviction: str = "lru"
    # Entries (slots, 512 bytes of file each) a pool can hold; None: sized from its capacity.
    entries_per_pool: int | None = None
    max_pool_bytes: int | None = None  # capacity one pool may ask for; None: the whole budget
    # Pool files: 0600, or 0660 with the group consumers run as (--pool-mode, --pool-group).
    file_mode: int = 0o600
    file_gid: int | None = None


@dataclass
class Dropped:
    """A pool dropped while other sessions held it. Their clients, opening it again by
    themselves (OpenPool's reopen), are refused with FAILED_PRECONDITION pool_dropped instead
    of making it anew, empty, behind the dropper's back; an explicit OpenPool with a geometry
    makes it and forgets this. Kept while a session that held it (or was refused since) lives,
    then a grace (`forget_dropped`), for a client whose lease ran out to come back and be told
    too."""

    by: str  # who dropped it, for the error: a client's name and pid
    holders: set[str]  # the sessions that held it, or asked to reopen it since
    until: float | None = None  # forgotten then, once no holder lives


@dataclass(frozen=True)
class Pool:
    """A pool the daemon serves: its file and the index of its entries."""

    file: PoolFile
    index: PoolIndex

    @property
    def engine_id(self) -> str:
        return self.file.header.engine_id

    def stats(self) -> PoolStats:
        return self.index.stats(self.file.header.compat_key)

    def info(self, created: bool) -> PoolInfo:
        header = self.file.header
        geometry = header.geometry
        return PoolInfo(
            engine_id=header.engine_id,
            path=str(self.file.path),
            block_size_bytes=geometry.block_size_bytes,
            num_blocks=geometry.num_blocks,
            data_offset=geometry.data_offset,
            file_size=geometry.file_size,
            pool_uuid=str(header.pool_uuid),
            compat_key=header.compat_key,
            max_entries=geometry.num_slots,
            created=created,
        )


class PoolRegistry:
    def __init__(
        self,
        settings: PoolSettings,
        clock: Callable[[], float],
        publish: Callable[[WatchEvent], None],
        boot_epoch: str,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._publish = publish
        self._boot_epoch = boot_epoch
        self._pools: dict[str, Pool] = {}
        self._refused: dict[str, str] = {}  # engine_id -> why its file was not adopted
        self._dropped: dict[str, Dropped] = {}
        # Allocation IDs, shared by the pools, from a random start: a client's Commit retried
        # after a restart names an allocation of the daemon before, never one of this daemon
        # (40 random bits, then 2**24 allocations before a boot's IDs could meet another's).
        self._allocations = itertools.count((secrets.randbits(40) << 24) + 1)

    def adopt_all(self, dropped_grace_s: float = 0.0) -> None:
        """Re-adopt the pool files a previous daemon left in shm_dir, with their READY entries,
        and the marks of pools dropped while others held them (kept dropped_grace_s, for those
        clients to come back and be told)."""
        suffix = POOL_FILE_SUFFIX + DROPPED_MARK_SUFFIX
        for mark in sorted(self.settings.shm_dir.glob(f"{POOL_FILE_PREFIX}*{suffix}")):
            engine_id = mark.name[len(POOL_FILE_PREFIX) : -len(suffix)]
            if ENGINE_ID_PATTERN.fullmatch(engine_id):
                by = read_dropped_mark(mark) or "a client of the daemon before this one"
                self._dropped[engine_id] = Dropped(by, set(), self._clock() + dropped_grace_s)
        for path in sorted(self.settings.shm_dir.glob(f"{POOL_FILE_PREFIX}*{POOL_FILE_SUFFIX}")):
            engine_id = path.name[len(POOL_FILE_PREFIX) : -len(POOL_FILE_SUFFIX)]
            if not ENGINE_ID_PATTERN.fullmatch(engine_id):
                log.warning(
                    "file in shm_dir is not a pool ecd could have made (bad engine_id); "
                    "left in place",
                    extra={"path": str(path)},
                )
                continue
            if creation_interrupted(path):
                path.unlink(missing_ok=True)
                log.warning(
                    "pool file removed: its creation was interrupted (the daemon stopped before "
                    "its header was whole), so it never held an entry; the pool is created anew "
                    "at its next OpenPool",
                    extra={"engine_id": engine_id, "path": str(path)},
                )
                continue
            try:
                file, records, doomed, unreadable = PoolFile.adopt(path)
            except (LayoutError, OSError) as exc:
                self.refuse(engine_id, path, str(exc))
                continue
            index = self._new_index(engine_id, file.header.geometry, file)
            try:
                index.restore(records, doomed)
            except ValueError as exc:
                file.close()
                self.refuse(engine_id, path, f"slot table does not verify: {exc}")
                continue
            self._pools[engine_id] = Pool(file, index)
            log.info(
                "pool adopted",
                extra={"engine_id": engine_id, "entries": len(records), "path": str(path)},
            )
            if unreadable:
                log.warning(
                    "pool adopted without the entries of slot records that do not verify (written "
                    "over, or torn, by another process): those entries are lost, their blocks "
                    "free; the others are served",
                    extra={"engine_id": engine_id, "slots": unreadable, "path": str(path)},
                )
        self._warn_over_budget()

    def _warn_over_budget(self) -> None:
        """Pools adopted at start are kept whatever the budget (they are the cache, and clients
        may be reading them): a budget below them only stops new pools until enough are dropped.
        Said once, at start, with the numbers."""
        used, budget = self.capacity_bytes(), self.settings.max_bytes
        if used <= budget:
            return
        log.warning(
            "pools adopted over the budget: all kept and served, but no pool can be created "
            "until pools are dropped (ecd drop) below the budget or --max-bytes is raised",
            extra={
                "capacity": format_size(used),
                "max_bytes": format_size(budget),
                "over_by": format_size(used - budget),
                "pools": ", ".join(
                    f"{p.engine_id}={format_size(p.file.header.geometry.capacity_bytes)}"
                    for p in self._pools.values()
                ),
            },
        )

    def refuse(self, engine_id: str, path: Path, why: str) -> None:
        self._refused[engine_id] = why
        extra = {"engine_id": engine_id, "path": str(path), "reason": why}
        if path.exists():
            log.error("pool file refused and left in place", extra=extra)
        else:  # nothing left in place: the pool is simply gone, and may be created again
            log.error("pool file removed from under the daemon: pool forgotten", extra=extra)

    def open(
        self,
        engine_id: str,
        block_size_bytes: int,
        capacity_bytes: int,
        compat_key: str,
        max_entries: int = 0,
        reopen: bool = False,
    ) -> tuple[Pool, bool]:
        """Attach to the pool of this engine_id or create it; returns (pool, created).

        Without a geometry (block_size_bytes and capacity_bytes 0) it only attaches: NOT_FOUND
        when the pool does not exist, and compat_key, if given, must match. max_entries: the
        slots to create it with (0: the default), or, given, the slots it must have. reopen: a
        client library opening again by itself a pool it opened before, which must not make
        one dropped since (FAILED_PRECONDITION pool_dropped)."""
        attach = block_size_bytes == 0
        geometry = None if attach else self._geometry(block_size_bytes, capacity_bytes, max_entries)
        pool = self._pools.get(engine_id)
        if pool is not None:
            self._check_same(pool, geometry, compat_key, max_entries)
            return pool, False
        refusal = self._refusal(engine_id)
        if refusal is not None and self._file_in_place(engine_id):
            raise CoreError(Code.FAILED_PRECONDITION, refusal, Reason.POOL_UNVERIFIED)
        if geometry is None or (reopen and engine_id in self._dropped):
            raise self._missing(engine_id)
        self._refused.pop(engine_id, None)  # its file is gone (as the refusal asked): start anew
        pool = self._create(engine_id, geometry, compat_key)
        self._forget_dropped(engine_id)
        return pool, True

    def _geometry(self, block_size_bytes: int, capacity_bytes: int, max_entries: int) -> Geometry:
        # The most slots a pool may ask for (its slot table is file outside the budget):
        # --entries-per-pool when set (every pool that asks for none gets that many), else the
        # most that sizing from the capacity gives any pool.
        bound = self.settings.entries_per_pool or MAX_AUTO_SLOTS
        if max_entries > bound:
            setting = (
                "--entries-per-pool"
                if self.settings.entries_per_pool
                else "the most any pool gets with --entries-per-pool auto; setting it raises it"
            )
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"max_entries {max_entries} is over the daemon's limit of {bound} entries per "
                f"pool ({setting}); ask for at most {bound}",
                Reason.BUDGET,
            )
        geometry = Geometry.for_capacity(
            block_size_bytes, capacity_bytes, max_entries or self.settings.entries_per_pool
        )
        limit = self.settings.max_pool_bytes
        if limit is not None and geometry.capacity_bytes > limit:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"capacity_bytes {format_size(geometry.capacity_bytes)} is over the per-pool limit "
                f"of {format_size(limit)} (--max-pool-bytes)",
                Reason.BUDGET,
            )
        return geometry

    def _create(self, engine_id: str, geometry: Geometry, compat_key: str) -> Pool:
        used, budget = self.capacity_bytes(), self.settings.max_bytes
        if used + geometry.capacity_bytes > budget:
            n = len(self._pools)
            pools, hold = ("1 pool", "holds") if n == 1 else (f"{n} pools", "hold")
            left = (
                f"only {format_size(budget - used)} of the daemon's {format_size(budget)} budget "
                f"(--max-bytes) are left ({pools} {hold} the rest)"
                if used <= budget
                else f"the {pools} it serves {hold} {format_size(used)}, "
                f"{format_size(used - budget)} over the daemon's {format_size(budget)} budget "
                "(--max-bytes): pools adopted at start that a smaller budget does not cover"
            )
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"pool {engine_id!r} asks for {format_size(geometry.capacity_bytes)} but {left}; "
                "ask for less capacity_bytes, drop a pool, or raise --max-bytes",
                Reason.BUDGET,
            )
        try:
            file = PoolFile.create(
                self.settings.shm_dir,
                engine_id,
                geometry,
                compat_key,
                self.settings.file_mode,
                self.settings.file_gid,
            )
        except FileExistsError as exc:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"{exc.filename} exists but the daemon did not create it; remove it and retry",
                Reason.POOL_UNVERIFIED,
            ) from exc
        pool = Pool(file, self._new_index(engine_id, geometry, file))
        self._pools[engine_id] = pool
        return pool

    @staticmethod
    def _check_same(
        pool: Pool, geometry: Geometry | None, compat_key: str, max_entries: int
    ) -> None:
        """An attach matches the pool's geometry (unless it gave none), its slots (unless it
        asked for none) and compat_key (unless it gave none and no geometry either: attaching
        by name alone)."""
        have = pool.file.header
        found = have.geometry
        # The slots a creation would have made: at most one per block.
        slots = min(max_entries, geometry.num_blocks if geometry else found.num_blocks)
        if max_entries and slots != found.num_slots:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {pool.engine_id!r} exists with max_entries={found.num_slots}; requested "
                f"max_entries={max_entries}"
                + (f" (at most one per block: {slots})" if slots != max_entries else ""),
                Reason.POOL_MISMATCH,
            )
        if geometry is not None and (found.block_size_bytes, found.num_blocks) != (
            geometry.block_size_bytes,
            geometry.num_blocks,
        ):
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {pool.engine_id!r} exists with block_size_bytes="
                f"{found.block_size_bytes} and num_blocks={found.num_blocks}; requested "
                f"block_size_bytes={geometry.block_size_bytes} and num_blocks="
                f"{geometry.num_blocks}",
                Reason.POOL_MISMATCH,
            )
        if have.compat_key != compat_key and (geometry is not None or compat_key):
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {pool.engine_id!r} exists with compat_key {have.compat_key!r}; requested "
                f"{compat_key!r} (another model or dtype wrote it)",
                Reason.POOL_MISMATCH,
            )

    def _new_index(self, engine_id: str, geometry: Geometry, file: PoolFile) -> PoolIndex:
        def emit(type: EventType, key: bytes, nbytes: int, slot: int) -> None:
            self._publish(WatchEvent(type, engine_id, key, nbytes, self._boot_epoch, slot=slot))

        policy = POLICIES[self.settings.eviction]()
        return PoolIndex(engine_id, geometry, file, policy, self._clock, emit, self._allocations)

    def get(self, engine_id: str) -> Pool:
        """The pool; NOT_FOUND, saying why, when it is not served."""
        pool = self._pools.get(engine_id)
        if pool is None:
            raise self._missing(engine_id)
        return pool

    def find(self, engine_id: str) -> Pool | None:
        """The pool, or None when it is not served (no error to build)."""
        return self._pools.get(engine_id)

    def _missing(self, engine_id: str) -> CoreError:
        """NOT_FOUND for a pool that is not served, saying why: refused, or not there;
        FAILED_PRECONDITION pool_dropped for one dropped while others held it."""
        dropped = self._dropped.get(engine_id)
        if dropped is not None:
            return CoreError(
                Code.FAILED_PRECONDITION,
                f"pool was dropped: {engine_id!r}, by {dropped.by}; the clients that had it "
                "open do not make it again by themselves: open_pool with its geometry "
                "(block_size_bytes, capacity_bytes) creates it anew, empty, if it is still "
                "wanted",
                Reason.POOL_DROPPED,
            )
        why = self._refusal(engine_id) or (
            f"pool {engine_id!r} does not exist (never created, or dropped): a producer creates "
            "it with OpenPool and its geometry; `ecd stats` lists the pools that exist"
        )
        return CoreError(Code.NOT_FOUND, why, Reason.UNKNOWN_POOL)

    def _refusal(self, engine_id: str) -> str | None:
        """Why this engine_id's pool was refused, and what to do now; None if it was not."""
        why = self._refused.get(engine_id)
        if why is None:
            return None
        if not self._file_in_place(engine_id):
            return (
                f"pool {engine_id!r} was refused ({why}) and its file is gone: open the pool "
                "again to create it anew"
            )
        path = self.settings.shm_dir / pool_file_name(engine_id)
        return (
            f"pool {engine_id!r} was refused ({why}): its file {path} is kept for inspection; "
            f"remove it (ecd drop {engine_id}), then open the pool again"
        )

    def _file_in_place(self, engine_id: str) -> bool:
        return os.path.lexists(self.settings.shm_dir / pool_file_name(engine_id))

    def refused(self) -> list[RefusedPool]:
        """The refused pools whose file is still in place, by engine_id (a refusal whose file
        is gone is only remembered, for OpenPool's answer)."""
        return [
            RefusedPool(engine_id, str(self.settings.shm_dir / pool_file_name(engine_id)), why)
            for engine_id, why in sorted(self._refused.items())
            if self._file_in_place(engine_id)
        ]

    def remove_refused(self, engine_id: str, force: bool) -> None:
        """Remove a refused pool's file (DropPool of a pool not served): NOT_FOUND, as for any
        pool not served, when none was refused or its file is gone already. Without force, only
        a file whose header still reads as this pool's: ecd's own cache, whose entries a drop
        removes as a served pool's; a file that does not may hold someone else's data."""
        why = self._refused.get(engine_id)
        path = self.settings.shm_dir / pool_file_name(engine_id)
        if why is None or not self._file_in_place(engine_id):
            raise self._missing(engine_id)
        problem = None if force else not_the_pool_file(path, engine_id)
        if problem is not None:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {engine_id!r} was refused, and its file {path} does not read as the "
                f"pool's ({problem}): it may hold someone else's data; look at it, then drop with "
                f"force (ecd drop {engine_id} --force) to remove it",
                Reason.POOL_UNVERIFIED,
            )
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # removed meanwhile: as asked
        except OSError as exc:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {engine_id!r} was refused ({why}); its file {path} cannot be removed: "
                f"{exc.strerror}; remove it by hand",
                Reason.POOL_UNVERIFIED,
            ) from exc
        del self._refused[engine_id]

    def dropped(self, engine_id: str, by: str, holders: set[str]) -> None:
        """The pool was dropped (DropPool) while these other sessions held it: remember it (see
        `Dropped`), on disk too; nothing to remember when no other session held it."""
        if not holders:
            return
        self._dropped[engine_id] = Dropped(by, set(holders))
        try:
            mark_dropped(self.settings.shm_dir / pool_file_name(engine_id), by)
        except OSError as exc:
            log.warning(
                "cannot mark the pool dropped on disk: a daemon restarted before its clients "
                "heard of it lets them make it again",
                extra={"engine_id": engine_id, "error": str(exc)},
            )

    def refused_reopening(self, engine_id: str, session_id: str) -> None:
        """A session was told the pool was dropped: it holds the memory of it from now on."""
        dropped = self._dropped.get(engine_id)
        if dropped is not None:
            dropped.holders.add(session_id)
            dropped.until = None

    def forget_dropped(self, live_sessions: set[str], grace_s: float) -> None:
        """Forget the dropped pools whose holders are all gone, grace_s after the last went."""
        now = self._clock()
        for engine_id, dropped in list(self._dropped.items()):
            dropped.holders &= live_sessions
            if dropped.holders:
                dropped.until = None
            elif dropped.until is None:
                dropped.until = now + grace_s
            elif now >= dropped.until:
                self._forget_dropped(engine_id)

    def _forget_dropped(self, engine_id: str) -> None:
        if self._dropped.pop(engine_id, None) is not None:
            dropped_mark(self.settings.shm_dir / pool_file_name(engine_id)).unlink(missing_ok=True)

    def all(self) -> list[Pool]:
        return list(self._pools.values())

    def capacity_bytes(self) -> int:
        """The capacity of every pool together: what the budget bounds."""
        return sum(p.file.header.geometry.capacity_bytes for p in self._pools.values())

    def reserved_bytes(self) -> int:
        """The bytes of every pool file together: capacity, headers and slot tables."""
        return sum(p.file.header.geometry.file_size for p in self._pools.values())

    def changed(self) -> list[tuple[Pool, str]]:
        """Pools whose file was truncated, overwritten, removed or replaced behind the daemon's
        back, with what changed."""
        changed = []
        for pool in self._pools.values():
            try:
                pool.file.verify()
            except (LayoutError, OSError) as exc:
                changed.append((pool, f"changed under the daemon: {exc}"))
        return changed

    def remove(self, pool: Pool) -> None:
        """Stop serving the pool (the store has undone what sessions held in it); its file stays
        until the caller unlinks or closes it."""
        del self._pools[pool.engine_id]
        self._publish(WatchEvent(EventType.POOL_DROPPED, pool.engine_id, b"", 0, self._boot_epoch))

    def close(self, drop_pools: bool) -> None:
        """Release the pool files (the data stays in shm_dir unless drop_pools)."""
        for pool in self._pools.values():
            if drop_pools:
                pool.file.unlink()
            else:
                pool.file.close()
        self._pools.clear()
