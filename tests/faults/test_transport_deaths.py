"""A Mooncake read whose source process is SIGKILLed or stopped mid-transfer, over loopback TCP.

What the pull (docs/design.md §13) builds on: a read from a dead source fails promptly and, once its
future is done, nothing writes into the local range any more; a read from a stalled source is
not done at the reader's deadline and goes on writing until its future is done, so a caller that
gives up must keep the range out of use until then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
from ecd_testing import REPO, new_shm_dir
from peer_testing import DATA_OFFSET, data_of, needs_mooncake, pool_file
from workload_testing import FAULT_TRIALS, record_figure, record_tally, trial_rng

from ec_daemon.transport import Copy, MooncakeTransport, TransportError

pytestmark = needs_mooncake

SIZE = 256 << 20  # ~0.1-0.2 s over loopback TCP here: wide enough to land a signal mid-read
POOL = "pulled"


class Source:
    """A process serving SIZE bytes of 0xAB from a registered pool-like file."""

    def __init__(self, shm_dir: Path) -> None:
        path = pool_file(shm_dir, f"source-{time.monotonic_ns()}", b"\xab" * SIZE)
        code = textwrap.dedent(f"""
            import sys
            from ec_daemon.transport import MooncakeTransport
            t = MooncakeTransport("127.0.0.1")
            base = t.register("src", {str(path)!r}, {DATA_OFFSET}, {SIZE})
            print(t.endpoint, base, flush=True)
            sys.stdin.read()
        """)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert self.proc.stdout is not None
        endpoint, base = self.proc.stdout.readline().split()
        self.endpoint, self.base = endpoint, int(base)
        path.unlink()  # the mapping keeps the pages; the test dir holds one source at a time

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        self.proc.kill()
        self.proc.communicate(timeout=30)  # reaps it and closes the pipes


@pytest.fixture(scope="module")
def reader() -> Iterator[tuple[MooncakeTransport, Path]]:
    shm = new_shm_dir("ecd-transport-")
    target = pool_file(shm, "target", bytes(SIZE))
    transport = MooncakeTransport("127.0.0.1")
    transport.register(POOL, target, DATA_OFFSET, SIZE)
    yield transport, target
    transport.close()
    target.unlink()
    shm.rmdir()


def clear(target: Path) -> None:
    with target.open("r+b") as f:
        f.seek(DATA_OFFSET)
        f.write(bytes(SIZE))


def landed(target: Path) -> int:
    return SIZE - data_of(target).count(0)


@pytest.mark.fault_kind("transport source killed mid-read")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_a_read_from_a_source_killed_mid_transfer_fails_and_then_nothing_writes(
    reader: tuple[MooncakeTransport, Path], shm_dir: Path, trial: int
) -> None:
    transport, target = reader
    rng, replay = trial_rng("transport-kill", trial)
    source = Source(shm_dir)
    try:
        transport.read(source.endpoint, POOL, [Copy(source.base, 0, SIZE)]).result(30)  # warm
        clear(target)
        future = transport.read(source.endpoint, POOL, [Copy(source.base, 0, SIZE)])
        time.sleep(rng.uniform(0.0, 0.1))
        source.signal(signal.SIGKILL)
        killed = time.monotonic()

        try:
            future.result(timeout=30)
            record_tally("kill landed mid-read", False)  # the read won the race: fine, rare
        except TransportError:
            record_tally("kill landed mid-read", True)
            record_figure("seconds from source kill to failed read", time.monotonic() - killed)
        before = landed(target)
        time.sleep(0.3)
        assert landed(target) == before, f"bytes landed after the read was over; {replay}"
    finally:
        source.close()


def test_a_read_from_a_stalled_source_outlives_its_deadline_and_writes_until_done(
    reader: tuple[MooncakeTransport, Path], shm_dir: Path
) -> None:
    transport, target = reader
    source = Source(shm_dir)
    try:
        transport.read(source.endpoint, POOL, [Copy(source.base, 0, 4096)]).result(30)  # connect
        clear(target)
        future = transport.read(source.endpoint, POOL, [Copy(source.base, 0, SIZE)])
        time.sleep(0.02)
        source.signal(signal.SIGSTOP)
        with pytest.raises(FutureTimeout):
            future.result(timeout=1.0)  # a caller's deadline passes; the read goes on

        clear(target)
        source.signal(signal.SIGCONT)
        future.result(timeout=30)
        assert landed(target) > 0  # written after the caller had given up: hence quarantine
    finally:
        source.signal(signal.SIGCONT)
        source.close()
