"""A daemon as a child process on a private socket and shm directory, for `ecd bench --spawn`
(a benchmark that brings its own daemon). The test suite's harness (tests/ecd_testing.py) builds
on the same command line and readiness wait."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ec_client import EcdError, check_health


def new_shm_dir(prefix: str = "ecd-") -> Path:
    """A private directory on /dev/shm (a tmpfs, as in production) when there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def serve_command(socket: Path, shm_dir: Path, args: Sequence[str]) -> list[str]:
    """`ecd serve` on this socket and shm directory, run by this interpreter."""
    return [
        sys.executable,
        "-m",
        "ec_daemon",
        "serve",
        "--socket",
        str(socket),
        "--shm-dir",
        str(shm_dir),
        *args,
    ]


def wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    """Return once the daemon answers SERVING; RuntimeError with its log if it exits first,
    TimeoutError if it is not serving within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}:\n{_read(log)}")
        try:
            if check_health(address, timeout_s=0.5) == "SERVING":
                return
        except EcdError:
            pass  # not bound, or bound but not serving yet
        time.sleep(0.05)
    raise TimeoutError(f"daemon not SERVING after {timeout_s} s:\n{_read(log)}")


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


@contextmanager
def spawned_daemon(*args: str, prefix: str = "ecd-") -> Iterator[str]:
    """A daemon in fresh directories; yields its address; killed and cleaned up on exit."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    shm_dir = new_shm_dir(prefix)
    socket, log = workdir / "ecd.sock", workdir / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            serve_command(socket, shm_dir, args), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        address = f"unix://{socket}"
        wait_serving(address, proc, 15.0, log)
        yield address
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
