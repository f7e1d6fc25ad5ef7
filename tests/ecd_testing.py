"""Test support: real daemons (ec_daemon.process) plus what tests ask of them.

Every test gets its own socket path and its own directory under /dev/shm, removed afterwards, so
tests never touch each other's files.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ec_client import Client
from ec_daemon.process import DaemonProcess, new_shm_dir, private_daemon

REPO = Path(__file__).resolve().parent.parent

__all__ = [
    "REPO",
    "Daemon",
    "assert_blocks_accounted",
    "new_shm_dir",
    "run_ecd",
    "run_python",
    "running_daemon",
]


Daemon = DaemonProcess


@contextmanager
def running_daemon(*args: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    with private_daemon(*args, env=env, prefix="ecd-test-") as daemon:
        yield daemon


def assert_blocks_accounted(client: Client, engine_id: str) -> None:
    """The block invariant seen from outside: free blocks + blocks of listed entries == all."""
    [pool] = client.stats(engine_id).pools
    held = sorted(e for entry in client.iter_entries(engine_id) for e in entry.extents)
    assert pool.free_blocks + sum(e.count for e in held) == pool.num_blocks
    for a, b in itertools.pairwise(held):
        assert a.start + a.count <= b.start, f"extents {a} and {b} overlap"


def run_ecd(
    *args: str, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the `ecd` command (`python -m ec_daemon ARGS`) as an operator would, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ec_daemon", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        check=check,
    )


def run_python(code: str, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a snippet in a fresh interpreter (a separate client process) and return its output."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=REPO,
        check=False,
    )
