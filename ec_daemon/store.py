"""The store: pools, their indexes, sessions and the global budget, behind one synchronous API.

Each public method is one RPC's worth of work on already-validated input. The gRPC service calls
it and translates; nothing here knows about gRPC or asyncio, and time comes from an injected clock.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ec_client.layout import (
    POOL_FILE_PREFIX,
    POOL_FILE_SUFFIX,
    Geometry,
    LayoutError,
    pool_file_name,
)
from ec_daemon.errors import Code, CoreError, ItemStatus, Reason
from ec_daemon.eviction import POLICIES
from ec_daemon.index import (
    Entry,
    Event,
    EventType,
    Outcome,
    PoolIndex,
    PoolSnapshot,
    TensorSpec,
)
from ec_daemon.pool import FileAccess, PoolFile
from ec_daemon.sessions import Role, Session, SessionTable

log = logging.getLogger("ecd.store")


@dataclass(frozen=True)
class StoreConfig:
    shm_dir: Path
    max_bytes: int  # all pool files together
    lease_ttl_s: float = 10.0
    eviction: str = "lru"
    max_entries_per_pool: int = 65536  # slot table size: 1 KiB of pool file per entry
    max_pool_bytes: int | None = None  # capacity one pool may ask for; None: the whole budget
    file_access: FileAccess = field(default_factory=FileAccess)


@dataclass(frozen=True)
class Pool:
    file: PoolFile
    index: PoolIndex

    @property
    def engine_id(self) -> str:
        return self.file.header.engine_id


@dataclass(frozen=True)
class AcquireOutcome:
    outcome: Outcome
    lease_id: int = 0


@dataclass(frozen=True)
class StoreSnapshot:
    boot_epoch: str
    uptime_s: float
    max_bytes: int
    reserved_bytes: int
    sessions: int
    lease_expiries: int
    pools: list[PoolSnapshot]


@dataclass(frozen=True)
class SessionEnd:
    """What ending a session undid."""

    session: Session
    aborted: int
    released: int


class Store:
    def __init__(
        self,
        config: StoreConfig,
        clock: Callable[[], float],
        on_event: Callable[[Event], None] = lambda event: None,
    ) -> None:
        self.config = config
        self.boot_epoch = secrets.token_hex(8)
        self.sessions = SessionTable(config.lease_ttl_s, clock)
        self.lease_expiries = 0
        self._clock = clock
        self._started = clock()
        self._on_event = on_event
        self._pools: dict[str, Pool] = {}
        self._refused: dict[str, str] = {}  # engine_id -> why its file was not adopted

    # ---- sessions ------------------------------------------------------------------------------

    def open_session(self, name: str, pid: int, role: Role) -> Session:
        return self.sessions.open(name, pid, role)

    def keep_alive(self, session_id: str) -> Session:
        return self.sessions.touch(session_id)

    def close_session(self, session_id: str) -> SessionEnd:
        return self._end_session(self.sessions.get(session_id))

    def expire_sessions(self) -> list[SessionEnd]:
        """End every session whose lease ran out: abort its PENDING entries, release its pins."""
        ends = [self._end_session(s) for s in self.sessions.expired()]
        self.lease_expiries += len(ends)
        return ends

    def _end_session(self, session: Session) -> SessionEnd:
        aborted = 0
        for engine_id, key in sorted(session.pending):
            pool = self._pools.get(engine_id)
            if pool is not None and pool.index.abort(key, session.id).status is ItemStatus.OK:
                aborted += 1
        released = 0
        for lease in list(session.leases.values()):
            pool = self._pools.get(lease.engine_id)
            if pool is not None:
                pool.index.unpin(lease.entry)
                released += 1
        session.pending.clear()
        session.leases.clear()
        self.sessions.remove(session)
        return SessionEnd(session, aborted, released)

    # ---- pools ---------------------------------------------------------------------------------

    def adopt_pools(self) -> None:
        """Re-adopt the pool files a previous daemon left in shm_dir, with their READY entries.

        A file that does not verify is refused loudly and left in place for inspection; OpenPool
        of its engine_id then fails until an operator removes it.
        """
        for path in sorted(self.config.shm_dir.glob(f"{POOL_FILE_PREFIX}*{POOL_FILE_SUFFIX}")):
            engine_id = path.name[len(POOL_FILE_PREFIX) : -len(POOL_FILE_SUFFIX)]
            try:
                file, records = PoolFile.adopt(path)
            except (LayoutError, OSError) as exc:
                self._refuse(engine_id, path, str(exc))
                continue
            index = self._new_index(engine_id, file.header.geometry, file)
            try:
                index.restore(records)
            except ValueError as exc:
                file.close()
                self._refuse(engine_id, path, f"slot table does not verify: {exc}")
                continue
            self._pools[engine_id] = Pool(file, index)
            log.info(
                "pool adopted",
                extra={"engine_id": engine_id, "entries": len(records), "path": str(path)},
            )

    def _refuse(self, engine_id: str, path: Path, why: str) -> None:
        self._refused[engine_id] = why
        log.error(
            "pool file refused and left in place",
            extra={"engine_id": engine_id, "path": str(path), "reason": why},
        )

    def open_pool(
        self, engine_id: str, block_size_bytes: int, capacity_bytes: int, compat_key: str
    ) -> tuple[Pool, bool]:
        """Attach to the pool of this engine_id or create it; returns (pool, created)."""
        num_blocks = capacity_bytes // block_size_bytes
        limit = self.config.max_pool_bytes
        if limit is not None and capacity_bytes > limit:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"capacity_bytes {capacity_bytes} is over the per-pool limit of {limit} bytes "
                "(--max-pool-bytes)",
                Reason.BUDGET,
            )
        pool = self._pools.get(engine_id)
        if pool is not None:
            have = pool.file.header
            if (have.geometry.block_size_bytes, have.geometry.num_blocks) != (
                block_size_bytes,
                num_blocks,
            ):
                raise CoreError(
                    Code.FAILED_PRECONDITION,
                    f"pool {engine_id!r} exists with block_size_bytes="
                    f"{have.geometry.block_size_bytes} and num_blocks={have.geometry.num_blocks}; "
                    f"requested block_size_bytes={block_size_bytes} and num_blocks={num_blocks}",
                    Reason.POOL_MISMATCH,
                )
            if have.compat_key != compat_key:
                raise CoreError(
                    Code.FAILED_PRECONDITION,
                    f"pool {engine_id!r} exists with compat_key {have.compat_key!r}; requested "
                    f"{compat_key!r} (another model or dtype wrote it)",
                    Reason.POOL_MISMATCH,
                )
            return pool, False
        if engine_id in self._refused and os.path.lexists(
            self.config.shm_dir / pool_file_name(engine_id)
        ):
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool file {self.config.shm_dir / pool_file_name(engine_id)} exists but was not "
                f"adopted ({self._refused[engine_id]}); inspect it, remove it, then retry",
                Reason.POOL_UNVERIFIED,
            )
        self._refused.pop(engine_id, None)  # its file is gone (as the refusal asked): start anew
        geometry = Geometry(
            block_size_bytes, num_blocks, min(num_blocks, self.config.max_entries_per_pool)
        )
        reserved = self.reserved_bytes()
        if reserved + geometry.file_size > self.config.max_bytes:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"pool {engine_id!r} needs {geometry.file_size} bytes but only "
                f"{self.config.max_bytes - reserved} of the daemon's {self.config.max_bytes}-byte "
                "budget are left; ask for less capacity_bytes, drop a pool, or raise --max-bytes",
                Reason.BUDGET,
            )
        try:
            file = PoolFile.create(
                self.config.shm_dir, engine_id, geometry, compat_key, self.config.file_access
            )
        except FileExistsError as exc:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"{exc.filename} exists but the daemon did not create it; remove it and retry",
                Reason.POOL_UNVERIFIED,
            ) from exc
        pool = Pool(file, self._new_index(engine_id, geometry, file))
        self._pools[engine_id] = pool
        log.info("pool created", extra={"engine_id": engine_id, "bytes": geometry.file_size})
        return pool, True

    def _new_index(self, engine_id: str, geometry: Geometry, file: PoolFile) -> PoolIndex:
        policy = POLICIES[self.config.eviction]()
        return PoolIndex(engine_id, geometry, file, policy, self._clock, self._on_event)

    def pool(self, engine_id: str) -> Pool:
        pool = self._pools.get(engine_id)
        if pool is None:
            raise CoreError(
                Code.NOT_FOUND,
                f"unknown pool {engine_id!r}: open it with OpenPool first",
                Reason.UNKNOWN_POOL,
            )
        return pool

    def pools(self) -> list[Pool]:
        return list(self._pools.values())

    def reserved_bytes(self) -> int:
        return sum(p.file.header.geometry.file_size for p in self._pools.values())

    def drop_pool(self, engine_id: str, force: bool) -> int:
        """Delete a pool and its file; refused while entries are PENDING or pinned, unless
        forced."""
        pool = self.pool(engine_id)
        snapshot = pool.index.snapshot()
        if (snapshot.entries_pending or snapshot.pins) and not force:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {engine_id!r} has {snapshot.entries_pending} PENDING entries and "
                f"{snapshot.pins} pins outstanding; wait, or drop with force",
            )
        dropped = self._forget(pool)
        pool.file.unlink()
        log.info("pool dropped", extra={"engine_id": engine_id, "entries": dropped})
        return dropped

    def verify_pools(self) -> list[str]:
        """Refuse every pool whose file was truncated or overwritten behind the daemon's back.

        Its entries can no longer be trusted, and clients mapping a truncated file would fault:
        the pool is forgotten (as if dropped) but its file is left in place for inspection, and
        OpenPool of its engine_id fails until an operator removes it. Returns the refused ids.
        """
        refused = []
        for pool in list(self._pools.values()):
            try:
                pool.file.verify()
            except (LayoutError, OSError) as exc:
                self._forget(pool)
                pool.file.close()
                self._refuse(pool.engine_id, pool.file.path, f"changed under the daemon: {exc}")
                refused.append(pool.engine_id)
        return refused

    def _forget(self, pool: Pool) -> int:
        """Remove a pool with every entry, pin and pending allocation in it; tell watchers."""
        engine_id = pool.engine_id
        for session, lease in self.sessions.leases_on(engine_id):
            del session.leases[lease.id]
        for session in self.sessions.all():
            session.pending = {(e, k) for e, k in session.pending if e != engine_id}
        dropped = pool.index.drop_all()
        del self._pools[engine_id]
        self._on_event(Event(EventType.POOL_DROPPED, engine_id))
        return dropped

    # ---- entries -------------------------------------------------------------------------------

    def allocate(
        self, session_id: str, engine_id: str, items: list[tuple[bytes, TensorSpec]]
    ) -> list[Outcome]:
        session = self.sessions.touch(session_id)
        index = self.pool(engine_id).index
        evictions_before = index.counters.evictions
        outcomes = []
        for key, spec in items:
            outcome = index.allocate(key, spec, session.id, session.name)
            if outcome.status is ItemStatus.ALLOCATED:
                session.pending.add((engine_id, key))
            outcomes.append(outcome)
        evicted = index.counters.evictions - evictions_before
        if evicted:  # one line per batch, never one per entry
            log.info(
                "entries evicted",
                extra={"engine_id": engine_id, "evicted": evicted, "client": session.name},
            )
        return outcomes

    def commit(
        self, session_id: str, engine_id: str, items: list[tuple[bytes, int]]
    ) -> list[Outcome]:
        session = self.sessions.touch(session_id)
        index = self.pool(engine_id).index
        outcomes = []
        for key, checksum in items:
            outcome = index.commit(key, session.id, checksum)
            if outcome.status is ItemStatus.OK:
                session.pending.discard((engine_id, key))
            outcomes.append(outcome)
        return outcomes

    def abort(self, session_id: str, engine_id: str, keys: list[bytes]) -> list[Outcome]:
        session = self.sessions.touch(session_id)
        index = self.pool(engine_id).index
        outcomes = []
        for key in keys:
            outcome = index.abort(key, session.id)
            if outcome.status is ItemStatus.OK:
                session.pending.discard((engine_id, key))
            outcomes.append(outcome)
        return outcomes

    def acquire(self, session_id: str, engine_id: str, keys: list[bytes]) -> list[AcquireOutcome]:
        session = self.sessions.touch(session_id)
        index = self.pool(engine_id).index
        results = []
        for key in keys:
            outcome = index.pin(key)
            lease_id = 0
            if outcome.status is ItemStatus.HIT and outcome.entry is not None:
                lease_id = self.sessions.add_lease(session, engine_id, outcome.entry).id
            results.append(AcquireOutcome(outcome, lease_id))
        return results

    def release(self, session_id: str, lease_ids: list[int]) -> list[Outcome]:
        session = self.sessions.touch(session_id)
        outcomes = []
        for lease_id in lease_ids:
            lease = session.leases.pop(lease_id, None)
            if lease is None:
                outcomes.append(
                    Outcome(
                        ItemStatus.NOT_FOUND,
                        f"unknown lease {lease_id}: already released, never issued, or not "
                        "this session's",
                    )
                )
                continue
            self.pool(lease.engine_id).index.unpin(lease.entry)
            outcomes.append(Outcome(ItemStatus.OK, entry=lease.entry))
        return outcomes

    def lookup(self, engine_id: str, keys: list[bytes]) -> list[Entry | None]:
        index = self.pool(engine_id).index
        return [index.get(key) for key in keys]

    def evict(self, engine_id: str, keys: list[bytes]) -> list[Outcome]:
        index = self.pool(engine_id).index
        return [index.evict(key) for key in keys]

    def delete(self, engine_id: str, keys: list[bytes]) -> list[Outcome]:
        index = self.pool(engine_id).index
        outcomes = []
        for key in keys:
            outcome = index.delete(key)
            if outcome.entry is not None:
                owner = self.sessions.find(outcome.entry.session_id)
                if owner is not None:
                    owner.pending.discard((engine_id, key))
            outcomes.append(outcome)
        return outcomes

    def list_entries(
        self, engine_id: str, start_after: bytes, limit: int
    ) -> tuple[list[Entry], bool]:
        """Entries in key order after `start_after`, at most `limit`; and whether more follow."""
        entries = sorted(
            (e for e in self.pool(engine_id).index.entries() if e.key > start_after),
            key=lambda e: e.key,
        )
        return entries[:limit], len(entries) > limit

    # ---- observation ---------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock()

    def snapshot(self, engine_id: str = "") -> StoreSnapshot:
        pools = [self.pool(engine_id)] if engine_id else list(self._pools.values())
        return StoreSnapshot(
            boot_epoch=self.boot_epoch,
            uptime_s=self._clock() - self._started,
            max_bytes=self.config.max_bytes,
            reserved_bytes=self.reserved_bytes(),
            sessions=len(self.sessions),
            lease_expiries=self.lease_expiries,
            pools=[p.index.snapshot() for p in pools],
        )

    def check(self) -> None:
        """Raise AssertionError unless every pool's block invariant holds and sessions agree."""
        for pool in self._pools.values():
            pool.index.check()
        for session in self.sessions.all():
            for engine_id, key in session.pending:
                entry = self._pools[engine_id].index.get(key)
                assert entry is not None and entry.session_id == session.id
            for lease in session.leases.values():
                assert lease.entry.pins > 0
        leases = sum(len(s.leases) for s in self.sessions.all())
        pins = sum(p.index.snapshot().pins for p in self._pools.values())
        assert pins == leases, f"{pins} pins but {leases} leases: a pin outlived its session"

    def close(self, drop_pools: bool = False) -> None:
        """Release the pool files (the data stays in shm_dir unless drop_pools)."""
        for pool in self._pools.values():
            if drop_pools:
                pool.file.unlink()
            else:
                pool.file.close()
        self._pools.clear()
