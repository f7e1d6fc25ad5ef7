"""Several client processes and one daemon: races, hand-offs, deaths and restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from ecd_testing import REPO, Daemon, assert_blocks_accounted

from ec_client import AllocateItem, Client, Consumer, EcdError, EntryState, Producer, Status
from ec_client.data.producer import PutStatus

POOL = "shared"
BLOCK = 4096


def spawn(daemon: Daemon, code: str, *args: str) -> subprocess.Popen[str]:
    """A client process running `code` with ADDRESS, POOL and argv set."""
    prelude = textwrap.dedent(f"""
        import sys, time
        from ec_client import AllocateItem, Client, Status
        ADDRESS, POOL, BLOCK, CAPACITY = {daemon.address!r}, {POOL!r}, {BLOCK}, {64 * BLOCK}
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def output(proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"client process failed ({proc.returncode}):\n{err}"
    return out.strip()


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_processes_racing_on_one_key_encode_it_once(daemon: Daemon, tmp_path: Path) -> None:
    go = tmp_path / "go"
    racer = f"""
        with Client(ADDRESS, name=sys.argv[1]) as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            print("ready", flush=True)
            while not __import__("os").path.exists({str(go)!r}):
                time.sleep(0.001)
            [r] = c.allocate(POOL, [AllocateItem("img", (4, 1024), "uint8")])
            if r.status is Status.ALLOCATED:
                time.sleep(1.0)  # "encode" while the other racer looks
                c.commit(POOL, ["img"])
            print(r.status.value)
    """
    racers = [spawn(daemon, racer, name) for name in ("encoder-a", "encoder-b")]
    for proc in racers:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    outcomes = sorted(output(proc).splitlines()[-1] for proc in racers)
    assert outcomes == ["allocated", "pending"]
    with daemon.client() as c:
        assert c.lookup(POOL, ["img"])[0].state is EntryState.READY


def test_a_waiting_acquire_wakes_when_another_process_commits(daemon: Daemon) -> None:
    with daemon.client(name="encoder") as producer:
        producer.open_pool(POOL, BLOCK, 64 * BLOCK)
        producer.allocate(POOL, [AllocateItem("img", (8, 512), "uint8")])
        consumer = spawn(
            daemon,
            """
            with Client(ADDRESS, name="decoder") as c:
                c.open_pool(POOL, BLOCK, CAPACITY)
                t0 = time.monotonic()
                [r] = c.acquire(POOL, ["img"], wait_ms=20000)
                print(r.status.value, r.spec.nbytes, time.monotonic() - t0, flush=True)
                c.release([r.lease_id])
        """,
        )
        wait_for(lambda: producer.stats(POOL).sessions >= 2, what="the consumer's session")
        time.sleep(0.5)  # the consumer is now waiting inside Acquire
        committed_at = time.monotonic()
        producer.commit(POOL, ["img"])
        status, nbytes, waited = output(consumer).split()
        woke_after_commit = time.monotonic() - committed_at
    assert (status, int(nbytes)) == ("hit", 4096)
    assert float(waited) < 10, "the consumer slept through the commit"
    assert woke_after_commit < 10


def test_a_killed_producers_pending_entry_is_aborted_at_once_and_its_waiter_hears_it(
    daemon: Daemon,
) -> None:
    with daemon.client(name="waiter") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        view = c.view(POOL)
        producer = spawn(
            daemon,
            """
            c = Client(ADDRESS, name="producer")
            c.open_pool(POOL, BLOCK, CAPACITY)
            c.allocate(POOL, [AllocateItem("encoding", (8192,), "uint8")])
            print("encoding", flush=True)
            time.sleep(60)
        """,
        )
        assert producer.stdout is not None and producer.stdout.readline().strip() == "encoding"
        wait_for(lambda: view.pending(b"encoding"), what="the waiter to see the entry PENDING")
        time.sleep(0.5)  # the daemon's sweep has seen the producer's life mark by now
        producer.send_signal(signal.SIGKILL)
        producer.wait()
        killed_at = time.monotonic()
        wait_for(lambda: not view.pending(b"encoding"), what="the entry's abort")
        heard_after = time.monotonic() - killed_at
        assert not view.has(b"encoding")  # aborted, not committed: the waiter encodes it
        assert c.stats().lease_expiries == 0  # ended by its death, not by its lease
        [pool] = c.stats(POOL).pools
        assert pool.entries_pending == 0 and pool.free_blocks == 64
    assert heard_after < 1.0  # the 2 s lease would take 2-3 s


def test_a_killed_client_that_holds_no_life_mark_loses_its_allocations_and_pins_after_the_lease(
    daemon: Daemon,
) -> None:
    with daemon.client(name="survivor") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("ready", (4096,), "uint8")])
        c.commit(POOL, ["ready"])
        victim = spawn(
            daemon,
            """
            # As a client on another machine (TCP), or one that cannot open the pool's file: it
            # marks nothing the daemon can probe, so only its lease tells it died.
            from ec_protocol.pool.life_marks import LifeMarks
            LifeMarks.mark = lambda self, engine_id, path, session_id, pool_uuid: None
            c = Client(ADDRESS, name="victim")
            c.open_pool(POOL, BLOCK, CAPACITY)
            c.allocate(POOL, [AllocateItem("half-written", (8192,), "uint8")])
            c.acquire(POOL, ["ready"])
            print("holding", flush=True)
            time.sleep(60)
        """,
        )
        assert victim.stdout is not None and victim.stdout.readline().strip() == "holding"
        assert c.lookup(POOL, ["ready"])[0].pins == 1
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed_at = time.monotonic()
        wait_for(lambda: c.lookup(POOL, ["ready"])[0].pins == 0, what="the pin to be released")
        freed_after = time.monotonic() - killed_at
        assert c.lookup(POOL, ["half-written"])[0].state is EntryState.ABSENT
        [pool] = c.stats(POOL).pools
        assert pool.free_blocks == 63 and pool.entries_pending == 0
        assert c.stats().lease_expiries == 1
        assert_blocks_accounted(c, POOL)
    assert freed_after < 2 + 1.5  # one 2 s TTL plus the reaper's period and slack


def test_a_client_reconnects_to_a_restarted_daemon_and_sees_the_new_epoch(daemon: Daemon) -> None:
    with daemon.client(name="encoder") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("kept", (100,), "uint8")])
        c.commit(POOL, ["kept"])
        restarts: list[str] = []
        c.on_restart(restarts.append)
        old_epoch, old_session = c.boot_epoch, c.session_id

        daemon.restart(signal.SIGKILL)

        [result] = c.allocate(POOL, [AllocateItem("after", (100,), "uint8")])
        assert result.status is Status.ALLOCATED
        assert c.boot_epoch != old_epoch and c.session_id != old_session
        assert restarts == [c.boot_epoch]
        assert c.lookup(POOL, ["kept"])[0].state is EntryState.READY  # warm restart


def test_a_call_that_asked_to_wait_rides_out_a_short_daemon_outage(daemon: Daemon) -> None:
    with daemon.client(name="consumer", connect_timeout_s=20) as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        daemon.stop()

        def come_back() -> None:
            daemon.start()
            with daemon.client(name="encoder") as producer:
                producer.open_pool(POOL, BLOCK, 64 * BLOCK)
                producer.allocate(POOL, [AllocateItem("k", (16,), "uint8")])
                producer.commit(POOL, ["k"])

        comeback = threading.Timer(1.0, come_back)
        comeback.start()
        try:
            # No daemon there, but the call may wait 20 s: retried until the daemon is back.
            [hit] = c.acquire(POOL, ["k"], wait_ms=20_000)
            assert hit.status is Status.HIT
        finally:
            comeback.join()


@pytest.mark.parametrize(
    "call",
    [
        lambda c: Producer(c, POOL).put("new", torch.ones(16)),
        lambda c: Consumer(c, POOL, watch=False).get("kept"),
        lambda c: Consumer(c, POOL, watch=False).get("absent"),
        lambda c: c.stats(),
    ],
    ids=["put", "get a hit", "get a miss", "stats"],
)
def test_a_call_to_a_daemon_that_died_fails_at_once_in_ecds_words(
    daemon: Daemon, call: Callable[[Client], object]
) -> None:
    with daemon.client(name="encoder") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        Producer(c, POOL).put("kept", torch.zeros(16))
        c.flush()
        daemon.kill()  # and no restart
        started = time.monotonic()
        with pytest.raises(EcdError) as info:
            call(c)
        assert time.monotonic() - started < 0.5
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert info.value.message.startswith(
            f"cannot reach ecd at {daemon.address}: nothing listens"
        )


def test_a_client_of_a_socket_that_is_not_there_fails_at_once_naming_it(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/no/such.sock"
    started = time.monotonic()
    with pytest.raises(EcdError) as info:
        Client(address)
    assert time.monotonic() - started < 0.5
    assert info.value.message.startswith(f"cannot reach ecd at {address}: no socket at")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_producer_with_wait_for_daemon_s_puts_through_a_daemon_restart(
    daemon: Daemon, sig: int
) -> None:
    """Puts at 20 Hz; the daemon is stopped between two of them and started again half a second
    later: none raises (the one after the stop waits for the daemon), and every put lands."""
    with daemon.client(name="encoder", wait_for_daemon_s=60) as c:
        c.open_pool(POOL, BLOCK, 256 * BLOCK)
        producer = Producer(c, POOL)
        comeback = threading.Timer(0.5, daemon.start)
        put: list[str] = []
        try:
            for i in range(20):
                if i == 5:
                    c.flush()  # every Commit so far answered: none lost with the daemon
                    daemon.stop(sig)
                    comeback.start()
                key = f"k{i}"
                assert producer.put(key, torch.full((16,), i)) is PutStatus.COMMITTING
                put.append(key)
                time.sleep(0.05)
        finally:
            comeback.join()
        producer.flush()  # raises if a Commit was refused
        assert {r.state for r in c.lookup(POOL, put)} == {EntryState.READY}


def test_a_call_whose_daemon_stays_away_past_wait_for_daemon_s_fails_saying_so(
    daemon: Daemon,
) -> None:
    with daemon.client(name="encoder", wait_for_daemon_s=1.0) as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        daemon.kill()  # and no restart
        started = time.monotonic()
        with pytest.raises(EcdError) as info:
            Producer(c, POOL).put("new", torch.ones(16))
        assert time.monotonic() - started >= 1.0
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert info.value.message.startswith(
            f"cannot reach ecd at {daemon.address} for 1 s: nothing listens"
        )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_get_whose_wait_ends_during_a_daemon_outage_answers_none(
    daemon: Daemon, sig: int
) -> None:
    """The get began before the daemon went away, which it stays until the get returned."""
    with daemon.client(name="consumer") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        consumer = Consumer(c, POOL, watch=False)
        got: list[object] = []
        getter = threading.Thread(target=lambda: got.append(consumer.get("never", wait_ms=2000)))
        getter.start()
        daemon.stop(sig)
        getter.join(60)
        assert not getter.is_alive()
        assert got == [None]  # not an exception in the thread
        daemon.start()
