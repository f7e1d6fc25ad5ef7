"""A store with several masters (docs/design.md §13, docs/operations.md, A store with several
masters): real etcd, real masters electing a leader through it (the directory replicated by
their oplog), real daemons that follow the leader (`--store-master etcd://...`)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable

import pytest
import torch
from cluster_testing import NAMESPACE, POOL, cluster_stats, needs_mooncake, store_daemon
from ecd_testing import run_ecd, wait_until
from ha_testing import HAStore, needs_etcd, running_etcd, running_ha_store
from prometheus_client.parser import text_string_to_metric_families

from ec_client import Client, Consumer, Producer, PutStatus
from ec_client.types import Key
from ec_daemon.tools.spawn import free_port

pytestmark = [needs_mooncake, needs_etcd]


def rows(i: int) -> torch.Tensor:
    """An entry of 16 KiB (4 rows of 2048 bf16) whose bytes say which it is."""
    return torch.full((4, 2048), float(i % 251), dtype=torch.bfloat16)


def leader_metrics(port: int) -> dict[str, str | float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        samples = [s for family in families for s in family.samples]
    [changes] = [s.value for s in samples if s.name == "ecd_cluster_leader_changes_total"]
    [leader] = [s.labels["leader"] for s in samples if s.name == "ecd_cluster_leader"]
    return {"leader": leader, "changes": changes}


def test_a_daemon_given_the_etcd_endpoints_joins_the_leader_and_names_it() -> None:
    port = free_port()
    with running_ha_store() as ha, store_daemon(ha, "--metrics-port", str(port)) as daemon:
        leader = ha.leader()
        with daemon.client() as client:
            wait_until(lambda: cluster_stats(client).connected, 30)
            stats = cluster_stats(client)
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
            Producer(client, "shared").put("k", rows(1))
            wait_until(lambda: cluster_stats(client).published == 1, 20)
        line = run_ecd("stats", "--address", daemon.address).stdout
        scraped = leader_metrics(port)
    assert (stats.master, stats.leader, stats.leader_changes) == (ha.address, leader.address, 0)
    assert f"store {ha.address} (leader {leader.address}, 0 leader changes) connected" in line
    assert scraped == {"leader": leader.address, "changes": 0}


def test_a_daemon_whose_etcd_names_no_leader_serves_locally_and_says_why() -> None:
    with (
        running_etcd() as etcd,
        store_daemon(HAStore(etcd, [])) as daemon,
        daemon.client() as client,
    ):
        wait_until(lambda: "no master leads the store" in cluster_stats(client).error, 20)
        client.open_pool("local", **POOL)
        Producer(client, "local").put("k", rows(1))
        got = Consumer(client, "local").get("k")
        stats = cluster_stats(client)
    assert got is not None and torch.equal(got, rows(1))
    assert (stats.connected, stats.leader, stats.leader_changes) == (False, "", 0)


class Loop(threading.Thread):
    """`step` again and again on its own client until stopped, counting the calls that raised
    and the answers that were wrong (step returns False)."""

    def __init__(self, client: Client, step: Callable[[int], bool]) -> None:
        super().__init__(daemon=True)
        self.client, self.step = client, step
        self.calls = self.errors = self.wrong = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                if not self.step(self.calls):
                    self.wrong += 1
            except Exception:
                self.errors += 1
            self.calls += 1
            time.sleep(0.02)

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)


@pytest.mark.slow
def test_a_leader_killed_under_load_is_followed_with_nothing_lost() -> None:
    """SIGKILL the leader while both nodes put and get: local hits never notice, remote hits
    resume once the new leader serves, the publishes made meanwhile are retried and every one
    reaches the other node, and both nodes name the new leader. No periodic walk (it would put
    back, a minute later, what a retry failed to)."""
    before = 8
    with (
        running_ha_store() as ha,
        store_daemon(ha, "--republish-every", "0") as near,
        store_daemon(ha, "--republish-every", "0") as far,
        near.client() as producer,
        near.client() as near_reader,
        far.client() as consumer,
        far.client() as far_reader,
    ):
        for client in (producer, near_reader, consumer, far_reader):
            client.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        Producer(producer, "shared").put_many({f"before-{i}": rows(i) for i in range(before)})
        wait_until(lambda: cluster_stats(producer).published == before, 20)
        # far reads before-0 from the store: from now on a local hit there
        assert Consumer(consumer, "shared").get("before-0", wait_ms=5000) is not None

        put: list[str] = []

        def publish(i: int) -> bool:  # a local put on near, published in the background
            key = f"during-{i}"
            status = Producer(producer, "shared").put(key, rows(i))
            put.append(key)
            return status is PutStatus.COMMITTING

        def local_hit(reader: Client, key: str, i: int) -> Callable[[int], bool]:
            def get(_: int) -> bool:
                got = Consumer(reader, "shared").get(key)
                return got is not None and torch.equal(got, rows(i))

            return get

        loops = [
            Loop(producer, publish),
            Loop(near_reader, local_hit(near_reader, "before-3", 3)),
            Loop(far_reader, local_hit(far_reader, "before-0", 0)),
        ]
        for loop in loops:
            loop.start()
        time.sleep(1.0)
        old = ha.leader()
        serving: list[float] = []  # when the new leader serves (Mooncake's own failover)

        def new_leader_serves() -> None:
            ha.leader()
            serving.append(time.monotonic())

        waiter = threading.Thread(target=new_leader_serves)
        killed = time.monotonic()
        old.kill()
        waiter.start()
        remote = Consumer(consumer, "shared")
        # remote hits: misses while no master serves, then before-1 read from its replica
        hit = None
        while hit is None and time.monotonic() - killed < 90:
            hit = remote.get("before-1", wait_ms=100)
        failover_s = time.monotonic() - killed
        new = ha.leader()
        time.sleep(1.0)  # load on the new leader too
        for loop in loops:
            loop.stop()
        waiter.join(60)
        print(
            f"leader failover: remote hits back {failover_s:.2f} s after the SIGKILL, the new "
            f"leader serving after {serving[0] - killed:.2f} s"
        )
        # every publish made meanwhile reached the store: near's failed ones were retried, those
        # the new leader refused for space before the nodes' segments were back with it too.
        # Told by far's reads, not by near's count of publishes: a retry whose first try reached
        # the store unanswered finds its key there (already stored); a new leader that lost the
        # node's mark has the pool republished (published again)
        reached: dict[Key, torch.Tensor | None] = {}

        def all_reached_far() -> bool:
            reached.update(Consumer(consumer, "shared").get_many(put, wait_ms=100))
            return None not in reached.values()

        wait_until(all_reached_far, 30)
        near_stats, far_stats = cluster_stats(producer), cluster_stats(consumer)
        line = run_ecd("stats", "--address", far.address).stdout

    assert hit is not None and torch.equal(hit, rows(1))
    assert [(loop.errors, loop.wrong) for loop in loops] == [(0, 0)] * len(loops)
    assert all(loop.calls > 10 for loop in loops)
    assert new is not old
    assert near_stats.publish_failures > 0 and near_stats.publishes_retried > 0
    wrong = [k for k in put if (t := reached[k]) is None or not torch.equal(t, rows(int(k[7:])))]
    assert put and wrong == []
    for stats in (near_stats, far_stats):
        assert (stats.leader, stats.leader_changes, stats.connected) == (new.address, 1, True)
    assert f"(leader {new.address}, 1 leader changes) connected" in line
