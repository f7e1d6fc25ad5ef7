"""The store: pools, their entries, sessions and the budget, behind one synchronous API.

Each public method is one RPC's worth of work on already-validated input, and answers in the
values of `ec_protocol.types` (the ones clients see), never in the core's own objects. The gRPC
service calls it and translates; nothing here knows about gRPC or asyncio, and time comes from an
injected clock.

Every call that names a session renews its lease (any RPC of a session is a sign of life), and
checks the session's role for calls that write entries (PRODUCE) or pin them (CONSUME). Whether
the caller is the session's opener is asked first, once per RPC (`owned`): session IDs are
never reused and a session's opener never changes, so the answer holds for the whole call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.index import Entry, Outcome, saturated
from ec_daemon.core.pools import Pool, PoolRegistry, PoolSettings
from ec_daemon.core.sessions import CONSUME, PRODUCE, Session, SessionTable
from ec_protocol import __version__
from ec_protocol import types as api
from ec_protocol.pool.layout import LayoutError

log = logging.getLogger("ecd.store")

# How many leases after a restart an adopted ephemeral pool waits for a session to open it again.
# A live client reopens its pools at its first call to the new daemon: its KeepAlive comes every
# third of a lease, and its channel tries to reconnect at least every second (ec_client's
# _connection), so a lease and a second at most; two leave room for a slow start.
UNCLAIMED_LEASES = 2

# Evictions are told at info at most once per this many seconds per pool, summed, with their
# causes: a full pool evicts at every Allocate, and a line each would drown the log (and cost
# the hot path); each batch's own line is at debug.
EVICTION_SUMMARY_S = 10.0


@dataclass(frozen=True)
class StoreConfig:
    pools: PoolSettings
    lease_ttl_s: float = 10.0
    # The longest an entry may stay PENDING: whoever waits for it (single flight) waits no
    # longer for a producer that is alive but stuck (docs/design.md §4).
    pending_timeout_s: float = 30.0


@dataclass(frozen=True)
class SessionEnd:
    """What ending a session undid (for the log)."""

    session_id: str
    client: str
    pid: int
    aborted: int
    released: int


@dataclass(frozen=True)
class EvictionsTold:
    """A pool's eviction counters when they were last told at info, and when: the next summary
    says what changed since. Of one pool file: a pool made anew under the name starts over."""

    pool_uuid: str
    at: float
    space: int = 0
    entries: int = 0
    total: int = 0


@dataclass(frozen=True)
class PullSlot:
    """A local entry being filled from the cluster's store (a *pull*, docs/design.md §13):
    PENDING under a session of its own that no client holds and no lease ends, so only its pull
    commits or aborts it, and a pull never touches another pull's entry (a pool dropped and made
    anew, the same key pulled again)."""

    engine_id: str
    block_size: int
    entry: Entry  # PENDING under the pull's own session until the pull commits or aborts it

    @property
    def key(self) -> bytes:
        return self.entry.key

    @property
    def session_id(self) -> str:
        return self.entry.session_id

    @property
    def extents(self) -> tuple[api.Extent, ...]:
        return self.entry.extents

    @property
    def nbytes(self) -> int:
        return self.entry.spec.nbytes  # the same at the commit, which sets the real shape


def item_result(key: bytes, outcome: Outcome) -> api.ItemResult:
    return api.ItemResult(key, outcome.status, outcome.message)


class Store:
    def __init__(
        self,
        config: StoreConfig,
        clock: Callable[[], float],
        publish: Callable[[api.WatchEvent], None] = lambda event: None,
        cluster: Callable[[], api.ClusterStats | None] = lambda: None,
    ) -> None:
        """publish: receives every event of every pool (the EventHub, in the daemon).
        cluster: the daemon's part in a Mooncake Store, for Stats."""
        self.config = config
        self.boot_epoch = secrets.token_hex(8)
        self.lease_expiries = 0
        self._sessions = SessionTable(config.lease_ttl_s, clock)
        self._pools = PoolRegistry(config.pools, clock, publish, self.boot_epoch)
        self._cluster = cluster
        # engine_id -> the namespace its entries are shared under in the cluster's store
        # (OpenPool's cluster_namespace): set once, gone with the pool.
        self._namespaces: dict[str, str] = {}
        self._pulls = itertools.count(1)
        # Pools that live only as long as the sessions that opened them (OpenPool's ephemeral),
        # each marked so beside its file too, for a restarted daemon (adopt_pools).
        self._ephemeral: set[str] = set()
        # Ephemeral pools adopted at startup that no session has opened since: dropped unless
        # one does within UNCLAIMED_LEASES leases of the start. A client that died while the
        # daemon was down never will, and nothing else would end its pool.
        self._unclaimed: set[str] = set()
        self._clock = clock
        self._started = clock()
        self._evictions_told: dict[str, EvictionsTold] = {}
        # Per session, the pool files (by UUID) it was seen holding its life mark on: its absence
        # from one of those, while it is still the pool's file, means the process is gone
        # (end_dead_sessions). A file dropped or made anew since says nothing: the client marks
        # a new file only when it opens it, so a session whose marked files are all gone is left
        # to its lease.
        self._marked: dict[str, set[uuid.UUID]] = {}

    # ---- sessions ------------------------------------------------------------------------------

    @property
    def lease_ttl_s(self) -> float:
        return self._sessions.ttl_s

    def open_session(self, name: str, pid: int, role: api.Role, owner: bytes = b"") -> str:
        """A new session, bound to the identity of the caller that opens it (ec_daemon.server.auth:
        b"", every caller, when the daemon tells none apart); returns its ID."""
        return self._sessions.open(name, pid, role, owner).id

    def owned(self, session_id: str, caller: bytes) -> None:
        """NOT_FOUND (unknown_session) unless the session is live and `caller` opened it; the
        same answer either way. The service asks this before any call naming a session."""
        self._sessions.owned(session_id, caller)

    def keep_alive(self, session_id: str) -> None:
        self._sessions.touch(session_id)

    def close_session(self, session_id: str) -> SessionEnd:
        return self._end_session(self._sessions.get(session_id))

    def expire_sessions(self) -> list[SessionEnd]:
        """End every session whose lease ran out: abort its PENDING entries, release its pins."""
        ends = [self._end_session(s) for s in self._sessions.expired()]
        self.lease_expiries += len(ends)
        self._pools.forget_dropped({s.id for s in self._sessions.all()}, self._dropped_grace_s)
        if self._unclaimed and self._clock() - self._started >= UNCLAIMED_LEASES * self.lease_ttl_s:
            unclaimed, self._unclaimed = self._unclaimed, set()
            self._drop_unheld(unclaimed, "no session opened it again after the daemon restarted")
        return ends

    def end_dead_sessions(self) -> list[SessionEnd]:
        """End every session whose client's process is gone: seen holding its life mark on a
        pool file once (ec_protocol/pool/life_marks.py), it holds it on none of its pools now. Its
        PENDING entries are aborted at once (whoever waits for them encodes), its pins
        released; a session never seen marked is left to its lease."""
        ends = []
        for session in self._sessions.all():
            pools = [p for p in map(self._pools.find, sorted(session.pools)) if p is not None]
            files = {p.file.header.pool_uuid: p.file for p in pools}
            marked_on = {u for u, f in files.items() if f.life_marked(session.id)}
            seen = self._marked.get(session.id, set()) & files.keys()
            if marked_on:
                self._marked[session.id] = seen | marked_on
            elif seen:  # a file it held its mark on is still the pool's, and the mark is gone
                ends.append(self._end_session(session))
        live = {s.id for s in self._sessions.all()}
        self._marked = {s: u for s, u in self._marked.items() if s in live}
        return ends

    def abort_stale_pending(self) -> list[tuple[str, str]]:
        """Abort the entries PENDING longer than `pending_timeout_s` (their producer is alive
        but stuck, or its output is lost): their waiters encode instead, and the producer's late
        Commit is answered NOT_FOUND. Returns (pool, producer's client name) of each."""
        deadline = self._clock() - self.config.pending_timeout_s
        aborted = []
        for session in self._sessions.all():
            for engine_id, key in sorted(session.pending):
                pool = self._pools.find(engine_id)
                entry = pool.index.get(key) if pool is not None else None
                if entry is None or entry.created_at > deadline:
                    continue
                if pool is not None and pool.index.abort(key, session.id).status is api.Status.OK:
                    session.pending.discard((engine_id, key))
                    aborted.append((engine_id, session.name))
        return aborted

    def _end_session(self, session: Session) -> SessionEnd:
        aborted = 0
        for engine_id, key in sorted(session.pending):
            pool = self._pools.find(engine_id)
            if pool is not None and pool.index.abort(key, session.id).status is api.Status.OK:
                aborted += 1
        released = 0
        for lease in list(session.leases.values()):
            pool = self._pools.find(lease.engine_id)
            if pool is not None:
                pool.index.unpin(lease.entry)
                released += 1
        session.pending.clear()
        session.leases.clear()
        self._sessions.remove(session)
        self._drop_unheld(
            session.pools,
            f"the last session that opened it ended: {session.name} (pid {session.pid})",
        )
        return SessionEnd(session.id, session.name, session.pid, aborted, released)

    def _drop_unheld(self, engine_ids: set[str], why: str) -> None:
        """Drop, forced, each of these pools that is ephemeral and that no live session opened."""
        held = {engine_id for session in self._sessions.all() for engine_id in session.pools}
        for engine_id in sorted(engine_ids & (self._ephemeral - held)):
            pool = self._pools.find(engine_id)
            if pool is not None:
                entries = self._drop(pool)
                log.info(
                    "ephemeral pool dropped",
                    extra={"engine_id": engine_id, "entries": entries, "reason": why},
                )

    # ---- pools ---------------------------------------------------------------------------------

    @property
    def _dropped_grace_s(self) -> float:
        """How long a pool dropped while others held it stays refused to their clients' own
        reopening once none of them lives: long enough for one whose lease ran out, or that a
        restart cut off, to come back (as for unclaimed ephemeral pools)."""
        return UNCLAIMED_LEASES * self.lease_ttl_s

    def adopt_pools(self) -> None:
        """Re-adopt the pool files a previous daemon left, with their READY entries (and which
        of them are ephemeral, to go unless a session opens them soon)."""
        self._pools.adopt_all(self._dropped_grace_s)
        self._unclaimed = {p.engine_id for p in self._pools.all() if p.file.marked_ephemeral()}
        self._ephemeral |= self._unclaimed

    def open_pool(
        self,
        session_id: str,
        engine_id: str,
        block_size_bytes: int,
        capacity_bytes: int,
        compat_key: str,
        ephemeral: bool = False,
        max_entries: int = 0,
        reopen: bool = False,
        cluster_namespace: str = "",
    ) -> api.PoolInfo:
        """Attach to the pool of this engine_id or create it. The session holds it from now on;
        `ephemeral` makes it go when the last session holding it ends; `max_entries` is its slot
        count (0: the daemon's default); `reopen`: the client's library opens it again by
        itself, which never makes anew a pool dropped while its clients held it;
        `cluster_namespace` shares its entries with other nodes under that namespace (the first
        that names one sets it; another one afterwards is FAILED_PRECONDITION)."""
        session = self._sessions.touch(session_id)
        shared = self._namespaces.get(engine_id, "")
        if cluster_namespace and shared and cluster_namespace != shared:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {engine_id!r} is shared under cluster_namespace {shared!r}, not "
                f"{cluster_namespace!r}: open it with that namespace, or with none",
            )
        try:
            pool, created = self._pools.open(
                engine_id, block_size_bytes, capacity_bytes, compat_key, max_entries, reopen
            )
        except CoreError as error:
            if error.reason is Reason.POOL_DROPPED:
                self._pools.refused_reopening(engine_id, session.id)
            raise
        if cluster_namespace:
            self._namespaces[engine_id] = cluster_namespace
        if created:
            geometry = pool.file.header.geometry
            log.info(
                "pool created",
                extra={
                    "engine_id": engine_id,
                    "capacity_bytes": geometry.capacity_bytes,
                    "file_bytes": geometry.file_size,
                    "client": session.name,
                    "pid": session.pid,
                },
            )
        session.pools.add(engine_id)
        self._unclaimed.discard(engine_id)
        if ephemeral and engine_id not in self._ephemeral:
            self._ephemeral.add(engine_id)
            try:
                pool.file.mark_ephemeral()
            except OSError as exc:
                log.warning(
                    "cannot mark the pool ephemeral on disk: it goes with its sessions, but a "
                    "daemon restarted before they end will keep it",
                    extra={"engine_id": engine_id, "error": str(exc)},
                )
        return self._info(pool, created)

    def _info(self, pool: Pool, created: bool) -> api.PoolInfo:
        namespace = self._namespaces.get(pool.engine_id, "")
        info = pool.info(created)
        return dataclasses.replace(info, cluster_namespace=namespace) if namespace else info

    def cluster_namespace(self, engine_id: str) -> str:
        """The namespace the pool's entries are shared under; "" for a pool on its node only."""
        return self._namespaces.get(engine_id, "")

    def has_pool(self, engine_id: str) -> bool:
        return self._pools.find(engine_id) is not None

    def pool_info(self, engine_id: str) -> api.PoolInfo:
        """What OpenPool would answer for an existing pool; NOT_FOUND if there is none."""
        return self._info(self._pools.get(engine_id), created=False)

    def open_pool_file(self, session_id: str, engine_id: str, pool_uuid: str) -> int:
        """A new read-write open of the pool's file for a client, whose grant on the pool was
        checked when it was promised the file (OpenPool's fd ticket, ec_daemon/server/
        fd_channel.py): NOT_FOUND unless its session is live and holds the pool, and the pool's
        file is still the one `pool_uuid` names."""
        session = self._sessions.get(session_id)
        pool = self._pools.find(engine_id)
        if pool is None or engine_id not in session.pools:
            raise CoreError(Code.NOT_FOUND, f"pool {engine_id!r} is not open in this session")
        if str(pool.file.header.pool_uuid) != pool_uuid:
            raise CoreError(
                Code.NOT_FOUND, f"pool {engine_id!r} was made anew since: open it again"
            )
        return self._open_for_client(pool, writable=True)

    def open_pool_file_again(self, file_id: tuple[int, int], writable: bool) -> int:
        """A new open of the pool file whose (device, inode) is `file_id`, for a client holding
        an open file of it already (and with it the file's bytes): NOT_FOUND if it is no pool's
        file now (dropped, refused, made anew)."""
        for pool in self._pools.all():
            if pool.file.file_id == file_id:
                return self._open_for_client(pool, writable)
        raise CoreError(
            Code.NOT_FOUND,
            "the file is not the file of any pool now (dropped, refused or made anew): open "
            "the pool again",
        )

    @staticmethod
    def _open_for_client(pool: Pool, writable: bool) -> int:
        try:
            return pool.file.open_for_client(writable)
        except (OSError, LayoutError) as error:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"cannot open the file of pool {pool.engine_id!r}: {error}; the daemon's check "
                "of pool files refuses it shortly",
            ) from None

    def engine_ids(self) -> list[str]:
        return [pool.engine_id for pool in self._pools.all()]

    def drop_pool(self, engine_id: str, force: bool, session_id: str = "") -> int:
        """Delete a pool and its file; refused while entries are PENDING, pinned or locked,
        unless forced (readers keep the pages they mapped). Returns how many entries went.
        session_id: the caller's session, if it named one (for the log, and the error the other
        sessions that held the pool get: see pools.Dropped). Of a refused pool, removes its
        file (PoolRegistry.remove_refused): no entry goes, since none was served."""
        caller = self._sessions.find(session_id) if session_id else None
        client, pid = (caller.name, caller.pid) if caller is not None else ("(no session)", 0)
        pool = self._pools.find(engine_id)
        if pool is None:
            self._pools.remove_refused(engine_id, force)
            log.info(
                "refused pool file removed",
                extra={"engine_id": engine_id, "client": client, "pid": pid, "force": force},
            )
            return 0
        stats = pool.stats()
        if (stats.entries_pending or stats.pins or stats.entries_locked) and not force:
            raise CoreError(
                Code.FAILED_PRECONDITION,
                f"pool {engine_id!r} has {stats.entries_pending} PENDING entries, "
                f"{stats.pins} pins outstanding and {stats.entries_locked} entries being read "
                "under lock pins; wait, or drop with force",
            )
        holders = {s.id for s in self._sessions.all() if engine_id in s.pools} - {session_id}
        dropped = self._drop(pool)
        self._pools.dropped(engine_id, f"{client} (pid {pid})", holders)
        log.info(
            "pool dropped",
            extra={
                "engine_id": engine_id,
                "entries": dropped,
                "client": client,
                "pid": pid,
                "held_by_others": len(holders),
            },
        )
        return dropped

    def _drop(self, pool: Pool) -> int:
        """Forget the pool and delete its file (readers keep the pages they mapped)."""
        dropped = self._forget(pool)
        pool.file.unlink()
        return dropped

    def verify_pools(self) -> list[str]:
        """Refuse every pool whose file was truncated or overwritten behind the daemon's back.

        Its entries can no longer be trusted, and clients mapping a truncated file would fault:
        the pool is forgotten (as if dropped) but its file is left in place for inspection, and
        OpenPool of its engine_id fails until an operator removes it. Returns the refused ids.
        """
        refused = []
        for pool, why in self._pools.changed():
            self._forget(pool)
            pool.file.close()
            self._pools.refuse(pool.engine_id, pool.file.path, why)
            refused.append(pool.engine_id)
        return refused

    def _forget(self, pool: Pool) -> int:
        """Remove a pool with every entry, pin and pending allocation in it; tell watchers."""
        engine_id = pool.engine_id
        for session, lease in self._sessions.leases_on(engine_id):
            del session.leases[lease.id]
        for session in self._sessions.all():
            session.pending = {(e, k) for e, k in session.pending if e != engine_id}
            session.pools.discard(engine_id)  # a pool made anew under this name is not held
        self._ephemeral.discard(engine_id)
        self._unclaimed.discard(engine_id)
        self._namespaces.pop(engine_id, None)
        dropped = pool.index.drop_all()
        self._pools.remove(pool)
        return dropped

    # ---- entries -------------------------------------------------------------------------------

    def allocate(
        self, session_id: str, engine_id: str, items: Sequence[tuple[bytes, api.TensorSpec]]
    ) -> list[api.AllocateResult]:
        session = self._sessions.touch(session_id, PRODUCE)
        return self._allocate(session, self._pools.get(engine_id), items)

    def commit(
        self, session_id: str, engine_id: str, items: Sequence[api.CommitItem]
    ) -> list[api.ItemResult]:
        session = self._sessions.touch(session_id, PRODUCE)
        return self._commit(session, self._pools.get(engine_id), items)

    def abort(self, session_id: str, engine_id: str, keys: Sequence[bytes]) -> list[api.ItemResult]:
        session = self._sessions.touch(session_id, PRODUCE)
        return self._abort(session, self._pools.get(engine_id), keys)

    def keys_to_wait_for(
        self, session_id: str, engine_id: str, keys: Sequence[bytes]
    ) -> list[bytes]:
        """The keys an Acquire with a wait should wait on before pinning: those not READY now,
        PENDING or not there yet (a consumer may ask before the producer has allocated).

        The caller must register its waiters before anything else runs on the loop, so no
        allocation and commit slip between this answer and the wait.
        """
        self._sessions.touch(session_id, CONSUME)
        index = self._pools.get(engine_id).index
        return [key for key in keys if index.state(key) is not api.EntryState.READY]

    def acquire(
        self, session_id: str, engine_id: str, keys: Sequence[bytes], count_misses: bool = True
    ) -> list[api.AcquireResult]:
        session = self._sessions.touch(session_id, CONSUME)
        return self._acquire(session, self._pools.get(engine_id), keys, count_misses)

    def may_consume(self, session_id: str) -> None:
        """Renew the session's lease; PERMISSION_DENIED unless its role may Acquire."""
        self._sessions.touch(session_id, CONSUME)

    def release(self, session_id: str, lease_ids: Sequence[int]) -> list[api.LeaseResult]:
        return self._release(self._sessions.touch(session_id, CONSUME), lease_ids)

    def step(
        self,
        session_id: str,
        engine_id: str,
        releases: Sequence[int],
        commits: Sequence[api.CommitItem],
        aborts: Sequence[bytes],
        acquires: Sequence[bytes],
        allocates: Sequence[tuple[bytes, api.TensorSpec]],
        count_misses: bool = True,
        hits: Sequence[bytes] = (),
    ) -> api.StepResult:
        """Release, Commit, Abort, Acquire and Allocate in this order, in one call. The session,
        the roles its parts need and the pool are checked before any part is applied. Without
        count_misses, the acquires' misses are the caller's to count (`count_misses`), once it
        knows them: those that the cluster's store then answers are hits, not misses.

        hits: the entries the client read under lock pins since its last Step (StepRequest.hits),
        refreshed for eviction before the Acquire and Allocate: the client read them before
        anything this Step asks, so an allocation must not evict an entry just read for one
        read longer ago. They are the caller's to count (`count_hits`), once nothing of the
        Step can fail: a Step that fails is sent again, and a refresh twice is harmless, a
        count twice is not."""
        produces, consumes = bool(commits or aborts or allocates), bool(releases or acquires)
        may = PRODUCE & CONSUME if produces and consumes else PRODUCE if produces else CONSUME
        session = self._sessions.touch(session_id, may if produces or consumes else None)
        pool = self._pools.get(engine_id)
        released = self._release(session, releases)
        committed = self._commit(session, pool, commits)
        aborted = self._abort(session, pool, aborts)
        for key in hits:
            pool.index.touch(key)
        acquired = self._acquire(session, pool, acquires, count_misses)
        allocated = self._allocate(session, pool, allocates)
        return api.StepResult(
            released, committed, aborted, acquired, allocated, str(pool.file.header.pool_uuid)
        )

    def count_misses(self, engine_id: str, misses: int) -> None:
        """Misses answered elsewhere than by a pin: by a client from its view of the pool
        (StepRequest.misses), or a Step's acquires once the cluster's store had its say.
        None counted for a pool gone."""
        pool = self._pools.find(engine_id)
        if misses and pool is not None:
            pool.index.counters.misses += misses

    def count_hits(self, engine_id: str, keys: Sequence[bytes]) -> None:
        """Hits a client answered under lock pins, with no round trip (StepRequest.hits; `step`
        refreshed them): each naming a READY entry counts, the others nothing
        (ec_daemon.core.index.PoolIndex.count_hit). None counted for a pool gone."""
        pool = self._pools.find(engine_id)
        if pool is not None:
            for key in keys:
                pool.index.count_hit(key)

    def reclaim(self) -> None:
        """Free the blocks of removed entries whose readers' lock pins are gone."""
        for pool in self._pools.all():
            pool.index.reclaim()

    def _allocate(
        self, session: Session, pool: Pool, items: Sequence[tuple[bytes, api.TensorSpec]]
    ) -> list[api.AllocateResult]:
        index = pool.index
        evictions_before = index.counters.evictions
        results = []
        for key, spec in items:
            outcome = index.allocate(key, spec, session.id, session.name)
            extents: tuple[api.Extent, ...] = ()
            allocation = 0
            if outcome.status is api.Status.ALLOCATED and outcome.entry is not None:
                session.pending.add((pool.engine_id, key))
                extents, allocation = outcome.entry.extents, outcome.entry.allocation
            results.append(
                api.AllocateResult(key, outcome.status, outcome.message, extents, allocation)
            )
        evicted = index.counters.evictions - evictions_before
        if evicted:  # one line per batch, never one per entry; at info, `summarize_evictions`
            log.debug(
                "entries evicted for an allocation",
                extra={"engine_id": pool.engine_id, "evicted": evicted, "client": session.name},
            )
        return results

    def summarize_evictions(self) -> None:
        """Tell at info, per pool, the evictions since it was last told, by cause, unless that
        was less than EVICTION_SUMMARY_S ago (called periodically: by the daemon's reaper)."""
        now = self._clock()
        pools = {pool.engine_id: pool for pool in self._pools.all()}
        for gone in self._evictions_told.keys() - pools.keys():
            del self._evictions_told[gone]
        for engine_id, pool in pools.items():
            counters = pool.index.counters
            pool_uuid = str(pool.file.header.pool_uuid)
            told = self._evictions_told.get(engine_id)
            if told is None or told.pool_uuid != pool_uuid:  # the first evictions: told at once
                told = self._evictions_told[engine_id] = EvictionsTold(
                    pool_uuid, now - EVICTION_SUMMARY_S
                )
            if counters.evictions == told.total or now - told.at < EVICTION_SUMMARY_S:
                continue
            space = counters.evictions_for_space - told.space
            entries = counters.evictions_for_entries - told.entries
            evicted = counters.evictions - told.total
            log.info(
                "entries evicted",
                extra={
                    "engine_id": engine_id,
                    "evicted": evicted,
                    "for_space": space,
                    "for_entries": entries,
                    "by_operator": evicted - space - entries,
                },
            )
            self._evictions_told[engine_id] = EvictionsTold(
                pool_uuid,
                now,
                counters.evictions_for_space,
                counters.evictions_for_entries,
                counters.evictions,
            )

    def _commit(
        self, session: Session, pool: Pool, items: Sequence[api.CommitItem]
    ) -> list[api.ItemResult]:
        results = []
        for key, checksum, allocation in items:
            outcome = pool.index.commit(key, session.id, checksum, allocation=allocation)
            if outcome.status is api.Status.OK:
                session.pending.discard((pool.engine_id, key))
            results.append(item_result(key, outcome))
        return results

    def _abort(self, session: Session, pool: Pool, keys: Sequence[bytes]) -> list[api.ItemResult]:
        results = []
        for key in keys:
            outcome = pool.index.abort(key, session.id)
            if outcome.status is api.Status.OK:
                session.pending.discard((pool.engine_id, key))
            results.append(item_result(key, outcome))
        return results

    def _acquire(
        self, session: Session, pool: Pool, keys: Sequence[bytes], count_misses: bool = True
    ) -> list[api.AcquireResult]:
        results = []
        for key in keys:
            outcome = pool.index.pin(key, count_misses)
            entry = outcome.entry
            if outcome.status is api.Status.HIT and entry is not None:
                lease_id = self._sessions.add_lease(session, pool.engine_id, entry).id
                results.append(
                    api.AcquireResult(
                        key, api.Status.HIT, "", lease_id, entry.extents, entry.spec, entry.checksum
                    )
                )
            else:
                results.append(
                    api.AcquireResult(key, outcome.status, outcome.message, 0, (), None, 0)
                )
        return results

    def _release(self, session: Session, lease_ids: Sequence[int]) -> list[api.LeaseResult]:
        results = []
        for lease_id in lease_ids:
            lease = session.leases.pop(lease_id, None)
            if lease is None:
                results.append(
                    api.LeaseResult(
                        lease_id,
                        api.Status.NOT_FOUND,
                        f"unknown lease {lease_id}: already released, never issued, or not "
                        "this session's",
                    )
                )
                continue
            self._pools.get(lease.engine_id).index.unpin(lease.entry)
            results.append(api.LeaseResult(lease_id, api.Status.OK, ""))
        return results

    # ---- pulls from the cluster's store (the orchestration is ec_daemon.cluster.fetch's) --------

    def pull_allocate(
        self, engine_id: str, key: bytes, nbytes: int, source: str
    ) -> PullSlot | None:
        """Reserve `nbytes` for `key`, PENDING, before it is pulled from `source`: local
        askers wait for it and local producers are told PENDING (single flight on the node). Its
        shape and dtype come with the commit. None if the key is here already or no room."""
        pool = self._pools.get(engine_id)
        session_id = f"ecd-pull-{next(self._pulls)}"
        spec = api.TensorSpec((nbytes,), "uint8", nbytes)
        outcome = pool.index.allocate(key, spec, session_id, f"ecd-pull from {source}")
        if outcome.status is not api.Status.ALLOCATED or outcome.entry is None:
            return None
        return PullSlot(engine_id, pool.index.geometry.block_size_bytes, outcome.entry)

    def pull_reading(self, slot: PullSlot) -> None:
        """A transfer-engine read into the pull's blocks starts (counted: one per remote hit).
        Until `pull_read_over`, removing the entry, however it is removed, holds its blocks."""
        pool = self._pools.find(slot.engine_id)
        if pool is not None:
            pool.index.counters.remote_reads += 1
            slot.entry.writing = True

    def pull_read_over(self, slot: PullSlot) -> None:
        """Nothing writes into the pull's blocks any more (the read landed, failed, or ended
        after the pull gave up on it)."""
        pool = self._pools.find(slot.engine_id)
        if pool is not None:
            pool.index.writes_over(slot.entry)

    def pull_commit(
        self, slot: PullSlot, spec: api.TensorSpec, checksum: int, seconds: float
    ) -> bool:
        """The bytes landed: READY with the value's shape, dtype and checksum. False when the
        entry is gone (its pool dropped meanwhile) or the value is another size."""
        pool = self._pools.find(slot.engine_id)
        if pool is None:
            return False
        index = pool.index
        if index.commit(slot.key, slot.session_id, checksum, spec).status is not api.Status.OK:
            return False
        index.counters.remote_hits += 1
        index.counters.remote_bytes += spec.nbytes
        index.remote_seconds.observe(seconds)
        return True

    def pull_abort(self, slot: PullSlot) -> None:
        """The pull fetched nothing: the entry goes (its waiters see a miss); blocks a read may
        still write stay held until `pull_read_over`."""
        pool = self._pools.find(slot.engine_id)
        if pool is None:
            return
        pool.index.abort(slot.key, slot.session_id)
        pool.index.counters.remote_misses += 1

    def lookup(self, engine_id: str, keys: Sequence[bytes]) -> list[api.LookupResult]:
        index = self._pools.get(engine_id).index
        results = []
        for key in keys:
            entry = index.get(key)
            if entry is None:
                results.append(api.LookupResult(key, api.EntryState.ABSENT, 0, 0))
            else:
                results.append(api.LookupResult(key, entry.state, entry.spec.nbytes, entry.pins))
        return results

    def evict(self, engine_id: str, keys: Sequence[bytes]) -> list[api.ItemResult]:
        index = self._pools.get(engine_id).index
        return [item_result(key, index.evict(key)) for key in keys]

    def delete(self, engine_id: str, keys: Sequence[bytes]) -> list[api.ItemResult]:
        index = self._pools.get(engine_id).index
        results = []
        for key in keys:
            outcome = index.delete(key)
            if outcome.entry is not None:
                owner = self._sessions.find(outcome.entry.session_id)
                if owner is not None:
                    owner.pending.discard((engine_id, key))
            results.append(item_result(key, outcome))
        return results

    def list_entries(
        self, engine_id: str, start_after: bytes, limit: int
    ) -> tuple[list[api.EntryInfo], bool]:
        """Entries in key order after `start_after`, at most `limit`; and whether more follow."""
        entries = sorted(
            (e for e in self._pools.get(engine_id).index.entries() if e.key > start_after),
            key=lambda e: e.key,
        )
        now = self._clock()
        return [self._entry_info(e, now) for e in entries[:limit]], len(entries) > limit

    @staticmethod
    def _entry_info(entry: Entry, now: float) -> api.EntryInfo:
        since = entry.committed_at if entry.state is api.EntryState.READY else entry.created_at
        e = entry
        return api.EntryInfo(
            e.key, e.state, e.spec, e.extents, e.pins, e.producer, e.checksum, now - since
        )

    # ---- observation ---------------------------------------------------------------------------

    def ready_snapshot(
        self, engine_id: str = "", include_pending: bool = False
    ) -> list[api.WatchEvent]:
        """Every READY entry of one pool (or all), as the snapshot that begins a Watch, and with
        include_pending every PENDING one as a PENDING event. The caller subscribes to live
        events in the same synchronous step, so none falls between."""
        pools = [self._pools.get(engine_id)] if engine_id else self._pools.all()
        snapshot_of = {api.EntryState.READY: api.EventType.SNAPSHOT}
        if include_pending:
            snapshot_of[api.EntryState.PENDING] = api.EventType.PENDING
        return [
            api.WatchEvent(
                snapshot_of[e.state],
                pool.engine_id,
                e.key,
                e.spec.nbytes,
                self.boot_epoch,
                slot=e.slot,
            )
            for pool in pools
            for e in pool.index.entries()
            if e.state in snapshot_of
        ]

    def stats(self, engine_id: str = "") -> api.Stats:
        pools = [self._pools.get(engine_id)] if engine_id else self._pools.all()
        return api.Stats(
            boot_epoch=self.boot_epoch,
            uptime_s=self._clock() - self._started,
            max_bytes=self.config.pools.max_bytes,
            capacity_bytes=self._pools.capacity_bytes(),
            reserved_bytes=self._pools.reserved_bytes(),
            sessions=len(self._sessions),
            lease_expiries=saturated(self.lease_expiries),
            version=__version__,
            pools=tuple(
                dataclasses.replace(p.stats(), ephemeral=p.engine_id in self._ephemeral)
                for p in pools
            ),
            cluster=self._cluster(),
            refused=() if engine_id else tuple(self._pools.refused()),
        )

    def check(self) -> None:
        """Raise AssertionError unless every pool's block invariant holds and sessions agree."""
        pools = {p.engine_id: p for p in self._pools.all()}
        for pool in pools.values():
            pool.index.check()
        for session in self._sessions.all():
            for engine_id, key in session.pending:
                entry = pools[engine_id].index.get(key)
                assert entry is not None and entry.session_id == session.id
            for lease in session.leases.values():
                assert lease.entry.pins > 0
            assert session.pools <= pools.keys(), "a session holds a pool that is gone"
        leases = sum(len(s.leases) for s in self._sessions.all())
        pins = sum(p.index.pins() for p in pools.values())
        assert pins == leases, f"{pins} pins but {leases} leases: a pin outlived its session"

    def close(self, drop_pools: bool = False) -> None:
        """Release the pool files (the data stays in shm_dir unless drop_pools)."""
        self._pools.close(drop_pools)
