"""A master lost, noticed at once (docs/operations.md, A master that goes away later): a real
`mooncake_master` per test, SIGKILLed (its calls fail) or SIGSTOPped (its calls hang, as over a
link that drops every packet), and daemons joined to it as nodes."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from cluster_testing import (
    NAMESPACE,
    POOL,
    Master,
    cluster_stats,
    pool_stats,
    published,
    running_master,
    settled,
    store_daemon,
)
from ecd_testing import Daemon, wait_until
from hosts_testing import Hosts, master_on, node_on

from ec_client import Client, Consumer, Producer, Status, check_health
from ec_daemon.cluster.calls import CALL_BOUND_S

PULL_TIMEOUT_S = 1.0  # the daemons' default --pull-timeout
SLACK_S = 3.0  # a loaded machine's scheduling delays
ROWS = torch.randn(16, 2048, dtype=torch.bfloat16)


@contextmanager
def shared_node(master: Master) -> Iterator[tuple[Daemon, Client]]:
    """A daemon in the store, connected, and a client of it with the pool "shared" open."""
    with store_daemon(master) as daemon, daemon.client() as client:
        client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        wait_until(lambda: cluster_stats(client).connected, 20)
        yield daemon, client


def put_three(client: Client) -> None:
    """Three puts into the shared pool: each writes a pending marker, then publishes."""
    producer = Producer(client, "shared")
    for i in range(3):
        producer.put(f"after-{i}", ROWS)


def test_a_killed_master_is_noticed_by_the_first_marker_put_and_every_publish_is_counted() -> None:
    with running_master() as master, shared_node(master) as (_, client):
        Producer(client, "shared").put("before", ROWS)
        wait_until(lambda: published(client) == 1, 20)
        master.stop()  # SIGKILL
        put_three(client)
        # the first store call after the kill is the first put's marker
        wait_until(lambda: not cluster_stats(client).connected, CALL_BOUND_S + SLACK_S)
        wait_until(lambda: settled(cluster_stats(client)) == 4, CALL_BOUND_S + SLACK_S)
        stats = cluster_stats(client)
        local = Consumer(client, "shared").get("after-2")
        master.start()  # the daemon leaves the store at its end: ~10 s against a dead master
    assert (stats.published, stats.publish_failures, stats.dropped) == (1, 3, 0), stats
    assert "did not answer" in stats.error, stats.error
    assert local is not None and torch.equal(local, ROWS)


def test_a_hung_master_is_noticed_within_the_call_bound_and_publishes_fail_meanwhile() -> None:
    with running_master() as master, shared_node(master) as (_, client):
        assert master.proc is not None
        master.proc.send_signal(signal.SIGSTOP)  # its calls hang (the store client's 30 s)
        try:
            put_three(client)
            wait_until(lambda: not cluster_stats(client).connected, CALL_BOUND_S + SLACK_S)
            # the call that hangs holds the first put's marker; the publishes fail, counted
            wait_until(lambda: settled(cluster_stats(client)) == 3, SLACK_S)
            stats = cluster_stats(client)
        finally:
            master.proc.send_signal(signal.SIGCONT)
    assert (stats.published, stats.publish_failures) == (0, 3), stats
    assert "has not answered" in stats.error, stats.error


@contextmanager
def node_cut_from_its_master() -> Iterator[tuple[Master, Daemon, Client]]:
    """A master; a daemon that holds "local" in its shared pool, published; then the master
    SIGSTOPped: a node cut from it (its calls hang, as over a link that drops every packet).
    Yields the master (SIGCONT heals the cut), the daemon and a client of it."""
    with running_master() as master, shared_node(master) as (daemon, client):
        Producer(client, "shared").put("local", ROWS)
        wait_until(lambda: published(client) == 1, 20)
        assert master.proc is not None
        master.proc.send_signal(signal.SIGSTOP)
        try:
            yield master, daemon, client
        finally:
            master.proc.send_signal(signal.SIGCONT)


def remote_lookup(client: Client, key: bytes) -> tuple[Status, float]:
    """A Step's acquire of `key`, which the node's shared pool lacks: its answer, its time."""
    started = time.monotonic()
    [answer] = client.step("shared", acquires=[key]).acquires
    return answer.status, time.monotonic() - started


def test_a_node_cut_from_its_master_fails_its_first_lookup_in_bound_and_later_ones_at_once() -> (
    None
):
    with node_cut_from_its_master() as (_, daemon, client):
        first, took = remote_lookup(client, b"elsewhere")
        failed_at = time.monotonic()
        wait_until(lambda: not cluster_stats(client).connected, 1.0 + SLACK_S)
        noticed = time.monotonic() - failed_at
        wait_until(
            lambda: check_health(daemon.address, service="ecd.cluster") == "NOT_SERVING",
            1.0 + SLACK_S,  # it is checked every second
        )
        before = cluster_stats(client).lookup_failures
        later = [remote_lookup(client, b"elsewhere-%d" % i)[0] for i in range(3)]
        after = cluster_stats(client).lookup_failures
        hits = [Consumer(client, "shared").get("local") for _ in range(20)]
        stats = pool_stats(client, "shared")
    assert first is Status.MISS and took < PULL_TIMEOUT_S + SLACK_S, took
    assert noticed < 1.0 + SLACK_S, noticed
    # not made: each a miss at once, counted, with no call waiting behind the hung one
    assert later == [Status.MISS] * 3
    assert after == before + 3
    assert all(hit is not None and torch.equal(hit, ROWS) for hit in hits)  # local: 0 errors
    assert (stats.entries_ready, stats.entries_pending, stats.held_blocks) == (1, 0, 0)


def test_a_node_cut_from_its_master_rejoins_when_the_cut_heals_and_publishes_again() -> None:
    with node_cut_from_its_master() as (master, _, client):
        remote_lookup(client, b"elsewhere")
        wait_until(lambda: not cluster_stats(client).connected, 1.0 + SLACK_S)
        assert master.proc is not None
        master.proc.send_signal(signal.SIGCONT)  # healed
        wait_until(lambda: cluster_stats(client).connected, 1.0 + SLACK_S)
        Producer(client, "shared").put("after", ROWS)
        # Counted published whichever puts it first: its commit's publish, or the walk the rejoin
        # may start (its commit's publish then finds it stored), which `settled` would not count.
        wait_until(lambda: published(client) == 2, SLACK_S)
        stats = cluster_stats(client)
    assert (stats.published, stats.publish_failures) == (2, 0), stats


@pytest.mark.cluster_faults  # three processes in network namespaces: make test-cluster-faults
def test_a_node_cut_from_its_master_on_test_hosts_serves_locally_fails_fast_and_rejoins(
    hosts: Hosts,
) -> None:
    """A true partition: the node's packets to and from the master's host vanish."""
    on_master, on_a, on_b = hosts.add("master"), hosts.add("node-a"), hosts.add("node-b")
    with (
        master_on(on_master) as master,
        node_on(on_a, master) as a,
        node_on(on_b, master) as b,
        a.client() as ca,
        b.client() as cb,
    ):
        for client in (ca, cb):
            wait_until(lambda c=client: cluster_stats(c).connected, 20)  # they join after serving
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        Producer(ca, "shared").put("remote", ROWS)
        Producer(cb, "shared").put("local", ROWS)
        wait_until(lambda: published(ca) == 1 and published(cb) == 1, 20)
        hosts.cut(on_b, on_master)
        first, took = remote_lookup(cb, b"remote")
        wait_until(lambda: not cluster_stats(cb).connected, 1.0 + SLACK_S)
        before = cluster_stats(cb).lookup_failures
        later = [remote_lookup(cb, b"remote-%d" % i)[0] for i in range(3)]
        after = cluster_stats(cb).lookup_failures
        hits = [Consumer(cb, "shared").get("local") for _ in range(20)]
        hosts.heal(on_b, on_master)
        wait_until(lambda: cluster_stats(cb).connected, 30)
        got = Consumer(cb, "shared").get("remote", wait_ms=5000)
    assert first is Status.MISS and took < PULL_TIMEOUT_S + SLACK_S, took
    assert later == [Status.MISS] * 3 and after == before + 3
    assert all(hit is not None and torch.equal(hit, ROWS) for hit in hits)
    assert got is not None and torch.equal(got, ROWS)
