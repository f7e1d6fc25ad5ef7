"""A Mooncake master on loopback and daemons joined to its store, as child processes, for
`ecd bench --spawn --suite cluster` (ec_bench.bench_cluster). The cluster tests' harness
(tests/cluster_testing.py) starts its master with the same command line and readiness wait."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.tools.spawn import SpawnedDaemon, free_port, restartable_daemon

# The mooncake extra installs it beside the interpreter (the venv's bin), on PATH or not.
MASTER_BINARY = str(Path(sys.executable).with_name("mooncake_master"))


def master_command(
    rpc_port: int,
    http_port: int,
    metrics_port: int,
    binary: str = MASTER_BINARY,
    host: str = "127.0.0.1",
) -> list[str]:
    """`mooncake_master` (`binary`) on `host` (loopback unless given) with its own HTTP metadata
    server. Every listener is given its address, and all but one bind it: Mooncake 0.3's
    metadata server ignores its host and listens on every address (docs/operations.md, Several
    nodes)."""
    return [
        binary,
        f"--rpc_port={rpc_port}",
        f"--rpc_address={host}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
    ]


def wait_listening(
    proc: subprocess.Popen[bytes], ports: Sequence[int], timeout_s: float, log: Path
) -> None:
    """Return once every loopback port accepts a connection; RuntimeError (with the process's
    log) if it exits first or a port is not listening within timeout_s."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"exited with {proc.returncode}: {log.read_text(errors='replace')}"
                )
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"not listening on {port}: {log.read_text(errors='replace')}"
                    ) from None
                time.sleep(0.05)


def _text(log: Path) -> str:
    return log.read_text(errors="replace")


@dataclass
class MasterAddress:
    """Where a `mooncake_master` answers: on loopback, unless a subclass gives it a `host` (the
    cluster tests' test hosts, tests/hosts_testing.py)."""

    rpc_port: int
    http_port: int
    host = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def store_flags(self, segment: str, transfer_host: str = "127.0.0.1") -> list[str]:
        """`ecd serve` flags that join this master, lending it `segment` (a size), from a node
        the other nodes reach at `transfer_host`."""
        return [
            "--store-master", self.address, "--store-metadata", self.metadata,
            "--store-segment-bytes", segment, "--transfer-host", transfer_host,
        ]  # fmt: skip


@dataclass
class SpawnedMaster(MasterAddress):
    """A `mooncake_master` child process on loopback, its metrics (its own counters of the calls
    it answered) on `metrics_port`."""

    metrics_port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the master was never started")
        return self.proc.pid

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                master_command(self.rpc_port, self.http_port, self.metrics_port),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_listening(
            self.proc, (self.rpc_port, self.http_port, self.metrics_port), 20.0, self.log
        )

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """SIGKILL it and start it again on its ports: a master with an empty directory."""
        self.kill()
        self.start()


@contextmanager
def spawned_master(prefix: str = "ecd-") -> Iterator[SpawnedMaster]:
    """A Mooncake master on free loopback ports; killed and cleaned up on exit."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    master = SpawnedMaster(free_port(), free_port(), free_port(), workdir / "master.log")
    try:
        master.start()
        yield master
    finally:
        master.kill()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def spawned_store_daemons(
    master: SpawnedMaster, segments: Sequence[str], *args: str, prefix: str = "ecd-"
) -> Iterator[list[SpawnedDaemon]]:
    """A daemon joined to `master` for each of `segments`, lending it that much ("0": none);
    serving when yielded."""
    with contextlib.ExitStack() as stack:
        daemons = []
        for segment in segments:
            daemon = stack.enter_context(
                restartable_daemon(*master.store_flags(segment), *args, prefix=prefix)
            )
            daemon.start()
            daemon.wait_serving(30.0)
            daemons.append(daemon)
        yield daemons
