"""A pool file truncated, overwritten or removed by another process, on a live daemon.

The daemon never maps pool files (it uses pwrite/pread, see ec_daemon/core/pool.py), so nothing
done to a file can crash it: it keeps serving, its other pools are untouched, and within a check
interval it refuses the changed pool (tests/security/test_pool_tampering.py shows the refusal
itself).
Clients find out on their own: a mapping checks the file before every copy, a new mapping checks
the header and size, and a consumer that verifies checksums catches overwritten bytes.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from ecd_testing import Daemon, assert_blocks_accounted, running_daemon
from workload_testing import (
    Interpreters,
    assert_intact,
    make_tensor,
    read_back,
    ready_keys,
    wait_until,
)

from ec_client import (
    Client,
    Consumer,
    EcdError,
    EntryState,
    PoolInfo,
    PoolMapping,
    Producer,
    PutStatus,
)
from ec_protocol.pool.layout import HEADER_SIZE, SLOT_SIZE

pytestmark = pytest.mark.fault_kind("pool file tampered with")

BLOCK = 4096
CAPACITY = 256 * BLOCK
CHECK_INTERVAL = 0.5
KEYS = [f"img-{i}" for i in range(8)]
DOCUMENTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.fixture
def tampered() -> Iterator[Daemon]:
    args = ("--max-bytes", "64MiB", "--pool-check-interval", str(CHECK_INTERVAL))
    with running_daemon(*args) as daemon:
        yield daemon


def fill(client: Client, pool: str) -> PoolInfo:
    info = client.open_pool(pool, BLOCK, CAPACITY)
    tensors = {k: make_tensor(k, (i + 1) * 5000) for i, k in enumerate(KEYS)}
    producer = Producer(client, pool, checksum=True)
    producer.put_many(tensors)
    producer.flush()  # READY for every client before the tampering begins
    return info


def another_process(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def flip_byte(path: str, offset: int) -> None:
    """Invert one byte of the file, as a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def answers_documented(client: Client, pool: str) -> None:
    """Every request on a tampered pool is answered, with success or a documented code."""
    for call in (
        lambda: client.lookup(pool, KEYS),
        lambda: client.acquire(pool, KEYS[:2]),
        lambda: client.list_entries(pool),
        lambda: client.stats(pool),
    ):
        try:
            results = call()
        except EcdError as error:
            assert error.code in DOCUMENTED, error
        else:
            if isinstance(results, list) and results and hasattr(results[0], "lease_id"):
                client.release([r.lease_id for r in results if r.lease_id])


MAPPED_READER = """
c = Client(ADDRESS, name="reader")
c.open_pool(POOL, BLOCK, CAPACITY)
consumer = Consumer(c, POOL, verify=True)
assert all(t is not None for t in consumer.get_many(KEYS).values())  # mapped and read
say("mapped")
sys.stdin.readline()
for attempt in ("get", "put"):
    try:
        if attempt == "get":
            consumer.get(KEYS[0])
        else:
            Producer(c, POOL).put("new", torch.ones(10))
        say("unnoticed", attempt)
    except Exception as exc:
        say("refused", attempt, type(exc).__name__, getattr(exc, "code", None))
"""


def test_a_truncated_pool_file_is_noticed_by_a_mapped_client_and_the_daemon_serves_on(
    tampered: Daemon, interpreters: Interpreters
) -> None:
    with tampered.client() as c:
        victim = fill(c, "victim")
        fill(c, "bystander")
        reader = interpreters.take().run(
            MAPPED_READER,
            ADDRESS=tampered.address,
            POOL="victim",
            BLOCK=BLOCK,
            CAPACITY=CAPACITY,
            KEYS=KEYS,
        )
        reader.expect("mapped")
        mapping = PoolMapping.open(victim)
        mapping.check_current()
        another_process("truncate", "-s", str(victim.data_offset + 10 * BLOCK), victim.path)

        # A mapping sees it at its next check (every copy starts with one), and so does a new one.
        with pytest.raises(EcdError, match="truncated") as seen:
            mapping.check_current()
        assert seen.value.code == grpc.StatusCode.FAILED_PRECONDITION
        mapping.close()
        with pytest.raises(EcdError, match="truncated") as fresh:
            PoolMapping(victim)
        assert fresh.value.code == grpc.StatusCode.FAILED_PRECONDITION
        # A client process that had the pool mapped refuses to copy (rather than die of SIGBUS):
        # its mapping refuses, or the daemon has refused the pool by now.
        reader.send("go")
        lines = reader.finish()
        refusals = [line.split()[:4] for line in lines if line.startswith("refused")]
        assert [r[1] for r in refusals] == ["get", "put"], lines
        assert {r[3] for r in refusals} <= {
            "StatusCode.FAILED_PRECONDITION",
            "StatusCode.NOT_FOUND",
        }

        # The daemon answers every request on the pool, and past a check interval still serves.
        answers_documented(c, "victim")
        time.sleep(2 * CHECK_INTERVAL)
        answers_documented(c, "victim")
        assert tampered.running
        assert c.health() == "SERVING"
        assert read_back(c, "bystander", [k.encode() for k in KEYS]) == len(KEYS)
        assert_intact(c, "bystander")


def test_overwritten_entry_bytes_are_caught_by_a_verifying_consumer_which_releases_its_pin(
    tampered: Daemon,
) -> None:
    with tampered.client() as c:
        info = fill(c, "victim")
        [entry] = [e for e in c.iter_entries("victim") if e.key == b"img-3"]
        start = info.data_offset + entry.extents[0].start * BLOCK
        another_process(
            "dd", "if=/dev/urandom", f"of={info.path}", "bs=100", "count=1",
            f"seek={start // 100 + 1}", "conv=notrunc",
        )  # fmt: skip
        consumer = Consumer(c, "victim", verify=True)
        with pytest.raises(EcdError, match="checksum") as caught:
            consumer.get("img-3")
        assert caught.value.code == grpc.StatusCode.DATA_LOSS
        assert c.stats("victim").pools[0].pins == 0  # released even though the read failed
        others = [k.encode() for k in KEYS if k != "img-3"]
        assert read_back(c, "victim", others) == len(others)
        # Deleting the damaged entry and producing it again heals the pool.
        c.delete("victim", ["img-3"])
        Producer(c, "victim", checksum=True).put("img-3", make_tensor("img-3", 4 * 5000))
        assert_intact(c, "victim")
        assert tampered.running


def test_a_slot_table_overwritten_before_a_restart_loses_entries_but_never_serves_wrong_bytes(
    tampered: Daemon,
) -> None:
    with tampered.client() as c:
        info = fill(c, "victim")
        slots = {e.key: e for e in c.iter_entries("victim")}
        assert len(slots) == len(KEYS)
    # Garbage over the first two slot records (whichever entries they hold) and one flipped byte
    # in the middle of the table.
    with open(info.path, "r+b") as f:
        f.seek(HEADER_SIZE)
        f.write(os.urandom(2 * SLOT_SIZE))
    flip_byte(info.path, HEADER_SIZE + 5 * SLOT_SIZE + 300)
    tampered.restart()
    with tampered.client() as c:
        c.open_pool("victim", BLOCK, CAPACITY)
        survivors = ready_keys(c, "victim")
        assert 0 < len(survivors) <= len(KEYS) - 2
        assert_intact(c, "victim")  # whatever survived is bit-identical; lost blocks are free
        [pool] = c.stats("victim").pools
        held = sum((n + BLOCK - 1) // BLOCK for n in survivors.values())
        assert pool.free_blocks == pool.num_blocks - held


def test_an_entry_lost_with_its_slot_record_at_a_restart_is_logged(tampered: Daemon) -> None:
    with tampered.client() as c:
        info = fill(c, "victim")
    tampered.kill()
    with open(info.path, "rb") as f:
        table = f.read(HEADER_SIZE + info.max_entries * SLOT_SIZE)[HEADER_SIZE:]
    slot = next(i for i in range(info.max_entries) if table[i * SLOT_SIZE :][:4] == b"REDY")
    flip_byte(info.path, HEADER_SIZE + slot * SLOT_SIZE + 20)  # the record's size: its CRC fails
    tampered.start()
    with tampered.client() as c:
        c.open_pool("victim", BLOCK, CAPACITY)
        assert len(ready_keys(c, "victim")) == len(KEYS) - 1
    [said] = [line for line in tampered.log().splitlines() if "do not verify" in line]
    assert "level=warning" in said and "engine_id=victim" in said and "slots=1" in said, said


def test_a_pool_whose_header_was_overwritten_is_refused_at_restart_kept_and_removable(
    tampered: Daemon,
) -> None:
    with tampered.client() as c:
        victim = fill(c, "victim")
        fill(c, "bystander")
    tampered.kill()
    with open(victim.path, "r+b") as f:
        f.write(os.urandom(64))
    tampered.start()
    with tampered.client() as c:
        with pytest.raises(EcdError, match=r"was refused .*bad magic") as refused:
            c.open_pool("victim", BLOCK, CAPACITY)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert os.path.exists(victim.path)
        c.open_pool("bystander", BLOCK, CAPACITY)
        assert len(ready_keys(c, "bystander")) == len(KEYS)
        assert_intact(c, "bystander")
        # The operator inspects the file and removes it, as the refusal says; then it is created
        # again, without restarting the daemon.
        os.unlink(victim.path)
        fresh = c.open_pool("victim", BLOCK, CAPACITY)
        assert fresh.created and fresh.pool_uuid != victim.pool_uuid


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_pool_file_removed_or_replaced_is_refused_and_can_be_created_again(
    tampered: Daemon, how: str
) -> None:
    with tampered.client() as c:
        victim = fill(c, "victim")
        fill(c, "bystander")
        if how == "removed":
            another_process("rm", victim.path)
        else:  # a copy renamed over it: same bytes, another file
            another_process("cp", "--sparse=always", victim.path, victim.path + ".tmp")
            another_process("mv", victim.path + ".tmp", victim.path)

        def refused() -> bool:
            try:
                c.lookup("victim", KEYS)
            except EcdError as error:
                assert error.code == grpc.StatusCode.NOT_FOUND
                return True
            return False

        wait_until(refused, 10 * CHECK_INTERVAL, "the daemon to notice the pool file is gone")
        assert tampered.running
        if how == "removed":  # nothing left to inspect: the pool can be created afresh
            assert "pool file removed from under the daemon: pool forgotten" in tampered.log()
            assert "refused and left in place" not in tampered.log()
            fresh = c.open_pool("victim", BLOCK, CAPACITY)
            assert fresh.created and fresh.pool_uuid != victim.pool_uuid
            Producer(c, "victim", checksum=True).put("img-0", make_tensor("img-0", 5000))
            assert_intact(c, "victim")
        else:  # someone else's file: refused and kept
            with pytest.raises(EcdError) as caught:
                c.open_pool("victim", BLOCK, CAPACITY)
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert os.path.exists(victim.path)
        assert_intact(c, "bystander")
        assert_blocks_accounted(c, "bystander")
        assert c.lookup("bystander", KEYS)[0].state is EntryState.READY


@pytest.mark.parametrize("how", ["truncated", "removed"])
def test_a_producer_and_consumer_of_a_refused_pool_raise_clear_errors_and_work_once_it_is_back(
    tampered: Daemon, how: str
) -> None:
    with tampered.client() as c, tampered.client(name="operator") as operator:
        victim = fill(c, "victim")
        producer, consumer = Producer(c, "victim"), Consumer(c, "victim", watch=False)
        assert consumer.get(KEYS[0]) is not None  # both have the pool mapped
        if how == "truncated":
            another_process("truncate", "-s", str(victim.data_offset), victim.path)
        else:
            another_process("rm", victim.path)

        def refused() -> bool:
            try:
                operator.lookup("victim", KEYS[:1])
            except EcdError:
                return True
            return False

        wait_until(refused, 10 * CHECK_INTERVAL, "the daemon to refuse the pool")
        for attempt in range(2):  # and again: the objects are not broken by a failure
            with pytest.raises(EcdError, match="was refused") as put_refused:
                producer.put(f"new-{attempt}", make_tensor("new", 5000))
            with pytest.raises(EcdError, match="was refused") as get_refused:
                consumer.get(KEYS[0])
            for error in (put_refused.value, get_refused.value):
                assert error.code == grpc.StatusCode.NOT_FOUND

        # The operator removes what is left of the file and the pool is created again: the same
        # producer and consumer carry on with it.
        pathlib.Path(victim.path).unlink(missing_ok=True)
        operator.open_pool("victim", BLOCK, CAPACITY)
        tensor = make_tensor("again", 5000)
        assert producer.put("again", tensor) is PutStatus.COMMITTING
        loaded = consumer.get("again")
        assert loaded is not None and torch.equal(loaded, tensor)
        assert consumer.get(KEYS[0]) is None  # the refused pool's entries are gone with it
