"""Transports: planning an entry's copies, and reading between two transports in this process
(LocalCopyTransport, and Mooncake over loopback TCP when it is installed)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import pytest
from ecd_testing import run_python
from hypothesis import given
from hypothesis import strategies as st
from peer_testing import DATA_OFFSET, LocalCopyTransport, data_of, needs_mooncake, pool_file

from ec_client import Extent
from ec_daemon import transport as transport_module
from ec_daemon.transport import (
    Copy,
    MooncakeTransport,
    Transport,
    TransportError,
    plan_copies,
)

BLOCK = 4096


def test_the_daemon_loads_the_mooncake_engine_only_when_it_makes_a_mooncake_transport() -> None:
    done = run_python("import sys, ec_daemon.transport; assert 'mooncake' not in sys.modules")
    assert done.returncode == 0, done.stderr


# ---- planning ------------------------------------------------------------------------------------


def test_an_entry_in_one_extent_on_each_side_is_one_copy() -> None:
    copies = plan_copies(1 << 40, [Extent(3, 4)], [Extent(10, 4)], BLOCK, 4 * BLOCK - 100)
    assert copies == [Copy((1 << 40) + 3 * BLOCK, 10 * BLOCK, 4 * BLOCK - 100)]


def test_extents_that_touch_merge_into_one_copy() -> None:
    copies = plan_copies(
        0, [Extent(0, 2), Extent(2, 2)], [Extent(5, 1), Extent(6, 3)], BLOCK, 4 * BLOCK
    )
    assert copies == [Copy(0, 5 * BLOCK, 4 * BLOCK)]


def test_extents_holding_fewer_bytes_than_the_entry_are_refused() -> None:
    with pytest.raises(ValueError, match="hold fewer than"):
        plan_copies(0, [Extent(0, 1)], [Extent(0, 2)], BLOCK, BLOCK + 1)


def scattered(total: int) -> st.SearchStrategy[list[Extent]]:
    """Extents of `total` blocks in all, in a shuffled order, apart from each other."""
    sizes = st.lists(st.integers(1, 4), min_size=1).filter(lambda s: sum(s) <= total)

    def place(counts: list[int]) -> st.SearchStrategy[list[Extent]]:
        counts = [*counts, total - sum(counts)] if sum(counts) < total else counts
        extents, start = [], 0
        for count in counts:
            extents.append(Extent(start, count))
            start += count + 1  # a gap, so no two extents touch
        return st.permutations(extents)

    return sizes.flatmap(place)


@given(st.data())
def test_planned_copies_move_every_byte_of_the_entry_to_its_place(data: st.DataObject) -> None:
    block, blocks = 8, data.draw(st.integers(1, 12))
    nbytes = data.draw(st.integers((blocks - 1) * block + 1, blocks * block))
    remote, local = data.draw(scattered(blocks)), data.draw(scattered(blocks))
    entry = data.draw(st.binary(min_size=nbytes, max_size=nbytes))
    remote_pool, local_pool = bytearray(64 * block), bytearray(64 * block)
    offsets = [e.start * block + i for e in remote for i in range(e.count * block)][:nbytes]
    for position, offset in enumerate(offsets):
        remote_pool[offset] = entry[position]

    copies = plan_copies(0, remote, local, block, nbytes)
    for c in copies:
        local_pool[c.local_offset : c.local_offset + c.length] = remote_pool[
            c.remote_address : c.remote_address + c.length
        ]

    read_back = bytes(
        local_pool[e.start * block + i] for e in local for i in range(e.count * block)
    )
    assert read_back[:nbytes] == entry
    assert sum(c.length for c in copies) == nbytes
    for a, b in itertools.pairwise(copies):  # merged wherever both sides touch
        assert not (
            a.remote_address + a.length == b.remote_address
            and a.local_offset + a.length == b.local_offset
        )


# ---- reading ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["local", pytest.param("mooncake", marks=needs_mooncake)])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    """A source transport and a reading one. Mooncake's pair is shared by the module: starting
    and stopping an engine takes about a second."""
    if request.param == "local":
        source: Transport = LocalCopyTransport()
        reader: Transport = LocalCopyTransport()
    else:
        source, reader = MooncakeTransport("127.0.0.1"), MooncakeTransport("127.0.0.1")
    yield source, reader
    source.close()
    reader.close()


@dataclass
class Pools:
    """A pool named `name` registered on both sides: the source's holds `payload` from address
    `base`, the reader's is the file `target`."""

    source: Transport
    reader: Transport
    name: str
    payload: bytes
    base: int
    target: Path

    def read(self, copies: list[Copy]) -> Future[None]:
        return self.reader.read(self.source.endpoint, self.name, copies)


@pytest.fixture
def pools(pair: tuple[Transport, Transport], shm_dir: Path) -> Iterator[Callable[..., Pools]]:
    made: list[Pools] = []

    def make(payload: bytes, target_len: int | None = None) -> Pools:
        source, reader = pair
        name = f"pool-{uuid.uuid4().hex[:8]}"
        base = source.register(name, pool_file(shm_dir, "src", payload), DATA_OFFSET, len(payload))
        target = pool_file(shm_dir, "dst", bytes(target_len or len(payload)))
        reader.register(name, target, DATA_OFFSET, target_len or len(payload))
        made.append(Pools(source, reader, name, payload, base, target))
        return made[-1]

    yield make
    for p in made:
        for side in (p.source, p.reader):
            with contextlib.suppress(ValueError):  # unregistered by the test itself
                side.unregister(p.name)


def test_a_read_lands_the_entry_bit_identical(pools: Callable[..., Pools]) -> None:
    p = pools(os.urandom(64 * BLOCK))
    # blocks 0-39 land at 20-59 (one copy), blocks 40-49 at 0-9
    local = [Extent(20, 40), Extent(0, 10)]
    copies = plan_copies(p.base, [Extent(0, 50)], local, BLOCK, 50 * BLOCK)
    assert len(copies) == 2

    p.read(copies).result(timeout=30)

    landed = data_of(p.target)
    assert hashlib.sha256(landed[20 * BLOCK : 60 * BLOCK] + landed[: 10 * BLOCK]).digest() == (
        hashlib.sha256(p.payload[: 50 * BLOCK]).digest()
    )


def test_concurrent_reads_all_land(pools: Callable[..., Pools]) -> None:
    p = pools(os.urandom(16 * BLOCK))
    futures = [p.read([Copy(p.base + i * BLOCK, i * BLOCK, BLOCK)]) for i in range(16)]
    done, _ = wait(futures, timeout=30)

    assert len(done) == 16 and all(f.exception() is None for f in futures)
    assert data_of(p.target) == p.payload


def test_a_read_of_a_pool_the_peer_no_longer_serves_fails(pools: Callable[..., Pools]) -> None:
    p = pools(bytes(BLOCK))
    p.source.unregister(p.name)

    with pytest.raises(TransportError):
        p.read([Copy(p.base, 0, BLOCK)]).result(timeout=30)


def test_a_read_from_an_endpoint_nobody_serves_fails(pools: Callable[..., Pools]) -> None:
    p = pools(bytes(BLOCK))
    nobody = "local:0" if isinstance(p.reader, LocalCopyTransport) else "127.0.0.1:1"

    with pytest.raises(TransportError):
        p.reader.read(nobody, p.name, [Copy(p.base, 0, BLOCK)]).result(timeout=30)


def test_a_copy_leaving_the_local_region_is_refused_before_anything_moves(
    pools: Callable[..., Pools],
) -> None:
    p = pools(bytes(2 * BLOCK), target_len=BLOCK)
    with pytest.raises(ValueError, match="leaves the 4096-byte region"):
        p.read([Copy(p.base, 0, 2 * BLOCK)])
    with pytest.raises(ValueError, match="is not registered"):
        p.reader.read(p.source.endpoint, "never-registered", [Copy(p.base, 0, BLOCK)])


def test_a_region_the_file_does_not_have_is_refused(
    pair: tuple[Transport, Transport], shm_dir: Path
) -> None:
    source, _ = pair
    path = pool_file(shm_dir, "small", bytes(BLOCK))
    with pytest.raises(ValueError, match="has no region of 8192 bytes"):
        source.register("small", path, DATA_OFFSET, 2 * BLOCK)


def test_a_pool_registered_twice_is_refused(pools: Callable[..., Pools], shm_dir: Path) -> None:
    p = pools(bytes(BLOCK))
    with pytest.raises(ValueError, match="registered already"):
        p.source.register(p.name, pool_file(shm_dir, "again", bytes(BLOCK)), DATA_OFFSET, BLOCK)


def test_an_unregistered_region_stays_mapped_but_no_longer_touches_the_file(
    pools: Callable[..., Pools], shm_dir: Path
) -> None:
    """A late access by the engine (serving a peer, or landing an abandoned read) must neither
    crash the daemon nor reach a pool file that is gone or reused."""
    p = pools(b"\x5a" * BLOCK)
    assert ctypes.string_at(p.base, 4) == b"\x5a" * 4
    p.source.unregister(p.name)

    assert ctypes.string_at(p.base, BLOCK) == bytes(BLOCK)
    ctypes.memset(p.base, 0x11, BLOCK)
    assert data_of(shm_dir / "src") == b"\x5a" * BLOCK


class FlakyEngine:
    """A stand-in for the Mooncake engine whose first `failing` reads fail, each after
    `fails_after_s`: as a read on a dead peer's pooled connection fails at once."""

    failing = 1
    fails_after_s = 0.0

    def __init__(self) -> None:
        self.submitted: list[float] = []

    def initialize(self, *args: object) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 15000

    def register_memory(self, address: int, length: int) -> int:
        return 0

    def batch_transfer_async_read(self, *args: object) -> int:
        self.submitted.append(time.monotonic())
        return len(self.submitted)

    def transfer_check_status(self, batch: int) -> int:
        if time.monotonic() - self.submitted[batch - 1] < self.fails_after_s:
            return 0  # in flight
        return -1 if batch <= self.failing else 1


@pytest.fixture
def flaky(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MooncakeTransport]:
    monkeypatch.setattr(transport_module, "mooncake_engine", lambda: FlakyEngine)
    transport = MooncakeTransport("127.0.0.1")
    transport.register("pool", pool_file(shm_dir, "dst", bytes(BLOCK)), DATA_OFFSET, BLOCK)
    yield transport
    transport.close()


def test_a_read_that_fails_at_once_is_tried_again_on_fresh_connections(
    flaky: MooncakeTransport,
) -> None:
    flaky.read("127.0.0.1:15001", "pool", [Copy(0, 0, BLOCK)]).result(5)
    assert len(flaky._engine.submitted) == 2


def test_a_read_that_failed_after_a_while_is_not_tried_again(
    flaky: MooncakeTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FlakyEngine, "fails_after_s", 0.1)
    monkeypatch.setattr(transport_module, "STALE_CONNECTION_WINDOW_S", 0.05)
    with pytest.raises(TransportError, match=r"read of 4096 bytes from 127\.0\.0\.1:15001 failed"):
        flaky.read("127.0.0.1:15001", "pool", [Copy(0, 0, BLOCK)]).result(5)
    assert len(flaky._engine.submitted) == 1
