"""LoadBook alone (the vLLM scheduler side's pins and loads): a lock pin admits its request in
the same call, a request whose item needs an Acquire waits one step for its pin, loads are
dispatched under fresh transfer IDs, a pin goes (a lease released, a lock unlocked) only after
every rank reported; a new session voids lease pins alone, a new pool file every pin."""

from __future__ import annotations

from ec_client.vllm.loads import LOCK_MISSED, LoadBook, Lock, LockMissed, Pin
from ec_protocol.types import AcquireResult, Extent, Status, TensorSpec

SPEC = TensorSpec((4, 8), "float16", 64)


def hit(key: str, lease_id: int) -> AcquireResult:
    return AcquireResult(key.encode(), Status.HIT, "", lease_id, (Extent(0, 1),), SPEC, 0)


def miss(key: str) -> AcquireResult:
    return AcquireResult(key.encode(), Status.MISS, "", 0, (), None, 0)


def pending(key: str) -> AcquireResult:
    return AcquireResult(key.encode(), Status.PENDING, "", 0, (), None, 0)


def ready(*keys: str):  # type: ignore[no-untyped-def]
    return lambda key: key in keys


def locks(**slots: int) -> Lock:
    """A fake lock pin: the keys named hold their slot, any other key is not lockable here."""

    def lock(key: str) -> Pin | None:
        slot = slots.get(key)
        return None if slot is None else Pin((Extent(slot, 1),), SPEC, slot=slot)

    return lock


def missed(key: str) -> LockMissed:
    return LOCK_MISSED


def locked_book(key: str = "k", slot: int = 3, ranks: int = 1) -> LoadBook:
    """A book holding a lock pin on `key` for r1, admitted in the same call."""
    book = LoadBook(ranks)
    assert book.admit("r1", [key], ready(key), now=0.0, wait_s=0.0, lock=locks(**{key: slot}))
    return book


def pinned_book(key: str = "k", lease_id: int = 7, ranks: int = 1) -> LoadBook:
    """A book holding a pin on `key`, as after one admit and one Acquire."""
    book = LoadBook(ranks)
    assert not book.admit("r1", [key], ready(key), now=0.0, wait_s=0.0)
    book.acquired(book.wanted(), [hit(key, lease_id)], lambda spec: True)
    return book


def test_a_request_whose_key_is_ready_but_not_pinned_waits_for_the_pin() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.wanted() == ["k"]
    assert not book.pinned("k")


def test_once_pinned_the_request_is_admitted_and_the_key_is_a_cache_hit() -> None:
    book = pinned_book()
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.pinned("k")


def test_a_request_whose_key_is_absent_is_admitted_to_encode() -> None:
    book = LoadBook(1)
    assert book.admit("r1", ["k"], ready(), now=0.0, wait_s=0.0)
    assert book.wanted() == []


def test_with_a_wait_an_absent_key_holds_the_request_that_long() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready(), now=10.0, wait_s=2.0)
    assert not book.admit("r1", ["k"], ready(), now=11.0, wait_s=2.0)
    assert book.admit("r1", ["k"], ready(), now=12.0, wait_s=2.0)


def test_a_key_being_written_holds_the_request_until_it_is_ready() -> None:
    book = LoadBook(1)
    writing = ready("k")
    assert not book.admit("r1", ["k"], ready(), 10.0, 0.0, pending=writing)
    assert not book.admit("r1", ["k"], ready(), 11.0, 0.0, pending=writing)
    # Committed: wanted, so pinned at the next flush, then loaded.
    assert not book.admit("r1", ["k"], ready("k"), 11.5, 0.0, pending=ready())
    assert book.wanted() == ["k"]


def test_a_key_being_written_holds_the_request_however_long_its_encode_takes() -> None:
    book = LoadBook(1)
    writing = ready("k")
    assert not book.admit("r1", ["k"], ready(), 10.0, 2.0, pending=writing)
    assert not book.admit("r1", ["k"], ready(), 3600.0, 2.0, pending=writing)


def test_a_key_whose_write_was_aborted_is_encoded_at_once() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready(), 10.0, 0.0, pending=ready("k"))
    assert book.admit("r1", ["k"], ready(), 10.1, 0.0, pending=ready())


def test_after_an_aborted_write_the_absent_wait_starts_anew() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready(), 10.0, 2.0, pending=ready("k"))
    assert not book.admit("r1", ["k"], ready(), 20.0, 2.0, pending=ready())  # aborted now
    assert book.admit("r1", ["k"], ready(), 22.0, 2.0, pending=ready())


def test_an_absent_key_nobody_writes_is_encoded_without_a_wait() -> None:
    book = LoadBook(1)
    assert book.admit("r1", ["k"], ready(), 10.0, 0.0, pending=ready())


def test_a_key_this_engine_is_saving_admits_its_request_at_once_though_it_is_pending() -> None:
    # Encoded here a moment ago: vLLM's own encoder cache, read before the connector is asked,
    # has it; holding the request would wait out the save's commit for nothing.
    book = LoadBook(1)
    assert book.admit("r2", ["k"], ready(), 10.0, 0.0, pending=ready("k"), saving=ready("k"))
    assert book.wanted() == [] and not book.pinned("k")


def test_a_key_this_engine_is_saving_is_neither_asked_of_the_daemon_nor_waited_for() -> None:
    book = LoadBook(1)
    assert book.admit("r2", ["k"], ready(), 10.0, 2.0, elsewhere=True, saving=ready("k"))
    assert book.wanted() == []


def test_a_key_this_engine_is_saving_is_lock_pinned_once_its_slot_is_known() -> None:
    # Committed and heard: pinned, so that it loads should vLLM have evicted it meanwhile.
    book = LoadBook(1)
    assert book.admit("r2", ["k"], ready("k"), 10.0, 0.0, lock=locks(k=3), saving=ready("k"))
    assert book.pinned("k")


def test_a_missed_key_does_not_hold_its_request_back_again() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.acquired(["k"], [miss("k")], lambda spec: True) == ["k"]
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)


def test_a_pin_of_an_unusable_shape_is_released_at_once() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.acquired(["k"], [hit("k", 9)], lambda spec: False) == ["k"]
    assert book.take_releases() == [9]
    assert not book.pinned("k")


def test_requests_of_one_step_share_one_dispatch_per_key() -> None:
    book = pinned_book()
    assert book.dispatch("r1", "k") and book.dispatch("r2", "k")
    [order] = book.take_step().values()
    assert order.extents == (Extent(0, 1),) and order.spec == SPEC
    assert book.take_step() == {}


def test_every_dispatch_gets_a_transfer_id_never_used_before() -> None:
    book = pinned_book()
    book.dispatch("r1", "k")
    first = book.take_step()["k"].transfer_id
    book.dispatch("r2", "k")
    assert book.take_step()["k"].transfer_id != first


def test_a_pin_is_released_only_after_every_rank_reported_and_no_request_needs_it() -> None:
    book = pinned_book(ranks=2)
    book.dispatch("r1", "k")
    transfer = book.take_step()["k"].transfer_id
    book.report(transfer, rank=0)
    book.report(transfer, rank=0)  # a rank counts once
    assert book.take_releases() == []
    book.report(transfer, rank=1)
    assert book.take_releases() == [7]
    assert not book.busy()


def test_a_pin_waits_for_requests_still_counting_on_it() -> None:
    book = pinned_book()
    book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0)  # r2 holds the pin too
    book.dispatch("r1", "k")
    book.report(book.take_step()["k"].transfer_id, rank=0)
    assert book.take_releases() == []
    book.forget("r2")
    assert book.take_releases() == [7]


def test_a_dispatch_without_a_copy_orders_nothing_and_gives_the_pin_back_once_unheld() -> None:
    """An encoder-only engine: the item is in the pool, which is all it needs."""
    book = pinned_book()
    book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0)  # r2 holds the pin too
    assert book.dispatch("r1", "k", copy=False)
    assert book.take_step() == {} and book.take_releases() == []
    assert book.dispatch("r2", "k", copy=False)
    assert book.take_releases() == [7] and not book.busy()
    locked = locked_book()
    assert locked.dispatch("r1", "k", copy=False)
    assert locked.take_unlocks() == [3]


def test_unknown_transfer_reports_change_nothing() -> None:
    book = pinned_book()
    book.report(12345, rank=0)
    assert book.pinned("k") and book.take_releases() == []


def test_giving_up_on_wanted_keys_lets_their_requests_encode() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    book.give_up()
    assert book.wanted() == []
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)


def test_voiding_the_pins_fails_the_requests_whose_loads_were_in_flight() -> None:
    book = pinned_book()
    book.dispatch("r1", "k")
    book.take_step()
    assert book.void() == {"r1"}
    assert not book.pinned("k") and book.take_releases() == []


def test_releases_that_did_not_reach_the_daemon_are_sent_again() -> None:
    book = pinned_book()
    book.forget("r1")
    releases = book.take_releases()
    book.requeue_releases(releases)
    assert book.take_releases() == [7]


def test_a_key_whose_acquire_is_on_its_way_keeps_its_requests_held_and_is_not_asked_twice() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.take_wanted() == ["k"]
    assert not book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.wanted() == [] and book.take_wanted() == []
    book.acquired(["k"], [hit("k", 3)], lambda spec: True)
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    assert book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0)


def test_a_pin_that_arrives_after_its_requests_went_is_released() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    book.take_wanted()
    book.forget("r1")
    book.acquired(["k"], [hit("k", 5)], lambda spec: True)
    assert not book.pinned("k") and book.take_releases() == [5]


def test_an_acquire_that_failed_lets_its_requests_encode() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    book.give_up(book.take_wanted())
    assert not book.busy()
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)


def test_the_wanted_keys_of_one_request() -> None:
    book = LoadBook(1)
    book.admit("r1", ["a", "b"], ready("a", "b"), now=0.0, wait_s=0.0)
    book.admit("r2", ["b", "c"], ready("b", "c"), now=0.0, wait_s=0.0)
    assert book.wanted("r1") == ["a", "b"] and sorted(book.wanted()) == ["a", "b", "c"]


# ---- lock pins ---------------------------------------------------------------------------------


def test_a_lock_pin_admits_its_request_in_the_same_call() -> None:
    book = locked_book()
    assert book.pinned("k") and book.wanted() == [] and book.take_wanted() == []
    assert book.dispatch("r1", "k")
    [order] = book.take_step().values()
    assert order.extents == (Extent(3, 1),) and order.spec == SPEC


def test_a_key_that_cannot_be_lock_pinned_takes_the_acquire_path() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0, lock=locks())
    assert book.wanted() == ["k"]


def test_a_lock_pin_that_missed_has_its_request_encode_and_not_wait_again() -> None:
    book = LoadBook(1)
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0, lock=missed)
    assert not book.pinned("k") and book.wanted() == []
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)  # not held back later either


def test_a_lock_pin_is_unlocked_only_after_every_rank_reported_never_released() -> None:
    book = locked_book(ranks=2)
    book.dispatch("r1", "k")
    transfer = book.take_step()["k"].transfer_id
    book.report(transfer, rank=0)
    book.report(transfer, rank=0)  # a rank counts once
    assert book.take_unlocks() == [] and book.pinned("k")
    book.report(transfer, rank=1)
    assert book.take_unlocks() == [3] and book.take_unlocks() == []
    assert book.take_releases() == [] and not book.pinned("k") and not book.busy()


def test_a_lock_pin_waits_for_requests_still_counting_on_it() -> None:
    book = locked_book()
    assert book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0, lock=missed)
    book.dispatch("r1", "k")
    book.report(book.take_step()["k"].transfer_id, rank=0)
    assert book.take_unlocks() == []  # r2 holds it too (and was not asked to lock again)
    book.forget("r2")
    assert book.take_unlocks() == [3]


def test_a_lock_pin_whose_request_went_before_its_load_is_unlocked() -> None:
    book = locked_book()
    book.forget("r1")
    assert book.take_unlocks() == [3] and not book.pinned("k")


def test_a_lock_pin_gives_the_requests_waiting_for_an_acquire_the_pin() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)  # slot not known yet
    assert book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0, lock=locks(k=3))
    assert book.wanted() == []  # no Acquire for it any more
    assert book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    book.forget("r1")
    assert book.take_unlocks() == []
    book.forget("r2")
    assert book.take_unlocks() == [3]


def test_a_key_whose_acquire_is_on_its_way_is_not_lock_pinned_as_well() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready("k"), now=0.0, wait_s=0.0)
    book.take_wanted()
    assert not book.admit("r2", ["k"], ready("k"), now=0.0, wait_s=0.0, lock=locks(k=3))
    book.acquired(["k"], [hit("k", 4)], lambda spec: True)
    book.forget("r1")
    book.forget("r2")
    assert book.take_releases() == [4] and book.take_unlocks() == []


def test_a_new_session_voids_lease_pins_alone_and_fails_only_their_loads() -> None:
    book = pinned_book("leased", lease_id=7)
    assert book.admit("r2", ["locked"], ready("locked"), 0.0, 0.0, lock=locks(locked=3))
    book.dispatch("r1", "leased")
    book.dispatch("r2", "locked")
    orders = book.take_step()
    assert book.void(locks_too=False) == {"r1"}
    assert not book.pinned("leased") and book.pinned("locked")
    book.report(orders["leased"].transfer_id, rank=0)  # from before: changes nothing
    book.report(orders["locked"].transfer_id, rank=0)
    assert book.take_unlocks() == [3] and book.take_releases() == []


def test_a_new_pool_file_voids_every_pin_and_the_unlocks_owed() -> None:
    book = locked_book("a", slot=1)
    book.admit("r2", ["b"], ready("b"), now=0.0, wait_s=0.0, lock=locks(b=2))
    book.dispatch("r1", "a")
    book.take_step()
    book.forget("r2")  # b's unlock is owed: the old file's locks go with its descriptor
    assert book.void() == {"r1"}
    assert not book.pinned("a") and book.take_unlocks() == [] and not book.busy()


def test_in_a_shared_pool_an_absent_key_is_asked_of_the_daemon_and_its_miss_encoded() -> None:
    book = LoadBook(1)
    assert not book.admit("r1", ["k"], ready(), 0.0, 0.0, elsewhere=True)
    assert book.take_wanted() == ["k"]  # its Acquire asks the store
    assert book.acquired(["k"], [miss("k")], lambda spec: True) == ["k"]
    assert book.admit("r1", ["k"], ready(), 0.1, 0.0, elsewhere=True)


def test_an_absent_key_the_daemon_lacks_too_is_not_asked_again_for_its_request() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready(), 0.0, 0.0, elsewhere=True)
    book.acquired(book.take_wanted(), [miss("k")], lambda spec: True)
    book.admit("r1", ["k"], ready(), 0.1, 0.0, elsewhere=True)
    assert book.wanted() == []


def test_with_a_wait_an_absent_key_the_daemon_lacks_is_waited_for_before_it_is_encoded() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready(), 0.0, 1.0, elsewhere=True)
    book.acquired(book.take_wanted(), [miss("k")], lambda spec: True)
    assert not book.admit("r1", ["k"], ready(), 0.1, 1.0, elsewhere=True)  # its wait begins
    assert not book.admit("r1", ["k"], ready(), 0.9, 1.0, elsewhere=True)
    assert book.admit("r1", ["k"], ready(), 1.2, 1.0, elsewhere=True)


def test_a_key_another_node_writes_holds_its_request_until_its_fate_is_known() -> None:
    book = LoadBook(1)
    book.admit("r1", ["k"], ready(), 0.0, 0.0, elsewhere=True)
    book.take_wanted()
    assert book.acquired(["k"], [pending("k")], lambda spec: True) == []
    assert not book.admit("r1", ["k"], ready(), 0.1, 0.0, pending=ready("k"), elsewhere=True)
    assert book.wanted() == []  # held by the view's PENDING, not asked again
