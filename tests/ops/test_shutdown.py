"""SIGTERM on a real daemon: readiness goes NOT_SERVING first, new calls are refused, an in-flight
RPC (an Acquire waiting on a PENDING key) still finishes, the process exits 0, and the pool files
stay for the next daemon."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from ecd_testing import running_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ec_client import AllocateItem, Client, EcdError
from ec_client._proto.ecd.v1 import ecd_pb2 as pb
from ec_client._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_client.layout import pool_file_name
from ec_client.types import AcquireResult, Status

POOL = "shutdown-pool"
WAIT_MS = 3000
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_sigterm_drains_in_flight_rpcs_and_keeps_pool_files() -> None:
    with running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "5") as daemon:
        assert daemon.proc is not None
        producer = daemon.client(name="producer", keepalive=False)
        producer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        [allocated] = producer.allocate(POOL, [AllocateItem("slow", (4096,), "uint8")])
        assert allocated.status is Status.ALLOCATED  # PENDING: never committed

        # Readiness as a probe or load balancer sees it: the health Watch stream.
        channel = grpc.insecure_channel(daemon.address)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(health).status == SERVING

        consumer = daemon.client(name="consumer", keepalive=False)
        consumer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        results: list[AcquireResult] = []
        acquire = threading.Thread(
            target=lambda: results.extend(consumer.acquire(POOL, ["slow"], wait_ms=WAIT_MS))
        )
        started = time.monotonic()
        acquire.start()
        time.sleep(0.5)  # the Acquire reaches the daemon and waits on the PENDING key

        daemon.proc.send_signal(signal.SIGTERM)
        assert next(health).status == NOT_SERVING
        assert acquire.is_alive(), "readiness must drop while the in-flight call still runs"
        health.cancel()  # an open stream would hold the daemon for its whole grace period
        # New calls are refused from now on, while the old one is still being served: with
        # UNAVAILABLE, or CANCELLED when grpc took the call in as it began to stop (ec_client
        # retries both for calls safe to retry, see ec_client/_session.py).
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.EncoderCacheStub(channel).Stats(pb.StatsRequest(), timeout=2)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert acquire.is_alive()

        acquire.join(10)
        # The call ran its full wait and was answered, not cut off: still PENDING, no error.
        assert [r.status for r in results] == [Status.PENDING]
        assert time.monotonic() - started >= WAIT_MS / 1000
        assert daemon.proc.wait(10) == 0
        channel.close()

        assert (daemon.shm_dir / pool_file_name(POOL)).is_file()
        log = daemon.log()
        assert 0 < log.index("msg=stopping") < log.index("msg=stopped"), log


def test_sigterm_ends_open_watch_streams_instead_of_waiting_out_the_grace() -> None:
    with (
        running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "10") as daemon,
        daemon.client(name="router", keepalive=False) as c,
    ):
        c.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        events = c.watch(POOL, snapshot=True)
        next(events)  # SYNCED: the stream is open
        started = time.monotonic()
        assert daemon.stop(signal.SIGTERM) == 0
        assert time.monotonic() - started < 5, "an open Watch held the daemon for its grace"
        assert list(events) == []  # the stream ended cleanly, not with an error


def acquire_in_background(
    client: Client, key: str, wait_ms: int
) -> tuple[threading.Thread, list[AcquireResult | EcdError]]:
    outcome: list[AcquireResult | EcdError] = []

    def run() -> None:
        try:
            outcome.extend(client.acquire(POOL, [key], wait_ms=wait_ms))
        except EcdError as error:
            outcome.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_an_acquire_waiting_through_a_daemon_restart_carries_on_and_gets_the_entry() -> None:
    with running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "1") as daemon:
        consumer = daemon.client(name="consumer", connect_timeout_s=60)
        consumer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        thread, outcome = acquire_in_background(consumer, "later", wait_ms=60_000)
        time.sleep(0.5)  # waiting inside the daemon
        daemon.stop(signal.SIGTERM)  # outlasts the grace: answered shutting_down, then retried
        assert thread.is_alive()
        daemon.start()
        with daemon.client(name="producer") as producer:
            producer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
            producer.allocate(POOL, [AllocateItem("later", (4096,), "uint8")])
            producer.commit(POOL, ["later"])
        thread.join(30)
        [hit] = outcome
        assert isinstance(hit, AcquireResult) and hit.status is Status.HIT
        consumer.release([hit.lease_id])
        consumer.close()


def test_an_acquire_waiting_when_the_daemon_stops_for_good_says_it_shut_down() -> None:
    with running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "1") as daemon:
        consumer = daemon.client(name="consumer", connect_timeout_s=1)
        consumer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        thread, outcome = acquire_in_background(consumer, "never", wait_ms=60_000)
        time.sleep(0.5)
        assert daemon.stop(signal.SIGTERM) == 0
        thread.join(30)
        [error] = outcome
        assert isinstance(error, EcdError) and error.code is grpc.StatusCode.UNAVAILABLE
        assert f"ecd at {daemon.address} shut down during Acquire" in error.message
