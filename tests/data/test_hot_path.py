"""The client's hot path (docs/design.md §12), against a real daemon: a put waits only for its
Allocate and its Commit follows once the bytes landed; a get waits only for its Acquire and its
Release follows once the copy landed; a miss the client's view of the pool can answer costs no
round trip; failures of what ran in the background still reach the caller."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ecd_testing import Daemon, wait_until

from ec_client import Client, Consumer, EcdError, EntryState, Producer, PutStatus
from ec_client.control.outbox import ANSWERED_LINGER_S
from ec_client.data import mover as mover_module
from ec_client.data.mover import Transfer

POOL = "hot"
BLOCK = 4096


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client(name="hot") as c:
        c.open_pool(POOL, BLOCK, 256 * BLOCK)
        yield c


def state(client: Client, key: str) -> EntryState:
    return client.lookup(POOL, [key])[0].state


class GatedTransfer(Transfer):
    """A copy that has not landed until the test opens the gate (as a D2H copy on a busy GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def done(self) -> bool:
        return self.gate.is_set()

    def wait(self) -> None:
        assert self.gate.wait(10), "the test never opened the gate"


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> list[GatedTransfer]:
    """Every save's copy is held in flight until its gate opens."""
    transfers: list[GatedTransfer] = []
    save = mover_module.TensorMover.save

    def gated_save(
        self: mover_module.TensorMover, tensor: torch.Tensor, extents: object
    ) -> Transfer:
        save(self, tensor, extents)  # type: ignore[arg-type]
        transfers.append(GatedTransfer())
        return transfers[-1]

    monkeypatch.setattr(mover_module.TensorMover, "save", gated_save)
    return transfers


def test_a_put_answers_committing_and_its_handle_stored_once_the_commit_is_answered(
    client: Client, gated: list[GatedTransfer]
) -> None:
    handle = Producer(client, POOL).put_many_async({"k": torch.ones(BLOCK, dtype=torch.uint8)})
    # The Commit is still owed: a daemon killed now would not have the entry.
    assert handle.statuses == {"k": PutStatus.COMMITTING}
    gated[0].gate.set()
    assert handle.wait(10) == {"k": PutStatus.STORED}  # durable from here on


def test_a_put_returns_before_its_commit_and_wait_makes_it_visible(
    client: Client, gated: list[GatedTransfer]
) -> None:
    handle = Producer(client, POOL).put_many_async({"k": torch.ones(BLOCK, dtype=torch.uint8)})
    assert handle.statuses == {"k": PutStatus.COMMITTING}
    assert state(client, "k") is EntryState.PENDING and not handle.done()
    gated[0].gate.set()
    assert handle.wait(10) == {"k": PutStatus.STORED}
    assert state(client, "k") is EntryState.READY


def test_a_commit_is_never_sent_before_the_copy_landed(
    client: Client, daemon: Daemon, gated: list[GatedTransfer]
) -> None:
    producer = Producer(client, POOL)
    producer.put("k", torch.ones(BLOCK, dtype=torch.uint8))
    with daemon.client(name="other") as other:
        other.open_pool(POOL, BLOCK, 256 * BLOCK)
        # 300 ms of waiting with the copy in flight: still PENDING, so nobody can read it.
        assert Consumer(other, POOL).get("k", wait_ms=300) is None
        assert state(client, "k") is EntryState.PENDING
        gated[0].gate.set()
        producer.flush(10)
        assert Consumer(other, POOL).get("k", wait_ms=5000) is not None


def test_flush_waits_for_every_put_so_far(client: Client) -> None:
    producer = Producer(client, POOL)
    for i in range(20):
        producer.put(f"k{i}", torch.full((BLOCK,), i, dtype=torch.uint8))
    producer.flush(10)
    assert {state(client, f"k{i}") for i in range(20)} == {EntryState.READY}


def test_a_refused_commit_reaches_the_caller_through_the_handle_flush_and_a_count(
    client: Client, gated: list[GatedTransfer]
) -> None:
    producer = Producer(client, POOL)
    handle = producer.put_many_async({"k": torch.ones(BLOCK, dtype=torch.uint8)})
    client.delete(POOL, ["k"])  # an operator drops the PENDING entry under the producer
    gated[0].gate.set()
    with pytest.raises(EcdError, match="Commit refused"):
        handle.wait(10)
    with pytest.raises(EcdError, match="Commit refused"):
        producer.flush(10)
    assert producer.failed_commits == 1
    producer.flush(10)  # reported once


def test_a_client_reads_its_own_puts_at_once(client: Client) -> None:
    Producer(client, POOL).put("mine", torch.arange(BLOCK, dtype=torch.int32))
    loaded = Consumer(client, POOL).get("mine")
    assert loaded is not None and torch.equal(loaded, torch.arange(BLOCK, dtype=torch.int32))


def test_a_get_releases_its_pin_in_the_background_once_the_copy_landed(client: Client) -> None:
    Producer(client, POOL).put("k", torch.ones(BLOCK, dtype=torch.uint8))
    assert Consumer(client, POOL).get("k") is not None
    client.flush(10)
    assert client.lookup(POOL, ["k"])[0].pins == 0


def test_a_miss_the_view_can_answer_costs_no_acquire(client: Client) -> None:
    consumer = Consumer(client, POOL)
    assert client.view(POOL).wait_synced(10)
    assert consumer.get("absent") is None
    assert consumer.get_many(["absent-too", "nor-this"]) == {"absent-too": None, "nor-this": None}
    [pool] = client.stats(POOL).pools
    assert pool.misses == 0  # the daemon was never asked


def test_a_get_with_a_wait_asks_the_daemon_even_for_a_key_the_view_lacks(client: Client) -> None:
    consumer = Consumer(client, POOL)
    assert client.view(POOL).wait_synced(10)
    assert consumer.get("absent", wait_ms=1) is None
    assert client.stats(POOL).pools[0].misses == 1


def test_without_a_view_every_get_asks_the_daemon(client: Client) -> None:
    consumer = Consumer(client, POOL, watch=False)
    assert consumer.get("absent") is None
    assert client.stats(POOL).pools[0].misses == 1


def test_another_clients_commit_reaches_the_view(client: Client, daemon: Daemon) -> None:
    consumer = Consumer(client, POOL)
    assert client.view(POOL).wait_synced(10)
    with daemon.client(name="producer") as other:
        other.open_pool(POOL, BLOCK, 256 * BLOCK)
        handle = Producer(other, POOL).put_many_async(
            {"theirs": torch.ones(BLOCK, dtype=torch.uint8)}
        )
        handle.wait(10)
    wait_until(lambda: client.view(POOL).has(b"theirs"))
    loaded = consumer.get("theirs")
    assert loaded is not None and int(loaded.sum()) == BLOCK


def counting_calls(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The RPCs the client makes from now on, by method (its background threads' too)."""
    calls: list[str] = []
    real = client._do

    def do(step: Any) -> Any:
        call = getattr(step, "call", None)
        if call is not None:
            calls.append(call.method)
        return real(step)

    monkeypatch.setattr(client, "_do", do)
    return calls


def committed_elsewhere(client: Client, daemon: Daemon, key: str, tensor: torch.Tensor) -> Consumer:
    """Another client commits `key`; returns a Consumer of `client` whose view knows its slot."""
    consumer = Consumer(client, POOL)
    with daemon.client(name="producer") as other:
        other.open_pool(POOL, BLOCK, 256 * BLOCK)
        Producer(other, POOL).put_many_async({key: tensor}).wait(10)
    wait_until(lambda: client.view(POOL).slot(key.encode()) is not None)
    return consumer


def test_a_local_hit_makes_no_round_trip_and_unlocks_once_copied(
    client: Client, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = committed_elsewhere(client, daemon, "theirs", torch.arange(BLOCK, dtype=torch.int32))
    calls = counting_calls(client, monkeypatch)
    loaded = consumer.get("theirs")
    assert calls == []  # not even one in the background yet: the hit is owed, with a linger
    assert loaded is not None and torch.equal(loaded, torch.arange(BLOCK, dtype=torch.int32))
    assert consumer.endpoint.pins().held() == 0  # a CPU copy lands at once: unlocked
    client.flush(10)
    [pool] = client.stats(POOL).pools
    assert (pool.hits, pool.entries_locked, pool.pins) == (1, 0, 0)  # the owed hit arrived


def test_a_quiet_clients_owed_hit_reaches_the_daemon_within_the_answered_linger(
    client: Client, daemon: Daemon
) -> None:
    consumer = committed_elsewhere(client, daemon, "theirs", torch.ones(BLOCK, dtype=torch.uint8))
    assert consumer.get("theirs") is not None  # a local hit, owed; no further call
    with daemon.client(name="reader") as other:
        # ANSWERED_LINGER_S after the get at most, plus a Step's trip (the margin is for a
        # loaded machine)
        wait_until(lambda: other.stats(POOL).pools[0].hits == 1, ANSWERED_LINGER_S + 4)


def test_a_lock_pin_is_held_until_the_copy_landed(
    client: Client, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = committed_elsewhere(client, daemon, "theirs", torch.ones(BLOCK, dtype=torch.uint8))
    gate = GatedTransfer()
    load_many = mover_module.TensorMover.load_many

    def gated(self: mover_module.TensorMover, *args: Any) -> tuple[list[torch.Tensor], Transfer]:
        return load_many(self, *args)[0], gate

    monkeypatch.setattr(mover_module.TensorMover, "load_many", gated)
    consumer.get_many_async(["theirs"])
    assert client.stats(POOL).pools[0].entries_locked == 1
    assert client.evict(POOL, ["theirs"])[0].status.is_error  # being read: not evicted
    gate.gate.set()
    client.flush(10)
    assert client.stats(POOL).pools[0].entries_locked == 0


def test_hits_answered_under_lock_pins_keep_the_lru_order(daemon: Daemon) -> None:
    with daemon.client(name="lru") as c:
        c.open_pool("lru", BLOCK, 2 * BLOCK)
        producer, consumer = Producer(c, "lru"), Consumer(c, "lru")
        producer.put("old", torch.ones(BLOCK, dtype=torch.uint8))
        producer.put("new", torch.ones(BLOCK, dtype=torch.uint8))
        producer.flush()
        wait_until(lambda: c.view("lru").slot(b"old") is not None)
        assert consumer.get("old") is not None  # a local hit: "new" is now the least recent
        c.flush(10)
        producer.put("third", torch.ones(BLOCK, dtype=torch.uint8))
        producer.flush()
        states = {r.key: r.state for r in c.lookup("lru", ["old", "new"])}
        assert states == {b"old": EntryState.READY, b"new": EntryState.ABSENT}


def test_a_hit_owed_by_the_client_protects_its_entry_from_the_eviction_its_next_put_makes(
    daemon: Daemon,
) -> None:
    """The hit rides on the put's Allocate, unflushed: the daemon refreshes it before it
    allocates, so the least recent entry is the one evicted."""
    blocks = 10
    with daemon.client(name="lru") as c:
        c.open_pool("lru", BLOCK, 3 * blocks * BLOCK)
        producer, consumer = Producer(c, "lru"), Consumer(c, "lru")
        for key in ("A", "B", "C"):
            producer.put(key, torch.ones(blocks * BLOCK, dtype=torch.uint8))
        producer.flush()
        wait_until(lambda: c.view("lru").slot(b"A") is not None)
        assert consumer.get("A") is not None  # a local hit, owed: "B" is now the least recent
        producer.put("D", torch.ones(blocks * BLOCK, dtype=torch.uint8))
        producer.flush()
        states = {r.key: r.state for r in c.lookup("lru", ["A", "B"])}
        assert states == {b"A": EntryState.READY, b"B": EntryState.ABSENT}
