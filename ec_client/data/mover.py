"""TensorMover: copy a tensor's bytes into an entry's extents, and extents back into a tensor.

One copy per extent (an entry is usually one extent, so one memcpy or one DMA), never a Python
loop over blocks. On CPU the copies are plain and done when the call returns. On GPU they run on
the mover's two CUDA streams, one per direction, so saves and loads overlap (both PCIe
directions at once) and a load never queues behind a save that waits for compute:

- save: the save stream first waits for the caller's current stream (the encoder's kernels that
  wrote the tensor), copies device-to-host into the registered pool pages, and records an event;
  the entry may be committed only once that event has fired (`Transfer.wait` / `done`). The
  source is recorded on the save stream, so the allocator cannot hand its memory to someone else
  before the copy read it.
- load: host-to-device copies into the output tensor, an event, and the caller's current stream
  waits on that event, so the caller can use the tensor at once with no host sync; the pin may be
  released only once the event has fired. A new output tensor is allocated on the load stream
  (so the copy need not wait for anything queued on the caller's stream: memory the allocator
  recycles there may still be read by queued kernels) and recorded on the caller's stream; a
  caller-provided `out` may still be in use by the caller's queued work, so the load stream
  waits for the caller's stream first.
- A GPU copy never spans two of the mapping's CUDA registrations (they are cut at chunk
  boundaries, see mapping.split_at).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ec_client.data.mapping import PoolMapping, Span, split_at
from ec_protocol.pool.layout import DTYPES, MAX_NDIM
from ec_protocol.types import Extent, TensorSpec


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name on the wire ("bfloat16"); ValueError for dtypes a pool cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored; supported: {', '.join(DTYPES)}")
    return name


# Looked up once: a get maps each entry's dtype name, and getattr on torch costs more.
_TORCH_DTYPES = {
    name: dtype for name in DTYPES if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


def torch_dtype(name: str) -> torch.dtype:
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"the entry's dtype {name!r} is not one torch {torch.__version__} has")
    return dtype


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    """What a tensor's entry holds; TypeError for what is not a tensor, ValueError for a tensor
    a pool cannot hold (nested, no elements, no dimensions or more than MAX_NDIM, no data
    (meta), not a dense strided layout (sparse), a dtype without a wire name): refused before
    anything is sent."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:  # before anything asks its shape, which a nested tensor has not
        raise ValueError(
            "a nested tensor cannot be stored: store each of its tensors (t.unbind()) as an "
            "entry of its own, or a padded dense one (t.to_padded_tensor(0))"
        )
    if not 1 <= tensor.dim() <= MAX_NDIM:
        hint = " (a 0-dim tensor: store t.reshape(1))" if tensor.dim() == 0 else ""
        raise ValueError(
            f"a tensor of {tensor.dim()} dimensions (shape {tuple(tensor.shape)}) cannot be "
            f"stored: expected 1 to {MAX_NDIM}{hint}"
        )
    if tensor.layout is not torch.strided:
        raise ValueError(f"a {tensor.layout} tensor cannot be stored: convert it to dense first")
    if tensor.is_meta:
        raise ValueError("a meta tensor has no data to store")
    if tensor.numel() == 0:
        raise ValueError(f"an empty tensor (shape {tuple(tensor.shape)}) cannot be stored")
    return TensorSpec(tuple(tensor.shape), dtype_name(tensor.dtype), tensor.nbytes)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("expected a contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8)


class Fence(Protocol):
    """What a Transfer waits on: a CUDA event (or a test's stand-in for one)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Transfer:
    """Copies in flight. `event` is None when they are already done (CPU)."""

    event: Fence | None = None
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the copies land

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the copies have landed."""
        if self.event is not None:
            self.event.synchronize()
        self.keep.clear()


def wait_all(transfers: Iterable[Transfer]) -> None:
    """Wait for every transfer, even when waiting for one raises (then the first error is
    raised, after the others landed): nothing launched may still be copying when the caller
    gives its entries or pins back."""
    error: BaseException | None = None
    for transfer in transfers:
        try:
            transfer.wait()
        except BaseException as exc:  # raised below, once the others landed
            error = error or exc
    if error is not None:
        raise error


def cuda_device(device: torch.device | str) -> torch.device:
    """The device with an index: "cuda" means the current CUDA device, as torch does for
    allocations, so movers, registrations and caches agree on which device it is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True, slots=True)
class Load:
    """One entry to copy out of the pool: its extents and spec, into `out` if one is given."""

    extents: Sequence[Extent]
    spec: TensorSpec
    out: torch.Tensor | None = None


class TensorMover:
    def __init__(self, mapping: PoolMapping, device: torch.device | str = "cpu") -> None:
        self.mapping = mapping
        self.device = cuda_device(device)
        self.save_stream: torch.cuda.Stream | None = None
        self.load_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            mapping.register_cuda(self.device)
            self.save_stream = torch.cuda.Stream(self.device)
            self.load_stream = torch.cuda.Stream(self.device)

    def save(self, tensor: torch.Tensor, extents: Sequence[Extent]) -> Transfer:
        """Start copying `tensor` into `extents` (a non-contiguous tensor is made contiguous)."""
        self._check_device(tensor, "tensor")
        source = byte_view(tensor.contiguous())
        copies = self._copies(source, extents)
        stream = self.save_stream
        if stream is None:
            self._copy(copies, to_pool=True)
            return Transfer()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._copy(copies, to_pool=True)
            event = self._record(stream)
        source.record_stream(stream)  # the allocator must not reuse it before the copy ran
        return Transfer(event, [source])

    def load(
        self,
        extents: Sequence[Extent],
        spec: TensorSpec,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Transfer]:
        """Start copying `extents` into `out` (or a new tensor of `spec` on the mover's device)."""
        tensors, transfer = self.load_many([Load(extents, spec, out)])
        return tensors[0], transfer

    def load_many(self, loads: Sequence[Load]) -> tuple[list[torch.Tensor], Transfer]:
        """Start copying each load's extents into its `out` (or a new tensor of its spec), all
        under one Transfer (on GPU one event).

        Step 1 checks every load and makes its tensor; step 2 launches the copies back to back.
        So a load that is refused (ValueError) refuses the batch before anything is copied, and
        no Python work runs between two copies: right after one, it would run on caches the copy
        has just flushed (8 x 8 MiB: 3 us of work per entry cost 10 us between copies, see
        docs/performance.md, *A get pins and copies its entries in batches*)."""
        stream = self.load_stream
        tensors: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, Span]] = []
        for load in loads:
            dtype = torch_dtype(load.spec.dtype)
            out = load.out
            if out is not None:
                self._check_out(out, load.spec.shape, dtype)
            elif stream is None:
                out = torch.empty(load.spec.shape, dtype=dtype, device=self.device)
            else:
                with torch.cuda.stream(stream):
                    out = torch.empty(load.spec.shape, dtype=dtype, device=self.device)
            tensors.append(out)
            copies += self._copies(byte_view(out), load.extents)
        if stream is None:
            self._copy(copies, to_pool=False)
            return tensors, Transfer()
        caller = torch.cuda.current_stream(self.device)
        for load, out in zip(loads, tensors, strict=True):
            if load.out is None:
                out.record_stream(caller)  # once freed, reused only after the caller's reads ran
            else:
                out.record_stream(stream)
        if any(load.out is not None for load in loads):
            stream.wait_stream(caller)  # the caller's queued kernels may still use an `out`
        with torch.cuda.stream(stream):
            self._copy(copies, to_pool=False)
            event = self._record(stream)
        caller.wait_event(event)
        return tensors, Transfer(event)

    def checksum(self, extents: Sequence[Extent], nbytes: int) -> int:
        """CRC-32 of the entry's bytes in the pool, with bit 32 set so that 0 means "none"."""
        crc = 0
        for pool_at, _, n in self._spans(extents, nbytes):
            crc = zlib.crc32(self.mapping.array[pool_at : pool_at + n].data, crc)
        return crc | (1 << 32)

    def _check_device(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"{name} is on {tensor.device}; this mover copies between the pool and "
                f"{self.device}"
            )

    def _check_out(self, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._check_device(out, "out")
        if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} (contiguous={out.is_contiguous()}); "
                f"expected a contiguous {shape} {dtype}"
            )

    def _record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        self.mapping.track(stream, event)
        return event

    def _copies(
        self, tensor: torch.Tensor, extents: Sequence[Extent]
    ) -> list[tuple[torch.Tensor, Span]]:
        """The copies between a flat uint8 tensor and its entry's extents, one per extent."""
        return [(tensor, span) for span in self._spans(extents, tensor.numel())]

    def _spans(self, extents: Sequence[Extent], nbytes: int) -> list[Span]:
        """(pool offset, tensor offset, length) per extent, the last one cut to nbytes;
        ValueError if nbytes do not fit the extents (more than they hold, or so few that their
        last block would be empty)."""
        block = self.mapping.block_size
        room = sum(e.count for e in extents) * block
        if not room - block < nbytes <= room:
            raise ValueError(f"{nbytes} bytes do not fit extents of {room} bytes")
        spans = []
        offset = 0
        for extent in extents:
            length = min(extent.count * block, nbytes - offset)
            spans.append((extent.start * block, offset, length))
            offset += length
        return spans

    def _copy(self, copies: list[tuple[torch.Tensor, Span]], to_pool: bool) -> None:
        """One copy per (flat uint8 tensor, span): between the pool and that tensor. On the CPU
        the views are all made first, then the copies run back to back."""
        if self.device.type == "cpu":
            ready = [host_copy(self.mapping, tensor, span, to_pool) for tensor, span in copies]
            for copy in ready:
                copy()
            return
        for tensor, (pool_at, at, n) in copies:
            for piece_at, part_at, piece in split_at([(pool_at, at, n)], self.mapping.chunk_bytes):
                region = self.mapping.flat[piece_at : piece_at + piece]
                part = tensor[part_at : part_at + piece]
                if to_pool:
                    region.copy_(part, non_blocking=True)
                else:
                    part.copy_(region, non_blocking=True)


# Host copies of at least this many bytes go through torch's copy_, smaller ones through numpy.
LARGE_COPY = 4 << 20


def host_copy(
    mapping: PoolMapping, tensor: torch.Tensor, span: Span, to_pool: bool
) -> Callable[[], object]:
    """The memcpy of one span between the pool and a flat uint8 tensor on the host, made ready
    to run (call it), so that a batch's copies run back to back (`TensorMover._copy`): numpy on
    this thread when small, torch's `copy_` when large.

    Small copies go through numpy views, whose slicing costs a fraction of slicing tensors (it
    matters for entries of a few hundred KiB), and stay off torch's intra-op threads: on a busy
    host one of them descheduled stalls the whole copy for a scheduler slice, which turned a
    256 KiB put's copy of 0.04 ms into 3 ms. Large copies want a second core, and torch's
    threads, spinning between copies, start at once; a thread of our own woken per copy started
    too late on a 2-core VM to help at all (8 x 8 MiB out of a pool: 3.2 ms split over two such
    threads, 2.9 ms on one, 1.5 ms with `copy_`). They slice the tensors themselves: a round
    trip through numpy views is three more calls per copy, each tens of microseconds the first
    time after a large copy; a tensor that one extent covers whole is not sliced at all.
    Figures: docs/performance.md, *Host copies of 4 MiB or more go through torch's copy_*.
    """
    pool_at, at, n = span
    if n < LARGE_COPY:
        blocks, data = mapping.array[pool_at : pool_at + n], tensor.numpy()[at : at + n]
        target, source = (blocks, data) if to_pool else (data, blocks)
        return functools.partial(np.copyto, target, source)
    region = mapping.flat[pool_at : pool_at + n]
    part = tensor if n == len(tensor) else tensor[at : at + n]  # one extent: all of it
    return (
        functools.partial(region.copy_, part) if to_pool else functools.partial(part.copy_, region)
    )
