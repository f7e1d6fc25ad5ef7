"""SaveBook alone (the vLLM scheduler side's saves): planned -> copying -> landed or failed, and
only the saving rank's report moves a save forward."""

from __future__ import annotations

from ec_client.types import AllocateResult, Extent, Status, TensorSpec
from ec_client.vllm.saves import SaveBook

SPEC = TensorSpec((4, 8), "float16", 64)


def allocated(key: str) -> AllocateResult:
    return AllocateResult(key.encode(), Status.ALLOCATED, "", (Extent(3, 1),))


def answered(key: str, status: Status) -> AllocateResult:
    return AllocateResult(key.encode(), status, "", ())


def copying_book(*keys: str) -> SaveBook:
    book = SaveBook()
    for key in keys:
        book.plan(key, SPEC)
    planned = book.take_planned()
    book.allocated(planned, [allocated(k) for k in planned])
    return book


def test_a_planned_save_is_ordered_once_allocated() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    planned = book.take_planned()
    orders = book.allocated(planned, [allocated("k")])
    assert orders["k"].extents == (Extent(3, 1),) and orders["k"].spec == SPEC
    assert book.busy()


def test_a_key_planned_twice_is_saved_once() -> None:
    book = SaveBook()
    book.plan("k", SPEC)
    book.plan("k", SPEC)
    assert list(book.take_planned()) == ["k"]


def test_exists_pending_and_no_space_order_nothing() -> None:
    book = SaveBook()
    for key in ("a", "b", "c"):
        book.plan(key, SPEC)
    planned = book.take_planned()
    results = [
        answered("a", Status.EXISTS),
        answered("b", Status.PENDING),
        answered("c", Status.NO_SPACE),
    ]
    assert book.allocated(planned, results) == {}
    assert not book.busy()


def test_a_reported_copy_is_committed_and_a_failed_one_aborted() -> None:
    book = copying_book("ok", "bad")
    book.report(saved=["ok"], failed=["bad"])
    assert book.take_landed() == ["ok"]
    assert book.take_failed() == ["bad"]
    assert not book.busy()


def test_a_report_of_a_key_not_being_copied_changes_nothing() -> None:
    book = copying_book("k")
    book.report(saved=["other"], failed=[])
    book.report(saved=["k"], failed=[])
    book.report(saved=["k"], failed=[])  # repeated
    assert book.take_landed() == ["k"]


def test_a_commit_that_did_not_reach_the_daemon_is_sent_again() -> None:
    book = copying_book("k")
    book.report(saved=["k"], failed=[])
    book.requeue(landed=book.take_landed())
    assert book.take_landed() == ["k"]


def test_voiding_forgets_every_unfinished_save() -> None:
    book = copying_book("a", "b")
    book.report(saved=["a"], failed=[])
    book.void()
    assert not book.busy()
    assert book.take_landed() == []
