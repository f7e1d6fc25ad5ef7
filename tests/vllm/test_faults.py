"""Evictions, a daemon restart, a daemon outage and a killed worker, each during an engine's steps.

Each ends in a re-encode or a failed request (only the request concerned), never a hang, an
engine-wide error or wrong bytes. A load under a lock pin outlives a daemon restart.
"""

from __future__ import annotations

import logging
import time

import pytest
from ecd_testing import Daemon, run_ecd, wait_until
from vllm_testing import ROWS, WIDTH, Engine, EngineFactory, digest, encoder_output, request

from ec_client import AllocateItem, EntryState, Status

ITEM_BYTES = ROWS * WIDTH * 2


def without_slots(e: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the view had not heard any entry's slot yet: cached items take the background
    Acquire (lease pins)."""
    monkeypatch.setattr(e.scheduler.view, "slot", lambda key: None)


def test_an_item_evicted_before_its_acquire_is_encoded_instead(
    engine: EngineFactory, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine()
    e.save("r0", "img-a")
    without_slots(e, monkeypatch)
    r1 = request("r1", "img-a")
    assert not e.connector.ensure_cache_available(r1, 0)  # the pool has it: wait for a pin
    with daemon.client(name="operator") as c:
        assert c.evict(e.pool, ["img-a"])[0].status is Status.OK
    held, result = e.admit(r1)
    assert result.step.encode == {"img-a": ROWS} and not result.failed
    assert held == 1


def test_an_item_evicted_before_its_lock_pin_is_encoded_instead_and_saved_again(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine()
    e.save("r0", "img-a")
    view = e.scheduler.view
    slot = view.slot(b"img-a")
    with daemon.client(name="operator") as c:
        assert c.evict(e.pool, ["img-a"])[0].status is Status.OK
    wait_until(lambda: not view.has(b"img-a"))
    view._ready[b"img-a"] = slot  # a stale view: the EVICTED event not heard yet
    held, result = e.admit(request("r1", "img-a"))  # the lock finds the record erased
    assert held == 0 and result.step.encode == {"img-a": ROWS} and not result.failed
    assert e.locked() == (0, 0)
    e.flush()
    with daemon.client() as c:
        assert c.lookup(e.pool, ["img-a"])[0].state is EntryState.READY  # saved again


def test_this_steps_allocations_never_evict_an_item_pinned_for_loading(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(capacity=ITEM_BYTES)  # room for exactly one item
    e.save("r0", "img-a")
    _, result = e.admit(request("r1", "img-a", "img-new"))  # load one, encode the other
    assert result.step.load == {"img-a"} and result.step.encode == {"img-new": ROWS}
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}
    # NO_SPACE: the pinned entry stayed, and the output kept for saving is let go.
    assert e.schedule().metadata.cancelled == {"img-new"}
    with daemon.client() as c:
        assert c.lookup(e.pool, ["img-a"])[0].state is EntryState.READY


def test_a_load_under_a_lock_pin_outlives_a_daemon_restart_and_its_entry_is_not_evicted(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="durable", capacity=2 * ITEM_BYTES)  # room for two items
    e.save("r0", "img-a")
    step = e.schedule([request("r1", "img-a")])  # lock-pinned, and the load is ordered
    assert step.load == {"img-a"}
    replies = e.run(step)
    epoch = e.scheduler.client.boot_epoch
    daemon.restart()  # SIGKILL, then a new daemon re-adopts the pool's READY entries
    wait_until(lambda: e.scheduler.client.boot_epoch != epoch)
    wait_until(lambda: e.scheduler.view.synced)
    assert e.connector.take_unavailable_requests() == set()  # not failed: its lock holds
    config = e.scheduler.config
    with daemon.client(name="operator") as c:
        assert c.stats("durable").pools[0].entries_locked == 1
        [evicted] = c.evict("durable", ["img-a"])  # refused: a reader holds it
        assert evicted.status is Status.FAILED_PRECONDITION
        c.open_pool("durable", config.block_size_bytes, config.capacity_bytes, config.compat_key)
        items = [AllocateItem(f"fill-{i}", (ROWS, WIDTH), "float16") for i in range(2)]
        answers = c.allocate("durable", items)  # the second needs img-a's blocks: not given
        assert [a.status for a in answers] == [Status.ALLOCATED, Status.NO_SPACE]
        assert c.lookup("durable", ["img-a"])[0].state is EntryState.READY
    assert e.finish(replies) == set()  # the report: not failed, and unlocked
    assert e.locked() == (0, 0)
    assert replies[0].loaded == {"img-a": digest(encoder_output("img-a"))}


def test_a_recreated_pool_fails_the_loads_under_lock_pins_and_lock_pins_work_on_the_new_file(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="durable")
    e.save("r0", "img-a")
    step = e.schedule([request("r1", "img-a")])  # lock-pinned, and the load is ordered
    assert step.load == {"img-a"}
    replies = e.run(step)
    info = e.scheduler.client.pool_info("durable")
    uuid = info.pool_uuid
    with daemon.client(name="operator") as c:  # dropped and made again: a new file
        c.drop_pool("durable", force=True)
        capacity = info.block_size_bytes * info.num_blocks
        c.open_pool("durable", info.block_size_bytes, capacity, info.compat_key)
    wait_until(lambda: e.scheduler.client.pool_info("durable").pool_uuid != uuid, 10)
    wait_until(lambda: e.scheduler.view.synced, 10)
    assert e.finish(replies) == {"r1"}  # its extents were the old file's
    e.save("r2", "img-b")
    _, after = e.admit(request("r3", "img-b"))
    assert after.loaded == {"img-b": digest(encoder_output("img-b"))}
    assert e.locked() == (0, 0)


@pytest.mark.parametrize("pool", [None, "durable"], ids=["private", "shared"])
def test_a_pool_an_operator_dropped_under_an_engine_stays_gone_and_the_engine_says_so(
    engine: EngineFactory, daemon: Daemon, caplog: pytest.LogCaptureFixture, pool: str | None
) -> None:
    e = engine(pool=pool)
    e.save("r0", "img-a")
    run_ecd("drop", e.pool, "--force", "--address", daemon.address, check=True)
    wait_until(lambda: not e.scheduler.view.synced, 10)
    deadline = time.monotonic() + 1.5  # before, the engine's view made it again within 0.2 s
    while time.monotonic() < deadline:
        with daemon.client(name="observer") as c:
            assert [p.engine_id for p in c.stats().pools] == [], "the engine made it again"
        time.sleep(0.05)
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"pool was dropped: {e.pool!r}, by ecd-cli" in message for message in told), told
    result = e.step(request("r1", "img-a"))  # the engine goes on without the cache
    assert result.step.encode == {"img-a": ROWS} and not result.failed


def test_a_daemon_restart_fails_only_the_requests_whose_loads_under_a_lease_were_in_flight(
    engine: EngineFactory, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(pool="durable")
    e.save("r0", "img-a")
    without_slots(e, monkeypatch)
    r1 = request("r1", "img-a")
    assert e.step(r1).step.held == {"r1"}  # its lease pin is taken in the background
    step = e.schedule([r1, request("r2", "img-b")])  # r1 loads, r2 encodes
    assert step.load == {"img-a"}
    replies = e.run(step)
    epoch = e.scheduler.client.boot_epoch
    daemon.restart()  # SIGKILL, then a new daemon re-adopts the pool's READY entries
    wait_until(lambda: e.scheduler.client.boot_epoch != epoch)
    assert e.finish(replies) == {"r1"}
    wait_until(lambda: e.scheduler.view.has(b"img-a"))
    _, after = e.admit(request("r3", "img-a"))
    assert after.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_while_the_daemon_is_down_requests_are_encoded_without_stalling_the_steps(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="durable")
    e.save("r0", "img-a")
    daemon.kill()
    wait_until(lambda: not e.scheduler.view.synced)
    started = time.monotonic()
    step = e.schedule([request("r1", "img-a"), request("r2", "img-b")])
    assert time.monotonic() - started < 1  # no call waits out the 2 s connect timeout
    assert step.encode == {"img-a": ROWS, "img-b": ROWS} and not step.metadata.saves
    assert not e.finish(e.run(step)) and not e.connector.has_pending_push_work()
    daemon.start()
    wait_until(lambda: e.scheduler.view.has(b"img-a"), timeout_s=10)
    _, after = e.admit(request("r3", "img-a"))
    assert after.loaded == {"img-a": digest(encoder_output("img-a"))}


def test_an_engine_started_while_the_daemon_is_down_encodes_then_uses_it_once_it_is_up(
    engine: EngineFactory, daemon: Daemon
) -> None:
    daemon.stop()
    e = engine(pool="durable")  # no error: the daemon is an optimisation
    step = e.schedule([request("r1", "img-a")])
    assert step.encode == {"img-a": ROWS} and step.metadata.pool is None
    assert not e.finish(e.run(step)) and not e.connector.has_pending_push_work()

    daemon.start()
    wait_until(lambda: e.scheduler.view.synced, timeout_s=15)
    e.save("r2", "img-b")
    _, after = e.admit(request("r3", "img-b"))
    assert after.loaded == {"img-b": digest(encoder_output("img-b"))}


def test_an_outage_leaves_no_save_intent_behind_and_the_key_is_saved_once_it_is_over(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="durable")
    daemon.kill()
    wait_until(lambda: not e.scheduler.view.synced)
    step = e.schedule([request("r1", "img-b")])  # encoded, not saved: the daemon is away
    assert not step.metadata.save_intents  # so no worker keeps the output for it
    assert not e.finish(e.run(step))
    daemon.start()
    wait_until(lambda: e.scheduler.view.synced, timeout_s=10)
    assert not e.connector.has_pending_push_work()  # the engine may idle
    e.save("r2", "img-b")
    wait_until(lambda: e.scheduler.view.has(b"img-b"))


def test_a_worker_killed_mid_save_leaves_nothing_pending_once_its_engine_stops(
    engine: EngineFactory, daemon: Daemon
) -> None:
    producer = engine(role="ec_producer", pool="shared")
    consumer = engine(role="ec_consumer", pool="shared")
    producer.schedule([request("p1", "img-a")])
    producer.answered()  # allocated: PENDING in the daemon
    wait_until(lambda: consumer.scheduler.view.pending(b"img-a"))
    producer.workers[0].kill()  # before it copied anything
    waiting = request("c1", "img-a")
    assert consumer.step(waiting).step.held == {"c1"}  # its producer's fate is not known yet
    producer.close()  # vLLM shuts the engine down when a worker dies: its entry is aborted
    _, result = consumer.admit(waiting, max_steps=200)
    assert result.step.encode == {"img-a": ROWS}  # not loaded: encoded
    with daemon.client() as c:
        assert c.lookup("shared", ["img-a"])[0].state is EntryState.ABSENT
        c.open_pool(
            "shared",
            consumer.scheduler.config.block_size_bytes,
            1 << 20,
            consumer.scheduler.config.compat_key,
        )
        [again] = c.allocate("shared", [AllocateItem("img-a", (ROWS, WIDTH), "float16")])
        assert again.status is Status.ALLOCATED


def test_a_worker_killed_mid_load_leaves_no_pin_once_its_engine_stops(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="shared")
    e.save("r0", "img-a")
    step = e.schedule([request("r1", "img-a")])  # pinned, and the load is ordered...
    assert step.load == {"img-a"} and e.locked() == (0, 1)
    e.workers[0].kill()  # ...and its worker dies before reporting it
    e.close()
    with daemon.client() as c:
        [pool] = c.stats("shared").pools
        assert (pool.pins, pool.entries_locked, pool.entries_ready) == (0, 0, 1)
