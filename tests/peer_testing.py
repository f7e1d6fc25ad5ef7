"""Test support for daemons as peers (docs/design.md §13): transports, pool-like files, ports,
waits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ecd_testing import Daemon, running_daemon, wait_until

from ec_client import Client
from ec_daemon.spawn import free_port, peer_flags
from ec_daemon.transport import TransportError, mooncake_engine

DATA_OFFSET = 4096  # where a test "pool file" keeps its data region (a page, as mmap needs)


def mooncake_missing() -> str:
    """Why the Mooncake transfer engine cannot load here; empty when it can."""
    try:
        mooncake_engine()
    except TransportError as exc:
        return str(exc)
    return ""


needs_mooncake = pytest.mark.skipif(bool(mooncake_missing()), reason=mooncake_missing())


def pool_file(directory: Path, name: str, data: bytes) -> Path:
    """A file with a header page of zeros and then `data`, like a pool file's data region."""
    path = directory / name
    path.write_bytes(bytes(DATA_OFFSET) + data)
    return path


def data_of(path: Path) -> bytes:
    return path.read_bytes()[DATA_OFFSET:]


async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Wait (without blocking the event loop) until `predicate()` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)


def peer_args(me: str, addresses: list[str], *extra: str) -> tuple[str, ...]:
    """`ecd serve` arguments of a daemon on TCP `me` whose peers are the other `addresses`."""
    return (*peer_flags(me, addresses), "--max-bytes", "512MiB", "--lease-ttl", "2", *extra)


@contextlib.contextmanager
def peered_daemons(count: int, *extra: str) -> Iterator[list[Daemon]]:
    """`count` daemons on loopback, each its own shm directory and TCP port, each the peer of
    every other."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(count)]
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(running_daemon(*peer_args(me, addresses, *extra)))
            for me in addresses
        ]


def tcp_address(daemon: Daemon) -> str:
    return daemon.args[daemon.args.index("--tcp") + 1]


def wait_peers_synced(client: Client, count: int, timeout_s: float = 20.0) -> None:
    """Until the client's daemon follows `count` peers, each synced."""
    wait_until(lambda: [p.state for p in client.stats().peers].count("synced") == count, timeout_s)
