"""Test support: a real `ecd serve` process on a private socket and shm directory.

Every test gets its own socket path and its own directory under /dev/shm (a tmpfs, as in
production), removed afterwards, so tests never touch each other's files.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ec_client import Client
from ec_client._connection import Options
from ec_client.client import check_health, shared_channel
from ec_client.errors import EcdError
from ec_client.types import Role

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARGS = ("--max-bytes", "256MiB", "--lease-ttl", "2", "--log-level", "debug")


def new_shm_dir(prefix: str = "ecd-test-") -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@dataclass
class Daemon:
    """One daemon process; start/stop/kill/restart keep its socket and shm directory."""

    workdir: Path
    shm_dir: Path
    args: tuple[str, ...] = DEFAULT_ARGS
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def socket(self) -> Path:
        return self.workdir / "ecd.sock"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"daemon-{self.starts}.log"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ec_daemon",
            "serve",
            "--socket",
            str(self.socket),
            "--shm-dir",
            str(self.shm_dir),
            *self.args,
        ]

    def start(self, timeout_s: float = 15.0, wait: bool = True) -> Daemon:
        self.starts += 1
        env = {**os.environ, **self.env}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )
        if wait:
            self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        options = Options.make(self.address, "probe", Role.ADMIN, 0.5, 0.5, None)
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    if check_health(shared_channel(self.address), options) == "SERVING":
                        return
                except EcdError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"daemon not SERVING after {timeout_s} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)

    def restart(self, sig: int = signal.SIGKILL) -> Daemon:
        self.stop(sig)
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kwargs: Any) -> Client:
        kwargs.setdefault("name", "test")
        return Client(self.address, **kwargs)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


def assert_blocks_accounted(client: Client, engine_id: str) -> None:
    """The block invariant seen from outside: free blocks + blocks of listed entries == all."""
    [pool] = client.stats(engine_id).pools
    held = sorted(e for entry in client.iter_entries(engine_id) for e in entry.extents)
    assert pool.free_blocks + sum(e.count for e in held) == pool.num_blocks
    for a, b in itertools.pairwise(held):
        assert a.start + a.count <= b.start, f"extents {a} and {b} overlap"


@contextmanager
def running_daemon(*args: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    workdir = Path(tempfile.mkdtemp(prefix="ecd-run-"))
    shm_dir = new_shm_dir()
    daemon = Daemon(workdir, shm_dir, args or DEFAULT_ARGS, env or {})
    try:
        yield daemon.start()
    finally:
        if daemon.running:
            daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


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
