"""Remote hits: entries only peer daemons hold, pulled into this daemon's pools (docs/design.md
§13).

An Acquire here (or a Step's acquire) of a key that is not here, but that a peer holds in a pool
this daemon can read (same engine_id, block size and compat key), pulls it:

1. allocate it here, PENDING, under a session of the pull's own (`Store.pull_allocate`): local
   askers wait on it, a local producer's Allocate answers PENDING (single flight across nodes);
2. Acquire it on the peer, in the session the follower holds there (the peer's pin); a MISS
   there moves on to the next peer holding it;
3. one transport read from the peer's pool into the local extents (one copy per run contiguous
   on both sides: a single copy for an entry held in one extent on each side);
4. release the peer's pin, without waiting for the answer;
5. commit here with the peer's shape, dtype and checksum: the COMMITTED event wakes the waiters.

Whatever fails (the peer lost the key, died or went silent; the read failed; the pull timeout ran
out) aborts the local entry: its waiters see it go (a miss, or they wait on within their wait_ms)
and nothing partial is ever READY. A read given up on while the engine may still write into the
entry's blocks keeps them *held* (as any removal of an entry being written does:
`Store.pull_reading`) until the transport says the read is over. A read that fails from a peer
that restarted behind the same transfer endpoint is tried once more: the engine's cached
descriptor of that endpoint is stale for the first read (Mooncake 0.3.13;
`MC_DISABLE_METACACHE=1` for peers that restart at fixed ports).

Waiting. An acquire of a key being pulled waits for the pull, up to the longer of its wait_ms and
the pull timeout, so a caller with wait_ms 0 (Consumer.get, a Step) gets a remote hit in one
round trip. The vLLM connector never asks for one on its scheduler thread: keys only peers hold
are pinned by its background Steps (ec_client/vllm/scheduler.py).

Republishing. This daemon's watchers that ask (Watch with include_remote) are also told which
keys the peers hold: per local pool, a key is *available* while at least one peer holds it in a
pool this daemon can read; an event with `remote` set says COMMITTED when it becomes available,
EVICTED when it stops being so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ec_client.errors import EcdError
from ec_client.layout import Geometry
from ec_client.types import (
    AcquireResult,
    EntryState,
    EventType,
    Key,
    LeaseResult,
    PeerStats,
    PoolInfo,
    Status,
    StepResult,
    TensorSpec,
    WatchEvent,
)
from ec_daemon.errors import Code, CoreError, Reason
from ec_daemon.peers import Holding, PeerDirectory
from ec_daemon.pools import TransferPoint
from ec_daemon.store import PullSlot, Store
from ec_daemon.transport import Transport, TransportError, plan_copies

log = logging.getLogger("ecd.remote")

# How long past the pull timeout an asker still waits for the pulls it joined (Remote.fetch).
_LATE_LOOP_S = 0.5


class PeerCalls(Protocol):
    """What a pull asks of a peer: the session this daemon's follower holds there."""

    @property
    def boot_epoch(self) -> str: ...

    async def acquire(
        self, engine_id: str, keys: Sequence[Key], wait_ms: int = 0
    ) -> list[AcquireResult]: ...

    async def release(self, lease_ids: Sequence[int]) -> list[LeaseResult]: ...


def readable(peer: PoolInfo, local: PoolInfo) -> bool:
    """Whether entries of the peer's pool can be read into the local one: both served by a
    transport, same block size (copies are planned in blocks) and same compat key (the same
    model wrote them)."""
    return (
        bool(peer.transfer_endpoint and local.transfer_endpoint)
        and peer.block_size_bytes == local.block_size_bytes
        and peer.compat_key == local.compat_key
    )


class ServedPools:
    """The pool registry's listener with peers on: each pool served is registered with the
    transport (its data region mapped once), each pool withdrawn is unregistered."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def serving(self, engine_id: str, path: Path, geometry: Geometry) -> TransferPoint | None:
        try:
            base = self._transport.register(
                engine_id, path, geometry.data_offset, geometry.capacity_bytes
            )
        except (TransportError, OSError, ValueError) as exc:
            log.error(
                "pool not served to peers: the transport refused it",
                extra={"engine_id": engine_id, "why": str(exc)},
            )
            return None
        return TransferPoint(self._transport.endpoint, base)

    def withdrawn(self, engine_id: str) -> None:
        self._transport.unregister(engine_id)


@dataclass(frozen=True)
class PulledEntry:
    """What the peer said the pulled entry holds, once its bytes landed here."""

    spec: TensorSpec
    checksum: int


@dataclass(eq=False)
class Pull:
    """One key being pulled: the local entry it fills, the peers it may come from, in order,
    and what its askers wait on; `reading` tells, when it ends, whether its blocks must be held."""

    slot: PullSlot
    holdings: list[Holding]
    done: asyncio.Future[None]  # set once the local entry is committed or aborted
    started: float
    reading: asyncio.Future[None] | None = None  # a read into the slot's blocks, not yet over


class Remote:
    """The pulls in flight, one per (pool, key), and the keys published as held by peers."""

    def __init__(
        self,
        store: Store,
        publish: Callable[[WatchEvent], None],
        directory: PeerDirectory,
        transport: Transport,
        peers: Callable[[str], PeerCalls | None],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """publish: where remote events go (the EventHub); peers: the session on a peer, while
        it is followed; timeout_s: how long one pull may take, first peer to last."""
        self._store = store
        self._publish = publish
        self._directory = directory
        self._transport = transport
        self._peers = peers
        self.timeout_s = timeout_s
        self._clock = clock
        self._pulls: dict[tuple[str, bytes], Pull] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_epochs: dict[str, str] = {}  # transfer endpoint -> peer epoch that last read
        # engine_id -> (pool_uuid of the local pool, keys published as available): made anew
        # from the directory when the local pool is new.
        self._published: dict[str, tuple[str, set[bytes]]] = {}
        directory.listen(self._changed)

    def not_here(self, engine_id: str) -> CoreError | None:
        """For an attach by name to a pool this node lacks: NOT_FOUND saying that a peer has
        it, with the geometry to create it here with; None when no followed peer has it."""
        info = next((info for info, _ in self._directory.pools(engine_id)), None)
        if info is None:
            return None
        capacity = info.block_size_bytes * info.num_blocks
        return CoreError(
            Code.NOT_FOUND,
            f"pool {engine_id!r} is not on this node, but a peer has it: open it here with its "
            f"geometry (block_size_bytes {info.block_size_bytes}, capacity_bytes {capacity}, "
            f"compat_key {info.compat_key!r}) and reads of its entries pull them from the peer",
            Reason.UNKNOWN_POOL,
        )

    # ---- what acquires ask -----------------------------------------------------------------

    async def fetch(
        self, session_id: str, engine_id: str, keys: Sequence[bytes], wait_ms: int
    ) -> list[bytes]:
        """Pull the keys that are not here but that peers hold, join the pulls in flight of
        the others, and wait until those pulls are over, up to the longer of wait_ms and the
        pull timeout. Returns the keys whose pulls were waited for."""
        self._store.may_consume(session_id)
        waits = self.start(engine_id, keys)
        if waits:
            # Each pull ends by its own deadline, timeout_s after it began; the margin keeps a
            # loaded loop that wakes this caller before the pull's own timer from answering a
            # pull that is about to end as still PENDING.
            timeout = max(wait_ms / 1000, self.timeout_s + _LATE_LOOP_S)
            await asyncio.wait(set(waits.values()), timeout=timeout)
        return list(waits)

    async def step(
        self, session_id: str, engine_id: str, acquires: Sequence[bytes], result: StepResult
    ) -> StepResult:
        """A Step's answer once the acquires it missed that peers hold were pulled: those are
        acquired again (after the Step's other parts, which the pulls could not disturb). The
        Step's acquires were pinned without counting their misses (Store.step's count_misses):
        its final MISS answers are counted here, so that a remote hit counts as a hit only."""
        result = await acquire_fetched(
            self._store, self.fetch, session_id, engine_id, acquires, result
        )
        self._store.count_misses(engine_id, sum(r.status is Status.MISS for r in result.acquires))
        return result

    def start(self, engine_id: str, keys: Sequence[bytes]) -> dict[bytes, asyncio.Future[None]]:
        """Start pulling the keys that are not here but that readable peer pools hold; the
        futures of those pulls and of the pulls already in flight among `keys`."""
        local: PoolInfo | None = None  # built for the first key a peer holds: most keys are here
        waits: dict[bytes, asyncio.Future[None]] = {}
        for found in self._store.lookup(engine_id, keys):
            key = found.key
            pull = self._pulls.get((engine_id, key))
            if pull is not None and found.state is EntryState.PENDING:
                waits[key] = pull.done
            elif found.state is EntryState.ABSENT and key not in waits:
                held = self._directory.holdings(engine_id, key)
                if held:
                    local = local or self._store.pool_info(engine_id)
                    pull = self._begin(engine_id, key, readable_holdings(held, local))
                    if pull is not None:
                        waits[key] = pull.done
        return waits

    def _begin(self, engine_id: str, key: bytes, holdings: list[Holding]) -> Pull | None:
        if not holdings:
            return None
        first = holdings[0]
        slot = self._store.pull_allocate(engine_id, key, first.nbytes, first.address)
        if slot is None:  # no room
            return None
        loop = asyncio.get_running_loop()
        pull = Pull(slot, holdings, loop.create_future(), self._clock())
        self._pulls[(engine_id, key)] = pull
        self._spawn(self._pull(pull))
        return pull

    # ---- one pull --------------------------------------------------------------------------

    async def _pull(self, pull: Pull) -> None:
        pulled: PulledEntry | None = None
        try:
            for holding in pull.holdings:
                pulled = await self._pull_from(pull, holding)
                if pulled is not None or pull.reading is not None or self._left(pull) <= 0:
                    break
        finally:
            self._finish(pull, pulled)

    async def _pull_from(self, pull: Pull, holding: Holding) -> PulledEntry | None:
        """The entry from one peer; None if that peer could not give it (pull.reading stays
        set when a read was given up on while still writing)."""
        slot = pull.slot
        peer = self._peers(holding.address)
        if peer is None or holding.nbytes != slot.nbytes:
            return None
        hit = await self._pin(pull, peer, holding.address)
        if hit is None or hit.spec is None:
            return None
        try:
            copies = plan_copies(
                holding.pool.transfer_base, hit.extents, slot.extents, slot.block_size, slot.nbytes
            )
            endpoint = holding.pool.transfer_endpoint
            retried = False
            while True:
                self._store.pull_reading(slot)
                read = asyncio.wrap_future(self._transport.read(endpoint, slot.engine_id, copies))
                pull.reading = read
                if not await self._until(read, pull):
                    log.warning(
                        "pull timed out mid-read: its blocks are held until the read is over",
                        extra={"peer": holding.address, "engine_id": slot.engine_id},
                    )
                    return None
                pull.reading = None
                self._store.pull_read_over(slot)
                error = read.exception()
                if error is None:
                    self._read_epochs[endpoint] = peer.boot_epoch
                    return PulledEntry(hit.spec, hit.checksum)
                if retried or not self._restarted(endpoint, peer.boot_epoch):
                    raise error
                retried = True  # a stale descriptor of a restarted peer fails one read
        except (TransportError, ValueError) as exc:
            log.info(
                "pull from a peer failed",
                extra={"peer": holding.address, "engine_id": slot.engine_id, "why": str(exc)},
            )
            return None
        finally:
            self._release_soon(peer, hit.lease_id)

    async def _pin(self, pull: Pull, peer: PeerCalls, address: str) -> AcquireResult | None:
        """The peer's pin of the entry (its Acquire), within the pull's time; a pin that comes
        after the pull gave up on it is released."""
        slot = pull.slot
        call = asyncio.ensure_future(peer.acquire(slot.engine_id, [slot.key]))
        done, _ = await asyncio.wait({call}, timeout=max(self._left(pull), 0))
        if not done:
            call.add_done_callback(lambda late: self._release_late(peer, late))
            return None
        try:
            [hit] = call.result()
        except EcdError as exc:
            log.info("peer Acquire failed", extra={"peer": address, "why": exc.message})
            return None
        if hit.status is not Status.HIT or hit.spec is None:
            return None
        if hit.spec.nbytes != slot.nbytes:  # another entry under that key since
            self._spawn(self._release(peer, hit.lease_id))
            return None
        return hit

    async def _until(self, read: asyncio.Future[None], pull: Pull) -> bool:
        """Wait for a read within the pull's time; whether it is over."""
        read.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({read}, timeout=max(self._left(pull), 0))
        return bool(done)

    def _finish(self, pull: Pull, pulled: PulledEntry | None) -> None:
        slot, reading = pull.slot, pull.reading
        seconds = self._clock() - pull.started
        if pulled is None or not self._store.pull_commit(
            slot, pulled.spec, pulled.checksum, seconds
        ):
            self._store.pull_abort(slot)
        if reading is not None:  # given up on mid-read: its blocks are free once it is over
            reading.add_done_callback(lambda _: self._store.pull_read_over(slot))
        if self._pulls.get((slot.engine_id, slot.key)) is pull:
            del self._pulls[(slot.engine_id, slot.key)]
        pull.done.set_result(None)

    def _left(self, pull: Pull) -> float:
        return pull.started + self.timeout_s - self._clock()

    def _restarted(self, endpoint: str, epoch: str) -> bool:
        last = self._read_epochs.get(endpoint)
        return last is not None and last != epoch

    def _release_soon(self, peer: PeerCalls, lease_id: int) -> None:
        """Release the peer's pin once the pull's waiters had their turn (two turns of the loop:
        the pull wakes them as it ends): their reply is on the critical path, the pin is not
        (what it saves: docs/performance.md, Across nodes)."""
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._spawn, self._release(peer, lease_id))

    async def _release(self, peer: PeerCalls, lease_id: int) -> None:
        try:
            await peer.release([lease_id])
        except EcdError as exc:  # the pin goes with this daemon's session there all the same
            log.info("peer Release failed", extra={"why": exc.message})

    def _release_late(self, peer: PeerCalls, call: asyncio.Future[list[AcquireResult]]) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        for hit in call.result():
            if hit.status is Status.HIT:
                self._spawn(self._release(peer, hit.lease_id))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the pulls in flight (each aborts its entry) and the releases not sent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- what peers hold, republished ----------------------------------------------------------

    def snapshot(self, engine_id: str) -> list[WatchEvent]:
        """The keys available from peers, in one local pool (or all), as SNAPSHOT events."""
        epoch = self._store.boot_epoch
        events = []
        for pool in [engine_id] if engine_id else self._store.engine_ids():
            published = self._published_keys(pool)
            if published is not None:
                events += [
                    WatchEvent(EventType.SNAPSHOT, pool, key, 0, epoch, remote=True)
                    for key in published[1]
                ]
        return events

    def _changed(self, engine_id: str, key: bytes) -> None:
        published = self._published_keys(engine_id)
        if published is None:
            return
        local, keys = published
        holdings = readable_holdings(self._directory.holdings(engine_id, key), local)
        if bool(holdings) == (key in keys):
            return
        if holdings:
            keys.add(key)
            event, nbytes = EventType.COMMITTED, holdings[0].nbytes
        else:
            keys.discard(key)
            event, nbytes = EventType.EVICTED, 0
        self._publish(
            WatchEvent(event, engine_id, key, nbytes, self._store.boot_epoch, remote=True)
        )

    def _published_keys(self, engine_id: str) -> tuple[PoolInfo, set[bytes]] | None:
        """The local pool and the keys published as available in it; None without the pool."""
        try:
            local = self._store.pool_info(engine_id)
        except CoreError:
            self._published.pop(engine_id, None)
            return None
        known = self._published.get(engine_id)
        if known is None or known[0] != local.pool_uuid:
            keys = {
                key
                for info, held in self._directory.pools(engine_id)
                if readable(info, local)
                for key in held
            }
            known = self._published[engine_id] = (local.pool_uuid, keys)
        return local, known[1]


async def acquire_fetched(
    store: Store,
    fetch: Callable[[str, str, list[bytes], int], Awaitable[list[bytes]]],
    session_id: str,
    engine_id: str,
    acquires: Sequence[bytes],
    result: StepResult,
) -> StepResult:
    """A Step's answer once the acquires it missed were fetched from elsewhere (pulled from
    peers, or read from the cluster's store): `fetch` answers the keys it waited for, which are
    acquired again (after the Step's other parts, which the fetches could not disturb)."""
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


def readable_holdings(holdings: list[Holding], local: PoolInfo) -> list[Holding]:
    """The peer pools among `holdings` that this daemon may read into its pool `local`."""
    return [h for h in holdings if readable(h.pool, local)]


def peer_stats(directory: PeerDirectory) -> tuple[PeerStats, ...]:
    """The peers followed, as Stats reports them."""
    return tuple(
        PeerStats(v.address, v.state.value, v.boot_epoch, v.keys, v.error)
        for v in directory.views()
    )


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a read's failure as seen (a read given up on is never awaited)."""
    if not future.cancelled():
        future.exception()
