"""ReadyView alone, over a fake client whose Watch streams the test feeds: READY keys known only
after the snapshot, followed as events come, forgotten while the stream is broken, and a fresh
snapshot after reattaching; its listeners told of each local commit's slot."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest

from ec_client.control.ready_view import ReadyView
from ec_protocol.errors import EcdError
from ec_protocol.types import EventType, WatchEvent

BROKEN = object()


class FakeStream:
    """A Watch stream: yields what the test puts, ends on cancel, raises on BROKEN."""

    def __init__(self) -> None:
        self.items: queue.Queue[object] = queue.Queue()
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[WatchEvent]:
        while not self.cancelled.is_set():
            try:
                item = self.items.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is BROKEN:
                raise EcdError(grpc.StatusCode.UNAVAILABLE, "daemon went away")
            yield cast(WatchEvent, item)

    def cancel(self) -> None:
        self.cancelled.set()


class FakeClient:
    def __init__(self) -> None:
        self.streams: queue.Queue[FakeStream] = queue.Queue()

    def open_watch(self, engine_id: str, snapshot: bool, include_pending: bool) -> FakeStream:
        assert snapshot and include_pending
        stream = FakeStream()
        self.streams.put(stream)
        return stream


def event(type: EventType, key: str = "", slot: int | None = None) -> WatchEvent:
    return WatchEvent(type, "p", key.encode(), 1, "epoch", slot)


def eventually(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, "condition not reached within 5 s"
        time.sleep(0.005)


@pytest.fixture
def setup() -> Iterator[tuple[ReadyView, FakeClient, list[int]]]:
    client = FakeClient()
    reattached: list[int] = []
    view = ReadyView(client, "p", lambda: reattached.append(1))
    yield view, client, reattached
    view.close()


def synced(client: FakeClient, *keys: str) -> FakeStream:
    stream = client.streams.get(timeout=5)
    for key in keys:
        stream.items.put(event(EventType.SNAPSHOT, key))
    stream.items.put(event(EventType.SYNCED))
    return stream


def test_nothing_is_ready_until_the_snapshot_ends(setup: Any) -> None:
    view, client, _ = setup
    stream = client.streams.get(timeout=5)
    stream.items.put(event(EventType.SNAPSHOT, "a"))
    time.sleep(0.05)
    assert not view.synced and not view.has(b"a")
    stream.items.put(event(EventType.SYNCED))
    eventually(lambda: view.has(b"a"))


def test_commits_and_removals_are_followed(setup: Any) -> None:
    view, client, _ = setup
    stream = synced(client, "a")
    eventually(lambda: view.synced)
    stream.items.put(event(EventType.COMMITTED, "b"))
    stream.items.put(event(EventType.EVICTED, "a"))
    eventually(lambda: view.has(b"b") and not view.has(b"a"))
    for gone in (EventType.ABORTED, EventType.DELETED):
        stream.items.put(event(gone, "b"))
        eventually(lambda: not view.has(b"b"))
        stream.items.put(event(EventType.COMMITTED, "b"))
        eventually(lambda: view.has(b"b"))


def test_keys_being_written_are_pending_until_committed_or_aborted(setup: Any) -> None:
    view, client, _ = setup
    stream = client.streams.get(timeout=5)
    stream.items.put(event(EventType.PENDING, "a"))  # in the snapshot
    stream.items.put(event(EventType.SYNCED))
    eventually(lambda: view.pending(b"a"))
    stream.items.put(event(EventType.PENDING, "b"))  # live
    eventually(lambda: view.pending(b"b"))

    stream.items.put(event(EventType.COMMITTED, "a"))
    stream.items.put(event(EventType.ABORTED, "b"))
    eventually(lambda: view.has(b"a") and not view.pending(b"a") and not view.pending(b"b"))
    assert not view.has(b"b")


def test_a_key_this_process_committed_is_no_longer_pending(setup: Any) -> None:
    view, client, _ = setup
    stream = synced(client)
    stream.items.put(event(EventType.PENDING, "a"))
    eventually(lambda: view.pending(b"a"))
    view.add(b"a")
    assert view.has(b"a") and not view.pending(b"a")


def test_a_broken_stream_forgets_everything_then_reattaches_and_resyncs(setup: Any) -> None:
    view, client, reattached = setup
    stream = synced(client, "a")
    eventually(lambda: view.has(b"a"))
    stream.items.put(BROKEN)
    eventually(lambda: not view.synced)
    assert not view.has(b"a")
    synced(client, "c")
    eventually(lambda: view.has(b"c"))
    assert reattached and not view.has(b"a")


def test_a_dropped_pool_ends_the_stream_and_takes_a_fresh_snapshot(setup: Any) -> None:
    view, client, reattached = setup
    stream = synced(client, "a")
    eventually(lambda: view.has(b"a"))
    stream.items.put(event(EventType.POOL_DROPPED))
    synced(client)
    eventually(lambda: view.synced and not view.has(b"a"))
    assert reattached


def test_a_pool_dropped_while_followed_is_said_once_at_warning_not_at_every_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = FakeClient()
    dropped = EcdError(grpc.StatusCode.FAILED_PRECONDITION, "pool was dropped: 'p'", "pool_dropped")
    tries: list[int] = []

    def reattach() -> None:
        tries.append(1)
        raise dropped

    view = ReadyView(client, "p", reattach)
    try:
        synced(client).items.put(event(EventType.POOL_DROPPED))
        for _ in range(2):  # a Watch of the dropped pool fails too: then the next try
            client.streams.get(timeout=5).items.put(BROKEN)
        eventually(lambda: len(tries) >= 3)
    finally:
        view.close()
    assert not view.synced
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warned] == ["ecd: the view of pool p stops: " + str(dropped)]


def test_what_the_scheduler_learned_first_is_known_before_the_event(setup: Any) -> None:
    view, client, _ = setup
    synced(client)
    eventually(lambda: view.synced)
    view.add(b"mine")
    assert view.has(b"mine")
    view.discard(b"mine")
    assert not view.has(b"mine")


def test_listeners_are_told_the_slot_of_each_entry_committed_here(setup: Any) -> None:
    view, client, _ = setup
    told: list[tuple[bytes, int]] = []
    view.on_committed(lambda key, slot: told.append((key, slot)))
    stream = client.streams.get(timeout=5)
    stream.items.put(event(EventType.SNAPSHOT, "old", slot=1))  # read when pinned, not now
    stream.items.put(event(EventType.SYNCED))
    stream.items.put(event(EventType.COMMITTED, "new", slot=5))
    eventually(lambda: view.slot(b"new") == 5)
    assert told == [(b"new", 5)]


def test_slots_are_known_only_once_every_key_is_ready_here_with_its_slot(setup: Any) -> None:
    view, client, _ = setup
    stream = synced(client)
    view.add(b"mine")  # committed by this process: READY, its slot still to come
    stream.items.put(event(EventType.COMMITTED, "a", slot=0))
    eventually(lambda: view.slot(b"a") == 0)
    assert view.slots_known(["a"])
    assert not view.slots_known(["a", "mine"])
    assert not view.slots_known(["a", "there"])
    stream.items.put(event(EventType.COMMITTED, "mine", slot=3))
    eventually(lambda: view.slots_known(["a", b"mine"]))


def test_a_listener_that_fails_does_not_stop_the_view(setup: Any) -> None:
    view, client, _ = setup
    told: list[bytes] = []

    def failing(key: bytes, slot: int) -> None:
        raise OSError("the pool file is gone")

    view.on_committed(failing)
    view.on_committed(lambda key, slot: told.append(key))
    stream = synced(client)
    stream.items.put(event(EventType.COMMITTED, "a", slot=0))
    stream.items.put(event(EventType.COMMITTED, "b", slot=1))
    eventually(lambda: view.has(b"b"))
    assert told == [b"a", b"b"]


@pytest.mark.parametrize("outcome", [EventType.COMMITTED, EventType.ABORTED])
def test_a_waiter_for_a_change_wakes_at_the_commit_or_abort_of_a_pending_key(
    setup: Any, outcome: EventType
) -> None:
    view, client, _ = setup
    stream = client.streams.get(timeout=5)
    stream.items.put(event(EventType.PENDING, "a"))
    stream.items.put(event(EventType.SYNCED))
    eventually(lambda: view.pending(b"a"))
    seen = view.changes
    assert not view.wait_change(seen, 0.05)  # nothing happened: it sleeps its whole timeout
    threading.Timer(0.1, lambda: stream.items.put(event(outcome, "a"))).start()
    started = time.monotonic()
    assert view.wait_change(seen, 30)
    assert time.monotonic() - started < 5 and not view.pending(b"a")


def test_a_waiter_for_a_change_wakes_when_the_stream_breaks(setup: Any) -> None:
    view, client, _ = setup
    stream = synced(client)
    eventually(lambda: view.synced)
    seen = view.changes
    stream.items.put(BROKEN)
    assert view.wait_change(seen, 30)
    assert not view.synced
