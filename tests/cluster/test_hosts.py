"""The cluster on test hosts (tests/hosts_testing.py): a master and nodes each in a network
namespace of its own, with its own address, reaching each other only over links the test
shapes; and the test hosts themselves, which leave nothing behind."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from cluster_testing import NAMESPACE, POOL, cluster_stats, pool_stats, published
from ecd_testing import wait_until
from hosts_testing import PREFIX, Hosts, hosts_missing, master_on, node_on, running_hosts

from ec_client import Consumer, Producer
from ec_daemon.tools import transfer_floor


def test_two_nodes_on_their_own_addresses_hit_remotely_across_a_1ms_link_bit_identical(
    hosts: Hosts,
) -> None:
    on_master, on_a, on_b = hosts.add("master"), hosts.add("node-a"), hosts.add("node-b")
    hosts.shape(on_a, delay_ms=0.5)  # what each receives: a round trip between them of 1 ms
    hosts.shape(on_b, delay_ms=0.5)
    tensor = torch.randn(2048, 2048, dtype=torch.bfloat16)  # 8 MiB
    with (
        master_on(on_master) as master,
        node_on(on_a, master) as near,
        node_on(on_b, master) as far,
        near.client() as producer,
        far.client() as consumer,
    ):
        producer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        Producer(producer, "shared").put("mm-1", tensor)
        wait_until(lambda: published(producer) == 1, 20)
        wait_until(lambda: cluster_stats(consumer).connected, 20)  # it joins after serving
        consumer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
        got = Consumer(consumer, "shared").get("mm-1", wait_ms=5000)
        stats = pool_stats(consumer, "shared")
        logs = {host.address: daemon.log() for host, daemon in ((on_a, near), (on_b, far))}
    assert got is not None and torch.equal(got, tensor)
    assert (stats.remote_hits, stats.remote_reads) == (1, 1)
    for address, log in logs.items():  # each names its segment, which others reach, by its host
        assert f"segment={address}:" in log, log


def test_the_transfer_engines_floor_reads_from_one_host_over_a_shaped_link_to_another(
    hosts: Hosts,
) -> None:
    reader, holder = hosts.add("reader"), hosts.add("holder")
    hosts.shape(holder, delay_ms=1.0)  # the round trip on the requests' side (link_figures.py)
    floor_ms = transfer_floor.read_ms(
        1 << 20,
        target=transfer_floor.Side(holder.address, holder.launcher),
        initiator=transfer_floor.Side(reader.address, reader.launcher),
    )
    assert floor_ms > 0


@pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing())
def test_the_test_hosts_leave_no_namespace_and_no_process_behind() -> None:
    with running_hosts() as hosts:
        host = hosts.add("node")
        hosts.shape(host, delay_ms=1.0, loss=0.01)
        hosts.cut(host)
        sleeper = hosts.popen(host, "sleep", "600")
        made = hosts.namespaces()
    assert len(made) == 2  # the switch and the host
    assert hosts.namespaces() == []
    assert sleeper.wait(5) == -9


@pytest.mark.skipif(bool(hosts_missing()), reason=hosts_missing())
def test_a_crashed_runs_namespaces_are_swept_and_a_live_runs_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = f"{PREFIX}{dead.pid}-0-node"
    live = f"{PREFIX}{os.getppid()}-0-node"  # pytest's parent: alive
    for name in (crashed, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with running_hosts():
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    finally:
        for name in (crashed, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert crashed not in names and live in names


def test_without_root_a_test_on_test_hosts_skips_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="need root"), running_hosts():
        pass
