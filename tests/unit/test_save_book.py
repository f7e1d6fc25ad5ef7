"""SaveBook alone (the vLLM scheduler side's saves): planned -> allocating (an intent the worker
keeps the output for) -> ordered or cancelled -> copying -> landed or failed; only the saving
rank's report moves a save forward; a landed save is committed naming the allocation it was
copied into."""

from __future__ import annotations

from ec_client.vllm.saves import SaveBook
from ec_protocol.types import AllocateResult, Extent, Status, TensorSpec

SPEC = TensorSpec((4, 8), "float16", 64)


def allocation_of(key: str) -> int:
    """The allocation ID the daemon answers for `key` in these tests."""
    return 1000 + len(key)


def allocated(key: str) -> AllocateResult:
    return AllocateResult(key.encode(), Status.ALLOCATED, "", (Extent(3, 1),), allocation_of(key))


def answered(key: str, status: Status) -> AllocateResult:
    return AllocateResult(key.encode(), status, "", ())


def copying_book(*keys: str) -> SaveBook:
    book = SaveBook()
    for key in keys:
        book.plan(key, SPEC)
    planned = list(book.take_planned())
    book.allocated(planned, [allocated(k) for k in planned])
    book.take_orders()
    return book


def test_a_planned_save_is_an_intent_until_its_allocate_answers() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    assert book.take_planned() == {"k": SPEC}
    assert book.intents() == {"k"}
    assert book.take_orders() == ({}, set())  # nothing to order before the answer
    assert book.busy()


def test_an_allocated_intent_is_ordered_with_the_next_metadata() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.allocated(list(book.take_planned()), [allocated("k")])
    orders, cancelled = book.take_orders()
    assert orders["k"].extents == (Extent(3, 1),) and orders["k"].spec == SPEC
    assert cancelled == set() and book.intents() == set()
    assert book.take_orders() == ({}, set())  # ordered once


def test_exists_pending_no_space_and_errors_cancel_the_intent() -> None:
    book = SaveBook()
    for key in ("a", "b", "c", "d"):
        book.plan(key, SPEC)
    planned = list(book.take_planned())
    results = [
        answered("a", Status.EXISTS),
        answered("b", Status.PENDING),
        answered("c", Status.NO_SPACE),
        answered("d", Status.INVALID_ARGUMENT),
    ]
    book.allocated(planned, results)
    assert book.take_orders() == ({}, {"a", "b", "c", "d"})
    assert not book.busy()


def test_an_allocate_that_never_reached_the_daemon_cancels_its_intents() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.give_up(list(book.take_planned()))
    assert book.take_orders() == ({}, {"k"})


def test_a_key_planned_twice_is_saved_once() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.plan("k", SPEC)
    assert list(book.take_planned()) == ["k"]
    book.plan("k", SPEC)  # its allocation is on its way: not planned again
    assert book.take_planned() == {}


def test_a_reported_copy_is_committed_and_a_failed_one_aborted() -> None:
    book = copying_book("ok", "bad")
    book.report(saved=["ok"], failed=["bad"])
    assert book.take_landed() == [("ok", allocation_of("ok"))]
    assert book.take_failed() == ["bad"]
    assert not book.busy()


def test_a_report_of_a_key_not_being_copied_changes_nothing() -> None:
    book = copying_book("k")
    book.report(saved=["other"], failed=[])
    book.report(saved=["k"], failed=[])
    book.report(saved=["k"], failed=[])  # repeated
    assert book.take_landed() == [("k", allocation_of("k"))]


def test_a_commit_that_did_not_reach_the_daemon_is_sent_again() -> None:
    book = copying_book("k")
    book.report(saved=["k"], failed=[])
    book.requeue(landed=book.take_landed())
    assert book.take_landed() == [("k", allocation_of("k"))]


def test_a_key_whose_commit_or_abort_is_unanswered_is_not_planned_again() -> None:
    book = copying_book("committed", "aborted")
    book.report(saved=["committed"], failed=["aborted"])
    book.take_landed()  # sent, not answered
    book.take_failed()
    book.plan("committed", SPEC)
    book.plan("aborted", SPEC)
    assert book.take_planned() == {}


def test_a_key_is_planned_again_once_its_commit_or_abort_is_answered() -> None:
    book = copying_book("k")
    book.report(saved=[], failed=["k"])
    book.take_failed()
    book.answered("k")
    book.plan("k", SPEC)
    assert book.take_planned() == {"k": SPEC}


def test_an_abort_owed_again_keeps_its_key_from_being_planned_until_it_is_answered() -> None:
    book = copying_book("k")
    book.report(saved=[], failed=["k"])
    book.requeue(failed=book.take_failed())  # its Step did not reach the daemon
    book.answered("k")
    book.plan("k", SPEC)
    assert book.take_planned() == {}
    assert book.take_failed() == ["k"]


def test_voiding_keeps_a_key_unanswered_until_its_answer_comes() -> None:
    """The Step carrying its Abort may still reach the daemon's new session."""
    book = copying_book("k")
    book.report(saved=[], failed=["k"])
    book.take_failed()
    book.void()
    book.plan("k", SPEC)
    assert book.take_planned() == {}


def test_voiding_forgets_every_unfinished_save_and_cancels_every_intent_and_order() -> None:
    book = copying_book("copying")
    book.report(saved=["copying"], failed=[])
    book.plan("ordered", SPEC)
    book.plan("allocating", SPEC)
    planned = list(book.take_planned())
    book.allocated(["ordered"], [allocated("ordered")])
    assert set(planned) == {"ordered", "allocating"}
    book.void()
    assert book.take_landed() == []
    assert book.take_orders() == ({}, {"ordered", "allocating"})
    book.allocated(["allocating"], [allocated("allocating")])  # a late answer: ignored
    assert book.take_orders() == ({}, set()) and not book.busy()


def test_saves_dropped_while_the_daemon_is_away_leave_nothing_behind() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.drop_planned()
    assert not book.intents() and not book.busy()
    book.plan("k", SPEC)  # planned again once the daemon is back
    assert book.take_planned() == {"k": SPEC}


def test_a_key_is_being_saved_from_its_plan_until_its_commit_is_answered() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    states = [book.saving("k")]  # planned
    book.take_planned()
    states.append(book.saving("k"))  # allocating
    book.allocated(["k"], [allocated("k")])
    states.append(book.saving("k"))  # ordered
    book.take_orders()
    states.append(book.saving("k"))  # copying
    book.report(["k"], [])
    states.append(book.saving("k"))  # landed
    book.take_landed()
    states.append(book.saving("k"))  # its commit sent, not answered
    assert states == [True] * 6
    book.answered("k")
    assert not book.saving("k")


def test_a_cancelled_save_is_no_longer_being_saved() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.allocated(list(book.take_planned()), [answered("k", Status.PENDING)])
    assert not book.saving("k")
