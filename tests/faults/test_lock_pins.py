"""Lock pins (docs/design.md §5, ec_protocol/pool/slot_locks.py) against real daemons and real
client processes: real OFD locks on real pool files, real SIGKILLs.

Proven here:
- a reader SIGKILLed while it holds lock pins frees them at once: the kernel drops its locks, so
  the entries are evictable again well within the lease (no lease to wait for);
- a daemon SIGKILLed and restarted warm while a reader holds a lock pin keeps the pinned entry
  READY and whole: pressure evicts every other entry, or answers NO_SPACE, never it, and the
  reader's bytes are still the committed ones; once unpinned it is evictable;
- a key deleted under a lock pin and put again (two records of it in the file) survives a daemon
  restart: the pool is adopted, the new bytes served, the old ones whole under the old pin;
- a key deleted under a lock pin is not served again after a daemon restart (its record is
  marked doomed), and its blocks stay the reader's until it lets go;
- readers, writers and an admin (evicting, deleting, dropping and recreating the pool) at random
  on one small pool, slots and blocks reused all the time, with or without the daemon SIGKILLed
  and restarted midway: no reader ever reads bytes of another entry, under a fresh view or a
  stale one, and the daemon's books balance afterwards;
- a stale view (the entry evicted and its slot given to another) is a miss, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator

import pytest
from ecd_testing import Daemon, running_daemon
from workload_testing import (
    FAULT_TRIALS,
    ClientProcess,
    Interpreters,
    assert_intact,
    check_entry_bytes,
    make_tensor,
    record_figure,
    record_tally,
    tensor_bytes,
    trial_rng,
    wait_until,
)

from ec_client import AllocateItem, Client, Consumer, EntryState, Producer, PutStatus, Status
from ec_protocol.errors import EcdError
from ec_protocol.pool.slot_locks import SlotPins

POOL = "locks"
BLOCK = 4096
ENTRY_BLOCKS = 8
ENTRIES = 8
CAPACITY = ENTRIES * ENTRY_BLOCKS * BLOCK  # exactly the 8 entries each test fills it with
LEASE_TTL = 10.0  # far longer than a lock pin may outlive its holder: a lease cannot explain it
UNLOCK_DEADLINE = 0.5  # seconds from a holder's death to its locks being gone, with slack
READERS = 2  # reader processes in a churn trial (and one writer)


def daemon_args(*more: str) -> tuple[str, ...]:
    return ("--max-bytes", "256MiB", "--lease-ttl", str(LEASE_TTL), "--log-level", "debug", *more)


@pytest.fixture(scope="module")
def interpreters() -> Iterator[Interpreters]:
    """Enough client processes warming at once for a churn trial's readers and writer."""
    pool = Interpreters(spares=READERS + 1)
    yield pool
    pool.close()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with running_daemon(*daemon_args()) as daemon:
        yield daemon


def fill(client: Client, prefix: str) -> list[str]:
    """Fill the pool with ENTRIES entries of ENTRY_BLOCKS blocks, committed in order (the first
    is the oldest: eviction's first choice)."""
    client.open_pool(POOL, BLOCK, CAPACITY)
    producer = Producer(client, POOL, checksum=True)
    keys = [f"{prefix}-{i}" for i in range(ENTRIES)]
    for key in keys:
        assert producer.put(key, make_tensor(key, ENTRY_BLOCKS * BLOCK)) is PutStatus.COMMITTING
        producer.flush()
    return keys


def locked(client: Client) -> int:
    return client.stats(POOL).pools[0].entries_locked


def states(client: Client, keys: list[str]) -> list[EntryState]:
    return [r.state for r in client.lookup(POOL, keys)]


def allocate(client: Client, key: str, blocks: int) -> Status:
    [result] = client.allocate(POOL, [AllocateItem(key, (blocks * BLOCK,), "uint8")])
    return result.status


# A reader process that lock-pins KEYS at the slots its view learned (no daemon involved), then
# on "read" reads their bytes under the pins and says which are not the committed ones, and on
# "unpin" gives the pins back.
HOLDER = """
from ec_client.data.mover import TensorMover
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import Extent, TensorSpec

c = Client(ADDRESS, name="holder")
c.open_pool(POOL, BLOCK, CAPACITY)
view = c.view(POOL)
assert view.wait_synced(10)
info = c.pool_info(POOL)
pins = SlotPins(info.path, info.pool_uuid)
mover = TensorMover(PoolMapping.open(info), "cpu")
held = {}
for key in KEYS:
    deadline = time.monotonic() + 10
    while view.slot(key.encode()) is None:
        assert time.monotonic() < deadline, f"the view never heard {key}'s slot"
        time.sleep(0.01)
    slot = view.slot(key.encode())
    record = pins.pin(slot, key.encode())
    assert record is not None, key
    held[key] = (slot, record)
say("pinned", *(str(slot) for slot, _ in held.values()))
for line in sys.stdin:
    if line.strip() == "read":
        bad = []
        for key, (slot, record) in held.items():
            extents = list(record.extents)
            spec = record.spec
            tensor, transfer = mover.load(extents, spec)
            transfer.wait()
            if check_entry_bytes(key, tensor_bytes(tensor)) is not None:
                bad.append(key)
        say("read", *bad)
    elif line.strip() == "unpin":
        for slot, _ in held.values():
            pins.unpin(slot)
        say("unpinned", pins.held())
"""


def holder(interpreters: Interpreters, daemon: Daemon, keys: list[str]) -> ClientProcess:
    proc = interpreters.take().run(
        HOLDER, ADDRESS=daemon.address, POOL=POOL, BLOCK=BLOCK, CAPACITY=CAPACITY, KEYS=keys
    )
    proc.expect("pinned")
    return proc


# ---- a holder SIGKILLed ------------------------------------------------------------------------


@pytest.mark.fault_kind("reader killed holding lock pins")
def test_a_reader_killed_holding_lock_pins_frees_them_at_once_and_its_entries_are_evictable(
    daemon: Daemon, interpreters: Interpreters
) -> None:
    with daemon.client(name="survivor") as c:
        keys = fill(c, "held")
        victim = holder(interpreters, daemon, keys)
        assert locked(c) == ENTRIES
        # While it lives, its pins hold: nothing can be evicted to make room.
        assert allocate(c, "needs-room", ENTRY_BLOCKS) is Status.NO_SPACE
        assert states(c, keys) == [EntryState.READY] * ENTRIES

        killed_at = victim.kill()
        wait_until(lambda: locked(c) == 0, UNLOCK_DEADLINE, "the dead reader's locks to go")
        record_figure("reader death -> lock pins gone (s)", time.monotonic() - killed_at)
        assert time.monotonic() - killed_at < LEASE_TTL / 2  # not its lease running out

        assert allocate(c, "needs-all", ENTRIES * ENTRY_BLOCKS) is Status.ALLOCATED
        assert states(c, keys) == [EntryState.ABSENT] * ENTRIES
        c.delete(POOL, ["needs-all"])


# ---- the daemon SIGKILLed under a holder -------------------------------------------------------


@pytest.mark.fault_kind("daemon killed under a lock pin")
def test_a_daemon_killed_and_restarted_under_a_lock_pin_keeps_the_pinned_entry_whole(
    daemon: Daemon, interpreters: Interpreters
) -> None:
    with daemon.client(name="filler") as c:
        keys = fill(c, "before")
    pinned, others = keys[0], keys[1:]  # the oldest: the one eviction would pick first
    reader = holder(interpreters, daemon, [pinned])

    daemon.restart()  # SIGKILL, then a warm start on the same files

    with daemon.client(name="after") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)  # attaches to the adopted pool
        assert states(c, keys) == [EntryState.READY] * ENTRIES
        assert locked(c) == 1  # the lock belongs to the file: it outlived the daemon
        # Pressure: every entry but the pinned one gives way, one at a time, to new bytes.
        producer = Producer(c, POOL, checksum=True)
        for i in range(len(others)):
            key = f"after-{i}"
            assert producer.put(key, make_tensor(key, ENTRY_BLOCKS * BLOCK)) is (
                PutStatus.COMMITTING
            )
            producer.flush()
        assert states(c, others) == [EntryState.ABSENT] * len(others)
        assert states(c, [pinned]) == [EntryState.READY]
        # Room that only evicting the pinned entry could make is refused, evicting nothing.
        assert allocate(c, "too-big", ENTRIES * ENTRY_BLOCKS - 1) is Status.NO_SPACE
        assert states(c, [pinned]) == [EntryState.READY]
        assert c.stats(POOL).pools[0].entries_ready == ENTRIES

        # The holder's load did not fail: its bytes are still the committed ones.
        reader.send("read")
        assert reader.expect("read") == "read", f"bytes changed under the pin: {reader.said}"
        # And the daemon serves it whole too.
        got = Consumer(c, POOL, verify=True).get(pinned)
        assert got is not None and check_entry_bytes(pinned, tensor_bytes(got)) is None
        c.flush()

        reader.send("unpin")
        assert reader.expect("unpinned") == "unpinned 0"
        wait_until(lambda: locked(c) == 0, UNLOCK_DEADLINE, "the unpinned lock to go")
        assert allocate(c, "needs-all", ENTRIES * ENTRY_BLOCKS) is Status.ALLOCATED
        assert states(c, [pinned]) == [EntryState.ABSENT]
        reader.close()


def let_go(reader: ClientProcess, c: Client) -> None:
    """The holder reads under its pins (the bytes must still be the committed ones), gives them
    back, and the daemon sees the locks go."""
    reader.send("read")
    assert reader.expect("read") == "read", f"bytes changed under the pin: {reader.said}"
    reader.send("unpin")
    assert reader.expect("unpinned") == "unpinned 0"
    wait_until(lambda: locked(c) == 0, UNLOCK_DEADLINE, "the unpinned lock to go")


@pytest.mark.fault_kind("daemon killed under a lock pin")
def test_a_key_deleted_under_a_lock_pin_and_put_again_survives_a_daemon_restart(
    daemon: Daemon, interpreters: Interpreters
) -> None:
    with daemon.client(name="filler") as c:
        keys = fill(c, "twice")
        key = keys[0]
        reader = holder(interpreters, daemon, [key])
        # Deleted while locked: it leaves the index, its record stays (its blocks are the
        # reader's) until the lock goes. Put again meanwhile, as version 1, at another slot.
        assert [r.status for r in c.delete(POOL, [key])] == [Status.OK]
        producer = Producer(c, POOL, checksum=True)
        again = make_tensor(key, ENTRY_BLOCKS * BLOCK, version=1)
        c.evict(POOL, [keys[1]])  # room for it
        assert producer.put(key, again) is PutStatus.COMMITTING
        producer.flush()
        assert locked(c) == 1

    daemon.restart()  # SIGKILL before the reader let go: two records of the key in the file

    with daemon.client(name="after") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)  # adopted, not refused
        assert states(c, keys[:1] + keys[2:]) == [EntryState.READY] * (ENTRIES - 1)
        got = Consumer(c, POOL, verify=True).get(key)
        assert got is not None and check_entry_bytes(key, tensor_bytes(got), 1) is None
        c.flush()
        let_go(reader, c)  # the old bytes, under the old pin, are still whole
        wait_until(lambda: _accounted(c), 5.0, "the old record's blocks to be reclaimed")
        assert_intact(c, POOL, version=None)
        reader.close()


@pytest.mark.fault_kind("daemon killed under a lock pin")
def test_a_key_deleted_under_a_lock_pin_is_not_served_after_a_daemon_restart(
    daemon: Daemon, interpreters: Interpreters
) -> None:
    with daemon.client(name="filler") as c:
        keys = fill(c, "gone")
        key = keys[0]
        reader = holder(interpreters, daemon, [key])
        # Deleted while locked: it leaves the index; its record stays (its blocks are the
        # reader's) until the lock goes, marked doomed.
        assert [r.status for r in c.delete(POOL, [key])] == [Status.OK]

    daemon.restart()  # SIGKILL before the reader let go

    with daemon.client(name="after") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        assert states(c, keys) == [EntryState.ABSENT] + [EntryState.READY] * (ENTRIES - 1)
        assert Consumer(c, POOL).get(key) is None
        assert locked(c) == 1
        # Its blocks are still the reader's: a pool-sized put gives way to nothing but them.
        assert allocate(c, "everything", ENTRIES * ENTRY_BLOCKS) is Status.NO_SPACE
        let_go(reader, c)  # the deleted bytes, under the pin, are still whole
        wait_until(
            lambda: allocate(c, "everything", ENTRIES * ENTRY_BLOCKS) is Status.ALLOCATED,
            5.0,
            "the deleted entry's blocks to be reclaimed",
        )
        reader.close()


# ---- everyone at once, at random ---------------------------------------------------------------

CHURN_BLOCK = 4096
CHURN_CAPACITY = 48 * CHURN_BLOCK
CHURN_SLOTS = 12  # fewer slots than the blocks could hold: slots are reused all the time too
UNIVERSE = 40  # keys k0..k39, each of a size fixed by its key (1 to 4 blocks, ragged)
CHURN_SECONDS = 3.0

# Shared by the churn's child processes: a key's size is a function of the key, like its bytes.
SIZE_OF = """
import hashlib

def size_of(key):
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    return (1 + h % 4) * CHURN_BLOCK - 8 * (h % 61)
"""


def size_of(key: str) -> int:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")
    return (1 + h % 4) * CHURN_BLOCK - 8 * (h % 61)


WRITER = (
    SIZE_OF
    + """
from ec_protocol.errors import EcdError
c = Client(ADDRESS, name="writer")
c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
producer = Producer(c, POOL)
rng = random.Random(SEED)
puts = errors = 0
say("ready")
sys.stdin.readline()  # "go": everyone starts together
deadline = time.monotonic() + SECONDS
while time.monotonic() < deadline:
    keys = rng.sample(range(UNIVERSE), rng.randint(1, 4))
    try:
        batch = {f"k{i}": make_tensor(f"k{i}", size_of(f"k{i}")) for i in keys}
        statuses = producer.put_many(batch)
        puts += sum(s is PutStatus.COMMITTING for s in statuses.values())
        if rng.random() < 0.3:
            producer.flush()
    except EcdError:  # the pool was dropped under the put: open it again
        errors += 1
        try:
            c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
        except EcdError:
            pass
    time.sleep(rng.uniform(0, 0.004))
try:
    producer.flush()
except EcdError:
    errors += 1
c.close()
say("wrote", puts, errors)
"""
)

# A reader: gets through a Consumer (lock pins at the slots its view knows), and lock-pins keys
# at slots it learned earlier (stale by now, often) or at random slots, reading under the pin,
# holding it a moment (while the admin evicts and deletes), and reading again. Every byte read is
# checked against the key's own contents.
READER = (
    SIZE_OF
    + """
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import LayoutError
from ec_protocol.types import Extent, TensorSpec

c = Client(ADDRESS, name="reader")
c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
consumer = Consumer(c, POOL)
view = c.view(POOL)
view.wait_synced(10)
rng = random.Random(SEED)
counts = dict(gets=0, get_hits=0, pins=0, pin_hits=0, stale_pins=0, stale_hits=0, errors=0)
wrong = []
learned = {}  # key -> a slot the view said it was at, some time ago

def check(key, raw):
    if len(raw) != size_of(key):
        wrong.append(f"{key}: {len(raw)} bytes, not {size_of(key)}")
    elif check_entry_bytes(key, raw) is not None:
        wrong.append(check_entry_bytes(key, raw))

def pin_and_read(key, slot):
    mover = consumer.endpoint.mover("cpu")
    pins = consumer.endpoint.pins()
    record = pins.pin(slot, key.encode())
    if record is None:
        return False
    try:
        extents = list(record.extents)
        spec = record.spec
        for _ in range(3):
            tensor, transfer = mover.load(extents, spec)
            transfer.wait()
            check(key, tensor_bytes(tensor))
            time.sleep(rng.uniform(0, 0.02))  # held while the others evict, delete, drop
    finally:
        pins.unpin(slot)
    return True

say("ready")
sys.stdin.readline()  # "go": everyone starts together
deadline = time.monotonic() + SECONDS
while time.monotonic() < deadline:
    try:
        for i in range(UNIVERSE):
            slot = view.slot(f"k{i}".encode())
            if slot is not None and rng.random() < 0.2:
                learned[f"k{i}"] = slot
        roll = rng.random()
        if roll < 0.5:
            keys = [f"k{i}" for i in rng.sample(range(UNIVERSE), rng.randint(1, 6))]
            got = consumer.get_many(keys)
            counts["gets"] += len(keys)
            for key, tensor in got.items():
                if tensor is not None:
                    counts["get_hits"] += 1
                    check(key, tensor_bytes(tensor))
        elif roll < 0.85 and learned:
            key = rng.choice(sorted(learned))
            counts["stale_pins"] += 1
            counts["stale_hits"] += pin_and_read(key, learned[key])
        else:  # any key at any slot: mostly a slot holding another key
            key = f"k{rng.randrange(UNIVERSE)}"
            counts["pins"] += 1
            counts["pin_hits"] += pin_and_read(key, rng.randrange(CHURN_SLOTS))
    except (EcdError, LayoutError, OSError):  # the pool dropped under the read
        counts["errors"] += 1
        time.sleep(0.01)
c.close()
say("wrong", json.dumps(wrong[:5]))
say("counts", json.dumps(counts))
"""
)


def admin(
    c: Client,
    rng: random.Random,
    stop: threading.Event,
    drops: threading.Event,
    did: dict[str, int],
) -> None:
    """Evict, delete (a few keys, or every key), and now and then (while `drops` is set) drop
    (forced) and recreate the pool, at random."""
    while not stop.is_set():
        keys = [f"k{i}" for i in rng.sample(range(UNIVERSE), rng.randint(1, 5))]
        roll = rng.random()
        try:
            if roll < 0.45:
                did["evicted"] += sum(r.status is Status.OK for r in c.evict(POOL, keys))
            elif roll < 0.8:
                did["deleted"] += sum(r.status is Status.OK for r in c.delete(POOL, keys))
            elif roll < 0.9:  # a sweep: whatever the readers hold now is deleted under them
                everything = [f"k{i}" for i in range(UNIVERSE)]
                did["deleted"] += sum(r.status is Status.OK for r in c.delete(POOL, everything))
            elif roll < 0.95 and drops.is_set():
                c.drop_pool(POOL, force=True)
                did["dropped"] += 1
                time.sleep(rng.uniform(0, 0.02))
                c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
        except EcdError:  # the pool is away (dropped, not recreated yet)
            did["errors"] += 1
            with contextlib.suppress(EcdError):
                c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
        time.sleep(rng.uniform(0, 0.005))


@pytest.mark.fault_kind("readers, writers and an admin at random on shared slots")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_readers_never_read_another_entrys_bytes_while_others_write_evict_delete_and_drop(
    interpreters: Interpreters, trial: int
) -> None:
    churn(interpreters, *trial_rng("lock-pin churn", trial), kill_daemon=False)


@pytest.mark.fault_kind("readers, writers and an admin at random, the daemon killed midway")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_readers_never_read_another_entrys_bytes_across_a_daemon_killed_mid_churn(
    interpreters: Interpreters, trial: int
) -> None:
    churn(interpreters, *trial_rng("lock-pin churn, daemon killed", trial), kill_daemon=True)


def churn(interpreters: Interpreters, rng: random.Random, replay: str, kill_daemon: bool) -> None:
    """Readers, a writer and the admin at random for CHURN_SECONDS (the daemon SIGKILLed and
    restarted warm a quarter of the way in, if asked), then the checks."""
    args = daemon_args("--entries-per-pool", str(CHURN_SLOTS))
    with running_daemon(*args) as daemon, daemon.client(name="admin") as c:
        c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
        assert c.pool_info(POOL).max_entries == CHURN_SLOTS
        common = dict(
            ADDRESS=daemon.address,
            POOL=POOL,
            CHURN_BLOCK=CHURN_BLOCK,
            CHURN_CAPACITY=CHURN_CAPACITY,
            CHURN_SLOTS=CHURN_SLOTS,
            UNIVERSE=UNIVERSE,
            SECONDS=CHURN_SECONDS,
        )
        procs = [interpreters.take() for _ in range(READERS + 1)]
        writer = procs[0].run(WRITER, SEED=rng.random(), **common)
        readers = [p.run(READER, SEED=rng.random(), **common) for p in procs[1:]]
        for proc in procs:
            proc.expect("ready")
        stop, drops = threading.Event(), threading.Event()
        drops.set()
        did = dict(evicted=0, deleted=0, dropped=0, errors=0)
        admin_rng = random.Random(rng.random())
        thread = threading.Thread(target=admin, args=(c, admin_rng, stop, drops, did))
        thread.start()
        try:
            for proc in procs:
                proc.send("go")
            # Drops only in the first half: deletes of locked entries late in the run must be
            # reclaimed by the daemon, not wiped by a drop, for the books below to be checked.
            if kill_daemon:
                time.sleep(CHURN_SECONDS / 4)
                daemon.restart()  # with the readers' lock pins held, deletes under them
                time.sleep(CHURN_SECONDS / 4)
            else:
                time.sleep(CHURN_SECONDS / 2)
            drops.clear()
            lines = [r.finish(60) for r in readers]
            writer.finish(60)
        finally:
            stop.set()
            thread.join(30)

        assert daemon.running, daemon.log()[-3000:]
        total: dict[str, int] = {}
        for said in lines:
            [wrong] = [line.split(" ", 1)[1] for line in said if line.startswith("wrong ")]
            assert wrong == "[]", f"a reader read another entry's bytes: {wrong} ({replay})"
            [counts] = [line.split(" ", 1)[1] for line in said if line.startswith("counts ")]
            for name, n in json.loads(counts).items():
                total[name] = total.get(name, 0) + n
        hits = total["get_hits"] + total["stale_hits"] + total["pin_hits"]
        assert hits > 0, f"no reader ever hit: nothing was checked ({total}, {replay})"
        assert total["stale_hits"] < total["stale_pins"] or total["stale_pins"] == 0
        for name, n in {**total, **did}.items():
            record_figure(f"lock-pin churn: {name} per trial", n)
        record_tally("lock-pin churn trials with a pool drop", did["dropped"] > 0)

        # The books balance: locks gone with the readers, removed entries' blocks reclaimed,
        # every READY entry whole.
        c.open_pool(POOL, CHURN_BLOCK, CHURN_CAPACITY)
        wait_until(lambda: locked(c) == 0, UNLOCK_DEADLINE, "the readers' locks to go")
        wait_until(lambda: _accounted(c), 5.0, "removed entries' blocks to be reclaimed")
        assert_intact(c, POOL)


def _accounted(c: Client) -> bool:
    [pool] = c.stats(POOL).pools
    held = sum(e.count for entry in c.iter_entries(POOL) for e in entry.extents)
    return pool.free_blocks + held == pool.num_blocks


# ---- a stale view ------------------------------------------------------------------------------

STALE_SLOTS = 2


@pytest.fixture
def reused() -> Iterator[tuple[Daemon, Client, int]]:
    """A pool of two slots where `gone` was at a slot, was evicted, and `other` took the slot.
    Yields the daemon, a client, and that slot."""
    args = daemon_args("--entries-per-pool", str(STALE_SLOTS))
    with running_daemon(*args) as daemon, daemon.client(name="stale") as c:
        c.open_pool(POOL, BLOCK, 16 * BLOCK)
        assert c.pool_info(POOL).max_entries == STALE_SLOTS
        producer = Producer(c, POOL)
        view = c.view(POOL)
        assert view.wait_synced(10)
        for key in ("gone", "stays"):
            assert producer.put(key, make_tensor(key, 2 * BLOCK)) is PutStatus.COMMITTING
        producer.flush()
        wait_until(lambda: view.slot(b"gone") is not None, 5.0, "gone's slot")
        slot = view.slot(b"gone")
        assert slot is not None
        assert [r.status for r in c.evict(POOL, ["gone"])] == [Status.OK]
        assert producer.put("other", make_tensor("other", 2 * BLOCK)) is PutStatus.COMMITTING
        producer.flush()
        wait_until(lambda: view.slot(b"other") is not None, 5.0, "other's slot")
        assert view.slot(b"other") == slot, "the test needs the slot reused"
        yield daemon, c, slot


def test_a_lock_pin_at_a_stale_slot_now_holding_another_entry_is_a_miss(
    reused: tuple[Daemon, Client, int],
) -> None:
    _, c, slot = reused
    info = c.pool_info(POOL)
    pins = SlotPins(info.path, info.pool_uuid)
    try:
        assert pins.pin(slot, b"gone") is None
        assert pins.held() == 0 and locked(c) == 0  # the miss left no lock
        assert pins.pin(slot, b"other") is not None  # the slot's true tenant
        assert locked(c) == 1
        pins.unpin(slot)
        assert locked(c) == 0
    finally:
        pins.close()


def test_a_consumer_whose_view_is_stale_gets_a_miss_never_the_new_tenants_bytes(
    reused: tuple[Daemon, Client, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, c, slot = reused
    consumer = Consumer(c, POOL)
    view = c.view(POOL)
    assert view.slot(b"gone") is None  # the real view heard the eviction: freeze it before
    fresh = view.slot
    monkeypatch.setattr(view, "slot", lambda key: slot if key == b"gone" else fresh(key))
    misses = c.stats(POOL).pools[0].misses

    assert consumer.get("gone") is None
    # The slot's tenant, asked for under its own key, is a hit with its own bytes.
    got = consumer.get("other")
    assert got is not None and check_entry_bytes("other", tensor_bytes(got)) is None
    c.flush()
    wait_until(lambda: c.stats(POOL).pools[0].misses > misses, 5.0, "the miss to be owed")
    assert locked(c) == 0
