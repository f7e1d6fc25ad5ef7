"""The waits alone, on a fake clock: what ends a wait (a commit, an abort, a dropped pool, the end
of a fetch, its deadline, the daemon's stop), the one deadline rule, and what a wait leaves
behind once it ended or its waiter went away."""

from __future__ import annotations

import pytest
from core_testing import FakeClock

from ec_daemon.core.waits import LATE_S, For, Outcome, Wait, Waits, deadline
from ec_protocol.types import EventType, WatchEvent


def event(type: EventType, key: bytes = b"k", engine_id: str = "p") -> WatchEvent:
    return WatchEvent(type, engine_id, key, 1, "epoch")


class Ends:
    """A waiter: how its wait ended, each time it was told."""

    def __init__(self) -> None:
        self.told: list[Outcome] = []

    def __call__(self, outcome: Outcome) -> None:
        self.told.append(outcome)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def waits(clock: FakeClock) -> Waits:
    return Waits(clock)


def wait(
    waits: Waits, keys: list[bytes], seconds: float = 5.0, kind: For = For.ENTRY
) -> tuple[Wait, Ends]:
    ends = Ends()
    return waits.register(kind, "p", keys, waits.deadline(seconds), ends), ends


def test_a_commit_ends_a_wait_for_its_key(waits: Waits) -> None:
    _, ends = wait(waits, [b"k"])
    waits.on_event(event(EventType.COMMITTED))
    assert ends.told == [Outcome.SETTLED]
    waits.check()


def test_an_abort_ends_a_wait_for_its_key(waits: Waits) -> None:
    _, ends = wait(waits, [b"k"])
    waits.on_event(event(EventType.ABORTED))
    assert ends.told == [Outcome.SETTLED]


def test_an_allocation_ends_no_wait(waits: Waits) -> None:
    _, ends = wait(waits, [b"k"])
    waits.on_event(event(EventType.PENDING))
    assert ends.told == []


def test_a_wait_for_several_keys_ends_once_every_one_settled(waits: Waits) -> None:
    _, ends = wait(waits, [b"a", b"b"])
    waits.on_event(event(EventType.COMMITTED, b"a"))
    assert ends.told == []
    waits.on_event(event(EventType.EVICTED, b"b"))
    assert ends.told == [Outcome.SETTLED]
    waits.check()


def test_events_of_other_keys_and_pools_end_no_wait(waits: Waits) -> None:
    _, ends = wait(waits, [b"k"])
    waits.on_event(event(EventType.COMMITTED, b"other"))
    waits.on_event(event(EventType.COMMITTED, b"k", engine_id="q"))
    assert ends.told == []


def test_a_dropped_pool_ends_every_wait_of_that_pool_only(waits: Waits) -> None:
    _, first = wait(waits, [b"a"])
    _, second = wait(waits, [b"b", b"c"])
    other = Ends()
    waits.register(For.ENTRY, "q", [b"a"], waits.deadline(5.0), other)
    waits.on_event(event(EventType.POOL_DROPPED, b""))
    assert first.told == second.told == [Outcome.SETTLED] and other.told == []
    waits.check()


def test_every_waiter_of_one_key_hears_its_commit_once(waits: Waits) -> None:
    waiters = [wait(waits, [b"k"])[1] for _ in range(3)]
    waits.on_event(event(EventType.COMMITTED))
    waits.on_event(event(EventType.COMMITTED))
    assert [w.told for w in waiters] == [[Outcome.SETTLED]] * 3
    assert waits.waiting() == 0


def test_a_wait_expires_at_its_deadline_not_before(waits: Waits, clock: FakeClock) -> None:
    _, ends = wait(waits, [b"k"], seconds=2.0)
    clock.advance(1.9)
    waits.expire()
    assert ends.told == []
    clock.advance(0.1)
    waits.expire()
    assert ends.told == [Outcome.EXPIRED]
    waits.on_event(event(EventType.COMMITTED))  # too late: heard no more
    assert ends.told == [Outcome.EXPIRED]
    waits.check()


def test_a_timer_fired_a_little_early_still_ends_its_wait(waits: Waits) -> None:
    # A timer set for the deadline passes it: the clock it reads may lag the loop's timer.
    registered, ends = wait(waits, [b"k"], seconds=2.0)
    waits.expire(registered.deadline)
    assert ends.told == [Outcome.EXPIRED]


def test_a_wait_whose_deadline_has_passed_ends_at_once(waits: Waits) -> None:
    _, ends = wait(waits, [b"k"], seconds=0.0)
    assert ends.told == [Outcome.EXPIRED]
    assert waits.waiting() == 0


def test_a_wait_for_no_key_ends_at_once_settled(waits: Waits) -> None:
    _, ends = wait(waits, [])
    assert ends.told == [Outcome.SETTLED]


def test_a_wait_lasts_the_longer_of_its_askers_time_and_its_works_bound(
    waits: Waits, clock: FakeClock
) -> None:
    assert waits.deadline(0.2) == clock.now + 0.2
    assert waits.deadline(0.2, work_s=3.0) == clock.now + 3.0
    assert waits.deadline(5.0, work_s=3.0) == clock.now + 5.0
    # A placeholder's writer is taken for dead its marker's bound after its beat was last seen.
    assert deadline(since=10.0, wait_s=0.0, work_s=2.0) == 12.0


def test_a_wait_that_joins_a_fetch_outlasts_its_bound(waits: Waits, clock: FakeClock) -> None:
    assert waits.joining(0.2, 3.0) == clock.now + 3.0 + LATE_S


def test_the_end_of_a_fetch_ends_the_waits_for_its_keys(waits: Waits) -> None:
    work = waits.start("p", [b"a", b"b"])
    assert waits.fetching("p", b"a") and not waits.fetching("p", b"c")
    _, ends = wait(waits, [b"a", b"b"], kind=For.FETCH)
    waits.finish(work)
    assert ends.told == [Outcome.SETTLED]
    assert not waits.fetching("p", b"a")
    waits.check()


def test_a_fetch_wait_ends_at_its_fetchs_end_not_at_its_entrys_commit(waits: Waits) -> None:
    # The entry a fetch reads into is committed before the fetch is over (its other keys).
    work = waits.start("p", [b"k"])
    _, ends = wait(waits, [b"k"], kind=For.FETCH)
    waits.on_event(event(EventType.COMMITTED))
    assert ends.told == []
    waits.finish(work)
    assert ends.told == [Outcome.SETTLED]


def test_a_placeholders_end_as_its_marker_goes_ends_the_waits_for_it(waits: Waits) -> None:
    # A fetch that found another node's marker leaves a placeholder: a PENDING entry, whose
    # askers wait for its entry; the poll aborts it when the marker goes without a value.
    work = waits.start("p", [b"k"])
    _, fetched = wait(waits, [b"k"], kind=For.FETCH)
    waits.on_event(event(EventType.PENDING))  # the placeholder
    waits.finish(work)
    _, entry = wait(waits, [b"k"])
    waits.on_event(event(EventType.ABORTED))  # the marker gone, no value
    assert fetched.told == entry.told == [Outcome.SETTLED]


def test_the_daemons_stop_ends_the_entry_waits_and_any_later_one_at_once(waits: Waits) -> None:
    _, before = wait(waits, [b"a", b"b"])
    waits.shut_down()
    _, after = wait(waits, [b"k"])
    assert before.told == after.told == [Outcome.SHUT_DOWN]
    assert waits.waiting() == 0
    waits.check()


def test_the_daemons_stop_leaves_a_fetch_wait_to_its_fetch(waits: Waits) -> None:
    work = waits.start("p", [b"k"])
    _, ends = wait(waits, [b"k"], kind=For.FETCH)
    waits.shut_down()
    assert ends.told == []
    waits.finish(work)
    assert ends.told == [Outcome.SETTLED]


def test_a_cancelled_wait_leaves_nothing_behind(waits: Waits, clock: FakeClock) -> None:
    registered, ends = wait(waits, [b"a", b"b"])
    waits.cancel(registered)
    assert waits.waiting() == 0
    waits.on_event(event(EventType.COMMITTED, b"a"))
    waits.on_event(event(EventType.COMMITTED, b"b"))
    clock.advance(10.0)
    waits.expire()
    assert ends.told == []
    assert not waits._waits and not waits._deadlines
    waits.check()


def test_waits_that_ended_before_their_deadlines_are_not_kept(waits: Waits) -> None:
    for i in range(100):
        wait(waits, [b"%d" % i], seconds=60.0)
        waits.on_event(event(EventType.COMMITTED, b"%d" % i))
    assert waits.waiting() == 0 and len(waits._deadlines) <= 1
    waits.check()


def test_cancelling_a_wait_that_ended_changes_nothing(waits: Waits) -> None:
    registered, ends = wait(waits, [b"k"])
    waits.on_event(event(EventType.COMMITTED))
    waits.cancel(registered)
    assert registered.outcome is Outcome.SETTLED and ends.told == [Outcome.SETTLED]
    waits.check()
