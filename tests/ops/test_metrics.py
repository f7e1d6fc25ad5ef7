"""The Prometheus endpoint of a real daemon: values move with traffic and equal what the Stats RPC
reports, RPC latency is counted per method, and a port in use stops the daemon at startup."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cluster_testing import NAMESPACE, needs_mooncake, published, running_master, store_daemon
from ecd_testing import Daemon, run_ecd, running_daemon, wait_until
from prometheus_client.parser import text_string_to_metric_families

from ec_client import AllocateItem, Client, Consumer, EcdError, Producer
from ec_protocol.types import PoolStats, Stats, Status

POOL = "metrics-pool"
BLOCK = 4096
CAPACITY = 16 * BLOCK
FULL = AllocateItem("a", (16, 1024), "float32")  # 64 KiB: the whole pool
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def pool_value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"engine_id": POOL, **labels}.items()))]


def rpc_count(samples: Samples, method: str) -> float:
    return samples.get(("ecd_rpc_duration_seconds_count", frozenset({("method", method)})), 0.0)


def assert_equals_stats(samples: Samples, stats: Stats) -> None:
    """Every figure the endpoint shows is the one Stats reports (no traffic between the two)."""
    assert samples[("ecd_sessions", frozenset())] == stats.sessions
    assert samples[("ecd_lease_expiries_total", frozenset())] == stats.lease_expiries
    assert samples[("ecd_budget_bytes", frozenset())] == stats.max_bytes
    assert samples[("ecd_capacity_bytes", frozenset())] == stats.capacity_bytes
    assert samples[("ecd_reserved_bytes", frozenset())] == stats.reserved_bytes
    info = {"boot_epoch": stats.boot_epoch, "version": stats.version}
    assert samples[("ecd_boot_info", frozenset(info.items()))] == 1
    [pool] = stats.pools
    assert_pool_equals(samples, pool)


def assert_pool_equals(samples: Samples, pool: PoolStats) -> None:
    block = pool.block_size_bytes
    assert pool_value(samples, "ecd_pool_capacity_bytes") == pool.capacity_bytes
    assert pool_value(samples, "ecd_pool_reserved_bytes") == pool.reserved_bytes
    assert pool_value(samples, "ecd_pool_max_entries") == pool.max_entries
    assert pool_value(samples, "ecd_pool_free_bytes") == pool.free_blocks * block
    used = (pool.num_blocks - pool.free_blocks) * block
    assert pool_value(samples, "ecd_pool_used_bytes") == used
    largest = pool.largest_free_extent * block
    assert pool_value(samples, "ecd_pool_largest_free_extent_bytes") == largest
    assert pool_value(samples, "ecd_pool_ready_bytes") == pool.bytes_ready
    assert pool_value(samples, "ecd_pool_entries", state="pending") == pool.entries_pending
    assert pool_value(samples, "ecd_pool_entries", state="ready") == pool.entries_ready
    assert pool_value(samples, "ecd_pool_pinned_entries") == pool.entries_pinned
    assert pool_value(samples, "ecd_pool_pins") == pool.pins
    assert pool_value(samples, "ecd_pool_locked_entries") == pool.entries_locked
    assert pool_value(samples, "ecd_pool_held_bytes") == pool.held_blocks * block
    for counter in (
        "hits",
        "misses",
        "no_space",
        "commits",
        "aborts",
        "remote_hits",
        "remote_misses",
        "remote_bytes",
        "remote_reads",
    ):
        assert pool_value(samples, f"ecd_pool_{counter}_total") == getattr(pool, counter), counter
    made_room = pool.evictions_for_space + pool.evictions_for_entries
    by_cause = {"space": pool.evictions_for_space, "entries": pool.evictions_for_entries}
    for cause, count in {**by_cause, "operator": pool.evictions - made_room}.items():
        assert pool_value(samples, "ecd_pool_evictions_total", cause=cause) == count, cause
    hits = pool_value(samples, "ecd_pool_remote_seconds_count")
    assert hits == sum(pool.remote_seconds_counts) == pool.remote_hits
    assert pool_value(samples, "ecd_pool_remote_seconds_sum") == pool.remote_seconds_sum


@pytest.fixture
def metrics_daemon() -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    args = ("--max-bytes", "64MiB", "--lease-ttl", "1", "--metrics-host", "127.0.0.1")
    with running_daemon(*args, "--metrics-port", str(port)) as daemon:
        yield daemon, port


def test_metrics_move_with_traffic_and_equal_stats(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    before = scrape(port)
    assert not any(name.startswith("ecd_pool_") for name, _ in before), "no pools yet"
    assert before[("ecd_sessions", frozenset())] == 0

    with daemon.client(name="metrics", keepalive=False) as client:
        client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=CAPACITY)
        [allocated] = client.allocate(POOL, [FULL])
        assert allocated.status is Status.ALLOCATED
        client.commit(POOL, ["a"])
        [hit, miss] = client.acquire(POOL, ["a", "never-stored"])
        assert (hit.status, miss.status) == (Status.HIT, Status.MISS)

        pinned = scrape(port)
        assert pool_value(pinned, "ecd_pool_pins") == 1
        assert pool_value(pinned, "ecd_pool_pinned_entries") == 1
        assert pool_value(pinned, "ecd_pool_used_bytes") == CAPACITY
        assert pool_value(pinned, "ecd_pool_free_bytes") == 0
        assert_equals_stats(pinned, client.stats())

        # The only entry is pinned: a second one cannot be had.
        [refused] = client.allocate(POOL, [AllocateItem("b", (16, 1024), "float32")])
        assert refused.status is Status.NO_SPACE
        client.release([hit.lease_id])
        # Unpinned now: the next allocation evicts it.
        [second] = client.allocate(POOL, [AllocateItem("b", (16, 1024), "float32")])
        assert second.status is Status.ALLOCATED

        after = scrape(port)
        assert_equals_stats(after, client.stats())
        expected = {"hits": 1, "misses": 1, "no_space": 1, "commits": 1}
        for counter, value in expected.items():
            assert pool_value(after, f"ecd_pool_{counter}_total") == value, counter
        assert pool_value(after, "ecd_pool_evictions_total", cause="space") == 1
        assert pool_value(after, "ecd_pool_entries", state="pending") == 1
        assert pool_value(after, "ecd_pool_entries", state="ready") == 0
        assert pool_value(after, "ecd_pool_pins") == 0
        assert after[("ecd_sessions", frozenset())] == 1
        # One latency observation per call, by method.
        assert rpc_count(after, "Allocate") == 3
        assert rpc_count(after, "Acquire") == 1
        assert rpc_count(after, "Release") == 1
        assert rpc_count(after, "Stats") == 1  # the assert_equals_stats above the pin
        bucket = frozenset({("method", "Allocate"), ("le", "+Inf")})
        assert after[("ecd_rpc_duration_seconds_bucket", bucket)] == 3


def test_evictions_are_counted_by_cause(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    one_block = [AllocateItem(k, (1024,), "float32") for k in ("a", "b", "c")]
    with daemon.client(name="metrics", keepalive=False) as client:
        client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=CAPACITY, max_entries=2)
        for item in one_block:  # c takes a's slot: 14 of 16 blocks free
            client.allocate(POOL, [item])
            client.commit(POOL, [item.key])
        client.evict(POOL, ["b"])  # an operator's
        client.allocate(POOL, [FULL])  # c's block is needed too
        samples = scrape(port)
        assert_equals_stats(samples, client.stats())
    for cause in ("space", "entries", "operator"):
        assert pool_value(samples, "ecd_pool_evictions_total", cause=cause) == 1, cause


def test_misses_answered_from_the_clients_view_are_counted(
    metrics_daemon: tuple[Daemon, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the settle sends them.
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)
    daemon, port = metrics_daemon
    with daemon.client(name="metrics", keepalive=False) as client:
        client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=CAPACITY)
        consumer = Consumer(client, POOL)
        assert client.view(POOL).wait_synced(5)
        for i in range(50):
            assert consumer.get(f"absent-{i}") is None
        assert rpc_count(scrape(port), "Step") == 0  # the view answered: no round trip
        client.flush(5)
        samples = scrape(port)
        assert pool_value(samples, "ecd_pool_misses_total") == 50
        [pool] = client.stats(POOL).pools
        assert pool.misses == 50


def test_rpcs_are_counted_by_method_and_status_code(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    with daemon.client(name="metrics", keepalive=False) as client:
        client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=CAPACITY)
        client.lookup(POOL, ["k"])
        for _ in range(2):
            with pytest.raises(EcdError):
                client.lookup("no-such-pool", ["k"])
        samples = scrape(port)
    count = "ecd_rpcs_total"
    assert samples[(count, frozenset({("method", "Lookup"), ("code", "OK")}))] == 1
    assert samples[(count, frozenset({("method", "Lookup"), ("code", "NOT_FOUND")}))] == 2
    assert samples[(count, frozenset({("method", "OpenPool"), ("code", "OK")}))] == 1


def test_lease_expiry_is_counted(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    # A client that goes silent: no keep-alive, never closed. Its lease (1 s) runs out.
    Client(daemon.address, name="silent", keepalive=False)
    assert scrape(port)[("ecd_sessions", frozenset())] == 1
    deadline = time.monotonic() + 10
    while scrape(port)[("ecd_lease_expiries_total", frozenset())] < 1:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.1)
    samples = scrape(port)
    assert samples[("ecd_sessions", frozenset())] == 0
    assert samples[("ecd_lease_expiries_total", frozenset())] == 1


def test_metrics_port_in_use_stops_the_daemon_at_startup(tmp_path: Path, shm_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--socket", str(tmp_path / "s.sock"), "--shm-dir", str(shm_dir)]
        args += ["--max-bytes", "16MiB", "--metrics-host", "127.0.0.1", "--metrics-port", str(port)]
        result = run_ecd("serve", *args)
    assert result.returncode == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4 and IPv6 sockets listening on `port`, as the kernel lists
    them (/proc/net/tcp: hex, "0100007F" for 127.0.0.1, zeros for every address)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, _, hex_port = local.partition(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


def test_metrics_listen_on_the_loopback_alone_by_default() -> None:
    port = free_port()
    with running_daemon("--max-bytes", "64MiB", "--metrics-port", str(port)) as daemon:
        assert listening_addresses(port) == {"0100007F"}
        assert f"metrics=127.0.0.1:{port}" in daemon.log()
        assert ("ecd_sessions", frozenset()) in scrape(port)


def test_the_metrics_page_needs_a_bearer_token_of_its_token_file(tmp_path: Path) -> None:
    token = "metrics-0123456789abcdef"
    token_file = tmp_path / "metrics-token"
    token_file.write_text(token + "\n")  # a bare token: the file Prometheus' credentials_file reads
    token_file.chmod(0o600)
    port = free_port()
    args = ("--max-bytes", "64MiB", "--metrics-port", str(port))
    with running_daemon(*args, "--metrics-token-file", str(token_file)):
        wrong = {"Authorization": "Bearer not-the-token-at-all"}
        for header in ({}, wrong, {"Authorization": token}):  # none, another, not as a bearer
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(metrics_request(port, header), timeout=5)
            assert refused.value.code == 401, header
            assert b"--metrics-token-file" in refused.value.read()
        granted = metrics_request(port, {"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(granted, timeout=5) as reply:
            assert reply.status == 200
            assert b"ecd_sessions 0.0" in reply.read()


def metrics_request(port: int, headers: dict[str, str]) -> urllib.request.Request:
    return urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)


@needs_mooncake
def test_remote_hits_from_the_store_are_scraped_as_stats_reports_them() -> None:
    port = free_port()
    with (
        running_master() as master,
        store_daemon(master) as near,
        store_daemon(master, "--metrics-port", str(port)) as daemon,
        near.client() as producer,
        daemon.client() as consumer,
    ):
        for client in (producer, consumer):
            client.open_pool(POOL, BLOCK, CAPACITY, cluster_namespace=NAMESPACE)
        Producer(producer, POOL).put("mm-1", torch.ones(4, BLOCK // 4))  # rows of one block
        wait_until(lambda: published(producer) == 1, 20)
        assert Consumer(consumer, POOL).get("mm-1", wait_ms=5000) is not None
        consumer.flush()  # the get's pin goes back now, not between the scrape and Stats

        samples, stats = scrape(port), consumer.stats()
    assert_equals_stats(samples, stats)
    assert (stats.pools[0].remote_hits, stats.pools[0].remote_reads) == (1, 1)
