"""The pending markers a node writes (ec_daemon/cluster/pending.py) against a store client of this
test's own that keeps the first value put under a key, as Mooncake Store does: a real core Store,
a real ClusterNode thread, the calls recorded in order."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_testing import BufferlessStore
from core_testing import session
from ecd_testing import wait_until

from ec_daemon.cluster import codec
from ec_daemon.cluster.mooncake import StoreSettings
from ec_daemon.cluster.node import NO_AVAILABLE_HANDLE, SETTLE_RETRY_S, ClusterNode
from ec_daemon.cluster.pending import (
    BOUND_S,
    REFRESH_S,
    Claims,
    Marker,
    RemoteWaits,
    alive_key,
    marker_key,
)
from ec_daemon.cluster.republish import Republisher
from ec_daemon.cluster.tier import Cluster
from ec_daemon.core.store import Store
from ec_daemon.server import config
from ec_daemon.server.events import EventHub
from ec_daemon.server.server import build_store
from ec_protocol.types import Status, TensorSpec

BLOCK = 4096
SPEC = TensorSpec((1, 2048), "bfloat16", BLOCK)
MARKER = marker_key("ns", b"k")


class RecordingStore(BufferlessStore):
    """Values in memory, each call recorded as (name, key)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []
        self.refusals = 0  # puts to refuse for space before the next is taken

    def put(self, key: str, value: bytes, config: Any = None) -> int:
        self.calls.append(("put", key))
        if self.refusals:
            self.refusals -= 1
            return NO_AVAILABLE_HANDLE
        self.values.setdefault(key, value)  # a key the store has is not written again
        return 0

    def get(self, key: str) -> bytes:
        return self.values.get(key, b"")

    def upsert(self, key: str, value: bytes, config: Any = None) -> int:
        self.calls.append(("upsert", key))
        self.values[key] = value
        return 0

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        self.calls += [("remove", key) for key in keys]
        return [0 if self.values.pop(key, None) is not None else -704 for key in keys]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(key in self.values) for key in keys]

    def batch_put_from_multi_buffers(
        self, keys: list[str], buffers: Any, sizes: Any, config: Any
    ) -> list[int]:
        for key in keys:
            self.calls.append(("publish", key))
            self.values[key] = b"value"
        return [0] * len(keys)


@pytest.fixture
def fake() -> RecordingStore:
    return RecordingStore()


@pytest.fixture
def claiming(shm_dir: Path, fake: RecordingStore) -> Iterator[tuple[Claims, Store, str]]:
    """A Store whose pool "p" is shared under "ns", its events handed to a node and to its
    claims as the daemon wires them (server.build_store); a session of that store."""
    settings = StoreSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata", "127.0.0.1", 0)
    node = ClusterNode(settings, connect=lambda _: (fake, None))
    claims = Claims(node, placement=lambda store: "here")
    loaded, _ = config.load({"shm_dir": str(shm_dir)}, {}, None)
    cluster = Cluster(node, claims, Republisher(node, rate=1), pull_timeout_s=1)
    store = build_store(loaded, 1 << 30, EventHub(), cluster)

    async def no_fill(engine_id: str, slots: Any, started: float) -> int:
        return 0

    claims.bind(store, lambda engine_id, key: False, RemoteWaits(store, node, no_fill))
    node.start()
    wait_until(lambda: node.connected, 10)
    sid = session(store)
    store.open_pool(sid, "p", BLOCK, 8 * BLOCK, "", cluster_namespace="ns")
    yield claims, store, sid
    node.stop(10)
    store.close()


def allocate(store: Store, sid: str) -> int:
    [result] = store.allocate(sid, "p", [(b"k", SPEC)])
    assert result.status is Status.ALLOCATED
    return result.allocation


def test_a_commit_removes_its_marker_only_after_its_value_is_published(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    allocation = allocate(store, sid)
    wait_until(lambda: claims.claims == 1, 10)
    store.commit(sid, "p", [(b"k", 0, allocation)])
    wait_until(lambda: ("remove", MARKER) in fake.calls, 10)
    value = codec.store_key("ns", b"k")
    calls = [call for call in fake.calls if call[0] != "upsert"]  # the writer's beats
    assert calls == [("put", MARKER), ("publish", value), ("remove", MARKER)]


def test_a_marker_of_this_nodes_from_an_earlier_entry_is_replaced_and_the_claim_held(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    fake.values[MARKER] = Marker(claims.writer, BLOCK, bound_s=BOUND_S + 1).pack()
    allocate(store, sid)
    wait_until(lambda: claims.claims == 1, 10)
    found = Marker.parse(fake.values[MARKER])
    assert found == Marker(claims.writer, SPEC.nbytes, bound_s=BOUND_S)
    assert claims.claims_lost == 0


def test_a_writer_holding_a_claim_bumps_its_beat_until_the_claim_ends(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    beat = alive_key(claims.writer)
    allocate(store, sid)
    wait_until(lambda: len(fake.values.get(beat, b"")) == 3, 10)  # the second beat's size
    store.abort(sid, "p", [b"k"])
    wait_until(lambda: ("remove", MARKER) in fake.calls, 10)
    time.sleep(3 * REFRESH_S)  # beats would have come by now
    after = fake.calls[fake.calls.index(("remove", MARKER)) :]
    assert fake.calls[0] == ("put", MARKER) and fake.calls[1:3] == [("upsert", beat)] * 2
    assert after == [("remove", MARKER)] and MARKER not in fake.values


def test_an_entry_whose_claim_another_node_holds_leaves_its_marker_when_it_ends(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    theirs = Marker(b"\x01" * 16, BLOCK, bound_s=BOUND_S).pack()
    fake.values[MARKER] = theirs
    allocate(store, sid)
    wait_until(lambda: claims.claims_lost == 1, 10)
    store.abort(sid, "p", [b"k"])
    allocate(store, sid)  # claimed again after the abort's turn: the other node's marker stays
    wait_until(lambda: claims.claims_lost == 2, 10)
    assert fake.values[MARKER] == theirs and ("remove", MARKER) not in fake.calls


def test_a_pool_dropped_by_force_while_an_entry_was_written_removes_its_marker(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    allocate(store, sid)
    wait_until(lambda: claims.claims == 1, 10)
    store.drop_pool("p", force=True)
    wait_until(lambda: MARKER not in fake.values, 10)


@pytest.fixture
def settling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's master has just taken over (a new leader): its refusals for space are the
    nodes' segments not yet back with it (ClusterNode's own judgement: test_cluster_node.py)."""
    monkeypatch.setattr(
        ClusterNode, "refused_while_settling", lambda self, results: NO_AVAILABLE_HANDLE in results
    )


def marker_puts(fake: RecordingStore) -> int:
    return fake.calls.count(("put", MARKER))


@pytest.mark.usefixtures("settling")
def test_a_claim_refused_for_space_by_a_master_just_taken_over_is_tried_again_until_held(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    fake.refusals = 4  # two claims, each refused in the node's segment and anywhere
    allocate(store, sid)
    wait_until(lambda: claims.claims == 1, 10)
    assert marker_puts(fake) == 5
    assert Marker.parse(fake.values[MARKER]) == Marker(claims.writer, SPEC.nbytes, BOUND_S)


def claim_refused(claiming: tuple[Claims, Store, str], fake: RecordingStore) -> None:
    """An entry allocated, its claim refused for space in the node's segment and anywhere."""
    _, store, sid = claiming
    fake.refusals = 2
    allocate(store, sid)
    wait_until(lambda: marker_puts(fake) == 2, 10)


@pytest.mark.usefixtures("settling")
def test_a_refused_claim_whose_entry_ended_is_neither_tried_again_nor_removed(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    claims, store, sid = claiming
    claim_refused(claiming, fake)
    store.abort(sid, "p", [b"k"])
    time.sleep(3 * SETTLE_RETRY_S)  # retries would have come by now
    assert marker_puts(fake) == 2 and ("remove", MARKER) not in fake.calls
    assert claims.claims == 0 and MARKER not in fake.values


def test_a_claim_refused_for_space_by_a_settled_master_is_not_tried_again(
    claiming: tuple[Claims, Store, str], fake: RecordingStore
) -> None:
    """The store is full: a marker would take the place of values; the entry goes unclaimed."""
    claim_refused(claiming, fake)
    time.sleep(3 * SETTLE_RETRY_S)
    assert marker_puts(fake) == 2 and claiming[0].claims == 0
