"""Outbox: what a client owes the daemon with nobody waiting (ec_client/control/outbox.py), with
fake copies and a fake sender; no daemon.

Proves: an op goes only once its copy landed (or, when flushing, after waiting for it); a commit
whose copy failed leaves as an abort and its owner hears why; each op gets its own answer and
the rest of a Step's answers go back to the caller; the background thread sends what a quiet pool
is owed, and leaves a busy pool's ops to its next Step; a commit is reported owed until its
answer came; flush sends everything and waits, or says it ran out of time; a Step asked soon goes
from the background in the order asked, with what is owed ahead of its asks (and what was handed
over with it), its future holding the asker's answers or the error; a Step refused for its
caller's own items gives its batch back, owed again ahead of what was owed since; a Step's keys
stop being in transit once it is answered, even when an op's handler raises; a Step of the
background thread that fails with a bug (not an EcdError: a closed channel, an item the wire
cannot encode, an op's handler) is logged, its ops and its asker hear INTERNAL once and it is not
sent again, and the thread goes on sending the Steps after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
from ecd_testing import wait_until

from ec_client.control.outbox import Answered, DeferredOp, Outbox, OutboxBatch
from ec_protocol.errors import EcdError
from ec_protocol.types import (
    MAX_HITS_PER_STEP,
    MAX_MISSES_PER_STEP,
    AcquireResult,
    AllocateItem,
    ItemResult,
    Key,
    LeaseResult,
    Status,
    StepResult,
)

POOL = "pool"


class FakeCopy:
    """A copy in flight until `land()`; `fail()` makes it land with a device error."""

    def __init__(self) -> None:
        self.landed = threading.Event()
        self.error: Exception | None = None

    def land(self) -> None:
        self.landed.set()

    def fail(self) -> None:
        self.error = RuntimeError("CUDA error: an illegal memory access")
        self.landed.set()

    def done(self) -> bool:
        return self.landed.is_set()

    def wait(self) -> None:
        assert self.landed.wait(5), "the test never landed this copy"
        if self.error is not None:
            raise self.error


class Answers:
    """Records what each op was told (`got`), and who was told, in order, once per telling."""

    def __init__(self) -> None:
        self.got: dict[str, Any] = {}
        self.told: list[str] = []

    def op(self, name: str, copy: FakeCopy | None = None, **fields: Any) -> DeferredOp:
        def heard(answer: Any) -> None:
            self.got[name] = answer
            self.told.append(name)

        return DeferredOp(on_result=heard, copy=copy, **fields)


class Sender:
    """Outbox's send: records batches (and asks), and answers them as a daemon would, or holds
    them, or fails them with `error`, or raises `bug` (once, telling nothing: a sender with a
    bug). With `build`, it builds the Step first, as the client's sender does."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, OutboxBatch]] = []
        self.asks: list[tuple[Sequence[Key], Sequence[AllocateItem]]] = []
        self.sent = threading.Event()
        self.hold = False
        self.release = threading.Event()  # lets a held Step be answered
        self.error: EcdError | None = None
        self.bug: Exception | None = None
        self.build = False

    def __call__(
        self,
        engine_id: str,
        batch: OutboxBatch,
        acquires: Sequence[Key],
        allocates: Sequence[AllocateItem],
    ) -> StepResult:
        self.batches.append((engine_id, batch))
        self.asks.append((acquires, allocates))
        self.sent.set()
        if self.build:
            batch.step(engine_id, acquires=acquires, allocates=allocates)
        if self.bug is not None:
            bug, self.bug = self.bug, None
            raise bug
        if self.hold:
            assert self.release.wait(5), "the test never let the held Step be answered"
        if self.error is not None:
            batch.fail(self.error)
            raise self.error
        return batch.resolve(answer(batch, acquires))


def answer(batch: OutboxBatch, acquires: Sequence[Key] = ()) -> StepResult:
    """What a daemon would answer a Step carrying this batch and these acquires: all OK, every
    acquire a miss."""
    return StepResult(
        tuple(LeaseResult(d.lease_id, Status.OK, "") for d in batch.releases),
        tuple(ItemResult(d.key, Status.OK, "") for d in batch.commits),
        tuple(ItemResult(d.key, Status.OK, "") for d in batch.aborts),
        tuple(AcquireResult(bytes(k), Status.MISS, "", 0, (), None, 0) for k in acquires),
        (),
    )


def owed(linger_s: float = 60.0) -> tuple[Outbox, Sender]:
    """An Outbox whose pools had a Step a moment ago: with the default linger, what they are owed
    waits for their next Step (the test's take) rather than go in the background."""
    sender = Sender()
    o = Outbox(sender, linger_s)
    for engine_id in (POOL, "other"):
        o.take(engine_id)
    return o, sender


def test_an_op_goes_only_once_its_copy_landed() -> None:
    o, _ = owed()
    answers = Answers()
    flying, landed = FakeCopy(), FakeCopy()
    landed.land()
    o.commits(POOL, [answers.op("a", flying, key=b"a"), answers.op("b", landed, key=b"b")])
    assert [d.key for d in o.take(POOL).commits] == [b"b"]
    flying.land()
    assert [d.key for d in o.take(POOL).commits] == [b"a"]
    o.close()


def test_taking_with_wait_carries_every_op_after_its_copy_landed() -> None:
    o, _ = owed()
    copy = FakeCopy()
    o.releases(POOL, [Answers().op("pin", copy, lease_id=7)])
    threading.Timer(0.05, copy.land).start()
    batch = o.take(POOL, wait=True)
    assert batch.release_ids() == [7] and copy.done()
    o.close()


def test_a_commit_whose_copy_failed_leaves_as_an_abort_and_its_owner_hears_why() -> None:
    o, _ = owed()
    answers, copy = Answers(), FakeCopy()
    o.commits(POOL, [answers.op("a", copy, key=b"a")])
    copy.fail()
    batch = o.take(POOL)
    assert batch.commits == [] and batch.abort_keys() == [b"a"]
    assert isinstance(answers.got["a"], EcdError) and "illegal memory access" in str(
        answers.got["a"]
    )
    o.close()


def test_each_op_gets_its_answer_and_the_rest_of_the_step_goes_back_to_the_caller() -> None:
    answers = Answers()
    batch = OutboxBatch(
        releases=[answers.op("pin", lease_id=3)], commits=[answers.op("a", key=b"a")]
    )
    theirs = AcquireResult(b"x", Status.HIT, "", 9, (), None, 0)
    rest = batch.resolve(
        StepResult(
            (LeaseResult(3, Status.OK, ""),),
            (ItemResult(b"a", Status.OK, ""), ItemResult(b"mine", Status.OK, "")),
            (),
            (theirs,),
            (),
        )
    )
    assert answers.got["pin"].lease_id == 3 and answers.got["a"].key == b"a"
    assert [r.key for r in rest.commits] == [b"mine"] and rest.acquires == (theirs,)
    assert rest.releases == ()


def test_a_failed_step_tells_every_op_it_carried() -> None:
    answers = Answers()
    batch = OutboxBatch(releases=[answers.op("pin", lease_id=1)], aborts=[answers.op("a")])
    error = EcdError(grpc.StatusCode.UNAVAILABLE, "the daemon went away")
    batch.fail(error)
    assert answers.got == {"pin": error, "a": error}


def test_the_background_sends_what_a_quiet_pool_is_owed() -> None:
    o, sender = owed(linger_s=0.01)
    answers, copy = Answers(), FakeCopy()
    copy.land()
    o.commits(POOL, [answers.op("a", copy, key=b"a")])
    assert sender.sent.wait(5)
    [(engine_id, batch)] = sender.batches
    assert engine_id == POOL and batch.commit_items() == [(b"a", 0, 0)]
    assert answers.got["a"].status is Status.OK
    o.close()


def test_a_busy_pools_ops_wait_for_its_next_step() -> None:
    o, sender = owed(linger_s=0.3)  # a Step to the pool just went out: it is not quiet
    o.commits(POOL, [Answers().op("a", key=b"a")])
    assert not sender.sent.wait(0.1)  # not yet: the pool's next Step would carry it
    assert [d.key for d in o.take(POOL).commits] == [b"a"]
    o.close()


def test_a_commit_counts_as_owed_until_its_answer_came() -> None:
    o, _ = owed()
    copy = FakeCopy()
    o.commits(POOL, [Answers().op("a", copy, key=b"a")])
    assert o.commits_owed(POOL) == {b"a": False}  # copy in flight
    copy.land()
    assert o.commits_owed(POOL) == {b"a": True}  # may ride on the next Step
    batch = o.take(POOL)
    assert o.commits_owed(POOL) == {b"a": False}  # in transit: not visible yet
    batch.resolve(answer(batch))
    assert o.commits_owed(POOL) == {}
    o.close()


def test_a_step_acquiring_a_key_waits_for_the_commit_of_it_another_step_carries() -> None:
    o, _ = owed()
    o.commits(POOL, [Answers().op("a", key=b"a")])
    carrying = o.take(POOL)  # the background thread's Step, on its way
    taken: list[OutboxBatch] = []
    reader = threading.Thread(target=lambda: taken.append(o.take(POOL, reading=["a"])))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive()  # its Acquire could reach the daemon ahead of the Commit
    carrying.resolve(answer(carrying))
    reader.join(5)
    assert len(taken) == 1 and not taken[0].commits
    o.close()


def test_a_step_acquiring_other_keys_does_not_wait_for_a_commit_on_its_way() -> None:
    o, _ = owed()
    o.commits(POOL, [Answers().op("a", key=b"a")])
    carrying = o.take(POOL)
    assert not o.take(POOL, reading=["b"])  # at once: nothing owed, nothing of its keys in transit
    carrying.resolve(answer(carrying))
    o.close()


def test_try_take_answers_none_where_take_would_wait_and_takes_nothing_then() -> None:
    """For an event loop, which must not block (it may be carrying the Step waited for)."""
    o, _ = owed()
    o.commits(POOL, [Answers().op("a", key=b"a")])
    carrying = o.take(POOL)
    o.commits(POOL, [Answers().op("b", key=b"b")])
    assert o.try_take(POOL, reading=["a"]) is None
    assert o.commits_owed(POOL) == {b"a": False, b"b": True}  # "b" still owed, not taken
    carrying.resolve(answer(carrying))
    batch = o.try_take(POOL, reading=["a"])
    assert batch is not None and [d.key for d in batch.commits] == [b"b"]
    o.close()


def taken_in_background(o: Outbox, **keys: Sequence[Key]) -> tuple[threading.Thread, list[Any]]:
    """A caller's take (a put's or a get's Step) on a thread of its own: it may have to wait."""
    taken: list[OutboxBatch] = []
    caller = threading.Thread(target=lambda: taken.append(o.take(POOL, **keys)))
    caller.start()
    caller.join(0.1)
    return caller, taken


@pytest.mark.parametrize("kind", ["commit", "abort"])
def test_a_step_allocating_a_key_waits_for_the_commit_or_abort_of_it_another_step_carries(
    kind: str,
) -> None:
    """An Abort reaching the daemon after the new Allocate would free the blocks being copied
    into; a Commit, make them READY under the new copy."""
    o, _ = owed()
    (o.commits if kind == "commit" else o.aborts)(POOL, [Answers().op("a", key=b"a")])
    carrying = o.take(POOL)  # the background thread's Step, on its way
    writer, taken = taken_in_background(o, writing=["a"])
    assert writer.is_alive()
    carrying.resolve(answer(carrying))
    writer.join(5)
    assert len(taken) == 1
    o.close()


def test_a_step_acquiring_a_key_does_not_wait_for_an_abort_of_it() -> None:
    o, _ = owed()
    o.aborts(POOL, [Answers().op("a", key=b"a")])
    carrying = o.take(POOL)
    reader, taken = taken_in_background(o, reading=["a"])
    assert not reader.is_alive() and taken  # a miss either way: nothing to wait for
    carrying.resolve(answer(carrying))
    o.close()


def test_a_step_refused_for_its_callers_items_gives_the_batch_back_ahead_of_later_ops() -> None:
    o, _ = owed()
    answers = Answers()
    o.commits(POOL, [answers.op("a", key=b"a")])
    o.misses(POOL, 2)
    batch = o.take(POOL)
    o.commits(POOL, [answers.op("b", key=b"b")])
    with pytest.raises(TypeError):
        batch.step(POOL, acquires=[12345])  # type: ignore[list-item]
    again = o.take(POOL, reading=["a"])  # at once: "a" is no longer on its way
    assert [d.key for d in again.commits] == [b"a", b"b"]
    assert again.answered.misses == 2 and answers.got == {}
    o.close()


def test_a_steps_keys_stop_being_in_transit_even_when_an_ops_handler_raises() -> None:
    o, _ = owed()

    def broken(answer: object) -> None:
        raise RuntimeError("a bug in whoever owed it")

    o.commits(POOL, [DeferredOp(on_result=broken, key=b"a")])
    carrying = o.take(POOL)
    with pytest.raises(RuntimeError):
        carrying.resolve(answer(carrying))
    taken: list[OutboxBatch] = []
    reader = threading.Thread(target=lambda: taken.append(o.take(POOL, reading=["a"])))
    reader.start()
    reader.join(5)
    assert taken, "a get of the key would wait for ever"
    o.close()


def test_flush_sends_everything_owed_and_returns_once_answered() -> None:
    o, sender = owed()
    answers, copy = Answers(), FakeCopy()
    o.commits(POOL, [answers.op("a", copy, key=b"a")])
    o.releases("other", [answers.op("pin", lease_id=5)])
    threading.Timer(0.05, copy.land).start()
    o.flush(5)
    assert sorted(e for e, _ in sender.batches) == ["other", POOL]
    assert set(answers.got) == {"a", "pin"}
    o.close()


def test_flush_says_so_when_an_answer_does_not_come_in_time() -> None:
    o, sender = owed(linger_s=0.01)
    sender.hold = True  # the daemon does not answer in time
    o.commits(POOL, [Answers().op("a", key=b"a")])
    assert sender.sent.wait(5)  # the background thread sent it
    with pytest.raises(TimeoutError, match="still running"):
        o.flush(0.1)
    sender.release.set()
    o.close()


def test_an_abort_owed_rides_on_the_pools_next_step_and_hears_its_answer() -> None:
    o, _ = owed()
    answers = Answers()
    o.aborts(POOL, [answers.op("a", key=b"a")])
    batch = o.take(POOL)
    assert batch.abort_keys() == [b"a"] and batch.step(POOL).build("sid").aborts == [b"a"]
    batch.resolve(answer(batch))
    assert answers.got["a"].status is Status.OK
    o.close()


def test_a_step_asked_soon_goes_from_the_background_with_what_is_owed_ahead_of_its_asks() -> None:
    o, sender = owed()  # the pool is busy: only the asked Step carries the release
    answers = Answers()
    o.releases(POOL, [answers.op("pin", lease_id=4)])
    result = o.step_soon(POOL, acquires=[b"x"]).result(5)
    [(engine_id, batch)] = sender.batches
    assert engine_id == POOL and batch.release_ids() == [4] and sender.asks == [([b"x"], [])]
    assert answers.got["pin"].status is Status.OK
    assert result.releases == () and [r.key for r in result.acquires] == [b"x"]  # the asker's
    o.close()


def test_ops_hits_and_misses_handed_over_with_a_step_asked_soon_ride_on_it() -> None:
    o, sender = owed()
    answers = Answers()
    future = o.step_soon(
        POOL,
        acquires=[b"x"],
        releases=[answers.op("pin", lease_id=4)],
        commits=[answers.op("c", key=b"c")],
        aborts=[answers.op("a", key=b"a")],
        answered=Answered(misses=2, hits=[b"h"]),
    )
    future.result(5)
    [(_, batch)] = sender.batches
    assert batch.release_ids() == [4] and [d.key for d in batch.commits] == [b"c"]
    assert [d.key for d in batch.aborts] == [b"a"]
    assert batch.answered.misses == 2 and batch.answered.hits == [b"h"]
    assert {"pin", "c", "a"} <= set(answers.got)
    o.close()


def test_steps_asked_soon_go_in_the_order_asked() -> None:
    o, sender = owed()
    futures = [o.step_soon(POOL, acquires=[f"k{i}".encode()]) for i in range(5)]
    assert [f.result(5).acquires[0].key for f in futures] == [f"k{i}".encode() for i in range(5)]
    assert [acquires for acquires, _ in sender.asks] == [[f"k{i}".encode()] for i in range(5)]
    o.close()


def test_a_step_asked_soon_with_nothing_owed_or_asked_sends_nothing() -> None:
    o, sender = owed()
    assert o.step_soon(POOL).result(5) == StepResult([], [], [], [], [])
    assert sender.batches == []
    o.close()


def test_a_step_asked_soon_that_failed_hands_its_error_to_the_asker_and_its_ops() -> None:
    o, sender = owed()
    sender.error = EcdError(grpc.StatusCode.UNAVAILABLE, "cannot reach ecd")
    answers = Answers()
    o.commits(POOL, [answers.op("a", key=b"a")])
    future = o.step_soon(POOL, acquires=[b"x"])
    with pytest.raises(EcdError, match="cannot reach ecd"):
        future.result(5)
    assert answers.got["a"] is sender.error
    o.close()


def test_a_step_asked_while_the_thread_decides_to_wait_out_a_linger_goes_at_once() -> None:
    # The clock the thread reads as it decides stands in for another thread that asks a Step
    # at that very moment; the thread must not then wait out the hits' linger (a minute).
    asked: list[Future[StepResult]] = []

    def clock() -> float:
        if threading.current_thread().name == "ecd-outbox" and not asked:
            asked.append(o.step_soon(POOL, acquires=[b"x"]))
        return time.monotonic()

    o = Outbox(Sender(), 60.0, clock=clock)
    o.take(POOL)  # a Step a moment ago: the hits wait for the linger
    o.hits(POOL, [b"h"])
    wait_until(lambda: bool(asked))
    assert asked[0].result(5).acquires[0].status is Status.MISS
    o.close()


def test_flush_waits_for_the_steps_asked_soon() -> None:
    o, sender = owed()
    sender.hold = True
    future = o.step_soon(POOL, acquires=[b"x"])
    assert sender.sent.wait(5)
    with pytest.raises(TimeoutError, match="still running"):
        o.flush(0.1)
    threading.Timer(0.05, sender.release.set).start()
    o.flush(5)
    assert future.done()
    o.close()


def test_closing_fails_the_steps_asked_and_not_sent() -> None:
    o, sender = owed()
    sender.hold = True
    first = o.step_soon(POOL, acquires=[b"x"])
    assert sender.sent.wait(5)
    second = o.step_soon(POOL, acquires=[b"y"])
    threading.Timer(0.1, sender.release.set).start()
    o.close()
    assert first.result(5).acquires[0].key == b"x"
    with pytest.raises(EcdError, match="closed"):
        second.result(5)
    with pytest.raises(EcdError, match="closed"):  # asked after the close: nobody sends it
        o.step_soon(POOL, acquires=[b"z"]).result(5)


def test_misses_answered_from_the_view_ride_on_the_pools_next_step() -> None:
    o, _ = owed()
    o.misses(POOL, 2)
    o.misses(POOL, 1)
    batch = o.take(POOL)
    assert batch.answered.misses == 3 and o.take("other").answered.misses == 0
    assert batch.step(POOL).build("sid").misses == 3  # StepRequest.misses
    o.close()


def test_hits_read_under_lock_pins_ride_on_the_pools_next_step() -> None:
    o, _ = owed()
    o.hits(POOL, [b"a"])
    o.hits(POOL, [b"b", b"a"])
    batch = o.take(POOL)
    assert batch.answered.hits == [b"a", b"b", b"a"]  # each read is a hit
    assert list(batch.step(POOL).build("sid").hits) == [b"a", b"b", b"a"]  # StepRequest.hits
    assert not o.take(POOL).answered
    o.close()


def test_a_step_carries_at_most_the_protocols_hits_and_the_rest_go_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)
    o, sender = owed(linger_s=60.0)
    keys = [b"k%d" % i for i in range(MAX_HITS_PER_STEP + 10)]
    o.hits(POOL, keys)  # a busy engine's hits, more than one Step may carry
    wait_until(lambda: len(sender.batches) == 1)  # due at once, not after the linger
    assert sender.batches[0][1].answered.hits == keys[:MAX_HITS_PER_STEP]
    assert o.take(POOL).answered.hits == keys[MAX_HITS_PER_STEP:]  # owed to the next Step
    o.close()


def test_send_answered_sends_the_hits_and_misses_owed_at_once_not_after_the_linger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)
    o, sender = owed(linger_s=60.0)
    o.send_answered(POOL)  # nothing owed: nothing sent
    o.hits(POOL, [b"a"])
    o.misses(POOL, 2)
    o.send_answered(POOL)  # the caller went quiet
    wait_until(lambda: len(sender.batches) == 1)
    [(engine_id, batch)] = sender.batches
    assert (engine_id, batch.answered.hits, batch.answered.misses) == (POOL, [b"a"], 2)
    sender.sent.clear()
    o.hits(POOL, [b"b"])  # owed after that Step: waits the linger again
    assert not sender.sent.wait(0.2)
    o.close()


def test_a_step_carries_at_most_the_protocols_misses_and_the_rest_go_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)
    o, sender = owed(linger_s=60.0)
    o.misses(POOL, MAX_MISSES_PER_STEP + 10)  # more than one Step may carry
    wait_until(lambda: len(sender.batches) == 1)  # due at once, not after the linger
    assert sender.batches[0][1].answered.misses == MAX_MISSES_PER_STEP
    assert o.take(POOL).answered.misses == 10  # owed to the next Step, none dropped
    o.close()


def test_a_flush_sends_every_miss_owed_in_as_many_steps_as_they_fill() -> None:
    o, sender = owed()
    o.misses(POOL, 2 * MAX_MISSES_PER_STEP + 5)
    o.flush()
    sent = [batch.answered.misses for _, batch in sender.batches]
    assert sum(sent) == 2 * MAX_MISSES_PER_STEP + 5 and max(sent) <= MAX_MISSES_PER_STEP
    assert not o.take(POOL).answered
    o.close()


def test_a_step_that_did_not_reach_the_daemon_leaves_its_hits_to_the_next_one() -> None:
    o, _ = owed()
    o.hits(POOL, [b"a"])
    batch = o.take(POOL)
    o.hits(POOL, [b"b"])
    batch.fail(EcdError(grpc.StatusCode.UNAVAILABLE, "cannot reach ecd"))
    assert sorted(o.take(POOL).answered.hits) == [b"a", b"b"]
    o.close()


def test_an_answered_steps_misses_are_not_sent_again() -> None:
    o, _ = owed()
    o.misses(POOL, 3)
    batch = o.take(POOL)
    batch.resolve(answer(batch))
    assert o.take(POOL).answered.misses == 0
    o.close()


def test_a_step_that_did_not_reach_the_daemon_leaves_its_misses_to_the_next_one() -> None:
    o, _ = owed()
    o.misses(POOL, 3)
    batch = o.take(POOL)
    o.misses(POOL, 1)  # while the Step was on its way
    batch.fail(EcdError(grpc.StatusCode.UNAVAILABLE, "cannot reach ecd"))
    assert o.take(POOL).answered.misses == 4
    o.close()


def test_a_step_the_daemon_refused_for_the_callers_items_leaves_its_misses_to_the_next_one() -> (
    None
):
    o, _ = owed()
    o.misses(POOL, 3)
    batch = o.take(POOL)
    batch.step(POOL, allocates=[AllocateItem(b"k", (8,), "uint8")])
    batch.fail(EcdError(grpc.StatusCode.PERMISSION_DENIED, "a consumer may not allocate"))
    assert o.take(POOL).answered.misses == 3
    o.close()


def test_a_step_of_nothing_but_misses_the_daemon_refused_drops_them_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    o, _ = owed()
    o.misses(POOL, 3)
    o.take(POOL).fail(EcdError(grpc.StatusCode.NOT_FOUND, "pool 'pool' does not exist"))
    assert o.take(POOL).answered.misses == 0  # the pool would refuse them again, for good
    assert "3 miss(es) and 0 hit(s) the client answered not counted" in caplog.text
    o.close()


def test_the_background_sends_a_quiet_pools_misses_after_the_misses_linger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 0.2)
    o, sender = owed(linger_s=0.01)
    o.misses(POOL, 5)
    assert not sender.sent.wait(0.1)  # a count waits longer than a pin for a Step to ride on
    assert sender.sent.wait(5)
    [(engine_id, batch)] = sender.batches
    assert engine_id == POOL and batch.answered.misses == 5
    o.close()


def test_flush_sends_the_misses_owed() -> None:
    o, sender = owed()
    o.misses(POOL, 2)
    o.flush(5)
    assert [(e, p.answered.misses) for e, p in sender.batches] == [(POOL, 2)]
    o.close()


def test_a_new_pools_misses_wait_the_misses_linger_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ec_client.control.outbox.ANSWERED_LINGER_S", 60.0)
    sender = Sender()
    o = Outbox(sender, 0.01)  # no Step to the pool yet
    o.misses(POOL, 1)
    assert not sender.sent.wait(0.2)
    o.close()


CLOSED_CHANNEL = "Cannot invoke RPC on closed channel!"  # what grpc raises, a ValueError


def broken(answer: object) -> None:
    raise RuntimeError("a bug in whoever owed it")


def test_a_step_that_raised_a_bug_does_not_stop_the_background_thread() -> None:
    o, sender = owed(linger_s=0.01)
    sender.bug = ValueError(CLOSED_CHANNEL)
    o.commits(POOL, [Answers().op("a", key=b"a")])
    assert sender.sent.wait(5)
    assert [r.key for r in o.step_soon(POOL, acquires=[b"x"]).result(5).acquires] == [b"x"]
    o.close()


def test_the_ops_of_a_step_that_raised_a_bug_hear_internal_once_and_are_not_sent_again() -> None:
    o, sender = owed(linger_s=0.01)
    sender.bug = ValueError(CLOSED_CHANNEL)
    answers = Answers()
    o.commits(POOL, [answers.op("a", key=b"a"), answers.op("b", key=b"b")])
    wait_until(lambda: len(answers.told) == 2)
    time.sleep(0.1)  # ten lingers: time enough to send them again
    assert sorted(answers.told) == ["a", "b"] and len(sender.batches) == 1
    error = answers.got["a"]
    assert isinstance(error, EcdError) and error.code is grpc.StatusCode.INTERNAL
    assert f"ValueError: {CLOSED_CHANNEL}" in error.message and "not sent" in error.message
    assert answers.got["b"] is error and o.commits_owed(POOL) == {}  # nothing in transit
    o.close()


def test_ops_the_wire_cannot_encode_hear_internal_once_and_are_not_sent_again() -> None:
    o, sender = owed(linger_s=0.01)
    sender.build = True  # the Step cannot be built: given back, it would fail again at once
    answers = Answers()
    o.aborts(POOL, [answers.op("a", key=b"a"), answers.op("bad", key=12345)])
    wait_until(lambda: len(answers.told) == 2)
    time.sleep(0.1)
    assert sorted(answers.told) == ["a", "bad"] and len(sender.batches) == 1
    error = answers.got["bad"]
    assert isinstance(error, EcdError) and error.code is grpc.StatusCode.INTERNAL
    assert "TypeError" in error.message and answers.got["a"] is error
    assert not o.take(POOL)  # not owed again
    o.close()


def test_a_step_asked_soon_that_raised_a_bug_hands_internal_to_the_asker_and_its_ops() -> None:
    o, sender = owed()
    sender.build = True
    answers = Answers()
    o.commits(POOL, [answers.op("a", key=b"a")])
    future = o.step_soon(POOL, acquires=[12345])  # type: ignore[list-item]
    with pytest.raises(EcdError, match="TypeError") as raised:
        future.result(5)
    assert raised.value.code is grpc.StatusCode.INTERNAL
    assert answers.told == ["a"] and answers.got["a"] is raised.value
    assert o.commits_owed(POOL) == {}  # not owed again, not in transit
    o.close()


def test_a_step_that_raised_a_bug_is_logged_once_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    o, sender = owed()
    sender.bug = ValueError(CLOSED_CHANNEL)
    with pytest.raises(EcdError):
        o.step_soon(POOL, acquires=[b"x"]).result(5)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.name == "ec_client" and record.exc_info is not None
    assert record.exc_info[1] is not None and str(record.exc_info[1]) == CLOSED_CHANNEL
    o.close()


def test_an_op_whose_handler_raises_does_not_keep_the_others_of_its_step_from_their_answers() -> (
    None
):
    o, _ = owed(linger_s=0.01)
    answers = Answers()
    o.commits(POOL, [DeferredOp(on_result=broken, key=b"a"), answers.op("b", key=b"b")])
    wait_until(lambda: bool(answers.told))
    assert answers.told == ["b"] and answers.got["b"].status is Status.OK
    o.close()


def test_a_handler_that_raises_as_its_op_is_taken_does_not_stop_the_background_thread() -> None:
    o, _ = owed(linger_s=0.01)
    dropped = threading.Event()

    def drop(answer: object) -> None:
        dropped.set()
        broken(answer)

    o.unlocks(POOL, [DeferredOp(on_result=drop)])  # dropped as the thread takes it
    assert dropped.wait(5)
    assert [r.key for r in o.step_soon(POOL, acquires=[b"x"]).result(5).acquires] == [b"x"]
    o.close()


def test_an_op_whose_handler_raises_as_it_hears_of_a_bug_does_not_keep_the_others_from_it() -> None:
    o, sender = owed()
    sender.bug = ValueError(CLOSED_CHANNEL)
    answers = Answers()
    future = o.step_soon(
        POOL, commits=[DeferredOp(on_result=broken, key=b"a"), answers.op("b", key=b"b")]
    )
    with pytest.raises(EcdError, match="closed channel") as raised:
        future.result(5)
    assert answers.told == ["b"] and answers.got["b"] is raised.value
    o.close()
