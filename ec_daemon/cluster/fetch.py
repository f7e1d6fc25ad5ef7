"""Remote hits from the store (docs/design.md §13): an Acquire of keys a shared pool lacks asks
the store once for the batch, and reads what it has straight into local PENDING entries.

For the keys of one Acquire that are ABSENT here, in a shared pool, while the node is connected
(else the Acquire is a miss at once, counted as a lookup failure):

1. one batched lookup at the master (`batch_get_replica_desc`): each value's size;
2. each key the store has is allocated here, PENDING, under a session of its own (the pulls'
   `Store.pull_allocate`: local askers wait on it, a local producer is told PENDING: single
   flight per node), and marked as being written (its blocks held, however it is removed,
   until the read is over);
3. one read for the batch (`batch_get_into_multi_buffers`): each value's header into a buffer
   of the node's thread, its bytes straight into the entry's extents in the pool's mapped,
   registered data region;
4. a value whose header is the format's and holds the entry's size is committed with the
   header's shape and dtype, whatever the pool's block size (its bytes fill the entry's blocks
   in order, the last in part); anything else (not read whole, a value not in the format, a
   read not over within the longer of the first asker's wait_ms and the fetch timeout) aborts
   the entry: a miss, nothing partial.

A fetch is bounded by the longer of its first asker's wait_ms and the fetch timeout: a lookup
still queued for the node's thread then never runs, a read still running is given up on (its
entries go, their blocks held until it is over). An asker waits for the keys being fetched up
to the longer of its wait_ms and the fetch timeout, and waits.LATE_S more: the fetches in
flight and the waits for them are the core's waits' (ec_daemon.core.waits), as is the deadline
rule. Counted per pool (remote_hits, remote_misses, remote_bytes, remote_reads,
remote_seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from ec_daemon.cluster import codec, pending
from ec_daemon.cluster.node import ClusterNode, Read
from ec_daemon.core.errors import CoreError
from ec_daemon.core.store import PullSlot, Store
from ec_daemon.core.waits import For, WaitFor, Waits, Work
from ec_protocol.types import EntryState, Status, StepResult

log = logging.getLogger("ecd.cluster")
T = TypeVar("T")


class ClusterFetch:
    """The fetches from the store, one per (pool, key) in flight (`Waits.start`)."""

    def __init__(
        self, store: Store, node: ClusterNode, timeout_s: float, waits: Waits, wait_for: WaitFor
    ) -> None:
        """waits: the daemon's, which the fetches are registered with; wait_for: what waits
        for them (EventHub.wait_for)."""
        self._store = store
        self._node = node
        self.timeout_s = timeout_s
        self._waits = waits
        self._wait_for = wait_for
        self._tasks: set[asyncio.Task[None]] = set()
        self.waits = pending.RemoteWaits(store, node, self.fill)

    async def fetch(
        self, session_id: str, engine_id: str, keys: Sequence[bytes], wait_ms: int
    ) -> list[bytes]:
        """Fetch the keys of a shared pool that are not here and that the store has, join the
        fetches in flight, and wait for them up to the longer of wait_ms and the timeout.
        Returns the keys whose fetches were waited for."""
        namespace = self._store.cluster_namespace(engine_id)
        if not namespace:
            return []
        self._store.may_consume(session_id)
        waits = self._waits
        absent: list[bytes] = []
        joined: list[bytes] = []
        for found in self._store.lookup(engine_id, keys):
            if waits.fetching(engine_id, found.key):
                joined.append(found.key)
            elif found.state is EntryState.ABSENT and found.key not in absent:
                absent.append(found.key)
        if absent and not self._node.connected:  # no call to the store: it would wait seconds
            self._node.lookup_failed()
            absent = []
        if absent:
            work = waits.start(engine_id, absent)
            deadline = waits.deadline(wait_ms / 1000, self.timeout_s)
            task = asyncio.create_task(self._fetch(namespace, work, deadline))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if joined or absent:
            await self._wait_for(
                For.FETCH, engine_id, joined + absent, waits.joining(wait_ms / 1000, self.timeout_s)
            )
        return joined + absent

    async def step(
        self,
        session_id: str,
        engine_id: str,
        acquires: Sequence[bytes],
        local: Callable[[bool], StepResult],
    ) -> StepResult:
        """A Step's answer: `local` (the core's step, given whether to count the acquires'
        misses: not here, where the store may still answer them), then the acquires it missed
        that the store has fetched and acquired again, and only then the misses counted. A pool
        recreated during the fetches leaves the answer's pool_uuid empty: the answers may name
        either file."""
        store = self._store
        result = await acquire_fetched(
            store, self.fetch, session_id, engine_id, acquires, local(False)
        )
        store.count_misses(engine_id, sum(r.status is Status.MISS for r in result.acquires))
        if (
            not store.has_pool(engine_id)
            or store.pool_info(engine_id).pool_uuid != result.pool_uuid
        ):
            result = dataclasses.replace(result, pool_uuid="")
        return result

    async def _fetch(self, namespace: str, work: Work, deadline: float) -> None:
        """Fetch the work's keys until `deadline` (time.monotonic()), then tell the waits it is
        over, whatever it found."""
        started = time.monotonic()
        engine_id, keys = work.engine_id, work.keys
        try:
            store_keys = [codec.store_key(namespace, key) for key in keys]
            markers = [pending.marker_key(namespace, key) for key in keys]
            # One lookup for the values and for the markers of keys being written elsewhere.
            found = await _until(self._node.ask(self._node.sizes(store_keys + markers)), deadline)
            if not self._store.has_pool(engine_id):
                return
            slots: list[tuple[PullSlot, str]] = []
            written: list[bytes] = []
            sizes, marks = found[: len(keys)], found[len(keys) :]
            for key, store_key, size, marked in zip(keys, store_keys, sizes, marks, strict=True):
                nbytes = size - codec.HEADER.size
                slot = (
                    self._store.pull_allocate(engine_id, key, nbytes, "the cluster's store")
                    if nbytes > 0
                    else None
                )
                if slot is not None:
                    slots.append((slot, store_key))
                elif size == 0 and marked:
                    written.append(key)
            if written:  # placeholders, waited for by whoever asks (not by this fetch)
                await self.waits.wait_for(engine_id, namespace, written)
            if slots:
                await self.fill(engine_id, slots, started, deadline)
        except Exception as exc:  # a store call that failed: the keys are misses
            why = str(exc) or type(exc).__name__  # a timeout's text is empty
            log.info("a fetch from the store failed", extra={"engine_id": engine_id, "why": why})
        finally:
            self._waits.finish(work)

    async def fill(
        self,
        engine_id: str,
        slots: list[tuple[PullSlot, str]],
        started: float,
        deadline: float | None = None,
    ) -> int:
        """Read the values (by their store keys) into the local PENDING entries' extents, with
        one read, and commit each that fits; abort the others (a miss, nothing partial). The
        read is given up on at `deadline` (time.monotonic(); by default the fetch timeout after
        `started`). Returns how many were committed."""
        if deadline is None:
            deadline = self._waits.deadline(0, self.timeout_s, since=started)
        unread = [slot for slot, _ in slots]
        committed = 0
        try:
            for slot in unread:
                self._store.pull_reading(slot)
            info = self._store.pool_info(engine_id)  # the file the entries are in
            reads = [Read(store_key, slot.extents, slot.nbytes) for slot, store_key in slots]
            reading = self._node.ask(self._node.read(info, reads))
            try:
                # bounded: a writer that stops answering would hold the entries PENDING, and
                # every asker and producer of their keys on this node with them
                specs = await _until(reading, deadline)
            except BaseException:
                # The read may still be writing into the entries' blocks (one not started yet
                # never will: cancelled): they go now (askers see a miss), their blocks held
                # until it is over.
                loop = asyncio.get_running_loop()
                held, unread = unread, []
                for slot in held:
                    self._store.pull_abort(slot)
                reading.add_done_callback(
                    lambda _: loop.call_soon_threadsafe(self._read_over, held)
                )
                raise
            seconds = time.monotonic() - started
            for slot, spec in zip(unread, specs, strict=True):
                self._store.pull_read_over(slot)
                if spec is not None and self._store.pull_commit(slot, spec, 0, seconds):
                    committed += 1
                else:
                    self._store.pull_abort(slot)
            unread = []
        except Exception as exc:  # a store call that failed: the entries go, as misses
            why = str(exc) or type(exc).__name__  # a timeout's text is empty
            log.info("a read from the store failed", extra={"engine_id": engine_id, "why": why})
        finally:
            for slot in unread:  # not read: nothing writes into them
                self._store.pull_abort(slot)
            self._read_over(unread)
        return committed

    def _read_over(self, slots: list[PullSlot]) -> None:
        for slot in slots:
            self._store.pull_read_over(slot)

    async def close(self) -> None:
        """Cancel the fetches in flight (each aborts its entries)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.waits.close()


async def acquire_fetched(
    store: Store,
    fetch: Callable[[str, str, list[bytes], int], Awaitable[list[bytes]]],
    session_id: str,
    engine_id: str,
    acquires: Sequence[bytes],
    result: StepResult,
) -> StepResult:
    """A Step's answer once the acquires it missed were read from the store: `fetch` answers the
    keys it waited for, which are acquired again (after the Step's other parts, which the
    fetches could not disturb)."""
    missed = {
        key
        for key, r in zip(acquires, result.acquires, strict=True)
        if r.status in (Status.MISS, Status.PENDING)
    }
    if not missed:
        return result
    fetched = set(await fetch(session_id, engine_id, list(missed), 0))
    again = [i for i, key in enumerate(acquires) if key in fetched]
    if not again:
        return result
    try:
        fresh = store.acquire(
            session_id, engine_id, [acquires[i] for i in again], count_misses=False
        )
    except CoreError:  # the session or the pool went while the fetches ran
        return result
    answers = list(result.acquires)
    for i, answer in zip(again, fresh, strict=True):
        answers[i] = answer
    return dataclasses.replace(result, acquires=answers)


def _until(future: Future[T], deadline: float) -> Awaitable[T]:
    """`future` waited for until `deadline` (time.monotonic()), then given up on (TimeoutError):
    work still queued for the node's thread then never runs, so that a thread held up (a read
    from a node that stopped answering, up to the store client's 60 s) does not find a
    backlog of lookups whose askers are long gone."""
    return asyncio.wait_for(asyncio.wrap_future(future), max(deadline - time.monotonic(), 0))
