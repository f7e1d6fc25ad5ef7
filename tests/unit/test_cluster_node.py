"""Publishing from a node (ec_daemon/cluster/node.py) against a store client of this test's own:
a real core Store on a private directory, its commits handed to a real ClusterNode thread."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_testing import BufferlessStore
from core_testing import FakeClock, session
from ecd_testing import REPO, wait_until

from ec_daemon.cluster import codec
from ec_daemon.cluster import node as node_module
from ec_daemon.cluster.mooncake import RPC_FAIL, StoreSettings, Unreachable, connect
from ec_daemon.cluster.node import NO_AVAILABLE_HANDLE, ClusterNode, Offered, SharedPool
from ec_daemon.core.pools import PoolSettings
from ec_daemon.core.store import Store, StoreConfig
from ec_protocol.types import PoolInfo, Status, TensorSpec

BLOCK = 4096  # one row of 2048 bf16
ROWS = 4


class FakeStore(BufferlessStore):
    """A store client keeping values in memory. `gate` holds lookups (the node's thread waits
    there, its queue filling behind it); `entered` says one is waiting; `put_result` is what
    every put answers (0: stored) once `put_answers` (answered first, one a put) run out; while
    `master_gone`, lookups answer as for a master gone; `lookups` counts them, `puts` the puts."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.put_result = 0
        self.put_answers: list[int] = []
        self.master_gone = False
        self.lookups = self.puts = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.entered.set()
        assert self.gate.wait(10)
        self.lookups += 1
        if self.master_gone:
            return [RPC_FAIL] * len(keys)
        return [int(k in self.values) for k in keys]

    def batch_put_from_multi_buffers(
        self, keys: list[str], buffers: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]:
        self.puts += 1
        answer = self.put_answers.pop(0) if self.put_answers else self.put_result
        for key, ptrs, lengths in zip(keys, buffers, sizes, strict=True):
            if answer == 0:
                self.values[key] = b"".join(map(ctypes.string_at, ptrs, lengths))
        return [answer] * len(keys)


@pytest.fixture
def fake() -> FakeStore:
    return FakeStore()


@pytest.fixture
def master_port() -> Iterator[socket.socket]:
    """The master's port: bound, so that nothing else takes it, and refusing connections until
    the test listens on it."""
    with socket.socket() as port:
        port.bind(("127.0.0.1", 0))
        yield port


@pytest.fixture
def node_and_store(
    shm_dir: Path, fake: FakeStore, master_port: socket.socket
) -> Iterator[tuple[ClusterNode, Store, str]]:
    """A node publishing the commits of a Store whose pool "p" is shared under "ns"; a session
    of that store."""
    host, port = master_port.getsockname()
    settings = StoreSettings(f"{host}:{port}", "http://127.0.0.1:2/metadata", "127.0.0.1", 0)
    node = ClusterNode(settings, connect=lambda _: (fake, None))
    store = Store(
        StoreConfig(PoolSettings(shm_dir=shm_dir, max_bytes=1 << 30)), FakeClock(), node.on_event
    )
    node.bind(store)
    node.start()
    sid = session(store)
    store.open_pool(sid, "p", BLOCK, 2 * ROWS * BLOCK, "", cluster_namespace="ns")
    yield node, store, sid
    node.stop(10)
    store.close()


def put(store: Store, sid: str, key: bytes, fill: int) -> bytes:
    """Commit `key`, ROWS rows of bf16 whose bytes are all `fill`, written into its extents."""
    data = bytes([fill]) * ROWS * BLOCK
    [result] = store.allocate(sid, "p", [(key, TensorSpec((ROWS, 2048), "bfloat16", len(data)))])
    assert result.status is Status.ALLOCATED
    info: PoolInfo = store.pool_info("p")
    fd = os.open(info.path, os.O_WRONLY)
    try:
        for extent in result.extents:  # one, in a pool this empty
            os.pwrite(fd, data, info.data_offset + extent.start * BLOCK)
    finally:
        os.close(fd)
    assert [r.status for r in store.commit(sid, "p", [(key, 0, result.allocation)])] == [Status.OK]
    return data


def offer_again(node: ClusterNode, store: Store) -> Offered:
    """Pool "p" walked once by a republish from its first slot, on the node's thread."""
    return node.ask(node.publish_again(SharedPool("ns", store.pool_info("p")), 0)).result(10)


def value(key: bytes, data: bytes) -> tuple[str, bytes]:
    spec = TensorSpec((ROWS, 2048), "bfloat16", len(data))
    return codec.store_key("ns", key), codec.header(spec) + data


def test_an_entry_removed_before_its_turn_is_not_published_nor_what_took_its_blocks(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore
) -> None:
    node, store, sid = node_and_store
    fake.gate.clear()
    first = put(store, sid, b"first", 1)
    assert fake.entered.wait(10)  # the node's thread holds "first" pinned, waiting on the store
    put(store, sid, b"removed", 2)
    store.delete("p", [b"removed"])
    third = put(store, sid, b"third", 3)  # into the blocks "removed" had: "first" holds the rest
    fake.gate.set()
    wait_until(lambda: node.published + node.gone == 3, 10)
    assert (node.published, node.gone) == (2, 1)
    assert fake.values == dict([value(b"first", first), value(b"third", third)])


def test_an_entry_the_format_cannot_express_is_counted_at_its_commit_not_again_at_a_republish(
    node_and_store: tuple[ClusterNode, Store, str],
) -> None:
    node, store, sid = node_and_store
    spec = TensorSpec((ROWS, 4096), "int8", ROWS * BLOCK)  # int8: no dtype code in the format
    [result] = store.allocate(sid, "p", [(b"int8", spec)])
    assert [r.status for r in store.commit(sid, "p", [(b"int8", 0, result.allocation)])] == [
        Status.OK
    ]
    wait_until(lambda: node.unpublishable == 1, 10)
    offered = offer_again(node, store)
    assert (offered.offered, offered.put, node.unpublishable) == (1, 0, 1)


def test_a_publish_the_store_refused_is_counted_at_its_commit_not_again_at_a_republish(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore
) -> None:
    node, store, sid = node_and_store
    fake.put_result = NO_AVAILABLE_HANDLE  # the store is full
    put(store, sid, b"refused", 1)
    wait_until(lambda: node.failures == 1, 10)
    offered = offer_again(node, store)
    assert (offered.offered, offered.put, node.failures) == (1, 0, 1)


def test_a_republish_keeps_no_entry_the_store_has_from_eviction_while_it_asks(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore
) -> None:
    node, store, sid = node_and_store
    put(store, sid, b"held", 1)
    wait_until(lambda: node.published == 1, 10)
    fake.gate.clear()
    fake.entered.clear()
    walk = node.ask(node.publish_again(SharedPool("ns", store.pool_info("p")), 0))
    assert fake.entered.wait(10)  # the walk's lookup waits on the store
    [evicted] = store.evict("p", [b"held"])
    fake.gate.set()
    assert walk.result(10) == Offered(1, 0, None)
    assert evicted.status is Status.OK, evicted.message


def test_a_publish_the_store_refuses_is_counted_and_the_commit_stands(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore
) -> None:
    node, store, sid = node_and_store
    fake.put_result = -800  # TRANSFER_FAIL
    put(store, sid, b"refused", 1)
    wait_until(lambda: node.failures == 1, 10)
    assert node.published == 0 and not fake.values
    assert node.connected  # the master answered: the store refused this one
    store.check()


def test_a_node_whose_master_is_gone_calls_the_store_no_more_until_its_port_answers(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore, master_port: socket.socket
) -> None:
    node, store, sid = node_and_store
    fake.master_gone = True
    put(store, sid, b"found-it-gone", 1)
    wait_until(lambda: node.stats().publish_failures == 1 and not node.connected, 10)
    lookups = fake.lookups
    for i in range(3):  # each fails at once, counted, with no call to the store
        put(store, sid, b"down-%d" % i, 2)
        wait_until(lambda n=i + 2: node.stats().publish_failures == n, 10)
    assert fake.lookups == lookups and not node.connected
    fake.master_gone = False
    master_port.listen()  # the master is back: the node probes its port, then calls the store
    wait_until(lambda: node.connected, 10)
    put(store, sid, b"back", 3)
    wait_until(lambda: codec.store_key("ns", b"back") in fake.values, 10)
    assert node.stats().publish_failures == 4
    store.check()


def test_publishes_the_master_did_not_answer_are_published_once_it_answers_again(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore, master_port: socket.socket
) -> None:
    node, store, sid = node_and_store
    fake.master_gone = True
    data = {b"found-it-gone": put(store, sid, b"found-it-gone", 1)}
    wait_until(lambda: not node.connected, 10)
    data[b"while-gone"] = put(store, sid, b"while-gone", 2)  # failed at once, not called
    wait_until(lambda: node.stats().publish_failures == 2, 10)
    fake.master_gone = False
    master_port.listen()
    wait_until(lambda: node.published == 2, 10)
    assert (node.retried, node.stats().publish_failures, node.dropped) == (2, 2, 0)
    assert fake.values == dict(value(key, written) for key, written in data.items())


def lose_and_regain_the_master(
    node: ClusterNode, store: Store, sid: str, fake: FakeStore, master_port: socket.socket
) -> None:
    """The master gone (a commit's publish finds it so), then back: the node rejoins it."""
    fake.master_gone = True
    put(store, sid, b"found-it-gone", 1)
    wait_until(lambda: not node.connected, 10)
    fake.master_gone = False
    master_port.listen()
    wait_until(lambda: node.published == 1, 10)


def test_a_put_a_master_just_back_refuses_for_space_is_tried_again_until_it_takes_it(
    node_and_store: tuple[ClusterNode, Store, str], fake: FakeStore, master_port: socket.socket
) -> None:
    """Its segments are not back with it yet (each store client remounts its own)."""
    node, store, sid = node_and_store
    lose_and_regain_the_master(node, store, sid, fake, master_port)
    puts = fake.puts
    fake.put_answers = [NO_AVAILABLE_HANDLE] * 2
    data = put(store, sid, b"refused-twice", 2)
    wait_until(lambda: node.published == 2, 10)
    assert fake.puts - puts == 3 and node.retried >= 2
    assert fake.values[codec.store_key("ns", b"refused-twice")] == value(b"refused-twice", data)[1]


def test_a_put_refused_for_space_once_the_master_has_settled_is_not_tried_again(
    node_and_store: tuple[ClusterNode, Store, str],
    fake: FakeStore,
    master_port: socket.socket,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past SETTLE_S the store is full: its eviction is its own to make."""
    monkeypatch.setattr(node_module, "SETTLE_S", 0.2)
    node, store, sid = node_and_store
    lose_and_regain_the_master(node, store, sid, fake, master_port)
    time.sleep(0.3)
    puts, retried = fake.puts, node.retried
    fake.put_result = NO_AVAILABLE_HANDLE
    put(store, sid, b"refused", 2)
    wait_until(lambda: node.failures == 2, 10)
    time.sleep(1.0)  # two held retries' time
    assert (fake.puts - puts, node.retried - retried, node.published) == (1, 0, 1)


def test_a_node_without_the_store_client_is_told_the_wheel_the_mooncake_extra_pins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not the project by name with its extra: `ecd` on the package index is another project."""
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # its import raises ImportError
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")  # connect sets it for the library
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    [wheel] = project["optional-dependencies"]["mooncake"]
    with socket.create_server(("127.0.0.1", 0)) as master:  # master and metadata both answer
        port = master.getsockname()[1]
        where = StoreSettings(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/m", "127.0.0.1", 0)
        with pytest.raises(Unreachable) as caught:
            connect(where)
    assert f"pip install '{wheel}'" in str(caught.value), caught.value
