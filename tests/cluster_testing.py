"""Test support for the cluster tier (docs/design.md §13): a real `mooncake_master` on loopback
(its own HTTP metadata server; every port free), the `ecd serve` flags that join it, and vLLM
0.33's own store client driven directly against it."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ecd_testing import Daemon, running_daemon, wait_until

from ec_client import Client, Producer
from ec_client.types import ClusterStats
from ec_daemon.spawn import free_port

# A shared pool as vLLM would name it: its namespace, rows of 2048 bf16 as blocks.
NAMESPACE = "embedding@model:test/llava@revision:default@encoder:e1@dtype:bfloat16@protocol:v3"
BLOCK = 4096
POOL: dict[str, Any] = dict(block_size_bytes=BLOCK, capacity_bytes=64 << 20, compat_key="llava")

# The mooncake extra installs it beside the interpreter (the venv's bin), on PATH or not.
MASTER_BINARY = str(Path(sys.executable).with_name("mooncake_master"))


@dataclass
class Master:
    """A `mooncake_master` on loopback; start/stop keep its ports, so a test can stop it and
    start it again where its clients look for it."""

    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(".log", "mc-master-")[1]))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def flags(self) -> tuple[str, ...]:
        """`ecd serve` flags that join this master (a small segment: tests move a few MiB)."""
        return (
            "--store-master", self.address, "--store-metadata", self.metadata,
            "--store-segment-bytes", "64MiB", "--transfer-host", "127.0.0.1",
        )  # fmt: skip

    def start(self, timeout_s: float = 20.0) -> Master:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    MASTER_BINARY,
                    f"--rpc_port={self.rpc_port}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.http_port}",
                    f"--metrics_port={self.admin_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        for port in (self.rpc_port, self.http_port):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"mooncake_master exited: {self.log_path.read_text()}")
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"mooncake_master not listening on {port}") from None
                    time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def running_master() -> Iterator[Master]:
    master = Master().start()
    try:
        yield master
    finally:
        master.stop()
        master.log_path.unlink(missing_ok=True)


@contextmanager
def store_daemon(master: Master, *args: str) -> Iterator[Daemon]:
    """A daemon in the store, stopped by SIGTERM at the end (it must exit 0): a daemon that
    leaves unmounts its segment, where a killed one leaves the master placing replicas in a
    segment nobody serves until its client TTL runs out."""
    with running_daemon(*master.flags(), *args) as daemon:
        yield daemon
        assert daemon.stop() == 0, daemon.log()


def cluster_stats(client: Client) -> ClusterStats:
    stats = client.stats().cluster
    assert stats is not None, "the daemon has no store"
    return stats


def published(client: Client) -> int:
    return cluster_stats(client).published


@contextmanager
def published_elsewhere(master: Master, tensors: dict[str, torch.Tensor]) -> Iterator[Daemon]:
    """Two daemons in the store: `tensors` put into the shared pool "shared" on one of them and
    published; yields the other one, which holds none of them."""
    with store_daemon(master) as near, store_daemon(master) as far, near.client() as producer:
        producer.open_pool("shared", **POOL, cluster_namespace=NAMESPACE)
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
