"""A daemon as a child process on a private socket and shm directory, for `ecd bench --spawn`
(a benchmark that brings its own daemon), or one that can be killed and started again on the
same directories (the restart suite). The test suite's harness (tests/ecd_testing.py) builds on
the same command line and readiness wait."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ec_client import check_health
from ec_protocol.errors import EcdError


def new_shm_dir(prefix: str = "ecd-") -> Path:
    """A private directory on /dev/shm (a tmpfs, as in production) when there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def serve_command(
    socket: Path, shm_dir: Path, args: Sequence[str], python: str = sys.executable
) -> list[str]:
    """`ecd serve` on this socket and shm directory, run by `python` (this interpreter)."""
    return [
        python,
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


class SpawnedDaemon:
    """A daemon child process on a private socket and shm directory that can be killed and
    started again on both (`ecd bench --suite restart`: a warm restart)."""

    def __init__(
        self, workdir: Path, shm_dir: Path, args: Sequence[str], env: dict[str, str] | None = None
    ) -> None:
        self.socket, self.log = workdir / "ecd.sock", workdir / "daemon.log"
        self.shm_dir = shm_dir
        self.args = tuple(args)
        self.env = env  # None: this process's
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("daemon was never started")
        return self.proc.pid

    def start(self) -> None:
        """Start the process; return at once (`wait_serving` waits for it)."""
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                serve_command(self.socket, self.shm_dir, self.args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
            )

    def wait_serving(self, timeout_s: float = 15.0) -> None:
        if self.proc is None:
            raise RuntimeError("daemon was never started")
        wait_serving(self.address, self.proc, timeout_s, self.log)

    def exited(self) -> str | None:
        """None while the process runs; else how it ended, with its log."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"daemon exited with {self.proc.returncode}:\n{_read(self.log)}"

    def kill(self) -> None:
        """SIGKILL, as a crash would end it; its pool files stay in the shm directory."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextmanager
def restartable_daemon(
    *args: str, prefix: str = "ecd-", cache_bytecode: bool = False
) -> Iterator[SpawnedDaemon]:
    """A daemon in fresh directories, not started yet; killed and cleaned up on exit.

    cache_bytecode: the bytecode of the modules it imports is cached in its work directory even
    where PYTHONDONTWRITEBYTECODE is set (as on the development VM), so that every start after
    the first imports them as an installed daemon does (pip compiles bytecode at install),
    instead of compiling them again (~0.2 s there): what a restart's timing should include."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    shm_dir = new_shm_dir(prefix)
    env = None
    if cache_bytecode:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(workdir / "bytecode")
    daemon = SpawnedDaemon(workdir, shm_dir, args, env)
    try:
        yield daemon
    finally:
        daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


@contextmanager
def spawned_daemon(*args: str, prefix: str = "ecd-") -> Iterator[str]:
    """A daemon in fresh directories; yields its address; killed and cleaned up on exit."""
    with restartable_daemon(*args, prefix=prefix) as daemon:
        daemon.start()
        daemon.wait_serving(15.0)
        yield daemon.address


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port
