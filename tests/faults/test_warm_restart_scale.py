"""Warm restart at scale: a 4 GiB pool holding 10,000 entries, the daemon SIGKILLed, restarted on
the same shm directory. Measures the time from the new process's start to health SERVING (and,
for comparison, a start with no pool to adopt), and checks that all 10,000 entries are READY and
read back bit-identical. Slow: runs under `make test-faults` only."""

from __future__ import annotations

import time

import grpc
import pytest
from ecd_testing import Daemon, running_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc
from workload_testing import (
    assert_intact,
    chunks,
    make_tensor,
    ready_keys,
    record_figure,
)

from ec_client import Producer, PutStatus

POOL = "big"
BLOCK = 16 << 10
CAPACITY = 4 << 30
ENTRIES = 10_000


def entry_size(i: int) -> int:
    """20 to 32 blocks (26 on average, so 10,000 fill 99% of the pool), less a ragged tail."""
    return (20 + i % 13) * BLOCK - 4 * (i % 1000)


def start_timed(daemon: Daemon, timeout_s: float = 120.0) -> float:
    """Start the daemon; seconds from spawning it to health SERVING, polled every 5 ms."""
    started = time.monotonic()
    daemon.start(wait=False)
    options = [("grpc.initial_reconnect_backoff_ms", 5), ("grpc.max_reconnect_backoff_ms", 20)]
    with grpc.insecure_channel(daemon.address, options=options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - started < timeout_s:
            assert daemon.running, daemon.log()
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            time.sleep(0.005)
    raise AssertionError(f"not SERVING after {timeout_s} s:\n{daemon.log()}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.fault_kind("daemon killed holding a 4 GiB pool of 10,000 entries")
def test_a_4_gib_pool_of_10000_entries_is_served_again_after_a_sigkill() -> None:
    with running_daemon("--max-bytes", "5GiB", "--lease-ttl", "10") as daemon:
        daemon.kill()
        record_figure("daemon start -> SERVING, nothing to adopt (s)", start_timed(daemon))
        with daemon.client(name="filler") as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            producer = Producer(c, POOL, checksum=True)
            keys = [f"img-{i:05d}" for i in range(ENTRIES)]
            for batch in chunks(range(ENTRIES), 100):
                tensors = {keys[i]: make_tensor(keys[i], entry_size(i)) for i in batch}
                assert set(producer.put_many(tensors).values()) == {PutStatus.COMMITTING}
            producer.flush()  # the last commits go in the background
            [pool] = c.stats(POOL).pools
            assert pool.entries_ready == ENTRIES and pool.evictions == 0
            used = pool.num_blocks - pool.free_blocks
            assert used * BLOCK > 0.98 * CAPACITY

        daemon.kill()
        seconds = start_timed(daemon)
        record_figure("daemon SIGKILL -> restart -> SERVING, 4 GiB / 10,000 entries (s)", seconds)
        print(
            f"\nwarm restart with {ENTRIES} entries in a 4 GiB pool: SERVING after {seconds:.3f} s"
        )

        with daemon.client(name="checker") as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            [pool] = c.stats(POOL).pools
            assert pool.entries_ready == ENTRIES
            assert pool.num_blocks - pool.free_blocks == used
            assert sorted(ready_keys(c, POOL)) == [k.encode() for k in keys]
            assert_intact(c, POOL)  # every entry read back, CRC and bytes
