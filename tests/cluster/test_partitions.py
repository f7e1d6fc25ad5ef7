"""Partitions on test hosts (tests/hosts_testing.py; docs/design.md §13, docs/operations.md,
Several nodes): a partition degrades the cluster, never corrupts it. A node cut from the node
that holds an entry while reading it misses cleanly within --pull-timeout and gives the entry's
blocks back; nodes cut from the master serve their local entries, and the nodes still with it
serve each other; a node whose link to the master heals is back within a second."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
import torch
from cluster_testing import NAMESPACE, POOL, cluster_stats, pool_stats, published
from ecd_testing import assert_blocks_accounted, wait_until
from hosts_testing import Host, Hosts, master_on, node_on

from ec_client import Client, Consumer, Producer, Status
from ec_protocol.types import AcquireResult

PULL_TIMEOUT_S = 3.0  # the reader's --pull-timeout: its read over the slow link takes ~1 s
SLACK_S = 3.0  # a loaded machine's scheduling delays
# Mooncake 0.3.13's store client waits this long for a batch of transfers, then fails it: a read
# from a node cut off mid-way is over (its blocks given back) no sooner.
TRANSFER_WAIT_S = 60.0
# How long a cut lasts past the call it holds: TCP resends that call's bytes 0.2, 0.6, 1.4, 3.0,
# 6.2 and 12.6 s after it was sent, so a node that waited for the resend would be back 5 s
# after this heal.
CUT_S = 7.0
REJOIN_S = 1.0  # docs/operations.md, Partitions: back within a second of the heal


def open_shared(*clients: Client) -> None:
    for client in clients:
        client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)


@dataclass
class Reading:
    """A read on `far` from `near`'s segment cut mid-way: its asker's `answer`, `took` seconds
    after the ask."""

    near: Host
    far: Host
    consumer: Client  # of far, with "shared" open
    answer: AcquireResult
    took: float


@contextmanager
def cut_mid_read(hosts: Hosts, value: torch.Tensor) -> Iterator[Reading]:
    """A master; a node `near` that published `value` as "cut" from its segment; a node `far`
    whose link is slow (100 ms), asking for it with a Step; `near` and `far` cut from each
    other once far's read began (its entry PENDING). Healed on exit."""
    on_master, on_near, on_far = hosts.add("master"), hosts.add("near"), hosts.add("far")
    hosts.shape(on_far, delay_ms=100)  # 8 MiB then takes ~1 s: the cut comes mid-read
    with (
        master_on(on_master) as master,
        node_on(on_near, master) as near,
        node_on(on_far, master, "--pull-timeout", str(PULL_TIMEOUT_S)) as far,
        near.client() as producer,
        far.client() as consumer,
        far.client() as asker,
        ThreadPoolExecutor(1) as background,
    ):
        open_shared(producer)
        Producer(producer, "shared").put("cut", value)
        wait_until(lambda: published(producer) == 1, 20)
        wait_until(lambda: cluster_stats(consumer).connected, 20)  # it joins after serving
        open_shared(consumer, asker)
        started = time.monotonic()
        asking = background.submit(lambda: asker.step("shared", acquires=[b"cut"]).acquires)
        wait_until(lambda: pool_stats(consumer, "shared").entries_pending == 1, 10)
        hosts.cut(on_far, on_near)
        try:
            [answer] = asking.result()
            yield Reading(on_near, on_far, consumer, answer, time.monotonic() - started)
        finally:
            if (on_far.name, on_near.name) in hosts.cuts:
                hosts.heal(on_far, on_near)  # so that the daemons leave the store cleanly


def test_a_node_cut_from_the_holder_mid_read_misses_within_the_pull_timeout_and_gives_blocks_back(
    hosts: Hosts,
) -> None:
    value = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB: 2048 blocks
    rows = torch.randn(16, 2048, dtype=torch.bfloat16)
    with cut_mid_read(hosts, value) as reading:
        during = pool_stats(reading.consumer, "shared")
        Producer(reading.consumer, "shared").put("here", rows)  # the cut node serves locally
        local = Consumer(reading.consumer, "shared").get("here")

        hosts.heal(reading.far, reading.near)  # the read in flight then ends
        wait_until(lambda: pool_stats(reading.consumer, "shared").held_blocks == 0, 30)
        assert_blocks_accounted(reading.consumer, "shared")
        after = pool_stats(reading.consumer, "shared")
        again = Consumer(reading.consumer, "shared").get("cut", wait_ms=10_000)
    assert reading.answer.status is Status.MISS, reading.answer
    assert reading.took < PULL_TIMEOUT_S + SLACK_S, reading.took
    assert (during.entries_pending, during.remote_hits, during.remote_misses) == (0, 0, 1)
    assert local is not None and torch.equal(local, rows)
    assert (after.entries_ready, after.entries_pending, after.held_blocks) == (1, 0, 0)
    assert again is not None and torch.equal(again, value)  # the daemon reads remotely again


@pytest.mark.cluster_faults
def test_a_read_cut_for_good_gives_its_blocks_back_when_the_store_fails_it_and_the_node_serves_on(
    hosts: Hosts,
) -> None:
    value = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB: 2048 blocks
    with cut_mid_read(hosts, value) as reading:
        started = time.monotonic() - reading.took
        # the node's store thread is held by the read: another key's Acquire is a miss at its
        # bound (its lookup never made), not a hang
        asked = time.monotonic()
        [other] = reading.consumer.step("shared", acquires=[b"other"]).acquires
        other_took = time.monotonic() - asked
        wait_until(
            lambda: pool_stats(reading.consumer, "shared").held_blocks == 0,
            TRANSFER_WAIT_S + 2 * SLACK_S,
        )
        held_s = time.monotonic() - started
        assert_blocks_accounted(reading.consumer, "shared")
        after = pool_stats(reading.consumer, "shared")
        connected = cluster_stats(reading.consumer).connected  # still cut from `near` alone
    print(f"blocks held {held_s:.1f} s after the read began; other key's miss {other_took:.1f} s")
    assert reading.answer.status is Status.MISS and other.status is Status.MISS
    assert other_took < PULL_TIMEOUT_S + SLACK_S, other_took
    assert (after.entries_ready, after.entries_pending, after.held_blocks) == (0, 0, 0)
    assert after.free_blocks == after.num_blocks
    assert connected


def test_nodes_cut_from_the_master_hit_locally_and_the_others_serve_each_other(
    hosts: Hosts,
) -> None:
    on_master = hosts.add("master")
    with_master = [hosts.add("with-1"), hosts.add("with-2")]
    cut_off = [hosts.add("cut-1"), hosts.add("cut-2")]
    before, after = (torch.randn(64, 2048, dtype=torch.bfloat16) for _ in range(2))
    with master_on(on_master) as master, ExitStack() as stack:
        daemons = [stack.enter_context(node_on(host, master)) for host in with_master + cut_off]
        clients = [stack.enter_context(daemon.client()) for daemon in daemons]
        writer, reader, *isolated = clients
        for client in clients:
            wait_until(lambda c=client: cluster_stats(c).connected, 20)  # joined
        open_shared(*clients)
        Producer(writer, "shared").put("before", before)
        for i, client in enumerate(isolated):
            Producer(client, "shared").put(f"own-{i}", before)
        wait_until(lambda: published(writer) == 1, 20)

        for host in cut_off:
            hosts.cut(on_master, host)
            stack.callback(hosts.heal, on_master, host)  # first thing on the way out
        Producer(writer, "shared").put("after", after)
        wait_until(lambda: published(writer) == 2, 20)
        got = Consumer(reader, "shared").get_many(["before", "after"], wait_ms=5000)
        local = [Consumer(c, "shared").get(f"own-{i}") for i, c in enumerate(isolated)]
        read = pool_stats(reader, "shared")
    assert torch.equal(got["before"], before) and torch.equal(got["after"], after)
    assert (read.remote_hits, read.remote_misses) == (2, 0)
    assert all(t is not None and torch.equal(t, before) for t in local)


@pytest.mark.cluster_faults  # a 7 s cut and three processes on test hosts: ~20 s
def test_a_node_cut_from_the_master_is_back_within_a_second_of_the_heal_and_reads_remotely(
    hosts: Hosts,
) -> None:
    on_master, on_a, on_b = hosts.add("master"), hosts.add("node-a"), hosts.add("node-b")
    rows = torch.randn(16, 2048, dtype=torch.bfloat16)
    with master_on(on_master) as master, ExitStack() as stack:
        a = stack.enter_context(node_on(on_a, master))
        ca = stack.enter_context(a.client())
        wait_until(lambda: cluster_stats(ca).connected, 20)  # it joins after serving
        open_shared(ca)
        Producer(ca, "shared").put("remote", rows)  # in a's segment: b has none yet
        wait_until(lambda: published(ca) == 1, 20)
        b = stack.enter_context(node_on(on_b, master))
        cb = stack.enter_context(b.client())
        wait_until(lambda: cluster_stats(cb).connected, 20)
        open_shared(cb)
        hosts.cut(on_b, on_master)
        cut_at = time.monotonic()
        [lookup] = cb.step("shared", acquires=[b"elsewhere"]).acquires  # the call the cut holds
        wait_until(lambda: not cluster_stats(cb).connected, 1.0 + SLACK_S)
        time.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))
        hosts.heal(on_b, on_master)
        healed_at = time.monotonic()
        wait_until(lambda: cluster_stats(cb).connected, 30)
        back_s = time.monotonic() - healed_at
        got = Consumer(cb, "shared").get("remote", wait_ms=5000)
    print(f"back {back_s:.2f} s after the heal of a {CUT_S:g} s cut")
    assert lookup.status is Status.MISS
    assert back_s < REJOIN_S + 1.0, back_s  # a second more: a loaded machine's delays
    assert got is not None and torch.equal(got, rows)
