"""What a daemon that joined a Mooncake Store runs (docs/design.md §13): every commit of a shared
pool (one opened with a cluster_namespace) published to the store in the background.

The event loop only hands over: `on_event` sees every event the core emits and queues a
publish for each COMMITTED entry of a shared pool (nobody waits on it). One thread of this
node's own does the rest, in order: it joins the store (again and again, backing off, while the
master cannot be reached: the daemon serves locally meanwhile), then takes the queued commits a
batch at a time and for each

1. pins the entry by a lock pin on its slot, as any reader does (ec_protocol.pool.slot_locks: the
   daemon's own index cannot erase the slot's record, hence cannot reuse the entry's blocks,
   while the pin holds), and checks that the slot still holds the key; an entry evicted or
   removed meanwhile is skipped (`gone`), so the bytes published are always the committed
   entry's own;
2. asks the store once for the whole batch which keys it has (those are not written again);
3. writes the rest with one call, each value its header (a registered buffer of this thread)
   and the entry's bytes straight from the pool's data region, which it mapped and registered
   with the store client at the pool's first publish (no copy of the data in this process);
4. unpins.

Failures (the master gone, the store full) are counted and logged at most every LOG_EVERY_S;
nothing reaches an engine. A publish the master did not answer is kept and tried again once it
answers; so is one refused for space by a master that has just taken over (SETTLE_S), which has
the nodes' segments back only as their store clients remount them. Every store call of the
thread goes through ec_daemon.cluster.calls, which marks the node disconnected when a call
fails, times out, or runs past its bound. From then on the node calls the store no more (each
call would wait seconds for it: ~4 s for a master killed, 30 s for one that does not answer):
publishes and lookups fail at once, counted, what was queued before is failed by `settle` (every
second, from the event loop), and the thread probes the master's port every PROBE_S; it calls
the store again once the port accepts a connection. A call the thread is held in by a cut link
is freed once the link heals, by a watch of the node's own (ec_daemon.cluster.unstall). A
dropped pool's region is unregistered and unmapped in turn. The remote hits' lookups and reads
(ec_daemon.cluster.fetch) run on the same thread, in turn with the publishes (`ask`): one thread
owns the store client, the mappings and the header buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ec_daemon.cluster import codec
from ec_daemon.cluster.calls import MasterState, WatchedStore
from ec_daemon.cluster.leader import NoLeader, View, etcd_endpoints, read_view
from ec_daemon.cluster.mooncake import (
    StoreClient,
    StoreSettings,
    Unreachable,
    answered,
    connect,
    reachable,
)
from ec_daemon.cluster.regions import MappedRegions, Region, byte_runs
from ec_daemon.cluster.unstall import PROBE_S, Watch
from ec_protocol.pool.layout import LayoutError
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import ClusterStats, EventType, Extent, PoolInfo, TensorSpec, WatchEvent

log = logging.getLogger("ecd.cluster")
T = TypeVar("T")

BATCH = 64  # commits published with one lookup and one put
# Entries a republish (publish_again) offers with one lookup and one put: held entries walked
# in slot order, where commits rarely queue up 64 deep. Fewer calls at the master for a node
# republishing all it holds, all nodes at once (docs/design.md §13).
REPUBLISH_BATCH = 512
QUEUE_LIMIT = 4096  # commits waiting to be published; past it they are dropped (counted)
HEARTBEAT_S = 5.0  # an idle node asks the store this often whether it answers
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 10.0  # joining the store again backs off between these
LOG_EVERY_S = 10.0
OBJECT_ALREADY_EXISTS = -705
NO_AVAILABLE_HANDLE = -200  # the store's answer to a put it has no space for
# A master that has just taken over (a new leader, or one back after the node lost it) has the
# nodes' segments back only as each store client remounts its own, a few seconds apart: a put
# it refuses for space meanwhile is kept and tried again every SETTLE_RETRY_S, as one it did not
# answer is, until SETTLE_S after the node saw the change. Past that a refusal is the store's
# eviction to make (not retried).
SETTLE_S, SETTLE_RETRY_S = 10.0, 0.5
# A put refused for space reads etcd's view of the leader (one HTTP call) at most this often: a
# store that is simply full refuses batch after batch.
FOLLOW_EVERY_S = 1.0
HEARTBEAT_KEY = "ecd@heartbeat"  # never written: asking for it tells whether the master answers


class Pools(Protocol):
    """What the node asks the daemon's store about pools (on the event loop's thread)."""

    def cluster_namespace(self, engine_id: str) -> str: ...

    def pool_info(self, engine_id: str) -> PoolInfo: ...


@dataclass(frozen=True)
class SharedPool:
    """A shared pool as its publisher reads it: one file (its UUID) and where its blocks are."""

    namespace: str
    info: PoolInfo


@dataclass(frozen=True)
class Publish:
    """A commit to publish: the entry `key` whose record the commit wrote into `slot`; `again`
    when a republish offers it once more (an entry that cannot be published, or whose publish
    fails, was counted so at its commit: not counted again)."""

    pool: SharedPool
    key: bytes
    slot: int
    again: bool = False


@dataclass(frozen=True)
class Withdraw:
    """A shared pool dropped: stop reading its file."""

    engine_id: str


@dataclass(frozen=True)
class Call:
    """Work the event loop hands the node's thread (a remote hit's lookup or read): run there,
    in turn with the publishes, its answer in `future`."""

    work: Callable[[StoreClient], Any]
    future: Future[Any]


@dataclass(frozen=True)
class Read:
    """One entry to read from the store into a local PENDING entry's extents."""

    store_key: str
    extents: tuple[Extent, ...]
    nbytes: int


@dataclass(frozen=True)
class Offered:
    """What one step of a republish did (ClusterNode.publish_again): READY entries found and
    offered to the store, how many of those it lacked and took, and the slot the walk goes on
    from (None: the pool's table is walked to its end, or the pool is gone)."""

    offered: int
    put: int
    next_slot: int | None


@dataclass
class Mounted:
    """A shared pool's file as the publisher reads it: lock pins and its data region, mapped
    and registered with the store client."""

    info: PoolInfo
    pins: SlotPins
    region: Region


@dataclass
class Item:
    """One entry of a batch being published, lock-pinned until the batch is over."""

    mounted: Mounted
    slot: int
    store_key: str
    header: bytes
    buffers: list[tuple[int, int]]  # (address, length) of its bytes in the region
    again: bool  # offered by a republish (Publish.again)


class ClusterNode:
    def __init__(
        self,
        settings: StoreSettings,
        connect: Callable[[StoreSettings], tuple[StoreClient, Any]] = connect,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._connect = connect
        self._clock = clock
        self._pools: Pools | None = None
        self._shared: dict[str, SharedPool] = {}  # the event loop's: pools seen shared
        self._jobs: queue.Queue[Publish | Withdraw | Call | None] = queue.Queue()
        self._stopping = threading.Event()
        self._republish_wanted = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ecd-cluster", daemon=True)
        # While disconnected, the link's heal frees a call the thread waits on (unstall.py).
        self._watch = Watch(lambda: self.joined and not self.connected, lambda: self.leader)
        # The rest is the node's thread's (the counters are read by stats() too: plain ints).
        self._store: StoreClient | None = None
        self._replicate: Any = None
        self._headers = ctypes.create_string_buffer(REPUBLISH_BATCH * codec.HEADER.size)
        self._mounted: dict[str, Mounted] = {}
        self._regions = MappedRegions()
        # Whether the master answers: every store call of the thread goes through it (calls.py).
        self._master = MasterState(
            lambda what: self._failed("the store's master does not answer", what),
            self._rejoined,
            clock,
        )
        self.published = self.already_stored = self.unpublishable = self.gone = 0
        self.failures = self.dropped = 0
        self.failed_unsent = 0  # the event loop's: publishes failed unsent, the node disconnected
        self.lookup_failures = 0  # lookup_failed's, from the event loop and this thread
        # The master that serves (with several, the leader: leader.py), and how often the lead
        # passed to another since the node joined.
        self._etcd = etcd_endpoints(settings.master)
        self._view: View | None = None
        self.leader = "" if self._etcd else settings.master
        self.leader_changes = 0
        # Publishes that failed because the master did not answer (the thread's) or were not sent
        # while it did not (the event loop's), queued again once it answers: a deque, whose
        # appends and pops are atomic, as the two share it.
        self._unanswered: deque[Publish] = deque()
        self.retried = 0
        self._retry_at = 0.0  # (clock) not retried before: a held refusal's backoff
        self._settling_until = 0.0  # (clock) a master that just took over: see SETTLE_S
        self._followed_at = -FOLLOW_EVERY_S  # (clock) the leader last read from etcd
        self._left_open: StoreClient | None = None
        self._probed_at = -PROBE_S
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    # ---- the event loop's side -----------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the master answered the node's last store call, and none has been running
        past the bound on a call (ec_daemon.cluster.calls)."""
        return self._master.connected

    @property
    def error(self) -> str:
        """Why the node is not connected; empty while it is."""
        return self._master.error

    @property
    def joined(self) -> bool:
        """Whether the node joined the store (its calls may still fail while the master is
        away: `connected` says whether the last one was answered)."""
        return self._store is not None

    def bind(self, pools: Pools) -> None:
        self._pools = pools

    def start(self) -> None:
        self._thread.start()
        self._watch.start()

    def on_event(self, event: WatchEvent) -> None:
        """Every event the core emits (on the event loop): a commit in a shared pool is queued
        for publishing, a dropped shared pool for unmapping. Costs a dict lookup otherwise."""
        if self._pools is None:
            return
        if event.type is EventType.COMMITTED and event.slot is not None:
            pool = self._shared.get(event.engine_id) or self._share(event.engine_id)
            if pool is None:
                return
            if self.joined and not self.connected:  # a queued publish would fail too, later
                self.failed_unsent += 1
                self._keep_for_retry([Publish(pool, event.key, event.slot)])
                return
            if self._jobs.qsize() >= QUEUE_LIMIT:
                self.dropped += 1
                return
            self._jobs.put_nowait(Publish(pool, event.key, event.slot))
        elif event.type is EventType.POOL_DROPPED and event.engine_id in self._shared:
            del self._shared[event.engine_id]
            self._jobs.put_nowait(Withdraw(event.engine_id))

    def _share(self, engine_id: str) -> SharedPool | None:
        assert self._pools is not None
        namespace = self._pools.cluster_namespace(engine_id)
        if not namespace:
            return None
        pool = self._shared[engine_id] = SharedPool(namespace, self._pools.pool_info(engine_id))
        return pool

    def ask(self, work: Callable[[StoreClient], T]) -> Future[T]:
        """Run `work` with the store client on the node's thread (from the event loop). Once it
        runs it cannot be cancelled: the future is done when it is over. While the node is
        joined but disconnected it fails at once (Unreachable), queued behind no hung call."""
        future: Future[T] = Future()
        if self.joined and not self.connected:
            future.set_exception(Unreachable(self.error))
        else:
            self._jobs.put_nowait(Call(work, future))
        return future

    def sizes(self, store_keys: list[str]) -> Callable[[StoreClient], list[int]]:
        """Work for `ask`: the size of each key's value in the store (one batched lookup at the
        master); 0 for a key it lacks."""

        def work(store: StoreClient) -> list[int]:
            found = store.batch_get_replica_desc(store_keys)
            # Empty is also its answer when the master is gone: asked again in a way that tells
            # (a round trip more for an Acquire the store has none of).
            if not found and not answered(store.batch_is_exist(store_keys)):
                self.lookup_failed()
            return [_memory_size(found.get(key, [])) for key in store_keys]

        return work

    def read(
        self, info: PoolInfo, reads: list[Read]
    ) -> Callable[[StoreClient], list[TensorSpec | None]]:
        """Work for `ask`: read each value, its header into a buffer of the thread's and its
        bytes straight into the extents (of the pool `info`), with one call; per read the spec
        its header gives, or None (not read whole, a header not the format's, or one that gives
        another size)."""

        def work(store: StoreClient) -> list[TensorSpec | None]:
            mounted = self._mount(info)
            if mounted is None:
                return [None] * len(reads)
            specs: list[TensorSpec | None] = []
            for first in range(0, len(reads), BATCH):  # as many as the header buffer holds
                specs += self._read_batch(store, mounted, reads[first : first + BATCH])
            return specs

        return work

    def _read_batch(
        self, store: StoreClient, mounted: Mounted, reads: list[Read]
    ) -> list[TensorSpec | None]:
        base, size = ctypes.addressof(self._headers), codec.HEADER.size
        block_size = mounted.info.block_size_bytes
        runs = [list(byte_runs(r.extents, block_size, r.nbytes)) for r in reads]
        results = store.batch_get_into_multi_buffers(
            [r.store_key for r in reads],
            [
                [base + i * size] + [mounted.region.address + o for o, _ in rs]
                for i, rs in enumerate(runs)
            ],
            [[size] + [n for _, n in rs] for rs in runs],
        )
        return [
            _fitting(ctypes.string_at(base + i * size, size), r.nbytes)
            if result == size + r.nbytes
            else None
            for i, (r, result) in enumerate(zip(reads, results, strict=True))
        ]

    def publish_again(self, pool: SharedPool, first_slot: int) -> Callable[[StoreClient], Offered]:
        """Work for `ask`: offer the store again the READY entries of the pool's slot table from
        `first_slot` on, up to REPUBLISH_BATCH of them: one lookup for the batch, then those
        the store lacks as their commits were (each lock-pinned and checked, one put: an entry
        evicted or removed meanwhile is skipped). A republish (ec_daemon.cluster.republish)
        walks a pool's table with it, a batch a call, in turn with the node's other work."""

        def work(store: StoreClient) -> Offered:
            mounted = self._mount(pool.info)
            if mounted is None:  # dropped, or made anew: nothing of this file to offer
                return Offered(0, 0, None)
            found, next_slot = mounted.pins.ready(first_slot, REPUBLISH_BATCH)
            if not found:  # the table read to its end: nothing to ask the store
                return Offered(0, 0, next_slot)
            # Looked up before any pin: a periodic walk finds the store holding nearly all it
            # offers, and pinning each would cost the thread ~20 us an entry (2 s a walk of
            # 100,000) and keep the daemon from evicting a whole batch during the call. A key
            # the lookup named is checked by its pin (a record read unpinned may be gone).
            present = store.batch_is_exist([codec.store_key(pool.namespace, k) for _, k in found])
            if not answered(present):  # the walk is cut short: walked again once back
                return Offered(len(found), 0, next_slot)
            lacking = [entry for entry, state in zip(found, present, strict=True) if state != 1]
            self.already_stored += len(found) - len(lacking)
            published = self.published
            # Pinned first all together, one lock and one read a run of neighbouring slots:
            # the publishes' own pins of them are then counts, with no call to the kernel.
            pinned = zip(lacking, mounted.pins.pin_many(lacking), strict=True)
            held = [slot for (slot, _), entry in pinned if entry is not None]
            try:
                if lacking:
                    batch: list[Publish | Withdraw | Call] = [
                        Publish(pool, key, slot, again=True) for slot, key in lacking
                    ]
                    self._handle(batch, looked_up=True)
            finally:
                mounted.pins.unpin_many(held)
            return Offered(len(found), self.published - published, next_slot)

        return work

    def republish_missing(self) -> None:
        """Have every shared pool's READY entries that the store lacks published again (from
        any thread; the republisher, ec_daemon.cluster.republish, walks them at its next
        tick): for a node that finds the store may have lost what it published, such as one
        that rejoins after its master dropped its segment."""
        self._republish_wanted.set()

    def republish_wanted(self) -> bool:
        """Whether republish_missing was called since this last answered (the republisher's)."""
        wanted = self._republish_wanted.is_set()
        self._republish_wanted.clear()
        return wanted

    def stats(self) -> ClusterStats:
        return ClusterStats(
            master=self.settings.master,
            leader=self.leader,
            leader_changes=self.leader_changes,
            publishes_retried=self.retried,
            connected=self.connected,
            error=self.error,
            published=self.published,
            already_stored=self.already_stored,
            unpublishable=self.unpublishable,
            gone=self.gone,
            publish_failures=self.failures + self.failed_unsent,
            dropped=self.dropped,
            lookup_failures=self.lookup_failures,
        )

    def settle(self) -> None:
        """While the node is joined but disconnected, fail what waits in its queue (from the
        event loop, every second): the publishes and calls queued before the loss was noticed,
        behind a store call that may hang for the store client's 30 s, are counted now. A
        dropped pool's unmapping and the stop stay queued, in order, for the thread."""
        if not self.joined or self.connected:
            return
        kept: list[Publish | Withdraw | Call | None] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Publish):
                self.failed_unsent += 1
                self._keep_for_retry([job])
            elif isinstance(job, Call):
                if job.future.set_running_or_notify_cancel():
                    self._refuse(job)
            else:
                kept.append(job)
        for job in kept:
            self._jobs.put_nowait(job)

    def stop(self, timeout_s: float) -> None:
        """Stop publishing and leave the store (blocking: call it off the event loop). A thread
        still inside a store call after timeout_s is left to the process's exit."""
        self._stopping.set()
        self._watch.stop()
        self._jobs.put_nowait(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the store client is still busy at exit", extra={"timeout_s": timeout_s})

    # ---- the node's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        retry_s = FIRST_RETRY_S
        while not self._stopping.is_set():
            if self._store is None:
                if not self._join():
                    self._stopping.wait(retry_s)
                    retry_s = min(retry_s * 2, MAX_RETRY_S)
                continue
            if self.connected and self._unanswered and self._clock() >= self._retry_at:
                self._retry()
            try:
                job = self._jobs.get(timeout=self._idle_s())
            except queue.Empty:
                if self.connected and self._unanswered:
                    continue  # a held retry is due: no heartbeat needed
                if self._up():
                    self._store.batch_is_exist([HEARTBEAT_KEY])
                    with contextlib.suppress(Unreachable):
                        self._follow()  # a lead that passed with no call failing
                continue
            if job is None:
                break
            if isinstance(job, Call):
                self._call(job)
            else:
                self._handle(self._batch(job))
        self._leave()

    def _idle_s(self) -> float:
        """How long the thread waits for a job: until the next probe, held retry or heartbeat."""
        if not self.connected:
            return PROBE_S
        if self._unanswered:
            return min(max(self._retry_at - self._clock(), 0.0), HEARTBEAT_S)
        return HEARTBEAT_S

    def _join(self) -> bool:
        try:
            self._follow()
            store, self._replicate = self._connect(self.settings)
        except Unreachable as exc:
            self._master.lost(str(exc))
            self._failed("cannot join the store; serving locally, trying again", str(exc))
            return False
        self._store = WatchedStore(store, self._master)
        if self._store.register_buffer(ctypes.addressof(self._headers), len(self._headers)) != 0:
            self._failed("the store client refused the header buffer", "register_buffer")
            self._store.close()
            self._store = None
            return False
        self._master.answered()
        log.info("joined the store", extra={"master": self.settings.master})
        return True

    def _call(self, call: Call) -> None:
        assert self._store is not None
        if not call.future.set_running_or_notify_cancel():
            return  # cancelled before it ran
        if not self._up():
            self._refuse(call)
            return
        try:
            call.future.set_result(call.work(self._store))
        except Exception as exc:  # the asker's to handle; the thread goes on
            call.future.set_exception(exc)

    def _batch(self, first: Publish | Withdraw) -> list[Publish | Withdraw | Call]:
        """`first` and the publishes queued behind it, up to BATCH; a Withdraw or a Call ends it
        (the batch's pins are given back before a pool's file is let go, or a read uses the
        header buffer)."""
        batch: list[Publish | Withdraw | Call] = [first]
        while isinstance(batch[-1], Publish) and len(batch) < BATCH:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._jobs.put_nowait(None)  # seen again by _run, once this batch is done
                break
            batch.append(job)
        return batch

    def _handle(self, batch: list[Publish | Withdraw | Call], looked_up: bool = False) -> None:
        """Publish the batch's publishes (`looked_up`: the store was just found lacking each),
        then unmount or run what ends it."""
        items: list[Item] = []
        publishes = [job for job in batch if isinstance(job, Publish)]
        try:
            if publishes and not self._up():
                self.failures += sum(not job.again for job in publishes)
                self._failed("publishes failed: the store's master does not answer", self.error)
                self._keep_for_retry(publishes)
                publishes = []
            pinned: dict[int, Publish] = {}
            for job in publishes:
                item = self._pin(job)
                if item is not None:
                    pinned[id(item)] = job
                    items.append(item)
            unanswered = self._publish(items, looked_up)
            self._keep_for_retry([pinned[id(item)] for item in unanswered])
        finally:
            for item in items:
                item.mounted.pins.unpin(item.slot)
        if isinstance(batch[-1], Withdraw):
            self._unmount(batch[-1].engine_id)
        elif isinstance(batch[-1], Call):
            self._call(batch[-1])

    def _pin(self, job: Publish) -> Item | None:
        """The entry lock-pinned, with what to publish; None (counted) if it cannot be."""
        mounted = self._mount(job.pool.info)
        entry = mounted.pins.pin(job.slot, job.key) if mounted is not None else None
        if mounted is None or entry is None:
            self.gone += 1
            return None
        try:
            header = codec.header(entry.spec)
        except codec.Unpublishable:
            mounted.pins.unpin(job.slot)
            self.unpublishable += not job.again
            return None
        block_size = mounted.info.block_size_bytes
        buffers = [
            (mounted.region.address + offset, length)
            for offset, length in byte_runs(entry.extents, block_size, entry.spec.nbytes)
        ]
        return Item(
            mounted,
            job.slot,
            codec.store_key(job.pool.namespace, job.key),
            header,
            buffers,
            job.again,
        )

    def _publish(self, items: list[Item], looked_up: bool = False) -> list[Item]:
        """Publish the items, those the store has not written again (`looked_up`: it lacked
        each a moment ago, not asked again; one it took meanwhile is refused as existing);
        returns those to try again: the master did not answer, or had just taken over and
        refused them for space (SETTLE_S)."""
        if not items or self._store is None:
            return []
        if looked_up:
            present = [0] * len(items)
        else:
            present = self._store.batch_is_exist([item.store_key for item in items])
        if not answered(present):
            self.failures += sum(not item.again for item in items)
            return items
        todo: dict[str, Item] = {}  # one per key: a batch may name a key twice
        for item, state in zip(items, present, strict=True):
            if state == 1 or item.store_key in todo:
                self.already_stored += 1
            else:
                todo[item.store_key] = item
        if not todo:
            return []
        base = ctypes.addressof(self._headers)
        size = codec.HEADER.size
        for i, item in enumerate(todo.values()):
            ctypes.memmove(base + i * size, item.header, size)
        results = self._store.batch_put_from_multi_buffers(
            list(todo),
            [[base + i * size] + [a for a, _ in it.buffers] for i, it in enumerate(todo.values())],
            [[size] + [n for _, n in it.buffers] for it in todo.values()],
            self._replicate,
        )
        settling = self.refused_while_settling(results)
        unanswered = []
        for item, result in zip(todo.values(), results, strict=True):
            if result == 0:
                self.published += 1
            elif result == OBJECT_ALREADY_EXISTS:
                self.already_stored += 1
            else:
                self.failures += not item.again
                self._failed("a publish failed", f"the store answered {result}")
                if not answered([result]) or (settling and result == NO_AVAILABLE_HANDLE):
                    unanswered.append(item)
        if settling:
            self._retry_at = self._clock() + SETTLE_RETRY_S
        return unanswered

    def refused_while_settling(self, results: Sequence[int]) -> bool:
        """(The node's thread) Whether the store refused a put of `results` for space while its
        master had just taken over (SETTLE_S): such a put is tried again in SETTLE_RETRY_S."""
        return NO_AVAILABLE_HANDLE in results and self._settling()

    def _settling(self) -> bool:
        """Whether the master took over a moment ago (SETTLE_S): a refusal for space may be
        the nodes' segments not yet back with it. The leader is read again first (a store
        client may follow a new one with no call of the node's failing), at most every
        FOLLOW_EVERY_S."""
        if self._etcd and self._clock() - self._followed_at >= FOLLOW_EVERY_S:
            with contextlib.suppress(Unreachable):
                self._follow()
        return self._clock() < self._settling_until

    def _keep_for_retry(self, publishes: list[Publish]) -> None:
        """Publishes the master did not answer, or that were not sent while it did not, to queue
        again once it answers (a leader's death, a master away): past QUEUE_LIMIT of them,
        dropped (counted)."""
        room = max(QUEUE_LIMIT - len(self._unanswered), 0)
        self._unanswered.extend(publishes[:room])
        self.dropped += len(publishes) - len(publishes[:room])

    def _retry(self) -> None:
        """Queue the publishes the master did not answer again, behind what is queued: each is
        pinned and checked again in its turn (one evicted meanwhile is `gone`)."""
        while self._unanswered:
            self._jobs.put_nowait(self._unanswered.popleft())
            self.retried += 1

    def _rejoined(self) -> None:
        """A call found the master answering after the node had lost it (on the node's thread,
        before the next job): where the node learns that it is back in the store."""
        self._settling_until = self._clock() + SETTLE_S
        log.info("the store's master answers again", extra={"master": self.settings.master})

    def lookup_failed(self) -> None:
        """Count a lookup or read not made or failed (the master did not answer): the node's
        thread counts its own, the event loop (ClusterFetch) those it does not ask for."""
        self.lookup_failures += 1

    def _refuse(self, call: Call) -> None:
        """Fail a call not made: the master does not answer."""
        self.lookup_failed()
        call.future.set_exception(Unreachable(self.error))

    def _up(self) -> bool:
        """Whether to call the store now: connected, or, while disconnected, once a probe (at
        most every PROBE_S) finds the master's port accepting connections again."""
        if self.connected:
            return True
        now = self._clock()
        if now - self._probed_at < PROBE_S:
            return False
        self._probed_at = now
        try:
            reachable(self._follow())
            # The leader's port open, the store client may not follow it yet (it switches on
            # its own pings and etcd's watch): a call now would wait seconds for the old one.
            if self._etcd and self._store is not None and self._store.health_check() != 0:
                return False
        except Unreachable:
            return False
        return True

    def _follow(self) -> str:
        """HOST:PORT of the master that serves: with several, the leader etcd names now (a
        change counted and logged); Unreachable if none leads."""
        if not self._etcd:
            return self.settings.master
        self._followed_at = self._clock()
        try:
            view = read_view(self._etcd)
        except NoLeader as exc:
            raise Unreachable(str(exc)) from None
        if self._view is not None and view.version != self._view.version:
            self.leader_changes += 1
            self._settling_until = self._clock() + SETTLE_S
            log.warning(
                "the store's leader changed",
                extra={"leader": view.leader, "was": self._view.leader},
            )
        self._view, self.leader = view, view.leader
        return view.leader

    def _mount(self, info: PoolInfo) -> Mounted | None:
        """The pool's file as published from: its lock pins and its data region, mapped and
        registered once; None if that file is no longer the pool's (dropped, made anew)."""
        mounted = self._mounted.get(info.engine_id)
        if mounted is not None and mounted.info.pool_uuid == info.pool_uuid:
            return mounted
        if mounted is not None:
            self._unmount(info.engine_id)
        assert self._store is not None
        try:
            pins = SlotPins(info.path, info.pool_uuid)
        except (OSError, LayoutError):
            return None
        try:
            length = info.block_size_bytes * info.num_blocks
            region = self._regions.map(info.engine_id, Path(info.path), info.data_offset, length)
        except (OSError, ValueError):
            pins.close()
            return None
        # Mapped after the pins opened the file: both are of one file if it is still at the
        # path now (a file, once replaced, never comes back: docs/design.md §3).
        if not pins.still_at_path() or self._store.register_buffer(region.address, length) != 0:
            self._regions.retire(info.engine_id)
            pins.close()
            return None
        mounted = self._mounted[info.engine_id] = Mounted(info, pins, region)
        return mounted

    def _unmount(self, engine_id: str) -> None:
        mounted = self._mounted.pop(engine_id, None)
        if mounted is None:
            return
        if self._store is not None:
            self._store.unregister_buffer(mounted.region.address)
        self._regions.retire(engine_id)
        mounted.pins.close()

    def _leave(self) -> None:
        while True:  # asks still queued get an answer: the node is gone
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Call):
                job.future.set_exception(Unreachable("the daemon is stopping"))
        for engine_id in list(self._mounted):
            self._unmount(engine_id)
        if self._store is not None:
            self._store.unregister_buffer(ctypes.addressof(self._headers))
            if self._etcd:
                # Left open until the process ends (mooncake.end_process_left_open): referenced
                # here, so that no teardown runs while the daemon stops; its regions stay mapped.
                self._left_open = self._store
            else:
                self._store.close()
                self._regions.unmap_all()
            self._store = None
        self._master.lost("stopped")

    def _failed(self, what: str, why: str) -> None:
        """Log a failure at most every LOG_EVERY_S, saying how many went unlogged since."""
        now = self._clock()
        if now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        extra = {"why": why, "master": self.settings.master, "unlogged": self._unlogged}
        log.warning(what, extra=extra)
        self._logged_at, self._unlogged = now, 0


def _memory_size(replicas: list[Any]) -> int:
    """A value's size from its replica descriptors (batch_get_replica_desc); 0 without one in
    memory."""
    for replica in replicas:
        if replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return 0


def _fitting(raw: bytes, nbytes: int) -> TensorSpec | None:
    """The spec a value's header gives, if it is the format's and holds `nbytes`; else None.

    Whatever the pool's block size: the bytes fill the entry's blocks in order, its last block
    in part, as a local put's do. A row need not be a block: the pool does not know the model's
    width (the namespace names the model; the vLLM connector checks the width it loads)."""
    try:
        spec = codec.parse_header(raw)
    except ValueError:
        return None
    return spec if spec.nbytes == nbytes else None
