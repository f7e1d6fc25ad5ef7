"""Test support for a store with several masters (docs/design.md §13, docs/operations.md, A
store with several masters): a real etcd on loopback and real `mooncake_master`s that elect a
leader through it, each on its own free ports, and the `ecd serve` flags that follow the
leader."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster_testing import MASTER_BINARY
from ecd_testing import wait_until

from ec_daemon.tools.spawn import free_port
from ec_daemon.tools.spawn_store import wait_listening

ETCD_BINARY = shutil.which("etcd") or "/usr/bin/etcd"  # Debian's etcd-server

needs_etcd = pytest.mark.skipif(
    not Path(ETCD_BINARY).exists(), reason=f"no etcd at {ETCD_BINARY} (Debian's etcd-server)"
)


@dataclass
class Etcd:
    """One etcd member on loopback, its data in a directory of its own."""

    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ecd-etcd-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> Etcd:
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        log = self.workdir / "etcd.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    ETCD_BINARY, "--name", "ecd-test", "--data-dir", str(self.workdir / "data"),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"ecd-test={peer}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_listening(self.proc, (self.client_port,), 20.0, log)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class HAMaster:
    """A `mooncake_master` that stands for the lead through etcd and replicates the directory
    to the others (its oplog); its RPC port listens only while it leads."""

    etcd: str  # HOST:PORT
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(".log", "mc-ha-")[1]))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> HAMaster:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    MASTER_BINARY, "--enable_ha=true", f"--etcd_endpoints={self.etcd}",
                    "--enable_oplog=true", "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_listening(self.proc, (self.metrics_port,), 20.0, self.log_path)
        return self

    def listening(self) -> bool:
        """Whether it serves: its RPC port accepts a connection (only while it leads)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            socket.create_connection(("127.0.0.1", self.rpc_port), 0.5).close()
        except OSError:
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class HAStore:
    """etcd and the masters standing for the lead through it."""

    etcd: Etcd
    masters: list[HAMaster]

    @property
    def address(self) -> str:
        """--store-master for the daemons: the etcd endpoints."""
        return f"etcd://{self.etcd.endpoint}"

    def flags(self) -> tuple[str, ...]:
        """`ecd serve` flags that join the store and follow its leader (no metadata server: the
        nodes' transfer engines exchange their segments' descriptors themselves)."""
        return (
            "--store-master", self.address, "--store-metadata", "P2PHANDSHAKE",
            "--store-segment-bytes", "64MiB", "--transfer-host", "127.0.0.1",
        )  # fmt: skip

    def leader(self) -> HAMaster:
        """The master that leads and serves now (waited for): the one whose RPC port listens."""
        serving: list[HAMaster] = []

        def found() -> bool:
            serving[:] = [m for m in self.masters if m.listening()]
            return len(serving) == 1

        wait_until(found, 40)
        return serving[0]


@contextmanager
def running_etcd() -> Iterator[Etcd]:
    """etcd on loopback, killed and its data removed at the end."""
    etcd = Etcd()
    try:
        yield etcd.start()
    finally:
        etcd.stop()


@contextmanager
def running_ha_store(masters: int = 2) -> Iterator[HAStore]:
    """etcd and `masters` masters on loopback, one of them leading and serving; all of it killed
    and removed at the end."""
    with ExitStack() as stack:
        etcd = stack.enter_context(running_etcd())
        started = []
        for _ in range(masters):
            master = HAMaster(etcd.endpoint)
            stack.callback(master.log_path.unlink, missing_ok=True)
            stack.callback(master.kill)
            started.append(master.start())
        store = HAStore(etcd, started)
        store.leader()
        yield store
