"""Test support for daemons as peers (DESIGN §13): transports, pool-like files, ports, waits."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Wait (without blocking the event loop) until `predicate()` holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)
