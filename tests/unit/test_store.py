"""The core (store, index, sessions, pool file) driven directly, with a clock the test moves."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from core_testing import FakeClock, make_store, open_pool, session, spec

from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.store import EVICTION_SUMMARY_S, Store
from ec_protocol.pool.layout import HEADER_SIZE, Header, pool_file_name
from ec_protocol.pool.life_marks import LifeMarks
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import EntryInfo, EntryState, EventType, PoolStats, Role, Status, WatchEvent

BLOCK = 4096


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(shm_dir: Path, clock: FakeClock) -> Store:
    s = make_store(shm_dir, clock)
    open_pool(s, "p", BLOCK, 16 * BLOCK, "model-a")
    return s


def statuses(results: list) -> list[Status]:  # type: ignore[type-arg]
    return [r.status for r in results]


def pool_stats(store: Store) -> PoolStats:
    [pool] = store.stats("p").pools
    return pool


def entry(store: Store, key: bytes) -> EntryInfo | None:
    return next((e for e in store.list_entries("p", b"", 100)[0] if e.key == key), None)


def present(store: Store, keys: list[bytes]) -> list[bool]:
    return [r.state is not EntryState.ABSENT for r in store.lookup("p", keys)]


def put(store: Store, sid: str, key: bytes, blocks: int) -> None:
    assert statuses(store.allocate(sid, "p", [(key, spec(blocks * BLOCK))])) == [Status.ALLOCATED]
    assert statuses(store.commit(sid, "p", [(key, 0, 0)])) == [Status.OK]


# ---- pools ---------------------------------------------------------------------------------------


def test_open_pool_creates_a_preallocated_file_with_a_verified_header(
    store: Store, shm_dir: Path
) -> None:
    path = shm_dir / pool_file_name("p")
    info = store.pool_info("p")
    assert info.path == str(path)
    assert path.stat().st_size == info.file_size
    assert path.stat().st_blocks * 512 >= info.file_size  # allocated up front
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    header = Header.unpack(path.read_bytes()[:HEADER_SIZE])
    assert (str(header.pool_uuid), header.compat_key) == (info.pool_uuid, "model-a")


def test_open_pool_again_with_the_same_geometry_attaches(store: Store) -> None:
    info = open_pool(store, "p", BLOCK, 16 * BLOCK, "model-a")
    assert not info.created
    assert info.pool_uuid == store.pool_info("p").pool_uuid


@pytest.mark.parametrize("compat_key", ["", "model-a"])
def test_open_pool_without_a_geometry_attaches_by_name(store: Store, compat_key: str) -> None:
    info = open_pool(store, "p", 0, 0, compat_key)
    assert not info.created
    assert (info.block_size_bytes, info.num_blocks) == (BLOCK, 16)


def test_open_pool_without_a_geometry_creates_nothing(store: Store) -> None:
    with pytest.raises(CoreError) as info:
        open_pool(store, "absent", 0, 0)
    assert (info.value.code, info.value.reason) == (Code.NOT_FOUND, Reason.UNKNOWN_POOL)
    assert store.engine_ids() == ["p"]


def test_open_pool_with_another_geometry_is_refused_naming_both(store: Store) -> None:
    with pytest.raises(CoreError) as info:
        open_pool(store, "p", 2 * BLOCK, 16 * BLOCK, "model-a")
    assert info.value.code is Code.FAILED_PRECONDITION
    assert "block_size_bytes=4096" in info.value.message
    assert "block_size_bytes=8192" in info.value.message


def test_open_pool_with_another_compat_key_is_refused(store: Store) -> None:
    with pytest.raises(CoreError) as info:
        open_pool(store, "p", BLOCK, 16 * BLOCK, "model-b")
    assert info.value.code is Code.FAILED_PRECONDITION
    assert "model-a" in info.value.message and "model-b" in info.value.message


def test_a_pool_that_asks_for_max_entries_gets_that_many_slots(store: Store) -> None:
    assert open_pool(store, "small-entries", 512, 64 << 20).max_entries == 4088  # the default
    assert open_pool(store, "asks", 512, 64 << 20, max_entries=20_000).max_entries == 20_000


def test_a_pool_asking_for_more_entries_than_blocks_gets_one_per_block(store: Store) -> None:
    assert open_pool(store, "q", BLOCK, 16 * BLOCK, max_entries=100).max_entries == 16


def test_open_pool_with_another_max_entries_is_refused_naming_both(store: Store) -> None:
    open_pool(store, "q", 512, 64 << 20, max_entries=20_000)
    assert open_pool(store, "q", 512, 64 << 20).max_entries == 20_000  # asking none attaches
    assert open_pool(store, "q", 0, 0, max_entries=20_000).max_entries == 20_000
    with pytest.raises(CoreError) as info:
        open_pool(store, "q", 512, 64 << 20, max_entries=30_000)
    assert info.value.code is Code.FAILED_PRECONDITION
    assert "max_entries=20000" in info.value.message
    assert "max_entries=30000" in info.value.message


@pytest.mark.parametrize(("entries_per_pool", "limit"), [(None, 65536), (10_000, 10_000)])
def test_max_entries_over_the_daemons_limit_is_refused_naming_it(
    shm_dir: Path, clock: FakeClock, entries_per_pool: int | None, limit: int
) -> None:
    store = make_store(shm_dir, clock, entries_per_pool=entries_per_pool)
    assert open_pool(store, "at", 512, 64 << 20, max_entries=limit).max_entries == limit
    with pytest.raises(CoreError) as info:
        open_pool(store, "over", 512, 64 << 20, max_entries=limit + 1)
    assert info.value.code is Code.RESOURCE_EXHAUSTED
    assert f"limit of {limit} entries per pool" in info.value.message
    assert not (shm_dir / pool_file_name("over")).exists()


def test_a_set_entries_per_pool_is_every_pools_default_and_a_pool_may_ask_for_fewer(
    shm_dir: Path, clock: FakeClock
) -> None:
    store = make_store(shm_dir, clock, entries_per_pool=10_000)
    assert open_pool(store, "default", 512, 64 << 20).max_entries == 10_000
    assert open_pool(store, "fewer", 512, 64 << 20, max_entries=100).max_entries == 100


def test_pools_whose_capacities_fill_the_budget_fit_and_one_more_block_is_refused(
    shm_dir: Path, clock: FakeClock
) -> None:
    store = make_store(shm_dir, clock, max_bytes=8 << 20)
    open_pool(store, "a", BLOCK, 4 << 20)
    open_pool(store, "b", BLOCK, 4 << 20)
    with pytest.raises(CoreError) as info:
        open_pool(store, "c", BLOCK, BLOCK)
    assert info.value.code is Code.RESOURCE_EXHAUSTED
    assert info.value.reason is Reason.BUDGET
    assert "8.0 MiB budget" in info.value.message
    assert not (shm_dir / pool_file_name("c")).exists()


@pytest.mark.parametrize(("pools", "holders"), [(1, "1 pool holds"), (2, "2 pools hold")])
def test_a_pool_refused_for_the_budget_is_told_how_many_pools_hold_the_rest(
    shm_dir: Path, clock: FakeClock, pools: int, holders: str
) -> None:
    store = make_store(shm_dir, clock, max_bytes=8 << 20)
    for name in "ab"[:pools]:
        open_pool(store, name, BLOCK, 4 << 20)
    with pytest.raises(CoreError) as info:
        open_pool(store, "c", BLOCK, 5 << 20)
    assert f"({holders} the rest)" in info.value.message, info.value.message


def test_drop_pool_refuses_while_pins_are_held_unless_forced(store: Store, shm_dir: Path) -> None:
    sid = session(store)
    put(store, sid, b"k", 1)
    store.acquire(sid, "p", [b"k"])
    with pytest.raises(CoreError, match="pins"):
        store.drop_pool("p", force=False)
    assert store.drop_pool("p", force=True) == 1
    assert not (shm_dir / pool_file_name("p")).exists()
    store.check()


# ---- ephemeral pools -----------------------------------------------------------------------------


def test_an_ephemeral_pool_is_dropped_when_the_session_that_opened_it_closes(
    store: Store, shm_dir: Path
) -> None:
    sid = session(store)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    put_e = store.allocate(sid, "e", [(b"k", spec(BLOCK))])
    assert statuses(put_e) == [Status.ALLOCATED]
    store.close_session(sid)
    assert not store.has_pool("e")
    assert not (shm_dir / pool_file_name("e")).exists()
    store.check()


def test_an_ephemeral_pool_is_dropped_when_its_last_session_expires(
    store: Store, clock: FakeClock, shm_dir: Path
) -> None:
    sid = session(store)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    clock.advance(11)  # killed: no KeepAlive, the lease runs out
    store.expire_sessions()
    assert not store.has_pool("e")
    assert not (shm_dir / pool_file_name("e")).exists()


def test_an_ephemeral_pool_stays_while_another_session_that_opened_it_lives(
    store: Store,
) -> None:
    engine, worker = session(store, "engine"), session(store, "worker")
    store.open_pool(worker, "e", BLOCK, 4 * BLOCK, "")  # attached first, without the flag
    store.open_pool(engine, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    store.close_session(worker)
    assert store.has_pool("e")
    store.close_session(engine)
    assert not store.has_pool("e")


def test_a_pool_not_opened_ephemeral_outlives_its_sessions(store: Store) -> None:
    sid = session(store)
    store.open_pool(sid, "named", BLOCK, 4 * BLOCK, "")
    store.close_session(sid)
    assert store.has_pool("named")


def test_dropping_an_ephemeral_pool_gives_its_capacity_back_to_the_budget(
    shm_dir: Path, clock: FakeClock
) -> None:
    store = make_store(shm_dir, clock, max_bytes=8 << 20)
    for run in range(3):  # each would not fit beside the one before
        sid = session(store)
        store.open_pool(sid, f"run-{run}", BLOCK, 6 << 20, "", ephemeral=True)
        clock.advance(11)
        store.expire_sessions()


def test_stats_say_which_pools_are_ephemeral(store: Store) -> None:
    sid = session(store)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    assert {p.engine_id: p.ephemeral for p in store.stats().pools} == {"p": False, "e": True}


def test_a_pool_made_anew_under_an_ephemeral_name_is_not_ephemeral(store: Store) -> None:
    sid = session(store)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    store.drop_pool("e", force=True)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "")
    store.close_session(sid)
    assert store.has_pool("e")
    store.check()


def restarted(shm_dir: Path, clock: FakeClock) -> Store:
    """A daemon started anew on the shm directory the one before left (stopped or killed)."""
    store = make_store(shm_dir, clock)
    store.adopt_pools()
    return store


def reopen(store: Store, sid: str, engine_id: str = "p") -> None:
    """What a client library sends to open again by itself a pool it opened before."""
    store.open_pool(sid, engine_id, BLOCK, 16 * BLOCK, "model-a", reopen=True)


def dropped_under(store: Store) -> tuple[str, str]:
    """Pool p dropped by an operator's session while a reader's session held it: (reader,
    operator)."""
    reader, operator = session(store, "reader"), session(store, "ecd-cli", Role.ADMIN)
    reopen(store, reader)
    store.drop_pool("p", force=True, session_id=operator)
    return reader, operator


def test_a_pool_dropped_while_another_session_held_it_is_not_reopened_by_its_client(
    store: Store,
) -> None:
    reader, _ = dropped_under(store)
    with pytest.raises(CoreError) as info:
        reopen(store, reader)
    assert (info.value.code, info.value.reason) == (Code.FAILED_PRECONDITION, Reason.POOL_DROPPED)
    assert "pool was dropped: 'p', by ecd-cli (pid 1);" in info.value.message
    assert store.engine_ids() == []


def test_every_call_naming_a_pool_dropped_under_its_clients_says_it_was_dropped(
    store: Store,
) -> None:
    reader, _ = dropped_under(store)
    with pytest.raises(CoreError) as info:
        store.acquire(reader, "p", [b"k"])
    assert info.value.reason is Reason.POOL_DROPPED


def test_an_explicit_open_pool_makes_a_pool_dropped_under_its_clients_again(
    store: Store, shm_dir: Path
) -> None:
    reader, _ = dropped_under(store)
    assert open_pool(store, "p", BLOCK, 16 * BLOCK, "model-a").created
    reopen(store, reader)  # attaches to the new pool
    assert not (shm_dir / (pool_file_name("p") + ".dropped")).exists()


def test_a_pool_dropped_that_no_other_session_held_is_reopened_by_its_client(
    store: Store,
) -> None:
    operator = session(store, "ecd-cli", Role.ADMIN)
    store.drop_pool("p", force=True, session_id=operator)
    reopen(store, session(store))  # a daemon that lost it: the client makes it again
    assert store.engine_ids() == ["p"]


def test_a_pool_dropped_under_its_clients_is_forgotten_two_leases_after_the_last_one_ends(
    store: Store, clock: FakeClock
) -> None:
    reader, _ = dropped_under(store)
    store.close_session(reader)
    store.expire_sessions()
    clock.advance(2 * store.lease_ttl_s - 1)
    store.expire_sessions()
    back = session(store)  # a client whose lease ran out, back in time: told too
    with pytest.raises(CoreError):
        reopen(store, back)
    store.close_session(back)
    for _ in range(2):
        clock.advance(2 * store.lease_ttl_s)
        store.expire_sessions()
    reopen(store, session(store))
    assert store.engine_ids() == ["p"]


def test_a_restarted_daemon_still_refuses_to_reopen_a_pool_dropped_under_its_clients(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    dropped_under(store)
    again = restarted(shm_dir, clock)
    refused = session(again, "reader")
    with pytest.raises(CoreError) as info:
        reopen(again, refused)
    assert "by ecd-cli (pid 1)" in info.value.message
    for _ in range(10):  # the refused session lives on: it holds the memory
        clock.advance(again.lease_ttl_s / 2)
        again.keep_alive(refused)
        again.expire_sessions()
    with pytest.raises(CoreError):
        reopen(again, refused)


def test_a_restarted_daemon_forgets_a_drop_no_client_came_back_for_in_two_leases(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    dropped_under(store)
    again = restarted(shm_dir, clock)
    clock.advance(2 * again.lease_ttl_s)
    again.expire_sessions()
    reopen(again, session(again))
    assert again.engine_ids() == ["p"]
    assert not (shm_dir / (pool_file_name("p") + ".dropped")).exists()


def ephemeral_pools(store: Store) -> set[str]:
    return {p.engine_id for p in store.stats().pools if p.ephemeral}


def test_an_ephemeral_pool_adopted_at_a_restart_goes_unless_a_session_opens_it_in_two_leases(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    sid = session(store)
    store.open_pool(sid, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    store.close()  # the daemon stops, and its client dies while it is down

    after = restarted(shm_dir, clock)
    assert ephemeral_pools(after) == {"e"}
    clock.advance(19)  # two leases
    after.expire_sessions()
    assert after.has_pool("e")  # its client may still come back
    clock.advance(2)
    after.expire_sessions()
    assert not after.has_pool("e") and not list(shm_dir.glob(pool_file_name("e") + "*"))
    assert after.has_pool("p")  # not ephemeral: it stays
    after.check()


def test_an_ephemeral_pool_reopened_after_a_restart_goes_with_the_session_that_reopened_it(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    store.open_pool(session(store), "e", BLOCK, 4 * BLOCK, "", ephemeral=True)
    store.close()

    after = restarted(shm_dir, clock)
    engine = session(after)
    after.open_pool(engine, "e", BLOCK, 4 * BLOCK, "", ephemeral=True)  # the client's reopen
    for _ in range(3):  # past two leases, its KeepAlives coming
        clock.advance(9)
        after.keep_alive(engine)
    after.expire_sessions()
    assert after.has_pool("e")
    after.close_session(engine)
    assert not after.has_pool("e")


def test_a_pool_of_a_name_once_ephemeral_is_not_ephemeral_after_a_restart(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    sid = session(store)
    store.open_pool(sid, "dropped", BLOCK, 4 * BLOCK, "", ephemeral=True)
    store.drop_pool("dropped", force=True)  # its mark goes with its file
    store.open_pool(sid, "dropped", BLOCK, 4 * BLOCK, "")
    # A mark left by a pool whose file was removed by hand: not the next pool's of its name.
    (shm_dir / (pool_file_name("by-hand") + ".ephemeral")).touch()
    store.open_pool(sid, "by-hand", BLOCK, 4 * BLOCK, "")
    store.close()

    after = restarted(shm_dir, clock)
    clock.advance(21)
    after.expire_sessions()
    assert ephemeral_pools(after) == set() and {"dropped", "by-hand"} <= set(after.engine_ids())


# ---- single flight and states --------------------------------------------------------------------


def test_a_committed_entry_is_visible_with_its_spec_and_extents(store: Store) -> None:
    sid = session(store)
    [allocated] = store.allocate(sid, "p", [(b"k", spec(3 * BLOCK))])
    assert store.lookup("p", [b"k"])[0].state is EntryState.PENDING
    store.commit(sid, "p", [(b"k", 7, 0)])
    found = entry(store, b"k")
    assert found is not None and found.state is EntryState.READY
    assert found.checksum == 7 and found.extents == allocated.extents
    assert found.spec == spec(3 * BLOCK) and sum(e.count for e in found.extents) == 3


def test_allocating_a_pending_key_answers_pending(store: Store) -> None:
    a, b = session(store, "a"), session(store, "b")
    store.allocate(a, "p", [(b"k", spec(BLOCK))])
    assert statuses(store.allocate(b, "p", [(b"k", spec(BLOCK))])) == [Status.PENDING]


def test_allocating_a_ready_key_answers_exists(store: Store) -> None:
    a, b = session(store, "a"), session(store, "b")
    put(store, a, b"k", 1)
    assert statuses(store.allocate(b, "p", [(b"k", spec(BLOCK))])) == [Status.EXISTS]


def test_a_retried_allocate_of_the_same_session_returns_the_same_extents(store: Store) -> None:
    sid = session(store)
    [first] = store.allocate(sid, "p", [(b"k", spec(BLOCK))])
    [again] = store.allocate(sid, "p", [(b"k", spec(BLOCK))])
    assert again.status is Status.ALLOCATED
    assert again.extents == first.extents


def test_only_the_producing_session_may_commit(store: Store) -> None:
    a, b = session(store, "a"), session(store, "b")
    store.allocate(a, "p", [(b"k", spec(BLOCK))])
    [outcome] = store.commit(b, "p", [(b"k", 0, 0)])
    assert outcome.status is Status.FAILED_PRECONDITION
    assert "another session" in outcome.message


def test_double_commit_is_a_per_item_failed_precondition(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"k", 1)
    [outcome] = store.commit(sid, "p", [(b"k", 0, 0)])
    assert outcome.status is Status.FAILED_PRECONDITION
    assert "READY" in outcome.message


def test_commit_after_abort_is_not_found_and_the_blocks_are_free(store: Store) -> None:
    sid = session(store)
    store.allocate(sid, "p", [(b"k", spec(4 * BLOCK))])
    assert statuses(store.abort(sid, "p", [b"k"])) == [Status.OK]
    assert statuses(store.commit(sid, "p", [(b"k", 0, 0)])) == [Status.NOT_FOUND]
    assert pool_stats(store).free_blocks == 16
    store.check()


def test_acquire_pins_a_ready_entry_and_release_unpins_it(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"k", 1)
    [hit] = store.acquire(sid, "p", [b"k"])
    assert hit.status is Status.HIT and hit.lease_id > 0
    assert hit.spec == spec(BLOCK) and sum(e.count for e in hit.extents) == 1
    assert store.lookup("p", [b"k"])[0].pins == 1
    assert statuses(store.release(sid, [hit.lease_id])) == [Status.OK]
    assert store.lookup("p", [b"k"])[0].pins == 0


def test_acquire_answers_miss_for_absent_and_pending_for_uncommitted_keys(store: Store) -> None:
    sid = session(store)
    store.allocate(sid, "p", [(b"pending", spec(BLOCK))])
    assert statuses(store.acquire(sid, "p", [b"absent", b"pending"])) == [
        Status.MISS,
        Status.PENDING,
    ]


def test_releasing_a_lease_twice_fails_the_second_time_only(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"k", 1)
    [hit] = store.acquire(sid, "p", [b"k"])
    assert statuses(store.release(sid, [hit.lease_id, hit.lease_id])) == [
        Status.OK,
        Status.NOT_FOUND,
    ]
    store.check()


def test_a_session_cannot_release_another_sessions_lease(store: Store) -> None:
    a, b = session(store, "a"), session(store, "b")
    put(store, a, b"k", 1)
    [hit] = store.acquire(a, "p", [b"k"])
    assert statuses(store.release(b, [hit.lease_id])) == [Status.NOT_FOUND]
    assert store.lookup("p", [b"k"])[0].pins == 1


# ---- eviction ------------------------------------------------------------------------------------


def told_evictions(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    """The info-level summaries of evictions logged so far: their figures."""
    figures = ("engine_id", "evicted", "for_space", "for_entries", "by_operator")
    return [
        {name: getattr(r, name) for name in figures}
        for r in caplog.records
        if r.levelno == logging.INFO and r.msg == "entries evicted"
    ]


def test_evictions_are_told_at_info_at_most_once_per_interval_per_pool(
    store: Store, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="ecd.store")
    sid = session(store)
    for i in range(16):  # the pool is full
        put(store, sid, f"fill-{i}".encode(), 1)
    store.summarize_evictions()
    assert told_evictions(caplog) == []
    for second in range(25):  # 10 puts a second, each evicting one entry
        for i in range(10):
            put(store, sid, f"k{second}-{i}".encode(), 1)
        store.summarize_evictions()  # as the daemon's reaper does, every second
        clock.advance(1)
    # The first at once, then the sum of each 10 s; the last 4 s's wait for theirs.
    assert [t["evicted"] for t in told_evictions(caplog)] == [10, 100, 100]
    clock.advance(EVICTION_SUMMARY_S)
    store.summarize_evictions()
    assert [t["evicted"] for t in told_evictions(caplog)] == [10, 100, 100, 40]
    per_batch = [r for r in caplog.records if r.msg == "entries evicted for an allocation"]
    assert len(per_batch) == 250 and {r.levelno for r in per_batch} == {logging.DEBUG}


def test_told_evictions_say_why_they_were_evicted(
    store: Store, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ecd.store")
    open_pool(store, "slots", BLOCK, 16 * BLOCK, max_entries=2)
    sid = session(store)
    for key in (b"a", b"b", b"c", b"d"):  # two evicted for slots, 14 blocks free
        assert statuses(store.allocate(sid, "slots", [(key, spec(BLOCK))])) == [Status.ALLOCATED]
        store.commit(sid, "slots", [(key, 0, 0)])
    store.evict("slots", [b"c"])
    for i in range(17):  # the other pool: one evicted for blocks
        put(store, sid, f"k{i}".encode(), 1)
    store.summarize_evictions()
    told = {t["engine_id"]: t for t in told_evictions(caplog)}
    assert told["slots"] == {
        "engine_id": "slots",
        "evicted": 3,
        "for_space": 0,
        "for_entries": 2,
        "by_operator": 1,
    }
    assert (told["p"]["evicted"], told["p"]["for_space"]) == (1, 1)


def test_lru_evicts_the_least_recently_used_entry_first(store: Store) -> None:
    sid = session(store)
    for key in (b"a", b"b", b"c", b"d"):
        put(store, sid, key, 4)
    [hit] = store.acquire(sid, "p", [b"a"])  # a is now the most recently used
    store.release(sid, [hit.lease_id])
    put(store, sid, b"e", 4)
    assert present(store, [b"a", b"b", b"c", b"d", b"e"]) == [True, False, True, True, True]


def test_fifo_evicts_the_oldest_commit_first_regardless_of_hits(
    shm_dir: Path, clock: FakeClock
) -> None:
    store = make_store(shm_dir, clock, eviction="fifo")
    open_pool(store, "p", BLOCK, 16 * BLOCK)
    sid = session(store)
    for key in (b"a", b"b", b"c", b"d"):
        put(store, sid, key, 4)
    [hit] = store.acquire(sid, "p", [b"a"])
    store.release(sid, [hit.lease_id])
    put(store, sid, b"e", 4)
    assert present(store, [b"a"]) == [False]


def test_pinned_and_pending_entries_are_never_evicted(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"pinned", 8)
    store.acquire(sid, "p", [b"pinned"])
    store.allocate(sid, "p", [(b"pending", spec(8 * BLOCK))])
    [outcome] = store.allocate(sid, "p", [(b"new", spec(BLOCK))])
    assert outcome.status is Status.NO_SPACE
    assert "evictable" in outcome.message
    assert present(store, [b"pinned", b"pending"]) == [True, True]
    store.check()


def test_an_allocation_that_cannot_fit_evicts_nothing(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"pinned", 8)
    store.acquire(sid, "p", [b"pinned"])
    put(store, sid, b"evictable", 4)
    [outcome] = store.allocate(sid, "p", [(b"big", spec(12 * BLOCK))])
    assert outcome.status is Status.NO_SPACE
    assert present(store, [b"evictable"]) == [True]
    assert pool_stats(store).no_space == 1


def test_an_entry_larger_than_the_pool_is_invalid(store: Store) -> None:
    [outcome] = store.allocate(session(store), "p", [(b"k", spec(17 * BLOCK))])
    assert outcome.status is Status.INVALID_ARGUMENT
    assert "16" in outcome.message


def test_a_full_slot_table_evicts_to_make_room_for_a_new_entry(
    shm_dir: Path, clock: FakeClock
) -> None:
    store = make_store(shm_dir, clock, entries_per_pool=2)
    open_pool(store, "p", BLOCK, 16 * BLOCK)
    sid = session(store)
    for key in (b"a", b"b", b"c"):
        put(store, sid, key, 1)
    assert present(store, [b"a", b"b", b"c"]) == [False, True, True]
    store.check()


def test_an_entry_can_span_several_extents_under_fragmentation(store: Store) -> None:
    sid = session(store)
    for i in range(8):
        put(store, sid, b"k%d" % i, 2)
    store.evict("p", [b"k1", b"k3", b"k5", b"k7"])  # four 2-block holes
    [outcome] = store.allocate(sid, "p", [(b"wide", spec(6 * BLOCK))])
    assert outcome.status is Status.ALLOCATED
    assert len(outcome.extents) == 3
    store.check()


def test_evict_refuses_pinned_and_pending_entries(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"pinned", 1)
    store.acquire(sid, "p", [b"pinned"])
    store.allocate(sid, "p", [(b"pending", spec(BLOCK))])
    assert statuses(store.evict("p", [b"pinned", b"pending", b"absent"])) == [
        Status.FAILED_PRECONDITION,
        Status.FAILED_PRECONDITION,
        Status.NOT_FOUND,
    ]


def test_delete_of_a_pinned_entry_hides_it_and_frees_its_blocks_at_the_last_release(
    store: Store,
) -> None:
    sid = session(store)
    put(store, sid, b"k", 4)
    [hit] = store.acquire(sid, "p", [b"k"])
    assert statuses(store.delete("p", [b"k"])) == [Status.OK]
    assert present(store, [b"k"]) == [False]
    assert pool_stats(store).free_blocks == 12  # still held by the pin
    store.release(sid, [hit.lease_id])
    assert pool_stats(store).free_blocks == 16
    store.check()


# ---- sessions ------------------------------------------------------------------------------------


def test_an_expired_session_loses_its_pending_entries_and_pins(
    store: Store, clock: FakeClock
) -> None:
    producer, consumer = session(store, "dead"), session(store, "alive")
    put(store, consumer, b"ready", 2)
    store.allocate(producer, "p", [(b"half-written", spec(4 * BLOCK))])
    store.acquire(producer, "p", [b"ready"])
    clock.advance(5)
    store.keep_alive(consumer)
    clock.advance(5)
    [end] = store.expire_sessions()
    assert (end.client, end.aborted, end.released) == ("dead", 1, 1)
    assert present(store, [b"half-written"]) == [False]
    assert store.lookup("p", [b"ready"])[0].pins == 0
    assert store.lease_expiries == 1
    store.check()


def test_closing_a_session_aborts_and_releases_at_once(store: Store) -> None:
    sid = session(store)
    put(store, sid, b"ready", 1)
    store.allocate(sid, "p", [(b"pending", spec(BLOCK))])
    store.acquire(sid, "p", [b"ready"])
    end = store.close_session(sid)
    assert (end.aborted, end.released) == (1, 1)
    with pytest.raises(CoreError, match="unknown session"):
        store.allocate(sid, "p", [(b"x", spec(BLOCK))])


def test_events_tell_of_allocations_commits_aborts_evictions_and_deletes(
    shm_dir: Path, clock: FakeClock
) -> None:
    events: list[WatchEvent] = []
    store = make_store(shm_dir, clock, events=events)
    open_pool(store, "p", BLOCK, 2 * BLOCK)
    sid = session(store)
    put(store, sid, b"a", 2)
    store.allocate(sid, "p", [(b"b", spec(2 * BLOCK))])  # evicts a
    store.abort(sid, "p", [b"b"])
    put(store, sid, b"c", 1)
    store.delete("p", [b"c"])
    assert {(e.engine_id, e.boot_epoch) for e in events} == {("p", store.boot_epoch)}
    assert [(e.type, e.key) for e in events] == [
        (EventType.PENDING, b"a"),
        (EventType.COMMITTED, b"a"),
        (EventType.EVICTED, b"a"),
        (EventType.PENDING, b"b"),
        (EventType.ABORTED, b"b"),
        (EventType.PENDING, b"c"),
        (EventType.COMMITTED, b"c"),
        (EventType.DELETED, b"c"),
    ]


# ---- restart -------------------------------------------------------------------------------------


def test_a_new_store_adopts_ready_entries_and_drops_pending_ones(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    sid = session(store)
    put(store, sid, b"kept", 3)
    store.allocate(sid, "p", [(b"lost", spec(2 * BLOCK))])
    before = store.pool_info("p")
    store.close()

    adopted = make_store(shm_dir, clock)
    adopted.adopt_pools()
    assert adopted.pool_info("p") == before
    kept = entry(adopted, b"kept")
    assert kept is not None and kept.state is EntryState.READY
    assert sum(e.count for e in kept.extents) == 3
    assert present(adopted, [b"lost"]) == [False]
    assert pool_stats(adopted).free_blocks == 13
    adopted.check()


def test_a_restart_keeps_a_locked_entry_that_was_deleted_and_put_again_out_of_use(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    """Two records of one key: the entry deleted while a reader held its lock pin, and its
    successor. The newer is served; the older's blocks stay out of use until the reader is
    done, rather than the whole pool being refused or the reader's bytes reused."""
    sid = session(store)
    put(store, sid, b"k", 8)
    [snapshot] = store.ready_snapshot("p")
    info = store.pool_info("p")
    reader = SlotPins(info.path, info.pool_uuid)
    record = reader.pin(snapshot.slot or 0, b"k")
    assert record is not None
    store.delete("p", [b"k"])
    put(store, sid, b"k", 8)  # the other 8 blocks: the old ones are still being read
    store.close()

    adopted = make_store(shm_dir, clock)
    adopted.adopt_pools()
    assert entry(adopted, b"k") is not None
    assert pool_stats(adopted).free_blocks == 0  # the reader's 8 blocks are not free
    [made] = adopted.allocate(session(adopted), "p", [(b"x", spec(BLOCK))])
    assert made.status is Status.ALLOCATED  # the new "k" was evicted for it
    assert made.extents[0].start >= 8 or record.extents[0].start >= 8  # not the blocks being read
    reader.close()
    adopted.reclaim()
    assert pool_stats(adopted).free_blocks == 15
    adopted.check()


def test_a_restart_does_not_bring_back_an_entry_deleted_under_a_lock_pin(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    """Deleted while a reader held its lock pin, the entry keeps its record (the daemon cannot
    erase it under the lock), marked doomed: a daemon that stops before the reader lets go
    neither serves the entry again nor gives its blocks to another while the reader reads."""
    sid = session(store)
    put(store, sid, b"k", 8)
    [snapshot] = store.ready_snapshot("p")
    info = store.pool_info("p")
    reader = SlotPins(info.path, info.pool_uuid)
    assert reader.pin(snapshot.slot or 0, b"k") is not None
    store.delete("p", [b"k"])
    store.close()

    adopted = make_store(shm_dir, clock)
    adopted.adopt_pools()
    assert entry(adopted, b"k") is None
    assert pool_stats(adopted).free_blocks == 8  # the reader's 8 are not free
    reader.close()
    adopted.reclaim()
    assert pool_stats(adopted).free_blocks == 16
    adopted.check()


def test_a_lock_pin_on_an_entry_deleted_under_another_readers_pin_is_a_miss(store: Store) -> None:
    """A reader that has not heard of the delete yet locks the entry's slot, which another
    reader's pin keeps from being erased: the record is marked doomed, so it misses."""
    sid = session(store)
    put(store, sid, b"k", 8)
    [snapshot] = store.ready_snapshot("p")
    info = store.pool_info("p")
    first, late = SlotPins(info.path, info.pool_uuid), SlotPins(info.path, info.pool_uuid)
    assert first.pin(snapshot.slot or 0, b"k") is not None
    store.delete("p", [b"k"])
    assert late.pin(snapshot.slot or 0, b"k") is None
    first.close()
    late.close()


def test_a_pool_file_whose_header_was_overwritten_is_refused_and_kept(
    store: Store, shm_dir: Path, clock: FakeClock
) -> None:
    store.close()
    path = shm_dir / pool_file_name("p")
    with path.open("r+b") as f:
        f.seek(40)
        f.write(b"garbage!")
    adopted = make_store(shm_dir, clock)
    adopted.adopt_pools()
    assert path.exists()
    with pytest.raises(CoreError) as info:
        open_pool(adopted, "p", BLOCK, 16 * BLOCK, "model-a")
    assert info.value.reason is Reason.POOL_UNVERIFIED
    assert "checksum" in info.value.message


def test_a_truncated_pool_file_is_refused(store: Store, shm_dir: Path, clock: FakeClock) -> None:
    store.close()
    path = shm_dir / pool_file_name("p")
    with path.open("r+b") as f:
        f.truncate(HEADER_SIZE * 2)
    adopted = make_store(shm_dir, clock)
    adopted.adopt_pools()
    with pytest.raises(CoreError, match="truncated"):
        open_pool(adopted, "p", BLOCK, 16 * BLOCK, "model-a")


# ---- roles ---------------------------------------------------------------------------------------


def test_a_consumer_session_may_not_allocate(store: Store) -> None:
    consumer = session(store, "decoder", Role.CONSUMER)
    with pytest.raises(CoreError) as info:
        store.allocate(consumer, "p", [(b"k", spec(BLOCK))])
    assert info.value.code is Code.PERMISSION_DENIED
    assert info.value.reason is Reason.ROLE
    assert "role consumer" in info.value.message and "producer" in info.value.message
    assert present(store, [b"k"]) == [False]


def test_a_producer_session_may_not_pin(store: Store) -> None:
    producer = session(store, "encoder", Role.PRODUCER)
    put(store, producer, b"k", 1)
    with pytest.raises(CoreError) as info:
        store.acquire(producer, "p", [b"k"])
    assert info.value.code is Code.PERMISSION_DENIED
    assert store.lookup("p", [b"k"])[0].pins == 0


def test_an_admin_session_may_open_pools_but_neither_produce_nor_consume(store: Store) -> None:
    admin = session(store, "ecd-cli", Role.ADMIN)
    assert store.open_pool(admin, "p", BLOCK, 16 * BLOCK, "model-a").engine_id == "p"
    for call in (
        lambda: store.allocate(admin, "p", [(b"k", spec(BLOCK))]),
        lambda: store.acquire(admin, "p", [b"k"]),
    ):
        with pytest.raises(CoreError) as info:
            call()
        assert info.value.code is Code.PERMISSION_DENIED


def test_misses_a_client_answered_from_its_view_add_to_the_pools_misses(store: Store) -> None:
    sid = session(store, "c")
    store.acquire(sid, "p", [b"absent"])  # one the daemon answered
    store.count_misses("p", 4)
    store.count_misses("gone", 2)  # a pool dropped meanwhile: nothing to count them in
    assert pool_stats(store).misses == 5


def test_a_steps_hits_are_refreshed_before_its_allocation_and_counted_apart(store: Store) -> None:
    sid = session(store, "c")
    for key in (b"a", b"b", b"c"):
        put(store, sid, key, 5)  # 15 of the pool's 16 blocks
    step = store.step(sid, "p", [], [], [], [], [(b"d", spec(5 * BLOCK))], hits=[b"a"])
    assert statuses(step.allocates) == [Status.ALLOCATED]
    assert entry(store, b"a") is not None and entry(store, b"b") is None  # b: least recent
    assert pool_stats(store).hits == 0  # the caller counts them, once the Step cannot fail
    store.count_hits("p", [b"a", b"b"])  # b went meanwhile: no hit of an entry not held
    assert pool_stats(store).hits == 1


# ---- single flight: a producer's fate is known soon ----------------------------------------------


def producing(store: Store) -> tuple[str, str]:
    """A producer's session that opened pool "p" and allocated b"k" (PENDING): (its ID, the
    pool file's path)."""
    sid = session(store)
    info = store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a")
    assert statuses(store.allocate(sid, "p", [(b"k", spec(BLOCK))])) == [Status.ALLOCATED]
    return sid, info.path


def test_a_session_whose_process_dropped_its_life_mark_ends_at_once_its_entries_aborted(
    store: Store,
) -> None:
    sid, path = producing(store)
    marks = LifeMarks()
    marks.mark("p", path, sid)
    assert store.end_dead_sessions() == []  # alive: seen marked from now on
    marks.close()  # as the kernel drops it when the process dies
    [end] = store.end_dead_sessions()
    assert (end.session_id, end.aborted) == (sid, 1)
    assert entry(store, b"k") is None  # its waiters encode now, not one lease later
    store.check()


def test_a_live_session_whose_marked_pool_was_made_anew_is_left_to_its_lease(
    store: Store,
) -> None:
    """Its mark is on the old file; the new one says nothing about its process."""
    sid, path = producing(store)
    marks = LifeMarks()
    marks.mark("p", path, sid)
    assert store.end_dead_sessions() == []
    store.drop_pool("p", force=True)
    store.open_pool(session(store), "p", BLOCK, 16 * BLOCK, "model-a")
    assert store.end_dead_sessions() == []
    store.keep_alive(sid)  # still its own
    marks.close()


def test_a_session_never_seen_with_its_life_mark_is_left_to_its_lease(store: Store) -> None:
    producing(store)  # a client over TCP, say: it cannot mark the pool's file
    assert store.end_dead_sessions() == []
    assert entry(store, b"k") is not None


def test_an_entry_pending_past_the_pending_timeout_is_aborted(
    store: Store, clock: FakeClock
) -> None:
    sid, _ = producing(store)
    for _ in range(29):  # alive (its KeepAlives come), but its encode never ends
        clock.advance(1)
        store.keep_alive(sid)
    assert store.abort_stale_pending() == []
    clock.advance(2)
    assert store.abort_stale_pending() == [("p", "producer")]
    assert entry(store, b"k") is None
    [late] = store.commit(sid, "p", [(b"k", 0, 0)])
    assert late.status is Status.NOT_FOUND
    store.check()


# ---- shared pools (docs/design.md §13) -----------------------------------------------------------


def test_the_first_open_pool_naming_a_cluster_namespace_shares_the_pool_under_it(
    store: Store,
) -> None:
    sid = session(store)
    assert store.pool_info("p").cluster_namespace == ""
    info = store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a", cluster_namespace="ns-a")
    assert info.cluster_namespace == store.pool_info("p").cluster_namespace == "ns-a"
    attached = store.open_pool(sid, "p", 0, 0, "")  # naming none leaves it as it is
    assert attached.cluster_namespace == store.cluster_namespace("p") == "ns-a"


def test_an_open_pool_naming_another_cluster_namespace_is_refused(store: Store) -> None:
    sid = session(store)
    store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a", cluster_namespace="ns-a")
    with pytest.raises(CoreError) as refused:
        store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a", cluster_namespace="ns-b")
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "'ns-a'" in refused.value.message and "'ns-b'" in refused.value.message
    assert store.cluster_namespace("p") == "ns-a"


def test_a_dropped_pool_made_anew_is_not_shared_until_an_open_pool_names_a_namespace(
    store: Store,
) -> None:
    sid = session(store)
    store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a", cluster_namespace="ns-a")
    store.drop_pool("p", force=True)
    assert store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a").cluster_namespace == ""
    reshared = store.open_pool(sid, "p", BLOCK, 16 * BLOCK, "model-a", cluster_namespace="ns-b")
    assert reshared.cluster_namespace == "ns-b"
