"""One ec_both engine (scheduler here, one worker process) driven in vLLM's per-step call order.

Proves: an encoded output is kept by the worker until its entry is allocated, copied the next
step, and committed only after the worker reported its copy; a later request loads it
bit-identical instead of encoding it, admitted in the same call (a lock pin on its slot, taken
before the scheduler is told "load", with no round trip), or one step later while its slot is
not known yet (a background Acquire); the pin goes once the load is reported; a step costs at
most one RPC of each purpose, all from the background thread, and a miss costs none; the
connector takes what vLLM's own connector tests pass (no SchedulerOutput); the hits it read
reach the daemon within a second of their step with no further call, at once when vLLM finds
the engine without requests, and when vLLM shuts the engine down.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
from ecd_testing import Daemon, wait_until
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_testing import Engine, EngineFactory, digest, encoder_output, request

from ec_client import EntryState
from ec_client.control.outbox import ANSWERED_LINGER_S
from ec_client.vllm.metadata import ECDaemonConnectorMetadata


def test_an_encoded_item_is_committed_only_after_the_worker_reported_its_copy(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine()
    first = e.schedule([request("r1", "img-a")])
    assert first.encode == {"img-a": 16}
    assert first.metadata.save_intents == {"img-a"} and not first.metadata.saves
    e.finish(e.run(first))  # the worker kept the output: its entry is being allocated
    e.answered()
    with daemon.client() as c:
        assert c.lookup(e.pool, ["img-a"])[0].state is EntryState.PENDING
        second = e.schedule()
        assert set(second.metadata.saves) == {"img-a"}  # the order comes with the next step
        replies = e.run(second)  # the worker copied what it kept, and reports it
        assert replies[0].saved_here == ["img-a"]
        assert c.lookup(e.pool, ["img-a"])[0].state is EntryState.PENDING
        e.finish(replies)  # the report: committed at once
        e.answered()
        assert c.lookup(e.pool, ["img-a"])[0].state is EntryState.READY
    assert not e.connector.has_pending_push_work()


def test_an_item_saved_in_one_step_is_loaded_bit_identical_in_a_later_step(
    engine: EngineFactory,
) -> None:
    e = engine()
    e.save("r1", "img-a")
    held, result = e.admit(request("r2", "img-a"))
    assert result.step.load == {"img-a"} and not result.step.encode
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}
    assert held == 0  # lock-pinned at once: not held back


def test_the_pin_is_taken_before_the_scheduler_is_told_to_load_and_released_after_the_load(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine()
    e.save("r1", "img-a")
    step = e.schedule([request("r2", "img-a")])
    assert step.load == {"img-a"} and not step.held
    assert e.locked() == (0, 1)  # lock-pinned before it was promised (no lease)
    replies = e.run(step)
    e.answered()
    assert e.locked() == (0, 1)  # held while the load is unreported
    e.finish(replies)
    assert e.locked() == (0, 0)  # unlocked at the report, with no round trip
    e.answered()
    with daemon.client() as c:
        assert c.stats(e.pool).pools[0].hits == 1  # the lock pin's hit reached the daemon


def hit_unflushed(e: Engine) -> None:
    """A request loads the saved img-a under a lock pin, in one whole step, and nothing sends
    what the connector owes the daemon (Engine.step would flush it)."""
    step = e.schedule([request("r2", "img-a")])
    assert step.load == {"img-a"}
    e.finish(e.run(step))


def test_an_engines_hits_reach_the_daemon_when_vllm_shuts_it_down(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(pool="kept")  # a pool that outlives the engine, to be read after it
    e.save("r1", "img-a")
    hit_unflushed(e)
    # What vLLM's engine core runs at shutdown (SIGTERM too): its Scheduler.shutdown.
    vllm_scheduler = SimpleNamespace(
        kv_event_publisher=None, connector=None, ec_connector=e.connector
    )
    Scheduler.shutdown(cast(Scheduler, vllm_scheduler))
    with daemon.client() as c:
        assert c.stats("kept").pools[0].hits == 1


def test_the_hits_owed_go_at_once_when_vllm_finds_the_engine_without_requests(
    engine: EngineFactory, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)  # none go alone
    e = engine()
    e.save("r1", "img-a")
    hit_unflushed(e)
    # vLLM's Scheduler.has_requests asks this once no request is left, as the engine goes idle
    assert not e.connector.has_pending_push_work()
    with daemon.client() as c:
        wait_until(lambda: c.stats(e.pool).pools[0].hits == 1, timeout_s=10)


def test_an_idle_engines_hits_reach_the_daemon_within_the_answered_linger_with_no_step(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine()
    e.save("r1", "img-a")
    hit_unflushed(e)  # then the engine is idle: vLLM calls the connector no more
    with daemon.client() as c:
        # ANSWERED_LINGER_S after the step's hand-over at most, then a Step's trip (the margin
        # is for a loaded machine)
        wait_until(lambda: c.stats(e.pool).pools[0].hits == 1, timeout_s=ANSWERED_LINGER_S + 4)


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
def test_build_connector_meta_takes_no_scheduler_output_as_vllms_own_tests_pass_it(
    engine: EngineFactory, positional: bool
) -> None:
    e = engine(workers=False)
    req = request("r1", "img-a")
    assert e.connector.ensure_cache_available(req, 0)
    e.connector.update_state_after_alloc(req, 0)  # encoded here: to be saved
    build = e.connector.build_connector_meta
    meta = build(None) if positional else build(scheduler_output=None)
    assert isinstance(meta, ECDaemonConnectorMetadata) and meta.save_intents == {"img-a"}


def without_slots(e: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the view had not heard any entry's slot yet (their COMMITTED events on their
    way): every cached item takes the background Acquire."""
    monkeypatch.setattr(e.scheduler.view, "slot", lambda key: None)


def test_a_cached_item_whose_slot_is_not_known_yet_waits_one_step_for_its_pin(
    engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine()
    e.save("r1", "img-a")
    without_slots(e, monkeypatch)
    rpcs = e.scheduler.rpcs.copy()
    held, result = e.admit(request("r2", "img-a"))
    assert held == 1 and result.step.load == {"img-a"}
    assert result.loaded == {"img-a": digest(encoder_output("img-a"))}
    assert set(e.scheduler.rpcs - rpcs) <= {"flush", "report"}  # background Steps only
    e.answered()
    assert e.locked() == (0, 0)  # the lease went with the next Step


def test_a_burst_of_cached_requests_is_admitted_in_the_same_call_with_no_round_trip(
    engine: EngineFactory,
) -> None:
    e = engine()
    for i in range(8):
        e.save(f"seed-{i}", f"img-{i}")
    requests = [request(f"r{i}", f"img-{i}") for i in range(8)]
    before = e.scheduler.rpcs.copy()
    assert all(e.connector.ensure_cache_available(r, 0) for r in requests)
    assert all(e.connector.has_cache_item(f"img-{i}") for i in range(8))
    assert e.scheduler.rpcs == before  # not one Step for the pins, not even a background one
    step = e.schedule(requests)
    assert not step.held and step.load == {f"img-{i}" for i in range(8)} and not step.encode
    e.finish(e.run(step))
    assert e.locked() == (0, 0)


def test_a_miss_costs_no_round_trip(engine: EngineFactory) -> None:
    e = engine(workers=False)
    before = sum(e.scheduler.rpcs.values())
    req = request("r1", *[f"new-{i}" for i in range(32)])
    assert e.connector.ensure_cache_available(req, 0)
    assert not any(e.connector.has_cache_item(f.identifier) for f in req.mm_features)
    assert sum(e.scheduler.rpcs.values()) == before


def test_a_miss_the_view_answered_is_counted_by_the_daemon(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(workers=False)
    assert len(e.schedule([request("r1", *[f"new-{i}" for i in range(3)])]).encode) == 3
    e.answered()
    with daemon.client() as c:
        assert c.stats(e.pool).pools[0].misses == 3


def test_a_step_makes_at_most_one_rpc_of_each_purpose_however_many_images(
    engine: EngineFactory,
) -> None:
    e = engine()
    e.step(*[request(f"seed-{i}", f"old-{i}") for i in range(32)])
    e.flush()
    waiting, per_step = [], []
    for s in range(4):  # 8 new requests a step, each with a cached image and a new one
        waiting += [request(f"s{s}-{i}", f"old-{s * 8 + i}", f"new-{s * 8 + i}") for i in range(8)]
        before = e.scheduler.rpcs.copy()
        result = e.step(*waiting)
        waiting = [r for r in waiting if r.request_id in result.step.held]
        per_step.append(e.scheduler.rpcs - before)
    assert all(count == 1 for step in per_step for count in step.values()), per_step
    # the step's flush (allocations, hits), the report's commits; no pin needs one
    assert {"flush", "report"} == per_step[2].keys(), per_step


def test_a_request_finished_before_its_load_gives_its_lock_pin_back(
    engine: EngineFactory,
) -> None:
    e = engine()
    e.save("r1", "img-a")
    r2 = request("r2", "img-a")
    assert e.connector.ensure_cache_available(r2, 0)  # lock-pinned for it
    assert e.locked() == (0, 1)
    e.connector.request_finished(r2)  # aborted by the user before it was scheduled
    assert e.locked() == (0, 0)


def test_a_request_finished_before_its_load_gives_its_lease_pin_back(
    engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine()
    e.save("r1", "img-a")
    without_slots(e, monkeypatch)
    r2 = request("r2", "img-a")
    e.step(r2)  # held back: the pin is taken for it in the background
    e.connector.request_finished(r2)  # aborted by the user before it ran
    e.flush()
    assert e.locked() == (0, 0)


def test_a_request_mid_prefill_is_not_held_back_for_an_image_it_already_has(
    engine: EngineFactory,
) -> None:
    e = engine()
    r1 = request("r1", "img-a")
    e.step(r1)  # encoded, and saved: the pool has img-a from now on
    e.flush()
    before = e.scheduler.rpcs.copy()
    assert e.connector.ensure_cache_available(r1, 1)  # its next chunk starts inside the image
    e.step()
    assert e.scheduler.rpcs == before  # no pin taken for it


def test_after_shutdown_no_item_is_reported_cached(engine: EngineFactory) -> None:
    e = engine()
    e.save("r1", "img-a")
    e.schedule([request("r2", "img-a")])  # pins img-a
    assert e.connector.has_cache_item("img-a")
    e.close()
    assert not e.connector.has_cache_item("img-a")  # the pin went with the session


def test_an_item_is_a_hit_at_the_step_after_its_save_was_reported(engine: EngineFactory) -> None:
    e = engine()
    e.step(request("r1", "img-a"))  # encoded; its entry allocated in the background
    saving = e.schedule()
    assert set(saving.metadata.saves) == {"img-a"}
    e.finish(e.run(saving))  # the workers report the copy: its Commit goes at once
    e.answered()
    e.slot_known("img-a")  # its COMMITTED event, in the time of a forward pass
    following = e.schedule([request("r2", "img-a")])
    assert following.load == {"img-a"} and not following.encode and not following.held
