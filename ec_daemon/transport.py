"""Moving an entry's bytes from a peer daemon's pool into this daemon's pool (docs/design.md §13).

Each daemon maps the data region of each of its pools once, at creation or adoption, and
registers it with its transport; a peer then reads an entry straight from that region into the
extents of its own PENDING entry: one transfer-engine read, no bounce buffer, no tensor bytes
through gRPC. A transport only ever reads; it never writes into a peer.

`Transport` is the interface (NIXL would be a second implementation); `MooncakeTransport` is the
Mooncake Transfer Engine in P2P-handshake mode (no metadata server): TCP here, RDMA in
production. (Tests of whoever drives a pull use an in-process copy: tests/peer_testing.py.)

A read cannot be cancelled once it started, and the engine keeps writing into the local range
for as long as the transfer runs, even after its caller stopped waiting (a stalled peer that
resumes completes it). So `read` returns a future that is done exactly when nothing writes into
the local range any more: a caller that gives up at its deadline must keep that range out of use
until the future is done. A read that has not started yet is cancelled with `future.cancel()`
and then never writes at all.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ec_client.types import Extent
from ec_daemon.peers import peer_address


class TransportError(Exception):
    """A transport that cannot start or register, or a read that failed. After a failed read
    the local range holds undefined bytes (part of the entry may have arrived), and nothing
    writes into it any more."""


@dataclass(frozen=True)
class Copy:
    """One piece of a read: `length` bytes at `remote_address` in a peer's registered region
    into `local_offset` of a local pool's data region."""

    remote_address: int
    local_offset: int
    length: int


def plan_copies(
    remote_base: int,
    remote_extents: Sequence[Extent],
    local_extents: Sequence[Extent],
    block_size: int,
    nbytes: int,
) -> list[Copy]:
    """The copies that move an entry's `nbytes` from its extents in a peer's pool (whose block 0
    is at `remote_base`) into its extents here: one per run contiguous on both sides, so an
    entry held in one extent on each side is one copy."""
    remote_runs = list(byte_runs(remote_extents, block_size, nbytes))
    local_runs = list(byte_runs(local_extents, block_size, nbytes))
    copies: list[Copy] = []
    i = j = remote_done = local_done = 0  # runs finished, bytes taken of the current ones
    while i < len(remote_runs):
        (remote_start, remote_len), (local_start, local_len) = remote_runs[i], local_runs[j]
        length = min(remote_len - remote_done, local_len - local_done)
        piece = Copy(remote_base + remote_start + remote_done, local_start + local_done, length)
        last = copies[-1] if copies else None
        if (
            last is not None
            and last.remote_address + last.length == piece.remote_address
            and last.local_offset + last.length == piece.local_offset
        ):
            copies[-1] = Copy(last.remote_address, last.local_offset, last.length + length)
        else:
            copies.append(piece)
        remote_done += length
        local_done += length
        if remote_done == remote_len:
            i, remote_done = i + 1, 0
        if local_done == local_len:
            j, local_done = j + 1, 0
    return copies


def byte_runs(extents: Sequence[Extent], block_size: int, nbytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the entry's bytes in each extent, in order, `nbytes` in all."""
    left = nbytes
    for extent in extents:
        if left == 0:
            return
        length = min(extent.count * block_size, left)
        yield extent.start * block_size, length
        left -= length
    if left:
        raise ValueError(f"extents {list(extents)} hold fewer than {nbytes} bytes")


class Transport(Protocol):
    @property
    def endpoint(self) -> str:
        """What a peer passes to `read` to reach this transport."""
        ...

    def register(self, engine_id: str, path: Path, offset: int, length: int) -> int:
        """Map `length` bytes of the pool file at `path` from `offset` (its data region) and
        serve them to peers; returns the address peers read block 0 at."""
        ...

    def unregister(self, engine_id: str) -> None:
        """Stop serving the pool and stop reading into it (a dropped or refused pool)."""
        ...

    def read(
        self, peer_endpoint: str, local_engine_id: str, copies: Sequence[Copy]
    ) -> Future[None]:
        """Start reading `copies` from the peer into the local pool; never blocks. The future is
        done when nothing writes into the local ranges any more: result None when every byte
        landed, TransportError when the read failed."""
        ...

    def close(self) -> None:
        """Cancel reads not started, wait for those in flight, release the engine and unmap."""
        ...


# ---- mapped regions ------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux values; Python's mmap module does not export these two
_MAP_NORESERVE = 0x4000


def _mmap(address: int | None, length: int, flags: int, fd: int, offset: int) -> int:
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    result = _libc.mmap(address, length, rw, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)


@dataclass(frozen=True)
class Region:
    """A pool's data region mapped into this process: `length` bytes from `address`."""

    engine_id: str
    address: int
    length: int

    def holds(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.address + self.length


@dataclass(frozen=True)
class Piece:
    """A Copy resolved to addresses on both sides."""

    local_address: int
    remote_address: int
    length: int


class MappedRegions:
    """The pool regions a transport serves and reads into, mapped MAP_SHARED.

    Only a daemon with a transport maps pool files: a mapping turns a pool file truncated by
    another process into a SIGBUS of the daemon when the engine next touches the lost pages.
    A region taken out of service is not unmapped while the engine may still touch it (serving
    a peer, or landing an abandoned read): it is overlaid in place with anonymous zero pages, so
    late reads see zeros, late writes land nowhere, and the file's pages are freed; the overlay
    is unmapped at close, once the engine has stopped.
    """

    def __init__(self) -> None:
        self._live: dict[str, Region] = {}
        self._retired: list[Region] = []

    def map(self, engine_id: str, path: Path, offset: int, length: int) -> Region:
        if engine_id in self._live:
            raise ValueError(f"pool {engine_id!r} is registered already")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if offset < 0 or length <= 0 or offset + length > size:
                raise ValueError(
                    f"{path} is {size} bytes: it has no region of {length} bytes at {offset}"
                )
            address = _mmap(None, length, mmap.MAP_SHARED, fd, offset)
        finally:
            os.close(fd)  # the mapping keeps the file
        region = self._live[engine_id] = Region(engine_id, address, length)
        return region

    def retire(self, engine_id: str) -> Region:
        region = self[engine_id]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        _mmap(region.address, region.length, flags, -1, 0)
        self._retired.append(self._live.pop(engine_id))
        return region

    def __getitem__(self, engine_id: str) -> Region:
        region = self._live.get(engine_id)
        if region is None:
            raise ValueError(f"pool {engine_id!r} is not registered with the transport")
        return region

    def serves(self, address: int, length: int) -> bool:
        return any(region.holds(address, length) for region in self._live.values())

    def pieces(self, engine_id: str, copies: Sequence[Copy]) -> list[Piece]:
        """The copies into `engine_id`'s region; ValueError when one leaves the region."""
        region = self[engine_id]
        for c in copies:
            if c.length <= 0 or c.local_offset < 0 or c.local_offset + c.length > region.length:
                raise ValueError(
                    f"copy of {c.length} bytes to offset {c.local_offset} leaves the "
                    f"{region.length}-byte region of pool {engine_id!r}"
                )
        return [Piece(region.address + c.local_offset, c.remote_address, c.length) for c in copies]

    def unmap_all(self) -> None:
        for region in [*self._live.values(), *self._retired]:
            _libc.munmap(region.address, region.length)
        self._live.clear()
        self._retired.clear()


# ---- Mooncake Transfer Engine --------------------------------------------------------------------

FIRST_POLL_S = 50e-6  # polls of a transfer in flight back off from this...
MAX_POLL_S = 500e-6  # ...to this: at most this much latency added to a read
# A read that failed within this long of its start may have failed on a dead peer's pooled
# connection, not on its own peer: it is tried once more (see MooncakeTransport._transfer).
STALE_CONNECTION_WINDOW_S = 0.5


def mooncake_engine() -> Any:
    """The engine class, loaded on first use (the daemon runs without the extra)."""
    # The library reads its MC_* settings when it is loaded, so defaults go in first.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            f"the Mooncake transfer engine cannot be loaded ({exc}): pip install 'ecd[mooncake]', "
            "and apt-get install libibverbs1 for its RDMA library"
        ) from None
    return TransferEngine


class MooncakeTransport:
    """Mooncake Transfer Engine, P2P handshake: the endpoint is `host:port` of the engine's
    handshake listener (a random port in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, 15000-17000 by
    default; the data port is another one). Both listen on every interface and authenticate
    nobody: whoever reaches them can read and write every registered region.

    Reads are the engine's asynchronous reads, submitted and polled on a worker thread (its
    synchronous read busy-polls more than a core, and is slower). How long until a hopeless
    read is over (0.3.13.post1, TCP): a killed peer fails it promptly (docs/performance.md,
    Across nodes); a peer that stops answering mid-transfer, after MC_TCP_PROGRESS_TIMEOUT_SEC
    without progress (30 s); a first read from a peer whose handshake port accepts but never
    answers waits 60 s (fixed in the engine) before it even starts. A worker busy with such a
    read is not free for others: `max_reads` bounds them.
    """

    def __init__(
        self, host: str, protocol: str = "tcp", devices: str = "", max_reads: int = 32
    ) -> None:
        self._engine: Any = mooncake_engine()()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, devices) != 0:
            raise TransportError(
                f"the Mooncake transfer engine did not start ({protocol} on {host}, devices "
                f"{devices or 'any'}); its log on stderr says why"
            )
        self._endpoint = peer_address(host, self._engine.get_rpc_port())
        self._regions = MappedRegions()
        self._reads = ThreadPoolExecutor(max_reads, thread_name_prefix="ecd-transfer")

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, engine_id: str, path: Path, offset: int, length: int) -> int:
        region = self._regions.map(engine_id, path, offset, length)
        if self._engine.register_memory(region.address, region.length) != 0:
            self._regions.retire(engine_id)
            raise TransportError(f"the transfer engine refused to register pool {engine_id!r}")
        return region.address

    def unregister(self, engine_id: str) -> None:
        self._engine.unregister_memory(self._regions[engine_id].address)
        self._regions.retire(engine_id)

    def read(
        self, peer_endpoint: str, local_engine_id: str, copies: Sequence[Copy]
    ) -> Future[None]:
        pieces = self._regions.pieces(local_engine_id, copies)
        return self._reads.submit(self._transfer, peer_endpoint, pieces)

    def _transfer(self, peer_endpoint: str, pieces: list[Piece]) -> None:
        started = time.monotonic()
        if self._read_once(peer_endpoint, pieces):
            return
        # The engine pools its TCP connections by peer address and keeps those to a peer that
        # died; a new peer that takes the same address (its port reused: a restarted daemon, or
        # another one) inherits them, and the first read from it fails at once on a connection
        # to the dead one, which the engine then drops. So a read that failed that quickly is
        # tried once more, on fresh connections. One that failed later (a peer killed or
        # stalled mid-read) is not: its failure is the peer's.
        if time.monotonic() - started < STALE_CONNECTION_WINDOW_S and self._read_once(
            peer_endpoint, pieces
        ):
            return
        nbytes = sum(p.length for p in pieces)
        raise TransportError(f"read of {nbytes} bytes from {peer_endpoint} failed")

    def _read_once(self, peer_endpoint: str, pieces: list[Piece]) -> bool:
        """One try at every piece; True when all landed. Either way, nothing writes into the
        local ranges once it returns."""
        # One submission per piece: the engine's status poll sees the first task of a batch only.
        batches = []
        for p in pieces:
            batch = self._engine.batch_transfer_async_read(
                peer_endpoint, [p.local_address], [p.remote_address], [p.length]
            )
            if batch == 0:  # not submitted (peer unreachable, refused): nothing more to send
                break
            batches.append(batch)
        return self._wait(batches) and len(batches) == len(pieces)

    def _wait(self, batches: list[int]) -> bool:
        """Poll until every transfer is over (its memory quiet); True when all completed."""
        completed = True
        poll_s = FIRST_POLL_S
        while batches:
            # 1 completed, -1 failed (both freed by the engine); 0 in flight; -2 past the
            # engine's slice timeout yet still in flight, so still writing.
            statuses = [self._engine.transfer_check_status(b) for b in batches]
            completed = completed and -1 not in statuses
            batches = [b for b, s in zip(batches, statuses, strict=True) if s in (0, -2)]
            if batches:
                time.sleep(poll_s)
                poll_s = min(poll_s * 2, MAX_POLL_S)
        return completed

    def close(self) -> None:
        self._reads.shutdown(wait=True, cancel_futures=True)
        self._engine = None  # its destructor stops the engine's threads (about 1 s)
        self._regions.unmap_all()
