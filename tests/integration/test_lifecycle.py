"""The life of an entry through a real daemon process, over its Unix socket."""

from __future__ import annotations

import os
import stat
import threading
import time

import grpc
import pytest
import torch
from ecd_testing import Daemon, assert_blocks_accounted

from ec_client import AllocateItem, EcdError, EntryState, EventType, Producer, Status

POOL = "qwen-vl-node1"
BLOCK = 7168


def test_an_entry_goes_from_allocate_to_commit_to_hit_to_eviction(daemon: Daemon) -> None:
    with daemon.client(name="encoder-0") as c:
        info = c.open_pool(POOL, BLOCK, 1024 * BLOCK, "Qwen2.5-VL-7B|bf16|3584")
        assert info.created and info.num_blocks == 1024
        assert info.path == str(daemon.shm_dir / f"ecd-{POOL}.pool")

        [allocated] = c.allocate(POOL, [AllocateItem("mm-hash-1", (256, 3584), "bfloat16")])
        assert allocated.status is Status.ALLOCATED
        assert [(e.start, e.count) for e in allocated.extents] == [(0, 256)]
        assert c.lookup(POOL, ["mm-hash-1"])[0].state is EntryState.PENDING

        assert [r.status for r in c.commit(POOL, ["mm-hash-1"])] == [Status.OK]
        [hit] = c.acquire(POOL, ["mm-hash-1"])
        assert hit.status is Status.HIT
        assert hit.spec is not None and hit.spec.shape == (256, 3584)
        assert hit.spec.dtype == "bfloat16" and hit.spec.nbytes == 256 * 3584 * 2
        assert hit.extents == allocated.extents
        assert c.lookup(POOL, ["mm-hash-1"])[0].pins == 1

        assert [r.status for r in c.release([hit.lease_id])] == [Status.OK]
        assert [r.status for r in c.evict(POOL, ["mm-hash-1"])] == [Status.OK]
        assert c.lookup(POOL, ["mm-hash-1"])[0].state is EntryState.ABSENT
        assert_blocks_accounted(c, POOL)


def test_one_batch_carries_many_items_with_their_own_statuses(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        items = [AllocateItem(f"k{i}", (1, 3584), "bfloat16") for i in range(64)]
        results = c.allocate(POOL, items)
        assert [r.status for r in results] == [Status.ALLOCATED] * 64
        assert [r.status for r in c.allocate(POOL, items[:2])] == [Status.ALLOCATED] * 2
        c.commit(POOL, [f"k{i}" for i in range(64)])
        acquired = c.acquire(POOL, [f"k{i}" for i in range(64)] + ["absent"])
        assert [r.status for r in acquired] == [Status.HIT] * 64 + [Status.MISS]
        c.release([r.lease_id for r in acquired[:64]])
        assert_blocks_accounted(c, POOL)


def test_a_commit_naming_an_allocation_removed_since_leaves_the_keys_new_one_pending(
    daemon: Daemon,
) -> None:
    item = AllocateItem("k", (4 * BLOCK,), "uint8")
    with daemon.client(name="encoder") as c, daemon.client(name="admin") as admin:
        c.open_pool(POOL, BLOCK, 1024 * BLOCK)
        [first] = c.allocate(POOL, [item])
        assert [r.status for r in admin.delete(POOL, ["k"])] == [Status.OK]
        [second] = c.allocate(POOL, [item])
        assert first.allocation and second.allocation and first.allocation != second.allocation
        [late] = c.commit(POOL, ["k"], allocations=[first.allocation])
        assert late.status is Status.NOT_FOUND and "allocated again" in late.message
        assert c.lookup(POOL, ["k"])[0].state is EntryState.PENDING
        [ok] = c.commit(POOL, ["k"], allocations=[second.allocation])
        assert ok.status is Status.OK
        assert c.lookup(POOL, ["k"])[0].state is EntryState.READY
        assert_blocks_accounted(c, POOL)


def test_stats_report_pools_entries_and_counters(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("a", (1, 3584), "bfloat16")])
        c.commit(POOL, ["a"])
        c.acquire(POOL, ["a", "b"])
        [pool] = c.stats().pools
        assert (pool.engine_id, pool.entries_ready, pool.pins) == (POOL, 1, 1)
        assert (pool.hits, pool.misses, pool.commits) == (1, 1, 1)
        assert pool.free_blocks == 63


def test_watch_streams_a_snapshot_then_live_events(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("before", (1,), "uint8")])
        c.commit(POOL, ["before"])
        events = c.watch(POOL, snapshot=True)
        assert [(e.type, e.key) for e in (next(events), next(events))] == [
            (EventType.SNAPSHOT, b"before"),
            (EventType.SYNCED, b""),
        ]
        c.allocate(POOL, [AllocateItem("after", (1,), "uint8")])
        c.commit(POOL, ["after"])
        c.evict(POOL, ["before"])
        assert [(e.type, e.key) for e in (next(events), next(events))] == [
            (EventType.COMMITTED, b"after"),
            (EventType.EVICTED, b"before"),
        ]
        events.close()


def test_a_watch_with_include_pending_also_streams_the_entries_being_written(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        c.allocate(POOL, [AllocateItem("writing", (1,), "uint8")])
        events = c.watch(POOL, snapshot=True, include_pending=True)
        assert [(e.type, e.key) for e in (next(events), next(events))] == [
            (EventType.PENDING, b"writing"),
            (EventType.SYNCED, b""),
        ]
        c.allocate(POOL, [AllocateItem("next", (1,), "uint8")])
        c.commit(POOL, ["writing"])
        assert [(e.type, e.key) for e in (next(events), next(events))] == [
            (EventType.PENDING, b"next"),
            (EventType.COMMITTED, b"writing"),
        ]
        events.close()


def test_a_watch_cancelled_from_another_thread_ends_its_iteration_quietly(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        stream = c.open_watch(POOL, snapshot=True)
        seen: list[EventType] = []
        reader = threading.Thread(target=lambda: seen.extend(e.type for e in stream))
        reader.start()
        time.sleep(0.2)  # the reader is blocked waiting for events after SYNCED
        stream.cancel()
        reader.join(timeout=2)
        assert not reader.is_alive() and seen == [EventType.SYNCED]


def test_the_socket_and_pool_files_are_private_by_default(daemon: Daemon) -> None:
    with daemon.client() as c:
        info = c.open_pool(POOL, BLOCK, 64 * BLOCK)
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o600


def test_pool_files_stay_after_a_graceful_stop(daemon: Daemon) -> None:
    with daemon.client() as c:
        info = c.open_pool(POOL, BLOCK, 64 * BLOCK)
    assert daemon.stop() == 0
    assert os.path.exists(info.path)
    assert not daemon.socket.exists()


def test_a_step_applies_its_parts_in_order_in_one_call(daemon: Daemon) -> None:
    with daemon.client(name="engine") as c:
        c.open_pool(POOL, BLOCK, 8 * BLOCK)
        c.allocate(POOL, [AllocateItem("old", (BLOCK,), "uint8")])
        c.commit(POOL, ["old"])
        [pin] = c.acquire(POOL, ["old"])
        c.allocate(POOL, [AllocateItem("mine", (BLOCK,), "uint8")])
        step = c.step(
            POOL,
            releases=[pin.lease_id],
            commits=["mine"],
            acquires=["mine", "absent"],
            allocates=[AllocateItem("new", (2, BLOCK), "uint8")],
        )
        assert [r.status for r in step.releases] == [Status.OK]
        assert [r.status for r in step.commits] == [Status.OK]
        # The commit came first, so the same call's Acquire already sees it.
        assert [r.status for r in step.acquires] == [Status.HIT, Status.MISS]
        assert [r.status for r in step.allocates] == [Status.ALLOCATED]
        assert c.lookup(POOL, ["old"])[0].pins == 0
        assert_blocks_accounted(c, POOL)


def test_a_bad_item_in_one_part_of_a_step_fails_alone(daemon: Daemon) -> None:
    with daemon.client(name="engine") as c:
        c.open_pool(POOL, BLOCK, 8 * BLOCK)
        step = c.step(
            POOL,
            acquires=["", "absent"],
            allocates=[
                AllocateItem("k", (BLOCK,), "uint8"),
                AllocateItem("x" * 300, (1,), "uint8"),
            ],
        )
        assert [r.status for r in step.acquires] == [Status.INVALID_ARGUMENT, Status.MISS]
        assert [r.status for r in step.allocates] == [Status.ALLOCATED, Status.INVALID_ARGUMENT]
        assert "too long" in step.allocates[1].message


def test_a_closed_client_refuses_every_call_saying_it_is_closed(daemon: Daemon) -> None:
    """A put after the `with` block names no session (the daemon's unknown-session answer would
    put its ID in application logs, and advise opening another); a call that needs no session
    fails too, rather than hide that the application uses a client it closed."""
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        producer = Producer(c, POOL)
    for call in (
        lambda: producer.put("after", torch.ones(16)),
        c.stats,
        lambda: c.lookup(POOL, ["after"]),
        c.health,
        lambda: c.watch(POOL),
    ):
        with pytest.raises(EcdError, match="this client is closed") as refused:
            call()
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert c.session_id not in refused.value.message


def open_files_of(path: str) -> int:
    """How many of this process's file descriptors are open on the file at `path`."""
    target = os.stat(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        count += (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)
    return count


def test_a_closed_client_holds_no_pool_file_the_daemon_handed_it(daemon: Daemon) -> None:
    with daemon.client() as c:
        path = c.open_pool("p", 4096, 64 * 4096).path
        assert open_files_of(path) >= 1  # the file the fd channel handed over, at least
        with daemon.client() as other:  # a second client in the process holds it too
            other.open_pool("p")
        assert open_files_of(path) >= 1
    assert open_files_of(path) == 0
