"""Pulls from peer daemons (ec_daemon.remote) between two real stores in this process: each its
own shm directory, its pools registered with an in-process transport (LocalCopyTransport), the
peer's answers those of its store. Bytes cross bit-identical, once; whatever fails leaves nothing
READY and every block accounted for; a read given up on holds its blocks until it is over."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ecd_testing import new_shm_dir
from peer_testing import LocalCopyTransport

from ec_client.types import (
    AcquireResult,
    EntryState,
    EventType,
    Key,
    LeaseResult,
    PoolStats,
    Role,
    Status,
    TensorSpec,
    WatchEvent,
    key_bytes,
)
from ec_daemon.peers import PeerDirectory
from ec_daemon.pools import PoolSettings
from ec_daemon.remote import Remote, ServedPools
from ec_daemon.store import Store, StoreConfig
from ec_daemon.transport import Copy, TransportError

BLOCK = 4096
POOL = "vl"
PEER = "10.0.0.2:7878"


class CountingTransport(LocalCopyTransport):
    """LocalCopyTransport that counts reads, can fail the next few, or hold them in flight
    until the test lets them finish."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.failures = 0
        self.hold = False
        self.held: list[tuple[Future[None], str, str, Sequence[Copy]]] = []

    def read(
        self, peer_endpoint: str, local_engine_id: str, copies: Sequence[Copy]
    ) -> Future[None]:
        self.reads += 1
        if self.failures:
            self.failures -= 1
            future: Future[None] = Future()
            future.set_exception(TransportError("the peer went away mid-read"))
            return future
        if self.hold:
            future = Future()
            self.held.append((future, peer_endpoint, local_engine_id, copies))
            return future
        return super().read(peer_endpoint, local_engine_id, copies)

    def finish_held(self) -> None:
        for future, endpoint, engine_id, copies in self.held:
            super().read(endpoint, engine_id, copies).result()
            future.set_result(None)
        self.held.clear()


@dataclass
class Node:
    """A store and its transport, as one daemon holds them."""

    store: Store
    transport: CountingTransport
    events: list[WatchEvent] = field(default_factory=list)

    def stats(self) -> PoolStats:
        [pool] = self.store.stats(POOL).pools
        return pool

    def data(self, key: bytes) -> bytes:
        [entry] = [e for e in self.store.list_entries(POOL, b"", 100)[0] if e.key == key]
        info = self.store.pool_info(POOL)
        with open(info.path, "rb") as f:
            f.seek(info.data_offset + entry.extents[0].start * BLOCK)
            return f.read(entry.spec.nbytes)


def make_node(shm_dir: Path, block: int = BLOCK, compat_key: str = "model") -> Node:
    transport = CountingTransport()
    events: list[WatchEvent] = []
    settings = PoolSettings(shm_dir=shm_dir, max_bytes=1 << 30)
    store = Store(
        StoreConfig(settings), time.monotonic, events.append, pool_listener=ServedPools(transport)
    )
    setup = store.open_session("setup", 1, Role.ADMIN)
    store.open_pool(setup, POOL, block, 64 * block, compat_key)
    store.close_session(setup)
    return Node(store, transport, events)


class FakePeer:
    """The peer daemon as a pull sees it: its store, through a session of the follower's."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.session = node.store.open_session("ecd-peer", 1, Role.CONSUMER)
        self.boot_epoch = node.store.boot_epoch
        self.acquires = 0
        self.answer_miss = False

    async def acquire(
        self, engine_id: str, keys: Sequence[Key], wait_ms: int = 0
    ) -> list[AcquireResult]:
        self.acquires += 1
        raw = [key_bytes(k) for k in keys]
        if self.answer_miss:
            return [AcquireResult(k, Status.MISS, "", 0, (), None, 0) for k in raw]
        return self.node.store.acquire(self.session, engine_id, raw)

    async def release(self, lease_ids: Sequence[int]) -> list[LeaseResult]:
        return self.node.store.release(self.session, lease_ids)


@dataclass
class Pair:
    local: Node
    peer: Node
    fake: FakePeer
    directory: PeerDirectory
    remote: Remote

    def store_on_peer(self, key: bytes, data: bytes, checksum: int = 0) -> None:
        store = self.peer.store
        producer = store.open_session("producer", 1, Role.PRODUCER)
        spec = TensorSpec((len(data) // 2, 2), "uint8", len(data))
        [allocated] = store.allocate(producer, POOL, [(key, spec)])
        info = store.pool_info(POOL)
        with open(info.path, "r+b") as f:
            f.seek(info.data_offset + allocated.extents[0].start * BLOCK)
            f.write(data)
        assert store.commit(producer, POOL, [(key, checksum, 0)])[0].status is Status.OK
        store.close_session(producer)
        self.directory.apply(
            PEER, WatchEvent(EventType.COMMITTED, POOL, key, len(data), self.peer.store.boot_epoch)
        )

    def state(self, key: bytes) -> EntryState:
        [found] = self.local.store.lookup(POOL, [key])
        return found.state

    def check(self) -> None:
        """Both stores' block invariants, and no pin left on the peer."""
        self.local.store.check()
        self.peer.store.check()
        assert self.peer.stats().pins == 0


@pytest.fixture
def shm_dirs() -> Iterator[tuple[Path, Path]]:
    dirs = (new_shm_dir(), new_shm_dir())
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def connect(local: Node, peer: Node, timeout_s: float = 2.0) -> Pair:
    fake = FakePeer(peer)
    directory = PeerDirectory()
    directory.add(PEER)
    directory.opened(PEER, peer.store.boot_epoch)
    directory.attached(PEER, POOL, peer.store.pool_info(POOL))
    remote = Remote(
        local.store, local.events.append, directory, local.transport, {PEER: fake}.get, timeout_s
    )
    return Pair(local, peer, fake, directory, remote)


@pytest.fixture
async def pair(shm_dirs: tuple[Path, Path]) -> Pair:
    return connect(make_node(shm_dirs[0]), make_node(shm_dirs[1]))


async def flush(pair: Pair) -> None:
    """Let the background releases run."""
    for _ in range(5):
        await asyncio.sleep(0)


def consumer(pair: Pair) -> str:
    return pair.local.store.open_session("consumer", 1, Role.CONSUMER)


async def test_a_key_only_a_peer_holds_is_pulled_bit_identical_in_one_read(pair: Pair) -> None:
    data = os.urandom(3 * BLOCK - 100)
    pair.store_on_peer(b"k", data, checksum=0xABC)
    session = consumer(pair)

    assert await pair.remote.fetch(session, POOL, [b"k"], wait_ms=0) == [b"k"]
    [hit] = pair.local.store.acquire(session, POOL, [b"k"])

    assert hit.status is Status.HIT and hit.checksum == 0xABC
    assert hit.spec == TensorSpec((len(data) // 2, 2), "uint8", len(data))
    assert pair.local.data(b"k") == data
    assert pair.local.transport.reads == 1
    stats = pair.local.stats()
    assert stats.remote_reads == 1
    assert (stats.remote_hits, stats.remote_misses, stats.remote_bytes) == (1, 0, len(data))
    assert sum(stats.remote_seconds_counts) == 1
    await flush(pair)
    pair.local.store.release(session, [hit.lease_id])
    pair.check()


async def test_concurrent_askers_share_one_pull(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    one, two = consumer(pair), consumer(pair)
    await asyncio.gather(
        pair.remote.fetch(one, POOL, [b"k"], 0), pair.remote.fetch(two, POOL, [b"k"], 0)
    )
    assert pair.fake.acquires == 1 and pair.local.transport.reads == 1
    assert pair.state(b"k") is EntryState.READY


async def test_a_key_being_pulled_is_pending_to_local_producers(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    pair.local.transport.hold = True
    waits = pair.remote.start(POOL, [b"k"])
    producer = pair.local.store.open_session("producer", 1, Role.PRODUCER)
    [answer] = pair.local.store.allocate(
        producer, POOL, [(b"k", TensorSpec((BLOCK,), "uint8", BLOCK))]
    )
    assert answer.status is Status.PENDING
    await asyncio.sleep(0.01)
    pair.local.transport.finish_held()
    await asyncio.wait(set(waits.values()))
    assert pair.state(b"k") is EntryState.READY


async def test_a_peer_that_no_longer_has_the_key_leaves_nothing_here(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    pair.fake.answer_miss = True
    session = consumer(pair)
    await pair.remote.fetch(session, POOL, [b"k"], 0)
    assert pair.state(b"k") is EntryState.ABSENT
    assert pair.local.transport.reads == 0
    assert pair.local.stats().remote_misses == 1
    assert pair.local.stats().free_blocks == pair.local.stats().num_blocks
    pair.check()


async def test_a_failed_read_aborts_the_entry_and_releases_the_peers_pin(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    pair.local.transport.failures = 1
    await pair.remote.fetch(consumer(pair), POOL, [b"k"], 0)
    await flush(pair)
    assert pair.state(b"k") is EntryState.ABSENT
    assert [e.type for e in pair.local.events if not e.remote][-1] is EventType.ABORTED
    assert pair.local.stats().free_blocks == pair.local.stats().num_blocks
    pair.check()


async def test_a_read_past_the_timeout_holds_its_blocks_until_it_is_over(
    shm_dirs: tuple[Path, Path],
) -> None:
    pair = connect(make_node(shm_dirs[0]), make_node(shm_dirs[1]), timeout_s=0.1)
    pair.store_on_peer(b"k", os.urandom(2 * BLOCK))
    pair.local.transport.hold = True
    started = time.monotonic()
    await pair.remote.fetch(consumer(pair), POOL, [b"k"], 0)
    assert time.monotonic() - started < 1.0  # the caller is not kept past the pull timeout

    assert pair.state(b"k") is EntryState.ABSENT
    stats = pair.local.stats()
    assert stats.held_blocks == 2 and stats.free_blocks == stats.num_blocks - 2
    pair.local.store.check()  # free + entries + held == num_blocks

    pair.local.transport.finish_held()  # the engine is done with the blocks at last
    await flush(pair)
    stats = pair.local.stats()
    assert stats.held_blocks == 0 and stats.free_blocks == stats.num_blocks
    pair.check()


async def test_an_entry_deleted_while_its_read_runs_keeps_its_blocks_until_the_read_is_over(
    pair: Pair,
) -> None:
    pair.store_on_peer(b"k", os.urandom(2 * BLOCK))
    pair.local.transport.hold = True
    waits = pair.remote.start(POOL, [b"k"])
    for _ in range(20):  # until the pull's read is in flight
        if pair.local.transport.held:
            break
        await asyncio.sleep(0.01)
    [deleted] = pair.local.store.delete(POOL, [b"k"])  # an operator's `ecd delete`
    assert deleted.status is Status.OK and pair.state(b"k") is EntryState.ABSENT
    stats = pair.local.stats()
    assert stats.held_blocks == 2 and stats.free_blocks == stats.num_blocks - 2
    pair.local.store.check()

    pair.local.transport.finish_held()  # the engine is done writing the blocks
    await asyncio.wait(set(waits.values()))
    await flush(pair)
    stats = pair.local.stats()
    assert stats.held_blocks == 0 and stats.free_blocks == stats.num_blocks
    assert pair.state(b"k") is EntryState.ABSENT  # the pull found its entry gone
    pair.check()


@pytest.mark.parametrize(("block", "compat_key"), [(2 * BLOCK, "model"), (BLOCK, "other-model")])
async def test_a_peer_pool_of_another_geometry_or_model_is_never_read(
    shm_dirs: tuple[Path, Path], block: int, compat_key: str
) -> None:
    pair = connect(make_node(shm_dirs[0]), make_node(shm_dirs[1], block, compat_key))
    pair.directory.apply(
        PEER, WatchEvent(EventType.COMMITTED, POOL, b"k", BLOCK, pair.peer.store.boot_epoch)
    )
    assert await pair.remote.fetch(consumer(pair), POOL, [b"k"], 0) == []
    assert pair.fake.acquires == 0 and pair.state(b"k") is EntryState.ABSENT
    assert pair.remote.snapshot(POOL) == []


async def test_a_step_that_missed_a_key_a_peer_holds_answers_a_hit(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    session = consumer(pair)
    step = pair.local.store.step(session, POOL, [], [], [], [b"k", b"nowhere"], [])
    assert [r.status for r in step.acquires] == [Status.MISS, Status.MISS]

    step = await pair.remote.step(session, POOL, [b"k", b"nowhere"], step)
    assert [r.status for r in step.acquires] == [Status.HIT, Status.MISS]


async def test_a_steps_remote_hit_counts_as_a_hit_and_a_remote_hit_not_a_miss(
    pair: Pair,
) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    session = consumer(pair)
    acquires = [b"k", b"nowhere"]
    step = pair.local.store.step(session, POOL, [], [], [], acquires, [], count_misses=False)
    step = await pair.remote.step(session, POOL, acquires, step)
    assert [r.status for r in step.acquires] == [Status.HIT, Status.MISS]
    stats = pair.local.stats()
    assert (stats.hits, stats.misses, stats.remote_hits) == (1, 1, 1)


async def test_a_read_failing_after_the_peer_restarted_behind_its_endpoint_is_tried_again(
    pair: Pair,
) -> None:
    pair.store_on_peer(b"a", os.urandom(BLOCK))
    await pair.remote.fetch(consumer(pair), POOL, [b"a"], 0)
    pair.fake.boot_epoch = "restarted"  # same transfer endpoint, new daemon behind it
    pair.store_on_peer(b"b", os.urandom(BLOCK))
    pair.local.transport.failures = 1  # the engine's stale descriptor fails one read
    await pair.remote.fetch(consumer(pair), POOL, [b"b"], 0)
    assert pair.state(b"b") is EntryState.READY
    assert pair.local.transport.reads == 3


async def test_watchers_are_told_when_the_first_peer_gains_a_key_and_the_last_loses_it(
    pair: Pair,
) -> None:
    remote_events = lambda: [(e.type, e.key) for e in pair.local.events if e.remote]  # noqa: E731
    assert pair.remote.snapshot(POOL) == []  # published from here on
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    assert remote_events() == [(EventType.COMMITTED, b"k")]
    assert [e.key for e in pair.remote.snapshot(POOL)] == [b"k"]

    pair.directory.broken(PEER, "stream lost")
    assert remote_events()[-1] == (EventType.EVICTED, b"k")
    assert pair.remote.snapshot(POOL) == []


async def test_a_pool_its_daemon_dropped_is_no_longer_served_to_peers(pair: Pair) -> None:
    pair.store_on_peer(b"k", os.urandom(BLOCK))
    assert pair.peer.store.pool_info(POOL).transfer_endpoint == pair.peer.transport.endpoint
    region = pair.peer.store.pool_info(POOL).transfer_base
    pair.peer.store.drop_pool(POOL, force=True)
    read = pair.local.transport.read(pair.peer.transport.endpoint, POOL, [Copy(region, 0, BLOCK)])
    with pytest.raises(TransportError, match="serves no such region"):
        read.result()
