"""Test support for daemons as peers (docs/design.md §13): transports, pool-like files, ports,
waits."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

import pytest
from ecd_testing import Daemon, running_daemon, wait_until

from ec_client import Client
from ec_daemon.peers import PeerDirectory
from ec_daemon.spawn import free_port, peer_flags
from ec_daemon.transport import Copy, MappedRegions, TransportError, mooncake_engine

DATA_OFFSET = 4096  # where a test "pool file" keeps its data region (a page, as mmap needs)


def mooncake_missing() -> str:
    """Why the Mooncake transfer engine cannot load here; empty when it can."""
    try:
        mooncake_engine()
    except TransportError as exc:
        return str(exc)
    return ""


needs_mooncake = pytest.mark.skipif(bool(mooncake_missing()), reason=mooncake_missing())


class LocalCopyTransport:
    """A Transport between transports of this process, for tests of whoever drives a pull:
    copies with memmove; reads are done when `read` returns. A read from a closed or unknown
    endpoint, or from an address the peer does not serve, fails as it would with an engine."""

    _live: ClassVar[dict[str, LocalCopyTransport]] = {}
    _numbers: ClassVar[Iterator[int]] = itertools.count(1)

    def __init__(self) -> None:
        self._endpoint = f"local:{next(self._numbers)}"
        self._regions = MappedRegions()
        self._live[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, engine_id: str, path: Path, offset: int, length: int) -> int:
        return self._regions.map(engine_id, path, offset, length).address

    def unregister(self, engine_id: str) -> None:
        self._regions.retire(engine_id)

    def read(
        self, peer_endpoint: str, local_engine_id: str, copies: Sequence[Copy]
    ) -> Future[None]:
        pieces = self._regions.pieces(local_engine_id, copies)
        future: Future[None] = Future()
        peer = self._live.get(peer_endpoint)
        if peer is None or not all(
            peer._regions.serves(p.remote_address, p.length) for p in pieces
        ):
            future.set_exception(
                TransportError(f"{peer_endpoint} serves no such region (closed, or unregistered)")
            )
            return future
        for p in pieces:
            ctypes.memmove(p.local_address, p.remote_address, p.length)
        future.set_result(None)
        return future

    def close(self) -> None:
        self._live.pop(self._endpoint, None)
        self._regions.unmap_all()


def holders(directory: PeerDirectory, engine_id: str, key: bytes) -> list[str]:
    """The addresses of the peers the directory knows to hold `key` READY in their pool
    `engine_id` (one that was attached, as a follower attaches every pool it hears of)."""
    return [holding.address for holding in directory.holdings(engine_id, key)]


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
