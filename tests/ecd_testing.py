"""Test support: real daemons as child processes, plus what tests ask of them.

Every test gets its own socket path and its own directory under /dev/shm, removed afterwards, so
tests never touch each other's files. A Daemon keeps its socket and shm directory across
stop/kill/restart, so tests can kill it and start it again on the same pools.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ec_client import Client
from ec_client.data.mapping import PoolMapping
from ec_daemon.tools import spawn
from ec_daemon.tools.spawn import serve_command, wait_serving
from ec_protocol.pool import slot_locks
from ec_protocol.pool.layout import RecordFields, read_record

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ARGS = ("--max-bytes", "256MiB", "--lease-ttl", "2", "--log-level", "debug")

__all__ = [
    "REPO",
    "Daemon",
    "assert_blocks_accounted",
    "auth_args",
    "count_record_parses",
    "new_shm_dir",
    "run_ecd",
    "run_python",
    "running_daemon",
    "wait_until",
]

# Every shm directory the tests made (`new_shm_dir`): the session fails if one outlives it
# (tests/conftest.py), since nothing else would notice a test that forgets to remove its own.
SHM_DIRS_MADE: list[Path] = []


def new_shm_dir(prefix: str = "ecd-") -> Path:
    """A private directory on /dev/shm (ec_daemon.tools.spawn.new_shm_dir), which the test
    removes."""
    path = spawn.new_shm_dir(prefix)
    SHM_DIRS_MADE.append(path)
    return path


def daemon_environ() -> dict[str, str]:
    """What a test's daemon inherits of this process's environment: all but the ECD_ variables.
    A daemon reads every ECD_ variable as a setting (and warns of one it does not know), so a
    developer's own settings, or the suites' knobs (ECD_E2E_JSON, ECD_FAULT_SEED, ...), would
    change what a test sees; a test gives its daemon settings by its flags and `env` alone."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ECD_")}


@dataclass
class Daemon:
    """One daemon; start/stop/kill/restart keep its socket path and shm directory."""

    workdir: Path
    shm_dir: Path
    args: tuple[str, ...] = DEFAULT_ARGS
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    python: str = sys.executable  # the interpreter that runs `ecd serve`
    launcher: tuple[str, ...] = ()  # what runs it: e.g. `ip netns exec NS` (tests/hosts_testing.py)

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
        return [*self.launcher, *serve_command(self.socket, self.shm_dir, self.args, self.python)]

    def start(self, timeout_s: float = 15.0, wait: bool = True) -> Daemon:
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**daemon_environ(), **self.env},
            )
        if wait:
            self.wait_serving(timeout_s)
        return self

    def wait_serving(self, timeout_s: float = 15.0) -> None:
        if self.proc is None:
            raise RuntimeError("daemon was never started")
        wait_serving(self.address, self.proc, timeout_s, self.log_path)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.proc is None:
            raise RuntimeError("daemon was never started")
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


def auth_args(directory: Path, tokens: dict[str, str], acl: str) -> tuple[str, ...]:
    """A daemon's arguments for these tokens (name -> token) and this access list (TOML), written
    into `directory`."""
    token_file = directory / "tokens"
    token_file.write_text("".join(f"{name} {token}\n" for name, token in tokens.items()))
    token_file.chmod(0o600)
    acl_file = directory / "acl.toml"
    acl_file.write_text(acl)
    return ("--token-file", str(token_file), "--acl-file", str(acl_file))


@contextmanager
def running_daemon(
    *args: str,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    launcher: tuple[str, ...] = (),
) -> Iterator[Daemon]:
    """A daemon in fresh directories (run by `python`, through `launcher` if given), killed and
    cleaned up on exit."""
    workdir = Path(tempfile.mkdtemp(prefix="ecd-test-"))
    shm_dir = new_shm_dir("ecd-test-")
    daemon = Daemon(
        workdir, shm_dir, args or DEFAULT_ARGS, env or {}, python=python, launcher=launcher
    )
    try:
        yield daemon.start()
    finally:
        if daemon.running:
            daemon.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)


def unmap_pools() -> None:
    """Close every pool mapping this process holds, so that their memory goes back to the tmpfs
    (and a mount of it can be taken down). Reads PoolMapping's own registry: only tests need to
    walk it."""
    with PoolMapping._lock:
        mappings = [m for key, m in PoolMapping._shared.items() if key[0] == os.getpid()]
    for mapping in mappings:
        mapping.close()


def assert_blocks_accounted(client: Client, engine_id: str) -> None:
    """The block invariant seen from outside: free blocks + blocks of listed entries + blocks
    of removed entries not free yet (`held_blocks`) == all."""
    [pool] = client.stats(engine_id).pools
    held = sorted(e for entry in client.iter_entries(engine_id) for e in entry.extents)
    assert pool.free_blocks + sum(e.count for e in held) + pool.held_blocks == pool.num_blocks
    for a, b in itertools.pairwise(held):
        assert a.start + a.count <= b.start, f"extents {a} and {b} overlap"


def run_ecd(
    *args: str, env: dict[str, str] | None = None, check: bool = False, timeout_s: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run the `ecd` command (`python -m ec_daemon ARGS`) as an operator would, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ec_daemon", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        check=check,
    )


def run_python(code: str, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a snippet in a fresh interpreter (a separate client process) and return its output."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_python_env(),
        cwd=REPO,
        check=False,
    )


@contextmanager
def python_killed_after(code: str, ready: str) -> Iterator[None]:
    """A snippet running in a fresh interpreter (a separate client process), once it printed the
    line `ready`; SIGKILLed when the block ends, as a process that dies mid-work."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=_python_env(), cwd=REPO
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == ready
        yield
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `predicate` (e.g. a Watch event reaching another client's view) until it holds;
    AssertionError if it does not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout_s} s")
        time.sleep(0.005)


def count_record_parses(monkeypatch: Any) -> list[bytes]:
    """From now on, the key of every slot record lock pins parse, in order (b"" for bytes that
    hold no whole record): to tell a pin that parsed from one that found a record it checked."""
    parsed: list[bytes] = []

    def counting(raw: bytes) -> RecordFields | None:
        fields = read_record(raw)
        parsed.append(fields[0] if fields else b"")
        return fields

    monkeypatch.setattr(slot_locks, "read_record", counting)
    return parsed
