"""Evictions, a daemon restart, a daemon outage and a killed worker, each during an engine's steps.

Each ends in a re-encode or a failed request (only the request concerned), never a hang, an
engine-wide error or wrong bytes.
"""

from __future__ import annotations

import time

from ecd_testing import Daemon, wait_until
from vllm_testing import ROWS, WIDTH, EngineFactory, digest, encoder_output, request

from ec_client import AllocateItem, EntryState, Status

ITEM_BYTES = ROWS * WIDTH * 2


def test_an_item_evicted_before_its_pin_was_taken_is_encoded_instead(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(extra={"ecd_pins": "ahead"})
    e.save("r0", "img-a")
    r1 = request("r1", "img-a")
    assert not e.connector.ensure_cache_available(r1, 0)  # the pool has it: wait for a pin
    with daemon.client(name="operator") as c:
        assert c.evict(e.pool, ["img-a"])[0].status is Status.OK
    held, result = e.admit(r1)
    assert result.step.encode == {"img-a": ROWS} and not result.failed
    assert held == 1


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


def test_a_daemon_restart_fails_only_the_requests_whose_loads_were_in_flight(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="durable")
    e.save("r0", "img-a")
    r1 = request("r1", "img-a")
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
    # Not waiting for PENDING entries: a consumer's wait is bounded (test_two_engines).
    consumer = engine(role="ec_consumer", pool="shared", extra={"ecd_pending_wait_ms": 0})
    producer.schedule([request("p1", "img-a")])
    producer.answered()  # allocated: PENDING in the daemon
    producer.workers[0].kill()  # before it copied anything
    result = consumer.step(request("c1", "img-a"))
    assert result.step.encode == {"img-a": ROWS}  # not waited for, not loaded: encoded
    producer.close()  # vLLM shuts the engine down when a worker dies
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
    assert step.load == {"img-a"}
    e.workers[0].kill()  # ...and its worker dies before reporting it
    e.close()
    with daemon.client() as c:
        [pool] = c.stats("shared").pools
        assert pool.pins == 0 and pool.entries_ready == 1
