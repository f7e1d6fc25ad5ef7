"""PoolMapping: a pool file mapped into this process, its blocks as one uint8 tensor.

- The header is verified (magic, version, checksum, pool UUID, geometry, engine_id) against what
  the daemon said in OpenPool before a single block is trusted.
- The data region is mapped shared and pre-populated (see map_populated), so the first copy
  runs at full speed instead of faulting its pages in one by one.
- The tensor views hold the mapping alive: numpy's buffer export makes mmap.close() refuse while
  any view exists, so a view can never outlive the pages it points at (a SIGSEGV otherwise).
- Registration with CUDA (cudaHostRegister, so copies are real async DMA) happens only when a CUDA
  TensorMover is made for the mapping (or `register_cuda` is called), once per mapping: a process
  that only copies on the CPU never pins the pool nor creates a CUDA context. It registers in
  chunks of whole blocks ending on 2 MiB boundaries (one huge registration has failed on recent
  drivers); a GPU copy never spans two chunks (`split_at`). A failed registration undoes the
  chunks already registered, clears the error CUDA keeps (it would otherwise be raised by the
  next kernel launch in the process), is counted and warned about with CUDA's own error string,
  and copies still work (as slower pageable copies).
- A pool recreated under a live mapping (dropped and opened again: new file, new UUID) is
  detected by `check_current`, not silently used.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import grpc
import numpy as np
import torch

from ec_client.data.cuda_runtime import (
    CUDA_ERROR_MEMORY_ALLOCATION,
    CUDA_SUCCESS,
    CudaRuntime,
    cuda_runtime,
)
from ec_protocol.errors import EcdError
from ec_protocol.pool.fd_passing import ChannelError, open_pool_file
from ec_protocol.pool.layout import HEADER_SIZE, Header, LayoutError
from ec_protocol.types import Extent, PoolInfo

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Python lacks the name
# cudaHostRegister of one huge range has failed on recent drivers: register in pieces of about
# this many bytes at most.
CUDA_REGISTER_CHUNK = 8 << 30
# Pieces are whole blocks and also end on 2 MiB boundaries (the data region starts on one), so no
# block and no page, of 4 KiB or 2 MiB, is split between two registrations.
CUDA_REGISTER_ALIGN = 2 << 20

Span = tuple[int, int, int]  # (pool offset, tensor offset, length) of one copy, in bytes


def chunk_bytes(block_size: int, limit: int) -> int:
    """The registration chunk: the largest multiple of both the block size and 2 MiB within
    `limit` bytes (or the smallest, when none fits)."""
    unit = math.lcm(block_size, CUDA_REGISTER_ALIGN)
    return max(1, limit // unit) * unit


def register_chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of the pieces a region of `size` bytes is registered in."""
    return [(offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]


def split_at(spans: Iterable[Span], chunk: int) -> list[Span]:
    """The spans cut wherever they cross a multiple of `chunk` in the pool, so that no copy reads
    or writes two registrations (one that does fails with `invalid argument` or runs as a slow
    synchronous copy)."""
    pieces = []
    for pool_at, at, length in spans:
        while length > 0:
            piece = min(length, chunk - pool_at % chunk)
            pieces.append((pool_at, at, piece))
            pool_at, at, length = pool_at + piece, at + piece, length - piece
    return pieces


def map_populated(fd: int, length: int, offset: int) -> mmap.mmap:
    """Map shared and read-write with every page table entry filled in, writable.

    MADV_POPULATE_WRITE (Linux 5.14+) makes the first write to each page as fast as the rest;
    MAP_POPULATE, the fallback, fills entries read-only, so first writes still fault and the
    first pass is slower (docs/performance.md, Facts the design relies on).
    """
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=rw, offset=offset)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:
        mapping.close()
        mapping = mmap.mmap(
            fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=rw, offset=offset
        )
    return mapping


@dataclass
class RegistrationStats:
    """Process-wide counts of CUDA host registrations, for metrics and tests."""

    registered: int = 0
    failed: int = 0


def stale(info: PoolInfo, why: str) -> EcdError:
    return EcdError(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"pool {info.engine_id!r} at {info.path} does not match what the daemon announced: {why}",
        "pool_changed",
    )


def _open_pool_file(info: PoolInfo) -> int:
    """The pool file, opened for mapping (from the daemon, or by its path: fd_passing); EcdError
    saying why it cannot be."""
    try:
        return open_pool_file(info.path, info.pool_uuid, writable=True)
    except ChannelError as error:  # the daemon's answer, which says why
        if error.code == "NOT_FOUND":  # no pool's file now: dropped, refused or made anew
            raise stale(info, error.message) from None
        code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
        raise EcdError(code, error.message) from None
    except FileNotFoundError:
        raise stale(info, "the file was removed (the pool was dropped or refused)") from None
    except PermissionError:
        raise EcdError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"cannot open pool file {info.path} for reading and writing: permission denied, and "
            "the daemon did not hand it over: connect over its Unix socket (it hands pool files "
            "to the sessions granted them on its fd channel, the socket's path + .fd), or run "
            "this process as the daemon's user or in its pool group (pool_group)",
        ) from None
    except OSError as exc:
        raise stale(info, f"cannot open the file: {exc.strerror}") from None


class PoolMapping:
    """Use `PoolMapping.open(info)`: one mapping per pool file per process."""

    _shared: ClassVar[dict[tuple[int, str, str], PoolMapping]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()
    registrations: ClassVar[RegistrationStats] = RegistrationStats()

    def __init__(self, info: PoolInfo) -> None:
        self.info = info
        self.block_size = info.block_size_bytes
        self.num_blocks = info.num_blocks
        self._closed = False
        fd = _open_pool_file(info)
        try:
            stat = os.fstat(fd)
            self.file_id = (stat.st_dev, stat.st_ino)  # which file, whatever is at the path now
            self._verify_header(os.pread(fd, HEADER_SIZE, 0), stat.st_size)
            try:
                self._mmap = map_populated(
                    fd, info.num_blocks * info.block_size_bytes, info.data_offset
                )
            except OSError as exc:
                raise EcdError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"cannot map pool {info.engine_id!r} ({info.path}): {exc.strerror}",
                ) from None
        except BaseException:
            os.close(fd)
            raise
        # Kept for check_current's fstat, open as long as this object lives (not just until
        # close): another thread may check a mapping that an endpoint sharing it just closed.
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)  # the blocks, for host copies
        self.flat = torch.from_numpy(self.array)
        self.blocks = self.flat.view(info.num_blocks, info.block_size_bytes)
        self.chunk_bytes = chunk_bytes(info.block_size_bytes, CUDA_REGISTER_CHUNK)
        self._cuda_lock = threading.Lock()
        self._cuda_device: torch.device | None = None  # set once registration was tried
        self._registered: list[int] = []  # the chunks' addresses, while registered
        # The last event recorded on each stream that copies to or from this mapping: events of
        # one stream complete in order, so waiting for these waits for every copy.
        self._fences: dict[int, torch.cuda.Event] = {}

    @classmethod
    def open(cls, info: PoolInfo) -> PoolMapping:
        """The process's mapping of this pool (by path and UUID), created on first use."""
        key = (os.getpid(), info.path, info.pool_uuid)
        with cls._lock:
            mapping = cls._shared.get(key)
            if mapping is None:
                mapping = cls._shared[key] = cls(info)
            return mapping

    def _verify_header(self, page: bytes, file_size: int) -> None:
        info = self.info
        try:
            header = Header.unpack(page)
        except LayoutError as exc:
            raise stale(info, str(exc)) from None
        g = header.geometry
        found = (str(header.pool_uuid), g.block_size_bytes, g.num_blocks, g.data_offset)
        expected = (info.pool_uuid, info.block_size_bytes, info.num_blocks, info.data_offset)
        if found != expected or header.engine_id != info.engine_id:
            raise stale(
                info, f"header has (uuid, block, blocks, offset) {found}, expected {expected}"
            )
        if file_size < g.file_size:
            raise stale(info, f"file is {file_size} bytes, expected {g.file_size}: truncated")

    def check_current(self) -> None:
        """Raise EcdError (reason pool_changed) if the file mapped is no longer at its path
        (removed: the pool dropped, or dropped and recreated) or was truncated.

        One fstat of the file mapped, not a stat of the path: no path walk, about half the cost
        cold, and that is the state every batch starts in after large copies (tens of
        microseconds: docs/performance.md, *A large get's own work, where it runs cold*). A
        file with no link left is no longer at the path: the daemon unlinks a pool's file and
        creates its successor anew (O_EXCL), and never renames or links one."""
        if self._closed:
            raise stale(self.info, "the mapping was closed (its pool was recreated)")
        stat = os.fstat(self._fd)
        if stat.st_nlink == 0:
            raise stale(self.info, "the file was removed (pool dropped or recreated)")
        if stat.st_size < self.info.file_size:
            raise stale(self.info, f"the file was truncated to {stat.st_size} bytes")

    def region(self, extent: Extent) -> torch.Tensor:
        """The bytes of one extent, as a flat uint8 view into the pool."""
        start = extent.start * self.block_size
        return self.flat[start : start + extent.count * self.block_size]

    def register_cuda(self, device: torch.device) -> bool:
        """Register the data region with CUDA as pinned host memory, once per mapping (flags 0:
        on a 64-bit UVA system the pages are then pinned for every device; `device` is the one
        whose context makes the calls). Returns whether it is registered; a failure is warned
        about and counted, never raised, and is not retried."""
        with self._cuda_lock:
            if self._cuda_device is None:
                self._cuda_device = device
                with torch.cuda.device(device):
                    self._registered = self._register(cuda_runtime())
            return self.cuda_registered

    def _register(self, runtime: CudaRuntime | None) -> list[int]:
        if runtime is None:
            self._registration_failed("libcudart is not loaded in this process")
            return []
        base = self.flat.data_ptr()
        registered: list[int] = []
        for offset, length in register_chunks(self.flat.numel(), self.chunk_bytes):
            error = runtime.cudaHostRegister(base + offset, length, 0)
            if error == CUDA_SUCCESS:
                registered.append(base + offset)
                continue
            for pointer in registered:
                runtime.cudaHostUnregister(pointer)
            # CUDA keeps the failure as its last error, and torch's next kernel launch anywhere
            # in this process would raise it: take it back now.
            runtime.cudaGetLastError()
            hint = (
                " If the memlock limit is low, raise it (ulimit -l / LimitMEMLOCK=infinity)."
                if error == CUDA_ERROR_MEMORY_ALLOCATION
                else ""
            )
            self._registration_failed(
                f"cudaHostRegister of {length} bytes at offset {offset} failed with CUDA error "
                f"{error}: {runtime.cudaGetErrorString(error)}.{hint}"
            )
            return []
        PoolMapping.registrations.registered += 1
        return registered

    def _registration_failed(self, why: str) -> None:
        PoolMapping.registrations.failed += 1
        warnings.warn(
            f"pool {self.info.engine_id!r} is not registered with CUDA: {why} Copies run from "
            "pageable memory (slower).",
            RuntimeWarning,
            stacklevel=4,
        )

    def track(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """`event` was recorded on `stream` after copies to or from this mapping."""
        self._fences[stream.cuda_stream] = event

    def wait_copies(self) -> None:
        """Block until every tracked copy has landed (not a device-wide synchronize)."""
        for event in self._fences.values():
            event.synchronize()
        self._fences.clear()

    @property
    def cuda_registered(self) -> bool:
        return bool(self._registered)

    def close(self) -> None:
        """Forget this mapping; the pages go when the last tensor view of them does. Closing
        again does nothing."""
        if self._closed:
            return
        self._closed = True
        with PoolMapping._lock:
            PoolMapping._shared.pop((os.getpid(), self.info.path, self.info.pool_uuid), None)
        self.wait_copies()  # no copy may still use the pages once they are unregistered
        if self._registered and self._cuda_device is not None:
            runtime = cuda_runtime()
            assert runtime is not None  # it registered them
            with torch.cuda.device(self._cuda_device):
                for pointer in self._registered:
                    runtime.cudaHostUnregister(pointer)
                runtime.cudaGetLastError()  # a failed unregister must not fail a later kernel
            self._registered.clear()
        del self.array, self.flat, self.blocks
        # With tensor views still alive the mapping refuses to close; it then closes when the last
        # view is collected.
        with contextlib.suppress(BufferError):
            self._mmap.close()
