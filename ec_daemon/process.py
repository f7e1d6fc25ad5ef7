"""A daemon as a child process on a private socket and shm directory.

Used by `ecd bench --spawn` (a benchmark that brings its own daemon) and by the test suite, which
starts, kills and restarts real daemons.
"""

from __future__ import annotations

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

from ec_client import Client
from ec_client._connection import Options
from ec_client.client import check_health, shared_channel
from ec_client.errors import EcdError
from ec_client.types import Role

DEFAULT_ARGS = ("--max-bytes", "256MiB", "--lease-ttl", "2", "--log-level", "debug")


def new_shm_dir(prefix: str = "ecd-") -> Path:
    """A private directory on /dev/shm (a tmpfs, as in production) when there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@dataclass
class DaemonProcess:
    """One daemon; start/stop/kill/restart keep its socket path and shm directory."""

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

    def start(self, timeout_s: float = 15.0, wait: bool = True) -> DaemonProcess:
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        if wait:
            self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        options = Options.make(self.address, "probe", Role.ADMIN, 0.5, 0.5, None)
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"daemon exited with {code}:\n{self.log()}")
            if self.socket.exists():
                try:
                    if check_health(shared_channel(options), options) == "SERVING":
                        return
                except EcdError:
                    pass  # bound but not serving yet
            time.sleep(0.05)
        raise TimeoutError(f"daemon not SERVING after {timeout_s} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None:
            raise RuntimeError("daemon was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def kill(self) -> int:
        return self.stop(signal.SIGKILL)

    def restart(self, sig: int = signal.SIGKILL) -> DaemonProcess:
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


@contextmanager
def private_daemon(
    *args: str, env: dict[str, str] | None = None, prefix: str = "ecd-"
) -> Iterator[DaemonProcess]:
    """A daemon in fresh directories, killed and cleaned up on exit."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    shm_dir = new_shm_dir(prefix)
    daemon = DaemonProcess(workdir, shm_dir, args or DEFAULT_ARGS, env or {})
    try:
        yield daemon.start()
    finally:
        if daemon.running:
            daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
