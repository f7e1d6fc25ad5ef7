"""Failures of the cluster tier on real processes (docs/design.md §13, docs/operations.md): a
real `mooncake_master` per test (each kills a process the store counts on, whose segment the
master would go on placing replicas in until its client TTL runs out) and daemons as nodes, each
with its own shm directory and transfer port."""

from __future__ import annotations

import itertools
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from cluster_testing import (
    NAMESPACE,
    POOL,
    cluster_stats,
    commits_published,
    pool_stats,
    published,
    running_master,
    settled,
    store_daemon,
)
from ecd_testing import Daemon, assert_blocks_accounted, run_ecd, running_daemon, wait_until

from ec_client import Client, Consumer, Producer, Status, check_health

PULL_TIMEOUT_S = 1.0  # the daemons' default --pull-timeout
SLACK_S = 3.0  # a loaded machine's scheduling delays, below the ~4 s a store call waits


def health(daemon: Daemon) -> str:
    return check_health(daemon.address, service="ecd.cluster")


@contextmanager
def only_in_the_segment_of_a_publisher(
    tensors: dict[str, torch.Tensor],
) -> Iterator[tuple[Daemon, Client]]:
    """A master; a daemon `near` that published `tensors` from its pool "shared"; then a daemon
    that joined after it, so that the values' only replicas are in the segment of `near`, and a
    client of it with the pool open. `near` is the test's to stop or kill."""
    with running_master() as master, running_daemon(*master.flags()) as near:
        with near.client() as producer:
            producer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            Producer(producer, "shared").put_many(tensors)
            wait_until(lambda: published(producer) == len(tensors), 20)
        with store_daemon(master) as far, far.client() as consumer:
            wait_until(lambda: cluster_stats(consumer).connected, 20)  # it joins after serving
            consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            yield near, consumer


def test_a_node_that_published_and_died_is_a_clean_counted_miss_and_the_encoder_runs() -> None:
    rows = torch.randn(256, 2048, dtype=torch.bfloat16)
    with only_in_the_segment_of_a_publisher({"died": rows}) as (near, consumer):
        near.kill()
        started = time.monotonic()
        [answer] = consumer.step("shared", acquires=[b"died"]).acquires
        took = time.monotonic() - started
        stats = pool_stats(consumer, "shared")
        assert_blocks_accounted(consumer, "shared")
        Producer(consumer, "shared").put("died", rows)  # the engine encodes it: not PENDING
        again = Consumer(consumer, "shared").get("died")
    assert answer.status is Status.MISS and took < PULL_TIMEOUT_S + SLACK_S, took
    assert (stats.remote_reads, stats.remote_misses, stats.remote_hits) == (1, 1, 0)
    assert (stats.entries_ready, stats.entries_pending, stats.held_blocks) == (0, 0, 0)
    assert again is not None and torch.equal(again, rows)


def test_a_read_cut_half_way_commits_nothing_and_gives_its_blocks_back() -> None:
    big = torch.randn(8192, 2048, dtype=torch.bfloat16)  # 32 MiB: 8192 blocks
    rows = torch.randn(16, 2048, dtype=torch.bfloat16)
    with only_in_the_segment_of_a_publisher({"cut": big, "late": rows}) as (near, consumer):
        assert near.proc is not None
        near.proc.send_signal(signal.SIGSTOP)  # its transfer engine stops answering the read
        [answer] = consumer.step("shared", acquires=[b"cut"]).acquires  # gave up on it
        during = pool_stats(consumer, "shared")
        # its lookup queued behind the read, and given up on with its asker: it is never made
        [late] = consumer.step("shared", acquires=[b"late"]).acquires
        near.kill()  # the read in flight fails
        wait_until(lambda: pool_stats(consumer, "shared").held_blocks == 0, 20)
        consumer.step("shared", acquires=[b"behind-them"])  # the node's thread got past both
        after = pool_stats(consumer, "shared")
        assert_blocks_accounted(consumer, "shared")
        missed = Consumer(consumer, "shared").get("cut", wait_ms=1)
    assert answer.status is Status.MISS and late.status is Status.MISS and missed is None
    # given up on, the entry went at once; the read still in flight kept its blocks held
    assert (during.entries_ready, during.entries_pending, during.held_blocks) == (0, 0, 8192)
    assert (after.entries_ready, after.entries_pending, after.remote_hits) == (0, 0, 0)
    assert (after.remote_reads, after.remote_misses) == (1, 1)
    assert after.free_blocks == after.num_blocks


def test_a_master_restart_fails_calls_fast_local_hits_never_notice_and_the_store_resumes() -> None:
    old, new = (
        torch.randn(64, 2048, dtype=torch.bfloat16),
        torch.randn(64, 2048, dtype=torch.bfloat16),
    )
    with (
        running_master() as master,
        store_daemon(master) as a,
        store_daemon(master) as b,
        a.client() as ca,
        b.client() as cb,
    ):
        for client in (ca, cb):
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        producer = Producer(ca, "shared")
        producer.put("read-before", old)
        wait_until(lambda: published(ca) == 1, 20)
        assert torch.equal(Consumer(cb, "shared").get("read-before", wait_ms=5000), old)
        reads = pool_stats(cb, "shared").remote_reads

        master.stop()
        # the calls that find it gone may each wait the store client's RPC timeout (~4 s)
        producer.put("finds-it-gone", old)
        cb.step("shared", acquires=[b"finds-it-gone-too"])
        wait_until(lambda: not cluster_stats(ca).connected and not cluster_stats(cb).connected, 20)
        for i in range(3):  # from then on each publish fails fast, counted
            failed = cluster_stats(ca).publish_failures
            producer.put(f"down-{i}", old)
            wait_until(lambda n=failed + 1: cluster_stats(ca).publish_failures == n, SLACK_S)
        lookups_failed = cluster_stats(cb).lookup_failures
        started = time.monotonic()
        [miss] = cb.step("shared", acquires=[b"never-published"]).acquires  # no lookup made
        assert miss.status is Status.MISS and time.monotonic() - started < SLACK_S
        assert cluster_stats(cb).lookup_failures > lookups_failed
        local = Consumer(cb, "shared").get("read-before")  # a local hit: no store call
        assert local is not None and torch.equal(local, old)
        assert pool_stats(cb, "shared").remote_reads == reads
        wait_until(lambda: health(b) == "NOT_SERVING", 5)
        assert "NOT CONNECTED" in run_ecd("stats", "--address", b.address).stdout

        master.start()  # on the same ports, its directory empty
        for daemon in (a, b):
            wait_until(lambda d=daemon: health(d) == "SERVING", 20)
        assert "connected; published" in run_ecd("stats", "--address", b.address).stdout
        # the clients mount their segments again by themselves, within seconds: until then
        # the master has no room for a value (a publish fails, counted)
        deadline = time.monotonic() + 20
        for i in itertools.count():
            key, before = f"after-{i}", cluster_stats(ca)
            producer.put(key, new)
            wait_until(lambda b=before: settled(cluster_stats(ca)) > settled(b), 5)
            if commits_published(cluster_stats(ca)) > commits_published(before):
                break
            assert time.monotonic() < deadline, "no publish lands after the restart"
        got = Consumer(cb, "shared").get(key, wait_ms=5000)
    assert got is not None and torch.equal(got, new)


def test_a_full_store_evicts_and_a_node_whose_segment_is_full_serves_locally() -> None:
    value = 8 << 20  # bytes of each value: 2048 x 2048 bfloat16
    segment = 24 << 20  # the node's segment, the whole store: two or three values
    most = 24  # puts before the test gives up on the master ever evicting
    too_big = torch.ones(8192, 2048, dtype=torch.bfloat16)  # 32 MiB, more than the whole store
    pool = dict(POOL, capacity_bytes=most * value + too_big.nbytes + (16 << 20))
    # leases short enough that a published value may be evicted at once (default 10 s)
    with (
        running_master("--default_kv_lease_ttl=50") as master,
        store_daemon(master, "--store-segment-bytes", "24MiB") as daemon,
        daemon.client() as client,
    ):
        client.open_pool("shared", **pool, cluster_namespace=NAMESPACE)
        producer = Producer(client, "shared")
        tensors: list[torch.Tensor] = []
        # One at a time, a store filling up, until it took more than its segment holds: the
        # master evicts on a thread of its own, after the puts that found it full failed (a
        # loaded machine has seen 7 in a row fail first), so the count of puts is not fixed.
        while cluster_stats(client).published * value <= segment and len(tensors) < most:
            i = len(tensors)
            tensors.append(torch.full((2048, 2048), i, dtype=torch.bfloat16))
            producer.put(f"full-{i}", tensors[i])
            wait_until(lambda n=i + 1: settled(cluster_stats(client)) == n, 20)
        producer.put("too-big", too_big)
        wait_until(lambda: settled(cluster_stats(client)) == len(tensors) + 1, 20)
        stats = cluster_stats(client)
        served = [Consumer(client, "shared").get(f"full-{i}") for i in range(len(tensors))]
        big = Consumer(client, "shared").get("too-big")
        assert check_health(daemon.address) == "SERVING"
    assert stats.connected and stats.publish_failures > 0, stats
    # more than the segment holds: the master evicted
    assert stats.published * value > segment, (len(tensors), stats)
    assert all(t is not None and torch.equal(t, e) for t, e in zip(served, tensors, strict=True))
    assert big is not None and torch.equal(big, too_big)
