"""The daemon SIGKILLed in the middle of a stream of commit batches, at a random point, then
restarted on the same shm directory (a warm restart, docs/design.md §8).

After the restart: every entry that was READY before the kill and every entry whose Commit reply
the producer received is READY with bit-identical bytes; an entry whose Commit was in flight is
READY (bit-identical) or gone, never partial; PENDING entries are gone and their blocks are free.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest
from ecd_testing import Daemon, running_daemon
from workload_testing import (
    FAULT_TRIALS,
    Interpreters,
    assert_intact,
    chunks,
    make_tensor,
    ready_keys,
    record_figure,
    record_tally,
    trial_rng,
)

from ec_client import Client, EcdError, Producer, PutStatus, Status

POOL = "commits"
BASE = "base"  # a fragmented pool of READY entries that must survive every restart
BLOCK = 4096
CAPACITY = 128 << 20
BUDGET = 48 << 20  # what one trial's committer writes at most: nothing is ever evicted
BASE_CAPACITY = 256 * BLOCK


def fragment(client: Client) -> dict[bytes, int]:
    """Fill a small pool, punch holes in it, and store entries that need several extents."""
    client.open_pool(BASE, BLOCK, BASE_CAPACITY)
    producer = Producer(client, BASE, checksum=True)
    fillers = {f"fill-{i}": make_tensor(f"fill-{i}", 8 * BLOCK) for i in range(32)}
    assert set(producer.put_many(fillers).values()) == {PutStatus.COMMITTING}
    producer.flush()  # committed (commits go in the background) before some are deleted
    client.delete(BASE, [f"fill-{i}" for i in range(0, 32, 2)])
    spread = {f"spread-{i}": make_tensor(f"spread-{i}", 40 * BLOCK - 100) for i in range(2)}
    assert set(producer.put_many(spread).values()) == {PutStatus.COMMITTING}
    producer.flush()  # committed: the snapshot below must see them READY
    assert all(len(e.extents) > 1 for e in client.iter_entries(BASE) if b"spread" in e.key)
    return ready_keys(client, BASE)


@pytest.fixture(scope="module")
def restarted() -> Iterator[tuple[Daemon, dict[bytes, int]]]:
    """A daemon whose base pool is filled once; each trial kills and restarts it."""
    # A slot for every block: the committer's entries are smaller than one, and none may be
    # evicted to free a slot.
    args = ("--max-bytes", "256MiB", "--lease-ttl", "2", "--entries-per-pool", "65536")
    with running_daemon(*args) as daemon:
        with daemon.client() as c:
            base = fragment(c)
            c.open_pool(POOL, BLOCK, CAPACITY)
        yield daemon, base


COMMITTER = """
c = Client(ADDRESS, name="committer")
c.open_pool(POOL, BLOCK, CAPACITY)
producer = Producer(c, POOL, checksum=True)
rng = random.Random(SEED)
n = written = 0
while written < BUDGET:
    batch = {}
    for _ in range(rng.randint(16, 512)):
        key = f"{PREFIX}-{n}"
        n += 1
        batch[key] = make_tensor(key, 4 * rng.randrange(1, 3 * BLOCK // 4))
    handle = producer.put_many_async(batch)  # allocated and copied: PENDING
    say("sending", *batch)
    statuses = handle.wait()  # the Commit RPC
    assert set(statuses.values()) == {PutStatus.STORED}, statuses
    say("committed", *batch)
    written += sum(t.nbytes for t in batch.values())
say("done")
time.sleep(600)
"""


def batches(lines: list[str], word: str) -> list[set[bytes]]:
    return [
        {k.encode() for k in line.split()[1:]} for line in lines if line.split(" ", 1)[0] == word
    ]


@pytest.mark.fault_kind("daemon killed mid-commit-batch")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_a_daemon_killed_during_commits_keeps_every_acknowledged_entry_after_restart(
    restarted: tuple[Daemon, dict[bytes, int]], interpreters: Interpreters, trial: int
) -> None:
    daemon, base = restarted
    rng, replay = trial_rng("daemon", trial)
    prefix = f"d{trial}"
    committer = interpreters.take().run(
        COMMITTER,
        ADDRESS=daemon.address,
        POOL=POOL,
        BLOCK=BLOCK,
        CAPACITY=CAPACITY,
        PREFIX=prefix,
        SEED=rng.random(),
        BUDGET=BUDGET,
    )
    committer.expect("committed")
    if rng.random() < 0.5:  # anywhere in the stream
        time.sleep(rng.uniform(0, 0.5))
    else:  # aimed at a Commit: a few milliseconds after the producer said it is sending one
        time.sleep(rng.uniform(0, 0.2))
        committer.expect("sending", "done")
        time.sleep(rng.uniform(0, 0.004))
    assert committer.proc.poll() is None, committer.describe()
    daemon.kill()
    committer.kill()  # its client would retry the in-flight Commit on the next daemon
    sent = batches(committer.said, "sending")
    acknowledged = set().union(*batches(committer.said, "committed"))
    in_flight = sent[-1] - acknowledged  # at most the last batch

    started = time.monotonic()
    daemon.start()
    record_figure("daemon restart -> SERVING, small pools (s)", time.monotonic() - started)

    with daemon.client() as c:
        c.open_pool(BASE, BLOCK, BASE_CAPACITY)  # attaches to the adopted pools
        c.open_pool(POOL, BLOCK, CAPACITY)
        assert ready_keys(c, BASE) == base, f"base entries changed ({replay})"
        ready = assert_intact(c, POOL)  # reads back every READY entry of both pools
        assert_intact(c, BASE)
        mine = {k for k in ready if k.startswith(f"{prefix}-".encode())}
        lost = acknowledged - mine
        assert not lost, (
            f"{len(lost)} acknowledged commits lost, e.g. {sorted(lost)[:3]} ({replay})"
        )
        assert mine <= acknowledged | in_flight, f"entries never committed are READY ({replay})"
        [pool] = c.stats(POOL).pools
        assert (
            pool.entries_pending == 0
            and pool.free_blocks + sum((n + BLOCK - 1) // BLOCK for n in ready.values())
            == pool.num_blocks
        )

        landed = mine & in_flight
        record_tally("daemon kills landing with a Commit in flight", bool(in_flight))
        if in_flight:
            split = "daemon kills landing with a Commit in flight:"
            record_tally(f"{split} before it was applied (all gone)", not landed)
            record_tally(f"{split} inside the batch (part READY)", landed not in (set(), in_flight))
            record_tally(f"{split} applied, reply lost (all READY)", landed == in_flight)
        for batch in chunks(sorted(mine), 1024):
            assert {r.status for r in c.delete(POOL, batch)} <= {Status.OK}


@pytest.mark.fault_kind("daemon killed while creating a pool")
@pytest.mark.parametrize("left", ["empty", "allocated", "header without its magic"])
def test_a_pool_whose_creation_a_killed_daemon_left_unfinished_is_created_anew(left: str) -> None:
    """PoolFile.create writes the magic last: a daemon killed before it leaves a file with none
    (created, allocated, or its header written). That file never held an entry; the restarted
    daemon removes it rather than refuse the pool until an operator does (the lock-pin churn
    test with the daemon killed met it: its pools are dropped and created again all along)."""
    with running_daemon("--max-bytes", "64MiB") as daemon:
        with daemon.client() as c:
            info = c.open_pool("early", BLOCK, BASE_CAPACITY)
            c.open_pool("kept", BLOCK, BASE_CAPACITY)
            Producer(c, "kept").put("img", make_tensor("img", 3 * BLOCK))
            c.flush()
        daemon.kill()
        path = pathlib.Path(info.path)
        size = 0 if left == "empty" else path.stat().st_size
        header = path.read_bytes()[:4096] if left.startswith("header") else b""
        path.unlink()
        with open(path, "wb") as file:  # what the kill left at that point of the creation
            file.truncate(size)
            file.write(bytes(8) + header[8:])
        daemon.start()
        with daemon.client() as c:
            fresh = c.open_pool("early", BLOCK, BASE_CAPACITY)
            assert fresh.created and fresh.pool_uuid != info.pool_uuid
            c.open_pool("kept", BLOCK, BASE_CAPACITY)
            assert set(ready_keys(c, "kept")) == {b"img"}  # the others were left alone
        assert "its creation was interrupted" in daemon.log()


def test_a_pool_holding_entries_whose_magic_was_zeroed_is_refused_and_kept() -> None:
    """Not an unfinished creation: the records in its slot table say it was served."""
    with running_daemon("--max-bytes", "64MiB") as daemon:
        with daemon.client() as c:
            info = c.open_pool("victim", BLOCK, BASE_CAPACITY)
            Producer(c, "victim").put("img", make_tensor("img", 3 * BLOCK))
            c.flush()
        daemon.kill()
        with open(info.path, "r+b") as file:
            file.write(bytes(8))
        daemon.start()
        with daemon.client() as c, pytest.raises(EcdError, match="refused"):
            c.open_pool("victim", BLOCK, BASE_CAPACITY)
        assert pathlib.Path(info.path).exists()  # kept for inspection
