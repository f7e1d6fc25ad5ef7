"""Producer and consumer processes sharing one pool through one daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ecd_testing import REPO, Daemon, assert_blocks_accounted

from ec_client import (
    AllocateItem,
    Client,
    Consumer,
    EcdError,
    EntryState,
    PoolMapping,
    Producer,
    PutStatus,
    Status,
    StepResult,
)

POOL = "exchange"
BLOCK = 4096
CAPACITY = 16384 * BLOCK  # 64 MiB

PRELUDE = """
import hashlib, json, os, sys, time
import torch
from ec_client import AllocateItem, Client, Consumer, Producer, PutStatus
ADDRESS, POOL, BLOCK, CAPACITY = {address!r}, {pool!r}, {block}, {capacity}

def tensor_for(i):
    g = torch.Generator().manual_seed(i)
    shape = (1 + (i * 37) % 120, [256, 1024, 3584][i % 3])  # 200 of them fill ~45 MiB
    dtype = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn][i % 4]
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)

def digest(t):
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
"""


def spawn(daemon: Daemon, code: str, *args: str) -> subprocess.Popen[str]:
    prelude = PRELUDE.format(address=daemon.address, pool=POOL, block=BLOCK, capacity=CAPACITY)
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"process failed ({proc.returncode}):\n{err}"
    return out


def test_200_tensors_of_mixed_sizes_cross_processes_bit_identical(daemon: Daemon) -> None:
    producer = spawn(
        daemon,
        """
        with Client(ADDRESS, name="encoder") as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            p = Producer(c, POOL, checksum=True)
            digests = {}
            for start in range(0, 200, 8):  # batches of 8, as an engine step would
                batch = {f"img-{i}": tensor_for(i) for i in range(start, start + 8)}
                assert set(p.put_many(batch).values()) == {PutStatus.COMMITTING}
                digests.update({k: digest(t) for k, t in batch.items()})
            print(json.dumps(digests))
    """,
    )
    produced = json.loads(finish(producer))
    consumer = spawn(
        daemon,
        """
        with Client(ADDRESS, name="decoder") as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            got = Consumer(c, POOL, verify=True).get_many([f"img-{i}" for i in range(200)])
            print(json.dumps({k: [digest(t), list(t.shape), str(t.dtype)] for k, t in got.items()}))
    """,
    )
    consumed = json.loads(finish(consumer))
    assert len(produced) == 200
    for i in range(200):
        key = f"img-{i}"
        assert consumed[key][0] == produced[key], f"{key} differs"
    with daemon.client() as c:
        assert c.stats(POOL).pools[0].pins == 0
        assert_blocks_accounted(c, POOL)


def test_concurrent_producers_of_one_key_store_it_once(daemon: Daemon) -> None:
    racers = [
        spawn(
            daemon,
            """
            with Client(ADDRESS, name=sys.argv[1]) as c:
                c.open_pool(POOL, BLOCK, CAPACITY)
                p = Producer(c, POOL)
                while not os.path.exists(sys.argv[2]):
                    time.sleep(0.001)
                print(p.put("shared-img", tensor_for(7)).value)
        """,
            f"encoder-{i}",
            str(daemon.workdir / "go"),
        )
        for i in range(4)
    ]
    time.sleep(1.5)  # let all four import torch and connect
    (daemon.workdir / "go").touch()
    outcomes = sorted(finish(proc).strip() for proc in racers)
    assert outcomes.count("committing") == 1
    assert set(outcomes) <= {"committing", "exists", "pending"}


def test_a_puts_late_commit_never_makes_a_later_allocation_of_its_key_ready(
    daemon: Daemon,
) -> None:
    """A put's Commit waits to ride on a later call; meanwhile the key is deleted and the same
    session allocates it again (its next put, not written yet). The late Commit names the first
    allocation: it must not make the second READY before its bytes are written."""
    with (
        daemon.client(name="encoder", linger_s=60.0) as c,  # the Commit waits for the flush
        daemon.client(name="admin") as admin,
    ):
        c.open_pool(POOL, BLOCK, CAPACITY)
        admin.open_pool(POOL)
        producer = Producer(c, POOL)
        assert producer.put("k", torch.ones(2 * BLOCK, dtype=torch.uint8)) is PutStatus.COMMITTING
        assert [r.status for r in admin.delete(POOL, ["k"])] == [Status.OK]
        [again] = c.allocate(POOL, [AllocateItem("k", (2 * BLOCK,), "uint8")])
        assert again.status is Status.ALLOCATED  # the next put of k: its bytes not written yet
        with pytest.raises(EcdError, match="allocated again"):
            producer.flush()  # the first put was not stored: its allocation is gone
        assert admin.lookup(POOL, ["k"])[0].state is EntryState.PENDING
        assert Consumer(admin, POOL).get("k") is None


def test_a_waiting_consumer_gets_the_tensor_as_soon_as_it_is_committed(daemon: Daemon) -> None:
    with daemon.client(name="encoder") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        expected = torch.arange(3584 * 4, dtype=torch.float32).reshape(4, 3584)
        handle_key = "late-img"
        [allocated] = c.allocate(POOL, [AllocateItem(handle_key, (4, 3584), "float32")])
        consumer = spawn(
            daemon,
            """
            with Client(ADDRESS, name="decoder") as c:
                c.open_pool(POOL, BLOCK, CAPACITY)
                t0 = time.monotonic()
                t = Consumer(c, POOL).get("late-img", wait_ms=30000)
                print(json.dumps({"waited": time.monotonic() - t0, "sum": float(t.sum())}))
        """,
        )
        time.sleep(2.0)  # the consumer is waiting inside Acquire by now
        mapping = PoolMapping.open(c.pool_info(POOL))
        mapping.region(allocated.extents[0])[: expected.nbytes].copy_(
            expected.view(-1).view(torch.uint8)
        )
        c.commit(POOL, [handle_key])
        committed = time.monotonic()
        report = json.loads(finish(consumer))
        assert report["sum"] == float(expected.sum())
        # Woken by the commit (about 2 s into its get), not by its 30 s wait running out; the
        # child's own count, so that its exit (torch's teardown, slow under load) is not in it.
        assert report["waited"] < 15
        assert time.monotonic() - committed < 30


def test_a_consumer_that_asks_before_the_producer_allocates_gets_the_tensor(
    daemon: Daemon,
) -> None:
    with daemon.client(name="encoder") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        consumer = spawn(
            daemon,
            """
            with Client(ADDRESS, name="decoder") as c:
                c.open_pool(POOL)
                print("asking", flush=True)
                t = Consumer(c, POOL).get("not-yet", wait_ms=30000)
                print(json.dumps(None if t is None else float(t.sum())))
        """,
        )
        assert consumer.stdout is not None and consumer.stdout.readline().strip() == "asking"
        time.sleep(1.0)  # the consumer is waiting inside Acquire by now, for a key not there
        assert c.lookup(POOL, ["not-yet"])[0].state is EntryState.ABSENT
        expected = torch.arange(3584 * 2, dtype=torch.float32).reshape(2, 3584)
        assert Producer(c, POOL).put("not-yet", expected) is PutStatus.COMMITTING
        assert json.loads(finish(consumer)) == float(expected.sum())


def test_acquire_tells_a_key_still_being_written_from_one_not_there_when_the_wait_runs_out(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        c.allocate(POOL, [AllocateItem("being-written", (10,), "uint8")])
        pending, absent = c.acquire(POOL, ["being-written", "never-made"], wait_ms=300)
        assert (pending.status, absent.status) == (Status.PENDING, Status.MISS)


def test_a_producer_killed_between_allocate_and_commit_never_exposes_its_bytes(
    daemon: Daemon,
) -> None:
    victim = spawn(
        daemon,
        """
        import signal
        from ec_client import PoolMapping
        with Client(ADDRESS, name="victim") as c:
            c.open_pool(POOL, BLOCK, CAPACITY)
            [r] = c.allocate(POOL, [AllocateItem("torn", (1024, 1024), "uint8")])
            region = PoolMapping.open(c.pool_info(POOL)).region(r.extents[0])
            region[: 512 * 1024].fill_(0xAB)  # half the copy done
            print("half", flush=True)
            time.sleep(60)
    """,
    )
    assert victim.stdout is not None and victim.stdout.readline().strip() == "half"
    with daemon.client(name="decoder") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        consumer = Consumer(c, POOL)
        assert consumer.get("torn") is None  # PENDING is never served
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert consumer.get("torn", wait_ms=5000) is None  # aborted when the lease ran out
        assert c.lookup(POOL, ["torn"])[0].state is EntryState.ABSENT
        assert c.stats(POOL).pools[0].free_blocks == CAPACITY // BLOCK
        # the key can be produced again, cleanly
        assert Producer(c, POOL).put("torn", torch.ones(1024, 1024, dtype=torch.uint8)) is (
            PutStatus.COMMITTING
        )
        loaded = consumer.get("torn")
        assert loaded is not None and bool((loaded == 1).all())


def test_a_pool_recreated_under_a_live_mapping_is_detected(daemon: Daemon) -> None:
    with daemon.client() as c:
        old = c.open_pool(POOL, BLOCK, CAPACITY)
        mapping = PoolMapping.open(old)
        c.drop_pool(POOL)
        new = c.open_pool(POOL, BLOCK, CAPACITY)
        assert new.pool_uuid != old.pool_uuid
        with pytest.raises(EcdError, match="recreated") as info:
            mapping.check_current()
        assert info.value.code.name == "FAILED_PRECONDITION"
        with pytest.raises(EcdError, match="uuid"):
            PoolMapping(old)  # the old announcement does not match the new file


def test_a_closed_mapping_is_not_current_though_its_file_still_is(daemon: Daemon) -> None:
    # Endpoints share a process's mapping: one that closed it (it found the pool recreated) must
    # not leave another copying through it (its check holds the file open, so it cannot be
    # answered by whatever file reused a closed descriptor's number).
    with daemon.client() as c:
        mapping = PoolMapping.open(c.open_pool(POOL, BLOCK, CAPACITY))
        mapping.check_current()
        mapping.close()
        opened_since = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
        try:
            with pytest.raises(EcdError, match="closed") as info:
                mapping.check_current()
        finally:
            for fd in opened_since:
                os.close(fd)
        assert info.value.code.name == "FAILED_PRECONDITION"


def test_producers_follow_a_recreated_pool(daemon: Daemon) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        producer = Producer(c, POOL)
        producer.put("before", torch.ones(10))
        with daemon.client(name="operator") as operator:
            operator.drop_pool(POOL, force=True)
            operator.open_pool(POOL, BLOCK, CAPACITY)
        assert producer.put("after", torch.ones(10)) is PutStatus.COMMITTING
        loaded = Consumer(c, POOL).get("after")
        assert loaded is not None and bool((loaded == 1).all())


def recreated_after_each_step(
    daemon: Daemon, c: Client, monkeypatch: pytest.MonkeyPatch, then: Callable[[Client], None]
) -> None:
    """Every Step of `c` is answered, then the pool is dropped (forced) and recreated by an
    operator, who does `then` with the new pool, before `c` sees the answer: the race of a
    Step with an operator's drop."""
    step = c.step

    def answered_then_recreated(*args: Any, **kwargs: Any) -> StepResult:
        result = step(*args, **kwargs)
        with daemon.client(name="operator") as operator:
            operator.drop_pool(POOL, force=True)
            operator.open_pool(POOL, BLOCK, CAPACITY)
            then(operator)
        return result

    monkeypatch.setattr(c, "step", answered_then_recreated)


def test_a_get_whose_pool_is_recreated_during_its_step_is_a_miss_not_the_new_files_bytes(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        Producer(c, POOL).put("k", torch.ones(4 * BLOCK, dtype=torch.uint8))
        c.flush()
        consumer = Consumer(c, POOL, watch=False)  # every get asks the daemon (a lease pin)
        recreated_after_each_step(daemon, c, monkeypatch, lambda operator: None)
        assert consumer.get("k") is None


def test_a_put_whose_pool_is_recreated_during_its_step_writes_nothing_into_the_new_file(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    def victim_put(operator: Client) -> None:  # at the blocks the first file gave "k"
        Producer(operator, POOL).put("victim", torch.full((4 * BLOCK,), 2, dtype=torch.uint8))
        operator.flush()

    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        producer = Producer(c, POOL)
        recreated_after_each_step(daemon, c, monkeypatch, victim_put)
        with pytest.raises(EcdError, match="recreated while this put was allocated"):
            producer.put("k", torch.ones(4 * BLOCK, dtype=torch.uint8))
        monkeypatch.undo()
        victim = Consumer(c, POOL).get("victim")
        assert victim is not None and bool((victim == 2).all())


def test_a_pool_file_whose_header_does_not_verify_is_refused(daemon: Daemon) -> None:
    with daemon.client() as c:
        info = c.open_pool(POOL, BLOCK, CAPACITY)
    with open(info.path, "r+b") as f:
        f.seek(0)
        f.write(b"NOTAPOOL")
    with pytest.raises(EcdError, match="bad magic") as caught:
        PoolMapping(info)
    assert caught.value.code.name == "FAILED_PRECONDITION"
