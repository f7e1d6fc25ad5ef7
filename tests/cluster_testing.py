"""Test support for the cluster tier (docs/design.md §13): a real `mooncake_master` on loopback
(its own HTTP metadata server; every port free), the `ecd serve` flags that join it, and vLLM
0.33's own store client driven directly against it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
from ecd_testing import Daemon, running_daemon, wait_until
from prometheus_client.parser import text_string_to_metric_families

from ec_client import Client, Producer
from ec_daemon.cluster.mooncake import INSTALL_HINT
from ec_daemon.tools.spawn import free_port
from ec_daemon.tools.spawn_store import (
    MASTER_BINARY as MASTER_BINARY,  # where the tests look for it
)
from ec_daemon.tools.spawn_store import MasterAddress, master_command, wait_listening
from ec_protocol.types import ClusterStats, PoolStats

# A shared pool as vLLM would name it: its namespace, rows of 2048 bf16 as blocks.
NAMESPACE = "embedding@model:test/llava@revision:default@encoder:e1@dtype:bfloat16@protocol:v3"
BLOCK = 4096
POOL: dict[str, Any] = dict(block_size_bytes=BLOCK, capacity_bytes=64 << 20, compat_key="llava")


def mooncake_missing() -> str:
    """Why the Mooncake Store client cannot load here; empty when it can."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake Store client cannot be loaded ({exc}): {INSTALL_HINT}"
    return ""


needs_mooncake = pytest.mark.skipif(bool(mooncake_missing()), reason=mooncake_missing())


@dataclass
class Master(MasterAddress):
    """A `mooncake_master` on loopback; start/stop keep its ports, so a test can stop it and
    start it again where its clients look for it."""

    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    args: tuple[str, ...] = ()  # more of mooncake_master's flags
    binary: str = MASTER_BINARY
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(".log", "mc-master-")[1]))
    launcher: tuple[str, ...] = ()  # what runs it: e.g. `ip netns exec NS` (tests/hosts_testing.py)

    def flags(self, transfer_host: str = "127.0.0.1") -> tuple[str, ...]:
        """`ecd serve` flags that join this master (a small segment: tests move a few MiB) from a
        node the others reach at `transfer_host`."""
        return tuple(self.store_flags("64MiB", transfer_host))

    def start(self, timeout_s: float = 20.0) -> Master:
        command = master_command(
            self.rpc_port, self.http_port, self.admin_port, self.binary, self.host
        )
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.launcher, *command, *self.args], stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_listening(timeout_s)
        return self

    def wait_listening(self, timeout_s: float) -> None:
        assert self.proc is not None
        wait_listening(self.proc, (self.rpc_port, self.http_port), timeout_s, self.log_path)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def running_master(*args: str, binary: str = MASTER_BINARY) -> Iterator[Master]:
    with started(Master(args=args, binary=binary)) as master:
        yield master


@contextmanager
def started(master: Master) -> Iterator[Master]:
    """`master` started, then killed and its log removed on exit."""
    master.start()
    try:
        yield master
    finally:
        master.stop()
        master.log_path.unlink(missing_ok=True)


class Joinable(Protocol):
    """A store as a daemon joins it: a Master, or several (ha_testing.HAStore)."""

    def flags(self) -> tuple[str, ...]: ...


@contextmanager
def store_daemon(
    master: Joinable, *args: str, env: dict[str, str] | None = None, python: str = sys.executable
) -> Iterator[Daemon]:
    """A daemon in the store (run by `python`, with `env` added to its environment), stopped by
    SIGTERM at the end (it must exit 0): a daemon that leaves unmounts its segment, where a
    killed one leaves the master placing replicas in a segment nobody serves until its client
    TTL runs out."""
    with running_daemon(*master.flags(), *args, env=env, python=python) as daemon:
        yield daemon
        assert daemon.stop() == 0, daemon.log()


# Shifts a process's wall clock (the Debian package libfaketime): a node whose clock is off.
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
needs_faketime = pytest.mark.skipif(
    not FAKETIME.exists(),
    reason=f"libfaketime is not installed ({FAKETIME} is missing: apt-get install libfaketime)",
)


def skewed_clock(offset: str) -> dict[str, str]:
    """A daemon's environment for a wall clock `offset` ("+60s", "-60s") off this machine's; its
    monotonic clock left as it is, as a node's is whatever its wall clock says."""
    return {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def clock_offset(daemon: Daemon) -> float:
    """How far ahead of this process's wall clock the daemon's runs (negative: behind), as the
    timestamp of its last log record tells (`ts=...Z`, written a moment ago: a little less
    than the offset)."""
    stamps = [line.split()[0] for line in daemon.log().splitlines() if line.startswith("ts=")]
    logged = datetime.fromisoformat(stamps[-1].removeprefix("ts=").replace("Z", "+00:00"))
    return logged.timestamp() - time.time()


def cluster_stats(client: Client) -> ClusterStats:
    stats = client.stats().cluster
    assert stats is not None, "the daemon has no store"
    return stats


def published(client: Client) -> int:
    return cluster_stats(client).published


def commits_published(stats: ClusterStats) -> int:
    """Commits published: what the node published less what it published again (a republish
    after the store lost its directory)."""
    return stats.published - stats.republished


def settled(stats: ClusterStats) -> int:
    """Publishes of commits that ended, either way (and republishes that failed)."""
    return commits_published(stats) + stats.publish_failures


def scrape(port: int) -> dict[str, float]:
    """The cluster's metrics (`ecd_cluster_*`) of the daemon whose metrics port is `port`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ecd_cluster_")
    }


def pool_stats(client: Client, engine_id: str) -> PoolStats:
    [stats] = client.stats(engine_id).pools
    return stats


@contextmanager
def published_elsewhere(
    master: Master, tensors: dict[str, torch.Tensor], pool: dict[str, Any] = POOL
) -> Iterator[Daemon]:
    """Two daemons in the store: `tensors` put into the shared pool "shared" (opened with
    `pool`) on one of them and published; yields the other one, which holds none of them."""
    with store_daemon(master) as near, store_daemon(master) as far, near.client() as producer:
        producer.open_pool("shared", **pool, cluster_namespace=NAMESPACE)
        Producer(producer, "shared").put_many(tensors)
        wait_until(lambda: published(producer) == len(tensors), 20)
        yield far


def store_client(master: Master) -> Any:
    """A plain Mooncake Store client joined to `master` (close it when done)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    ret = store.setup("127.0.0.1", master.metadata, 64 << 20, 64 << 20, "tcp", "", master.address)
    assert ret == 0, f"setup answered {ret}"
    return store


def vllm_store_client(master: Master) -> Any:
    """vLLM 0.33's own encoder-cache store client (`MooncakeEmbeddingStoreClient`), around a
    store client joined to `master` as vLLM's `create_mooncake_embedding_store_client` joins it
    (that function reads its settings from a file named by the environment: the same calls
    here, with this master's addresses)."""
    from mooncake.store import ObjectDataType, ReplicateConfig
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.store_client import (
        MooncakeEmbeddingStoreClient,
    )

    store = store_client(master)
    config = ReplicateConfig()
    config.data_type = ObjectDataType.TENSOR
    return MooncakeEmbeddingStoreClient(store, replicate_config=config, read_buffer_bytes=32 << 20)


class BufferlessStore:
    """The calls of a store client (ec_daemon.cluster.mooncake.StoreClient) that a fake of it in
    memory answers as done: registering buffers, closing."""

    def register_buffer(self, address: int, length: int) -> int:
        return 0

    def unregister_buffer(self, address: int) -> int:
        return 0

    def close(self) -> int:
        return 0
