"""The directory comes back (docs/design.md §13): when the store has lost what a node published
(its master restarted with an empty directory, or the node's own segment gone with an earlier
run of its daemon), the node publishes its shared pools' READY entries again, and every entry
some node still holds is a remote hit again, bit-identical; so does a node whose entry's copy in
the store went, at its next walk (--republish-every). A real `mooncake_master`, SIGKILLed and
started again on its ports, and two real daemons: one that writes and lends the store its
segment (every value is in it), one that reads, lends none and walks its pools every second."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

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
    scrape,
    store_client,
    store_daemon,
)
from ecd_testing import Daemon, run_ecd, wait_until

from ec_client import Client, Consumer, Producer
from ec_daemon.cluster import codec
from ec_daemon.tools.spawn import free_port

# How long a node may take to have the store hold again what it lost: a node asks for its mark
# within 5 s of the master's return, then walks its pools (here, a batch).
REPUBLISH_S = 30


@dataclass
class Nodes:
    master: Master
    near: Daemon  # writes; every value the store holds is in its segment
    far: Daemon  # reads; lends the store no segment
    metrics_port: int  # near's


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    port = free_port()
    with (
        running_master() as master,
        store_daemon(master, "--metrics-port", str(port)) as near,
        store_daemon(master, "--store-segment-bytes", "0", "--republish-every", "1") as far,
    ):
        yield Nodes(master, near, far, port)


@pytest.fixture
def clients(nodes: Nodes) -> Iterator[tuple[Client, Client]]:
    """A client of each node with the pool "shared" open, dropped at the end (its entries are
    then no node's, and never republished in another test)."""
    with nodes.near.client() as writer, nodes.far.client() as reader:
        for client in (writer, reader):
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        yield writer, reader
        for client in (writer, reader):
            client.drop_pool("shared", force=True)


def tensors(*keys: str) -> dict[str, torch.Tensor]:
    return {key: torch.randn(64, 2048, dtype=torch.bfloat16) for key in keys}


def remote_hits(reader: Client, wanted: dict[str, torch.Tensor]) -> dict[str, bool]:
    """For each key, whether the reader's node read it from the store, bit-identical, within
    REPUBLISH_S: read again while some are missing (not republished yet; or the reader node's
    first store call after its master restarted went to the old connection, an empty answer,
    as its store client reconnects)."""
    deadline = time.monotonic() + REPUBLISH_S
    while True:
        got = Consumer(reader, "shared").get_many(list(wanted), wait_ms=1000)
        hits = {k: got[k] is not None and torch.equal(got[k], t) for k, t in wanted.items()}
        if all(hits.values()) or time.monotonic() > deadline:
            return hits


def missed(reader: Client, key: str) -> bool:
    return Consumer(reader, "shared").get(key, wait_ms=1000) is None


def published_from(writer: Client, entries: dict[str, torch.Tensor]) -> None:
    before = published(writer)
    Producer(writer, "shared").put_many(entries)
    wait_until(lambda: published(writer) == before + len(entries), 20)


def test_a_master_restarted_empty_has_every_entry_a_node_holds_again_as_remote_hits(
    nodes: Nodes, clients: tuple[Client, Client]
) -> None:
    writer, reader = clients
    held = tensors("a", "b", "c", "d", "e")
    published_from(writer, held)
    before = cluster_stats(writer)

    nodes.master.stop()  # SIGKILL
    nodes.master.start()  # on its ports, its directory empty
    assert remote_hits(reader, held) == dict.fromkeys(held, True)
    wait_until(lambda: cluster_stats(writer).republished == before.republished + 5, 5)
    stats, reads = cluster_stats(writer), pool_stats(reader, "shared")
    line = run_ecd("stats", "--address", nodes.near.address).stdout
    metrics = scrape(nodes.metrics_port)
    assert reads.remote_hits == len(held)
    assert stats.republish_batches > before.republish_batches
    assert stats.last_republish > before.last_republish
    counted = f"republished {stats.republished} in {stats.republish_batches} batches, the last at"
    assert counted in line, line
    assert metrics["ecd_cluster_republished_total"] == stats.republished
    assert metrics["ecd_cluster_republish_batches_total"] == stats.republish_batches
    assert metrics["ecd_cluster_last_republish_timestamp_seconds"] == stats.last_republish


def test_an_entry_evicted_or_a_pool_dropped_while_the_master_was_away_is_not_republished(
    nodes: Nodes, clients: tuple[Client, Client]
) -> None:
    writer, reader = clients
    kept, evicted, dropped = tensors("kept"), tensors("evicted"), tensors("dropped")
    writer.open_pool("other", **POOL, cluster_namespace=NAMESPACE)
    before = cluster_stats(writer)
    Producer(writer, "other").put_many(dropped)
    Producer(writer, "shared").put_many({**kept, **evicted})
    wait_until(lambda: published(writer) == before.published + 3, 20)

    nodes.master.stop()
    writer.evict("shared", ["evicted"])
    writer.drop_pool("other", force=True)
    nodes.master.start()
    assert remote_hits(reader, kept) == {"kept": True}
    wait_until(lambda: cluster_stats(writer).republished == before.republished + 1, 5)
    assert missed(reader, "evicted") and missed(reader, "dropped")
    assert cluster_stats(writer).republished == before.republished + 1


def test_a_restarted_daemon_republishes_what_its_old_segment_held_then_a_master_restart_too(
    nodes: Nodes, clients: tuple[Client, Client]
) -> None:
    writer, reader = clients
    first, later = tensors("x", "y"), tensors("z")
    published_from(writer, first)

    nodes.near.restart(signal.SIGTERM)  # its segment leaves the store; its pool stays here
    writer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)  # adopted, shared again
    assert remote_hits(reader, first) == dict.fromkeys(first, True)
    wait_until(lambda: cluster_stats(writer).republished == len(first), 5)

    reader.delete("shared", list(first))  # the writer's node alone holds them again
    published_from(writer, later)
    nodes.master.stop()
    nodes.master.start()
    assert remote_hits(reader, {**first, **later}) == dict.fromkeys([*first, *later], True)
    everything = len(first) + len(first) + len(later)
    wait_until(lambda: cluster_stats(writer).republished == everything, 5)


def test_an_entry_whose_copy_in_the_store_went_is_put_back_by_another_node_that_holds_it(
    nodes: Nodes, clients: tuple[Client, Client]
) -> None:
    writer, reader = clients
    held = tensors("held")
    published_from(writer, held)
    assert remote_hits(reader, held) == {"held": True}  # the reader's node holds it too
    writer.evict("shared", ["held"])  # now only the reader's node holds it
    before = cluster_stats(reader)

    store = store_client(nodes.master)  # the store's copy, the writer's, removed
    try:
        store.batch_remove([codec.store_key(NAMESPACE, b"held")], True)
        assert store.is_exist(codec.store_key(NAMESPACE, b"held")) == 0
    finally:
        store.close()
    assert remote_hits(writer, held) == {"held": True}
    assert cluster_stats(reader).republished > before.republished  # the reader's node put it


@pytest.mark.cluster_faults
def test_a_daemon_killed_and_restarted_at_once_puts_back_what_its_old_segment_took() -> None:
    # The checker's finding: the restarted daemon's walk finds the key still listed (its old
    # segment goes at the master's client TTL, 10 s) and skips it; the value goes with it.
    with (
        running_master() as master,
        store_daemon(master, "--republish-every", "1") as near,
        store_daemon(master, "--store-segment-bytes", "0") as far,
        near.client() as writer,
        far.client() as reader,
    ):
        for client in (writer, reader):
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        held = tensors("held")
        published_from(writer, held)  # into near's segment, the only one

        near.restart(signal.SIGKILL)
        writer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)  # adopted, walked
        wait_until(lambda: cluster_stats(writer).already_stored == 1, 10)
        assert cluster_stats(writer).republished == 0  # found listed, skipped
        assert remote_hits(reader, held) == {"held": True}
        assert cluster_stats(writer).republished == 1
