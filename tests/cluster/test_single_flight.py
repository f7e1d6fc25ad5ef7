"""Single flight across the cluster (docs/design.md §13): a key a producer on one node is writing
(PENDING there) is pending for the other nodes too, through a marker of ecd's own in the store
that its writer refreshes; their askers wait for it until its commit (then a remote hit), or its
abort, its producer's death or the marker going unrefreshed for its bound by their own clock
(then a miss). Nodes' wall clocks need not agree: some tests shift one node's by a minute
(libfaketime). Real daemons on a real master."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from cluster_testing import (
    NAMESPACE,
    POOL,
    Master,
    clock_offset,
    cluster_stats,
    needs_faketime,
    running_master,
    skewed_clock,
    store_client,
    store_daemon,
)
from ecd_testing import Daemon, python_killed_after, wait_until

from ec_client import AllocateItem, Client, Consumer, EntryState, Status
from ec_daemon.cluster import pending
from ec_daemon.cluster.pending import Marker, marker_key
from ec_protocol.types import ClusterStats

ROWS = torch.arange(16 * 2048, dtype=torch.float32).reshape(16, 2048).to(torch.bfloat16)


def shared(daemon: Daemon, name: str = "engine") -> Client:
    client = daemon.client(name=name)
    client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
    return client


def allocate(client: Client, key: str) -> Any:
    [allocated] = client.allocate("shared", [AllocateItem(key, tuple(ROWS.shape), "bfloat16")])
    assert allocated.status is Status.ALLOCATED
    return allocated


def write(client: Client, allocated: Any) -> None:
    """Write ROWS into the allocated entry's blocks, through the pool file."""
    info = client.pool_info("shared")
    data, done = ROWS.view(torch.uint8).numpy().tobytes(), 0
    with open(info.path, "r+b") as pool:
        for extent in allocated.extents:
            length = min(extent.count * info.block_size_bytes, len(data) - done)
            pool.seek(info.data_offset + extent.start * info.block_size_bytes)
            pool.write(data[done : done + length])
            done += length


def state(client: Client, key: str) -> EntryState:
    return client.lookup("shared", [key])[0].state


def marker_in_store(master: Master, key: str) -> bool:
    store = store_client(master)
    try:
        return bool(store.is_exist(marker_key(NAMESPACE, key.encode())) == 1)
    finally:
        store.close()


# Daemons under libfaketime run in make test-cluster-faults: one such daemon died of SIGSEGV once
# under a heavily loaded machine (cause not found), and make test must not hang on a flake there.
skewed = pytest.mark.cluster_faults


@contextmanager
def two_nodes(master: Master, *a_args: str, b_clock: str = "") -> Iterator[tuple[Daemon, Daemon]]:
    """Two daemons joined to the store; b's wall clock `b_clock` ("+60s", "-60s") off."""
    b_env = skewed_clock(b_clock) if b_clock else None
    with store_daemon(master, *a_args) as a, store_daemon(master, env=b_env) as b:
        for daemon in (a, b):
            with daemon.client() as client:
                wait_until(lambda: cluster_stats(client).connected, 20)
        if b_clock:  # the shift took: b's log says so
            assert abs(clock_offset(b) - float(b_clock.rstrip("s"))) < 10, clock_offset(b)
        yield a, b


def pending_elsewhere(writer: Client, reader: Client, key: str) -> None:
    """The reader's node, asked by a Step (as the vLLM connector asks), answers PENDING: it
    holds a placeholder for the writer's entry."""
    wait_until(lambda: cluster_stats(writer).claims == 1, 20)
    [answer] = reader.step("shared", acquires=[key.encode()]).acquires
    assert answer.status is Status.PENDING
    assert state(reader, key) is EntryState.PENDING


def test_a_key_being_written_on_one_node_is_waited_for_on_another_and_read_once_committed(
    master: Master,
) -> None:
    with two_nodes(master) as (a, b), shared(a) as writer, shared(b) as reader:
        allocated = allocate(writer, "img")
        wait_until(lambda: cluster_stats(writer).claims == 1, 20)
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(Consumer(reader, "shared").get, "img", wait_ms=20000)
            wait_until(lambda: state(reader, "img") is EntryState.PENDING, 20)
            assert not got.done()
            write(writer, allocated)
            writer.commit("shared", ["img"])
            tensor = got.result(20)
        stats = cluster_stats(reader)
        wait_until(lambda: not marker_in_store(master, "img"), 20)
    assert tensor is not None and torch.equal(tensor, ROWS)
    assert (stats.waits_hit, stats.waits_missed) == (1, 0)


def test_an_abort_on_the_writing_node_lets_the_other_nodes_asker_miss_at_once(
    master: Master,
) -> None:
    with two_nodes(master) as (a, b), shared(a) as writer, shared(b) as reader:
        allocate(writer, "img")
        pending_elsewhere(writer, reader, "img")
        writer.abort("shared", ["img"])
        aborted_at = time.monotonic()
        wait_until(lambda: state(reader, "img") is EntryState.ABSENT, 20)
        missed_after = time.monotonic() - aborted_at
        [answer] = reader.step("shared", acquires=[b"img"]).acquires
        stats = cluster_stats(reader)
        gone = not marker_in_store(master, "img")
    assert answer.status is Status.MISS and gone
    assert (stats.waits_hit, stats.waits_missed) == (0, 1)
    assert missed_after < 1.0


def test_a_producer_killed_mid_write_lets_the_other_nodes_asker_miss_at_once(
    master: Master,
) -> None:
    with two_nodes(master) as (a, b), shared(b) as reader, shared(a, "watcher") as watcher:
        code = textwrap.dedent(f"""
            import time
            from cluster_testing import NAMESPACE, POOL
            from ec_client import AllocateItem, Client
            client = Client({a.address!r}, name="producer")
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            client.allocate("shared", [AllocateItem("img", (16, 2048), "bfloat16")])
            print("writing", flush=True)
            time.sleep(120)
        """)
        with python_killed_after(code, "writing"):
            pending_elsewhere(watcher, reader, "img")
            time.sleep(0.5)  # the daemon probes life marks every 0.2 s: it has seen the mark
        killed_at = time.monotonic()
        wait_until(lambda: state(reader, "img") is EntryState.ABSENT, 20)
        missed_after = time.monotonic() - killed_at
        gone = not marker_in_store(master, "img")
    assert gone
    assert missed_after < 2.0  # the daemon's lease (30 s by default) is not waited


def test_a_marker_nobody_refreshes_is_taken_for_dead_within_its_bound_and_replaced(
    master: Master,
) -> None:
    store = store_client(master)
    key = marker_key(NAMESPACE, b"img")
    try:  # a writer that died long ago left it
        stale = Marker(b"\x01" * 16, ROWS.nbytes, bound_s=pending.BOUND_S)
        store.put(key, stale.pack())
        with store_daemon(master) as b, shared(b) as client:
            wait_until(lambda: cluster_stats(client).connected, 20)  # it joins after serving
            [answer] = client.step("shared", acquires=[b"img"]).acquires  # it cannot tell yet
            wait_until(lambda: state(client, "img") is EntryState.ABSENT, 20)
            wait_until(lambda: store.is_exist(key) == 0, 20)  # removed by the node that waited
            allocate(client, "img")
            wait_until(lambda: cluster_stats(client).claims == 1, 20)
            stats = cluster_stats(client)
            now = Marker.parse(store.get(key))
            client.abort("shared", ["img"])
    finally:
        store.close()
    assert answer.status is Status.PENDING
    assert (stats.waits_hit, stats.waits_missed, stats.claims_lost) == (0, 1, 0)
    assert now is not None and now.writer != stale.writer


@pytest.mark.parametrize(
    "reader_clock",
    [
        pytest.param("", id="same-clock"),
        pytest.param("-60s", id="reader-a-minute-behind", marks=[needs_faketime, skewed]),
    ],
)
def test_a_marker_whose_writers_daemon_died_holds_the_other_node_no_longer_than_its_bound(
    reader_clock: str,
) -> None:
    # A master of its own: the killed daemon's segment stays in a master until its client TTL
    # runs out, and the module's next tests' values placed there could not be read.
    with (
        running_master() as master,
        two_nodes(master, b_clock=reader_clock) as (a, b),
        shared(b) as reader,
    ):
        writer = shared(a)
        allocate(writer, "img")
        pending_elsewhere(writer, reader, "img")
        a.kill()
        killed_at = time.monotonic()
        wait_until(lambda: state(reader, "img") is EntryState.ABSENT, 20)
        missed_after = time.monotonic() - killed_at
        writer.close(flush_timeout_s=0)
        a.start()  # for store_daemon's clean stop
    # its last refresh seen, then the bound by the reader's own clock, and a few polls
    assert missed_after < pending.REFRESH_S + pending.BOUND_S + 1.0


@needs_faketime
@skewed
def test_a_node_whose_clock_runs_a_minute_ahead_waits_for_a_live_claim_and_reads_it_committed(
    master: Master,
) -> None:
    with (
        two_nodes(master, b_clock="+60s") as (a, b),
        shared(a) as writer,
        shared(b) as reader,
    ):
        allocated = allocate(writer, "img")
        pending_elsewhere(writer, reader, "img")  # not taken for expired: no second encode
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(Consumer(reader, "shared").get, "img", wait_ms=20000)
            time.sleep(pending.BOUND_S + 2 * pending.REFRESH_S)  # an encode longer than the bound
            assert state(reader, "img") is EntryState.PENDING and not got.done()
            write(writer, allocated)
            writer.commit("shared", ["img"])
            tensor = got.result(20)
        stats = cluster_stats(reader)
    assert tensor is not None and torch.equal(tensor, ROWS)
    assert (stats.waits_hit, stats.waits_missed) == (1, 0)


@needs_faketime
@skewed
def test_a_node_whose_clock_runs_a_minute_ahead_does_not_take_another_nodes_claim_over(
    master: Master,
) -> None:
    with (
        two_nodes(master, b_clock="+60s") as (a, b),
        shared(a) as first,
        shared(b) as second,
    ):
        allocate(first, "img")
        wait_until(lambda: cluster_stats(first).claims == 1, 20)
        allocate(second, "img")  # its engine found nothing when it asked: it encodes too
        wait_until(lambda: sum(_claimed(cluster_stats(second))) == 1, 20)
        claimed = _claimed(cluster_stats(second))
        second.abort("shared", ["img"])
        allocate(second, "later")  # claimed after the abort's turn on the node's thread
        wait_until(lambda: cluster_stats(second).claims >= 1, 20)
        kept = marker_in_store(master, "img")  # the first node still writes it
        first.abort("shared", ["img"])
        second.abort("shared", ["later"])
    assert claimed == (0, 1) and kept


def _claimed(stats: ClusterStats) -> tuple[int, int]:
    return stats.claims, stats.claims_lost


def test_two_nodes_writing_one_key_at_once_are_counted_and_the_loser_leaves_the_marker_be(
    master: Master,
) -> None:
    with two_nodes(master) as (a, b), shared(a) as first, shared(b) as second:
        allocate(first, "img")
        wait_until(lambda: cluster_stats(first).claims == 1, 20)
        allocate(second, "img")  # its engine found nothing when it asked: it encodes too
        wait_until(lambda: cluster_stats(second).claims_lost == 1, 20)
        second.abort("shared", ["img"])
        allocate(second, "later")  # claimed after the abort's turn on the node's thread
        wait_until(lambda: cluster_stats(second).claims == 1, 20)
        kept = marker_in_store(master, "img")  # the first node still writes it
        first.abort("shared", ["img"])
        wait_until(lambda: not marker_in_store(master, "img"), 20)
        second.abort("shared", ["later"])
    assert kept
