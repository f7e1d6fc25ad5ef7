"""A pool file changed behind the daemon's back is noticed, refused and kept for inspection,
while the daemon and its other pools carry on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from ecd_testing import REPO, Daemon, running_daemon

from ec_client import AllocateItem, Consumer, EcdError, EntryState, EventType, Producer

BLOCK = 4096


@pytest.mark.parametrize("tamper", ["truncate", "overwrite header"])
def test_a_tampered_pool_is_refused_and_the_daemon_carries_on(tamper: str) -> None:
    args = ("--max-bytes", "64MiB", "--pool-check-interval", "0.2")
    with running_daemon(*args) as daemon, daemon.client() as c:
        victim = c.open_pool("victim", BLOCK, 64 * BLOCK)
        c.open_pool("bystander", BLOCK, 64 * BLOCK)
        for pool in ("victim", "bystander"):
            c.allocate(pool, [AllocateItem("k", (16,), "uint8")])
            c.commit(pool, ["k"])
        events = c.watch("victim")
        if tamper == "truncate":
            os.truncate(victim.path, victim.data_offset)
        else:
            with open(victim.path, "r+b") as f:
                f.write(b"\0" * 64)
        assert next(events).type is EventType.POOL_DROPPED
        events.close()
        with pytest.raises(EcdError) as info:
            c.lookup("victim", ["k"])
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(EcdError) as reopened:
            c.open_pool("victim", BLOCK, 64 * BLOCK)
        assert reopened.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "changed under the daemon" in reopened.value.message
        assert os.path.exists(victim.path)  # kept for inspection
        assert c.lookup("bystander", ["k"])[0].state is EntryState.READY
        assert "pool refused" in daemon.log()
        time.sleep(0.5)
        assert daemon.running


READER = """
import select, sys
from ec_client import Client, PoolMapping
with Client(sys.argv[1], name="reader", connect_timeout_s=30) as c:
    mapping = PoolMapping.open(c.open_pool(sys.argv[2]))
    print("mapped", flush=True)
    passes = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        int(mapping.array.sum())  # every page of the blocks: a truncated file would SIGBUS here
        passes += 1
    print(passes, flush=True)
"""


def start_reader(daemon: Daemon, pool: str) -> subprocess.Popen[str]:
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, daemon.address, pool],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert reader.stdout is not None and reader.stdout.readline().strip() == "mapped"
    return reader


def test_nothing_the_daemon_or_its_clients_do_truncates_a_pool_file_under_a_reader() -> None:
    """The trust boundary is write access to a pool file (docs/security.md): a process that can
    write it can truncate it and kill its readers with SIGBUS. The daemon and the client
    library never do, whatever happens to the pool: readers copying from it all along live."""
    args = ("--max-bytes", "64MiB", "--lease-ttl", "1", "--pool-check-interval", "0.1")
    with running_daemon(*args) as daemon:
        with daemon.client() as c:
            c.open_pool("mapped", BLOCK, 256 * BLOCK)
            readers = [start_reader(daemon, "mapped")]
            producer, consumer = Producer(c, "mapped"), Consumer(c, "mapped")
            for i in range(64):  # more than fits: evictions
                producer.put(f"k{i}", torch.full((8 * BLOCK,), i, dtype=torch.uint8))
            consumer.get_many([f"k{i}" for i in range(64)])
            c.evict("mapped", ["k63"])
            c.delete("mapped", ["k62"])
            c.drop_pool("mapped", force=True)  # the file goes; the readers keep its pages
            c.open_pool("mapped", BLOCK, 256 * BLOCK)
            readers.append(start_reader(daemon, "mapped"))
            producer.put("after", torch.ones(BLOCK, dtype=torch.uint8))
        daemon.restart()  # SIGKILL, then the new daemon adopts the file
        with daemon.client() as c:
            c.open_pool("mapped")
            Producer(c, "mapped").put("adopted", torch.ones(BLOCK, dtype=torch.uint8))
        daemon.restart(signal.SIGTERM)
        time.sleep(0.3)  # a few pool checks
        for reader in readers:
            out, err = reader.communicate("stop\n", timeout=60)
            assert reader.returncode == 0, f"reader died ({reader.returncode}): {err}"
            assert int(out.split()[-1]) > 0
