"""SIGTERM on a real daemon: readiness goes NOT_SERVING first, new calls are refused, calls that
would only end at the grace's deadline (Watch streams, Acquires waiting on keys) are ended at once,
the process exits 0, and the pool files stay for the next daemon."""

from __future__ import annotations

import signal
import socket
import threading
import time

import grpc
import pytest
import torch
from ecd_testing import running_daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc
from http2_testing import (
    DATA,
    END_STREAM,
    GOAWAY,
    HEADERS,
    grpc_call,
    read_frames,
)

from ec_client import AllocateItem, Client, Consumer, EcdError, Producer
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_protocol.pool.layout import pool_file_name
from ec_protocol.types import AcquireResult, Status

POOL = "shutdown-pool"
WAIT_MS = 3000
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCH = f"/{pb.DESCRIPTOR.services_by_name['EncoderCache'].full_name}/Watch".encode()


def test_sigterm_turns_not_serving_refuses_new_calls_and_keeps_pool_files() -> None:
    with running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "5") as daemon:
        assert daemon.proc is not None
        with daemon.client(name="producer", keepalive=False) as producer:
            producer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)

        # Readiness as a probe or load balancer sees it: the health Watch stream.
        channel = grpc.insecure_channel(daemon.address)
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(health).status == SERVING

        daemon.proc.send_signal(signal.SIGTERM)
        assert next(health).status == NOT_SERVING
        health.cancel()
        # New calls are refused from now on: with UNAVAILABLE, or CANCELLED when grpc took the
        # call in as it began to stop (ec_client retries both for calls safe to retry, see
        # ec_client/control/_session.py).
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.EncoderCacheStub(channel).Stats(pb.StatsRequest(), timeout=2)
        assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert daemon.proc.wait(10) == 0
        channel.close()

        assert (daemon.shm_dir / pool_file_name(POOL)).is_file()
        log = daemon.log()
        assert 0 < log.index("msg=stopping") < log.index("msg=stopped"), log


def test_sigterm_answers_a_waiting_acquire_at_once_and_exits_without_waiting_out_the_grace() -> (
    None
):
    with running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "5") as daemon:
        assert daemon.proc is not None
        consumer = daemon.client(name="consumer", keepalive=False)
        consumer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        request = pb.AcquireRequest(
            session_id=consumer.session_id, engine_id=POOL, keys=[b"never"], wait_ms=WAIT_MS
        )
        with grpc.insecure_channel(daemon.address) as channel:
            waiting = pb_grpc.EncoderCacheStub(channel).Acquire.future(request, timeout=10)
            time.sleep(0.5)  # the Acquire reaches the daemon and waits on the missing key
            stopped = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as answered:
                waiting.result()
            # Nothing could commit the key any more (new calls are refused): the wait is ended
            # at once, UNAVAILABLE for its client to retry at the next daemon.
            assert answered.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (answered.value.details() or "")
            assert daemon.proc.wait(10) == 0
        assert time.monotonic() - stopped < 2, "the daemon waited out its grace"


def test_a_get_with_default_settings_waits_through_a_sigterm_restart() -> None:
    with (
        running_daemon("--max-bytes", "64MiB") as daemon,  # the default grace
        daemon.client(name="consumer") as consumer,
    ):
        consumer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
        got: list[torch.Tensor | None] = []
        get = threading.Thread(
            target=lambda: got.append(
                Consumer(consumer, POOL, watch=False).get("later", wait_ms=30_000)
            )
        )
        get.start()
        time.sleep(0.5)  # waiting inside the daemon
        daemon.stop(signal.SIGTERM)
        daemon.start()  # at once, as systemd's Restart= or a supervisor does
        with daemon.client(name="producer") as producer:
            producer.open_pool(POOL, block_size_bytes=4096, capacity_bytes=64 * 4096)
            put = Producer(producer, POOL)
            put.put("later", torch.arange(16, dtype=torch.uint8))
            put.flush()
        get.join(30)
        [tensor] = got
        assert tensor is not None and torch.equal(tensor, torch.arange(16, dtype=torch.uint8))


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


def test_a_watch_streams_end_is_sent_before_the_daemons_goaway() -> None:
    """The end comes first on the connection, so grpc, which closes it only once the client
    answered the PING that follows its GOAWAY, never closes it before the client read the end
    (a client that wrote after the close lost an end still in its socket: "Stream removed")."""
    with (
        running_daemon("--max-bytes", "64MiB", "--shutdown-grace", "10") as daemon,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
    ):
        assert daemon.proc is not None
        conn.settimeout(30)
        conn.connect(str(daemon.socket))
        conn.sendall(grpc_call(WATCH, pb.WatchRequest(snapshot=True).SerializeToString()))
        frames = read_frames(conn)
        next(f for f in frames if f.kind == DATA and f.stream == 1)  # SYNCED: the stream is open
        daemon.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        order = [
            "goaway" if f.kind == GOAWAY else "end"
            for f in frames  # until the daemon closes the connection
            if f.kind == GOAWAY or (f.kind == HEADERS and f.stream == 1 and f.flags & END_STREAM)
        ]
        assert daemon.proc.wait(10) == 0
        assert time.monotonic() - started < 5, "the connection stayed open for the grace"
    assert order[0] == "end", order


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
