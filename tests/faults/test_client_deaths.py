"""Client processes SIGKILLed while they hold something: a producer mid-copy or between Allocate
and Commit, a consumer holding pins. Whatever the dead client held is given back within one lease
(plus the reaper's period), at once when its life mark goes with it; nothing it half-wrote is
ever served, and everything READY still reads back bit-identical."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from ecd_testing import Daemon, assert_blocks_accounted, running_daemon
from workload_testing import (
    FAULT_TRIALS,
    ClientProcess,
    Interpreters,
    assert_intact,
    make_tensor,
    read_back,
    ready_keys,
    record_figure,
    record_tally,
    settled,
    trial_rng,
    wait_until,
)

from ec_client import AllocateItem, Client, EntryState, Producer, PutStatus, Status
from ec_protocol.pool.layout import pool_file_name

POOL = "faults"
BLOCK = 4096
CAPACITY = 128 << 20
LEASE_TTL = 1.0
REAPER_PERIOD = min(LEASE_TTL / 4, 1.0)  # ec_daemon.server.server.reap_sessions
# The longest a dead client's holdings may outlive it: its last renewal was at most one TTL
# before its death, the reaper looks every REAPER_PERIOD, and the test polls with some slack.
GIVE_BACK_DEADLINE = LEASE_TTL + REAPER_PERIOD + 0.75


DAEMON_ARGS = ("--max-bytes", "256MiB", "--lease-ttl", str(LEASE_TTL))


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    """One daemon for every trial of this module: state (and any leak) accumulates across them."""
    with running_daemon(*DAEMON_ARGS) as daemon:
        yield daemon


@pytest.fixture
def own() -> Iterator[Daemon]:
    """A daemon of the test's own, for it to kill and start again."""
    with running_daemon(*DAEMON_ARGS) as daemon:
        yield daemon


def pool_of(daemon: Daemon) -> dict[str, object]:
    """What every client script needs to reach the shared pool."""
    return {"ADDRESS": daemon.address, "POOL": POOL, "BLOCK": BLOCK, "CAPACITY": CAPACITY}


def survivor(daemon: Daemon) -> Client:
    client = daemon.client(name="survivor")
    client.open_pool(POOL, BLOCK, CAPACITY)
    return client


def keys_said(lines: list[str], word: str) -> list[bytes]:
    return [k.encode() for line in lines if line.split(" ", 1)[0] == word for k in line.split()[1:]]


# ---- a producer killed with entries PENDING ---------------------------------------------------

HALF_WRITER = """
c = Client(ADDRESS, name="victim")
c.open_pool(POOL, BLOCK, CAPACITY)
items = [AllocateItem(k, (n,), "uint8") for k, n in zip(KEYS, SIZES)]
results = c.allocate(POOL, items)
assert [r.status for r in results] == [Status.ALLOCATED] * len(KEYS), results
mapping = PoolMapping.open(c.pool_info(POOL))
for i, (key, n, r) in enumerate(zip(KEYS, SIZES, results)):
    data = torch.frombuffer(bytearray(b"\\xee" * n), dtype=torch.uint8)
    if STAGE == "mid-copy" and i == len(KEYS) // 2:
        data = data[: n // 2]  # stop half-way through this entry's copy
    offset = 0
    for extent in r.extents:
        region = mapping.region(extent)[: len(data) - offset]
        region.copy_(data[offset : offset + region.numel()])
        offset += region.numel()
    if STAGE == "mid-copy" and i == len(KEYS) // 2:
        break
say(STAGE)
time.sleep(600)
"""


@pytest.mark.fault_kind("producer killed (deterministic stage)")
@pytest.mark.parametrize("stage", ["mid-copy", "between allocate and commit"])
def test_a_producer_killed_with_entries_pending_never_exposes_them_and_frees_them_in_one_lease(
    shared: Daemon, interpreters: Interpreters, stage: str
) -> None:
    keys = [f"torn-{stage[:3]}-{i}" for i in range(4)]
    sizes = [300_000, 5_000, 1_000_000, 4096]
    with survivor(shared) as c:
        free_before = c.stats(POOL).pools[0].free_blocks
        victim = interpreters.take().run(
            HALF_WRITER,
            **pool_of(shared),
            KEYS=keys,
            SIZES=sizes,
            STAGE=stage,
        )
        victim.expect(stage)
        # While the producer lives, its entries are PENDING: never served, and single-flight.
        assert [r.state for r in c.lookup(POOL, keys)] == [EntryState.PENDING] * 4
        assert {r.status for r in c.acquire(POOL, keys)} == {Status.PENDING}
        others = c.allocate(
            POOL, [AllocateItem(k, (n,), "uint8") for k, n in zip(keys, sizes, strict=True)]
        )
        assert {r.status for r in others} == {Status.PENDING}

        killed_at = victim.kill()
        wait_until(lambda: settled(c, POOL), GIVE_BACK_DEADLINE, "the dead producer's entries")
        record_figure(
            f"producer death -> blocks free, lease {LEASE_TTL:g} s", time.monotonic() - killed_at
        )

        assert [r.state for r in c.lookup(POOL, keys)] == [EntryState.ABSENT] * 4
        assert c.stats(POOL).pools[0].free_blocks == free_before
        # The keys can be produced again, and what is served is the new bytes, not the dead
        # producer's 0xee.
        tensors = {k: make_tensor(k, n) for k, n in zip(keys, sizes, strict=True)}
        assert set(Producer(c, POOL, checksum=True).put_many(tensors).values()) == {
            PutStatus.COMMITTING
        }
        assert read_back(c, POOL, [k.encode() for k in keys]) == 4
        assert_intact(c, POOL)
        c.delete(POOL, keys)


STREAMING_PRODUCER = """
c = Client(ADDRESS, name="victim")
c.open_pool(POOL, BLOCK, CAPACITY)
producer = Producer(c, POOL, checksum=True)
rng = random.Random(SEED)
n = 0

def next_batch():
    global n
    batch = {}
    for _ in range(rng.randint(1, 8)):
        key = f"{PREFIX}-{n}"
        n += 1
        dtype = rng.choice(["uint8", "float16", "bfloat16", "float32"])
        batch[key] = make_tensor(key, 4 * rng.randrange(1, 65536), dtype)
    return batch

written = 0
batch = next_batch()
while written < BUDGET:
    # As an engine would: launch the copies, prepare the next batch, then commit.
    handle = producer.put_many_async(batch)
    written += sum(t.nbytes for t in batch.values())
    batch = next_batch()
    statuses = handle.wait()
    say("stored", *[k for k, s in statuses.items() if s is PutStatus.STORED])
say("done")
time.sleep(600)
"""


@pytest.mark.fault_kind("producer killed at a random point")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_a_producer_killed_at_a_random_point_loses_only_what_it_had_not_committed(
    shared: Daemon, interpreters: Interpreters, trial: int
) -> None:
    rng, replay = trial_rng("producer", trial)
    prefix = f"p{trial}"
    with survivor(shared) as c:
        evictions = c.stats(POOL).pools[0].evictions
        victim = interpreters.take().run(
            STREAMING_PRODUCER,
            **pool_of(shared),
            PREFIX=prefix,
            SEED=rng.random(),
            BUDGET=48 << 20,
        )
        victim.expect("stored")
        time.sleep(rng.uniform(0, 0.3))
        assert victim.proc.poll() is None, victim.describe()
        killed_at = victim.kill()
        pending_at_kill = c.stats(POOL).pools[0].entries_pending
        wait_until(lambda: settled(c, POOL), GIVE_BACK_DEADLINE, f"the lease to end ({replay})")
        if pending_at_kill:  # killed between an Allocate and its Commit
            record_figure(
                f"producer death -> blocks free, lease {LEASE_TTL:g} s",
                time.monotonic() - killed_at,
            )
        record_tally("producer kills landing between allocate and commit", bool(pending_at_kill))

        ready = assert_intact(c, POOL)
        stored = set(keys_said(victim.said, "stored"))
        mine = {k for k in ready if k.startswith(f"{prefix}-".encode())}
        assert c.stats(POOL).pools[0].evictions == evictions, f"the pool overflowed ({replay})"
        assert stored <= mine, f"committed entries lost: {sorted(stored - mine)[:5]} ({replay})"
        # Anything more was committed just before the kill, before the victim could say so
        # (one batch at most), and assert_intact has read it back bit-identical.
        assert len(mine - stored) <= 8, replay
        c.delete(POOL, sorted(mine))
        assert_intact(c, POOL)


# ---- a consumer killed holding pins ------------------------------------------------------------

# A get's own lock pins last only as long as its copies (microseconds on the CPU), so the reader
# also holds some keys' lock pins across its wait, as vLLM's scheduler does from a request's
# admission to its load: kills then land while entries are locked.
READER = """
from ec_protocol.pool.slot_locks import SlotPins

c = Client(ADDRESS, name="reader")
c.open_pool(POOL, BLOCK, CAPACITY)
consumer = Consumer(c, POOL, verify=True)
view = c.view(POOL)
info = c.pool_info(POOL)
pins = SlotPins(info.path, info.pool_uuid)
rng = random.Random(SEED)
keys = [k.encode() for k in KEYS]
while True:
    wanted = rng.sample(keys, rng.randint(1, len(keys)))
    slots = [view.slot(key) if rng.random() < 0.5 else None for key in wanted]
    held = [s for s, key in zip(slots, wanted) if s is not None and pins.pin(s, key) is not None]
    handle = consumer.get_many_async(wanted)
    say("pinned")
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0, 0.05))
    for key, tensor in handle.wait().items():
        if tensor is not None and (problem := check_entry_bytes(key, tensor_bytes(tensor))):
            say("corrupt", problem)
    pins.unpin_many(held)
"""


@pytest.mark.fault_kind("consumer killed holding pins")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_a_consumer_killed_holding_pins_releases_them_within_one_lease(
    shared: Daemon, interpreters: Interpreters, trial: int
) -> None:
    rng, replay = trial_rng("consumer", trial)
    keys = [f"c{trial}-{i}" for i in range(12)]
    with survivor(shared) as c:
        free_before = c.stats(POOL).pools[0].free_blocks
        tensors = {k: make_tensor(k, 4 * rng.randrange(1, 65536)) for k in keys}
        producer = Producer(c, POOL, checksum=True)
        assert set(producer.put_many(tensors).values()) == {PutStatus.COMMITTING}
        producer.flush()  # visible to the other process
        victim = interpreters.take().run(
            READER,
            **pool_of(shared),
            KEYS=keys,
            SEED=rng.random(),
        )
        victim.expect("pinned")
        # An operator acts on the entries being read: a pinned one deleted keeps its blocks until
        # its last pin goes; a pinned one cannot be evicted.
        action = rng.choice(["none", "delete", "evict"])
        target = rng.choice(keys)
        if action == "delete":
            assert [r.status for r in c.delete(POOL, [target])] == [Status.OK]
        elif action == "evict":
            [evicted] = c.evict(POOL, [target])
            assert evicted.status in (Status.OK, Status.FAILED_PRECONDITION), replay
        time.sleep(rng.choice([0.0, rng.uniform(0, 0.3)]))  # half the kills right after the action
        assert victim.proc.poll() is None, victim.describe()
        locked_before_kill = c.stats(POOL).pools[0].entries_locked  # its reads' lock pins
        killed_at = victim.kill()
        at_kill = c.stats(POOL).pools[0]
        # Every block is somewhere even now: a deleted entry the reader locked is held until
        # the daemon's next sweep.
        assert_blocks_accounted(c, POOL)
        wait_until(lambda: settled(c, POOL), GIVE_BACK_DEADLINE, f"the pins to go ({replay})")
        if at_kill.pins:
            record_figure(
                f"consumer death -> pins released, lease {LEASE_TTL:g} s",
                time.monotonic() - killed_at,
            )
        record_tally("consumer kills landing while pins were held", bool(at_kill.pins))
        record_tally(
            "consumer kills landing while a removed entry was held", bool(at_kill.held_blocks)
        )
        record_tally("consumer kills just after it held lock pins", bool(locked_before_kill))

        assert not [line for line in victim.said if line.startswith("corrupt")], victim.said
        ready = assert_intact(c, POOL)
        mine = sorted(k for k in ready if k.startswith(f"c{trial}-".encode()))
        # Nothing is pinned any more: every entry can be evicted, and then every block is free.
        assert {r.status for r in c.evict(POOL, mine)} <= {Status.OK}
        assert c.stats(POOL).pools[0].free_blocks == free_before, replay
        assert not ready_keys(c, POOL).keys() & set(mine)


@pytest.mark.slow
@pytest.mark.fault_kind("producer killed (deterministic stage)")
@pytest.mark.parametrize("lease_ttl", [3.0, 10.0])
def test_a_dead_producers_blocks_are_free_at_once_after_its_death_whatever_the_lease(
    interpreters: Interpreters, lease_ttl: float
) -> None:
    """The figure for operators: a producer on this machine holds a life mark on the pool file
    (ec_protocol/pool/life_marks.py), so its blocks come back within the daemon's settle period (0.2
    s) of its death, not one lease later, for the default lease (10 s) as for short ones."""
    args = ("--max-bytes", "256MiB", "--lease-ttl", str(lease_ttl))
    with running_daemon(*args) as daemon, survivor(daemon) as c:
        free_before = c.stats(POOL).pools[0].free_blocks
        victim = interpreters.take().run(
            HALF_WRITER,
            **pool_of(daemon),
            KEYS=["a", "b"],
            SIZES=[1 << 20, 3 << 20],
            STAGE="mid-copy",
        )
        victim.expect("mid-copy")
        assert c.stats(POOL).pools[0].free_blocks < free_before
        killed_at = victim.kill()
        wait_until(lambda: settled(c, POOL), 1.5, "the dead producer's entries")
        seconds = time.monotonic() - killed_at
        record_figure(f"producer death -> blocks free, lease {lease_ttl:g} s", seconds)
        assert c.stats(POOL).pools[0].free_blocks == free_before
        assert c.stats().lease_expiries == 0  # its death ended it, not its lease


# ---- a client killed holding an ephemeral pool -------------------------------------------------

EPHEMERAL_OWNER = """
c = Client(ADDRESS, name="engine")
c.open_pool(EPHEMERAL, BLOCK, EPHEMERAL_CAPACITY, ephemeral=True)
Producer(c, EPHEMERAL).put("k", torch.ones(BLOCK, dtype=torch.uint8))
c.flush()
say("opened")
time.sleep(3600)
"""
EPHEMERAL_CAPACITY = 96 << 20  # with the shared pool's 128 MiB, two would not fit the budget


def ephemeral_owner(interpreters: Interpreters, daemon: Daemon, name: str) -> ClientProcess:
    owner = interpreters.take().run(
        EPHEMERAL_OWNER, **pool_of(daemon), EPHEMERAL=name, EPHEMERAL_CAPACITY=EPHEMERAL_CAPACITY
    )
    owner.expect("opened")
    return owner


def ephemeral_pools(c: Client) -> set[str]:
    return {p.engine_id for p in c.stats().pools if p.ephemeral}


@pytest.mark.fault_kind("client killed holding an ephemeral pool")
def test_a_client_killed_holding_an_ephemeral_pool_leaks_neither_its_file_nor_its_budget(
    shared: Daemon, interpreters: Interpreters
) -> None:
    """vLLM's per-run pool: an engine OOM-killed before it could drop it must not keep its file in
    /dev/shm and its capacity in the budget, run after run."""
    with survivor(shared) as c:
        for run in range(2):
            name = f"ephemeral-{run}"
            victim = ephemeral_owner(interpreters, shared, name)
            path = shared.shm_dir / pool_file_name(name)
            assert path.exists() and name in {p.engine_id for p in c.stats().pools}
            killed_at = victim.kill()
            wait_until(lambda gone=path: not gone.exists(), GIVE_BACK_DEADLINE, "its file to go")
            record_figure(
                f"client death -> ephemeral pool dropped, lease {LEASE_TTL:g} s",
                time.monotonic() - killed_at,
            )
            assert name not in {p.engine_id for p in c.stats().pools}
        assert_intact(c, POOL)  # the shared pool lost nothing


# ---- an ephemeral pool across a daemon restart ---------------------------------------------------

# After a restart, an adopted ephemeral pool waits two leases for its client to open it again
# (ec_daemon.core.store.UNCLAIMED_LEASES), then the reaper's period, then the test's slack.
UNCLAIMED_DEADLINE = 2 * LEASE_TTL + REAPER_PERIOD + 0.75


@pytest.mark.fault_kind("client killed while the daemon was down")
def test_an_ephemeral_pool_whose_client_died_while_the_daemon_was_down_goes_after_its_restart(
    own: Daemon, interpreters: Interpreters
) -> None:
    owner = ephemeral_owner(interpreters, own, "orphaned")
    path = own.shm_dir / pool_file_name("orphaned")
    own.kill()
    owner.kill()  # while the daemon is down: no session of its ends on any daemon
    own.start()
    started = time.monotonic()
    with own.client(name="operator") as c:
        assert ephemeral_pools(c) == {"orphaned"}  # adopted, and known to be ephemeral
        wait_until(lambda: not path.exists(), UNCLAIMED_DEADLINE, "its file to go")
        record_figure(
            "daemon restart -> orphaned ephemeral pool dropped (s)", time.monotonic() - started
        )
        assert "orphaned" not in {p.engine_id for p in c.stats().pools}
        assert not list(own.shm_dir.glob(pool_file_name("orphaned") + "*"))


@pytest.mark.fault_kind("daemon killed under a live client's ephemeral pool")
def test_a_live_clients_ephemeral_pool_outlives_a_daemon_restart_and_goes_with_the_client(
    own: Daemon, interpreters: Interpreters
) -> None:
    owner = ephemeral_owner(interpreters, own, "private")
    path = own.shm_dir / pool_file_name("private")
    own.restart()  # SIGKILL: the client lives on, and opens its pool again
    with own.client(name="operator") as c:
        time.sleep(UNCLAIMED_DEADLINE)
        assert path.exists() and ephemeral_pools(c) == {"private"}
        assert [r.state for r in c.lookup("private", ["k"])] == [EntryState.READY]
        owner.kill()
        wait_until(lambda: not path.exists(), GIVE_BACK_DEADLINE, "its file to go")
