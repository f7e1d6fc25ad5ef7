"""The pool regions the store's transfer engine reads from and writes into (docs/design.md §13).

The cluster node maps the data region of each shared pool once, at its first publish or remote
hit, and registers it with the store client: the engine then reads an entry's bytes straight from
its extents (a publish) and writes a remote hit's bytes straight into a PENDING entry's extents,
no bounce buffer, no tensor bytes through gRPC. A transfer cannot be cancelled once it started:
a region taken out of use stays mapped, overlaid with zero pages, until the engine is gone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ec_protocol.types import Extent


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


class MappedRegions:
    """The shared pools' data regions, mapped MAP_SHARED.

    Only a daemon that joined a store maps pool files: a mapping turns a pool file truncated by
    another process into a SIGBUS of the daemon when the engine next touches the lost pages.
    A region taken out of use is not unmapped while the engine may still touch it (a publish's
    read, or an abandoned remote hit landing): it is overlaid in place with anonymous zero pages,
    so late reads see zeros, late writes land nowhere, and the file's pages are freed; the
    overlay is unmapped at close, once the store client has stopped.
    """

    def __init__(self) -> None:
        self._live: dict[str, Region] = {}
        self._retired: list[Region] = []

    def map(self, engine_id: str, path: Path, offset: int, length: int) -> Region:
        if engine_id in self._live:
            raise ValueError(f"pool {engine_id!r} is mapped already")
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
            raise ValueError(f"pool {engine_id!r} is not mapped")
        return region

    def unmap_all(self) -> None:
        for region in [*self._live.values(), *self._retired]:
            _libc.munmap(region.address, region.length)
        self._live.clear()
        self._retired.clear()
