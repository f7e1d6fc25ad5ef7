"""A CUDA stand-in for machines without a GPU: enough of torch.cuda for a CUDA TensorMover to be
made (streams, device guards), and a CUDA runtime that keeps errors the way the real one does.

The real runtime records a failed call as its last error and keeps it until cudaGetLastError
takes it back; torch checks that error after every kernel launch, so an error left behind by
cudaHostRegister surfaces at the next unrelated kernel. `FakeCudart.launch` is that check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from ec_client.data import mapping as mapping_module
from ec_client.data.mapping import PoolMapping, RegistrationStats

ERROR_STRINGS = {
    1: "invalid argument",
    2: "out of memory",
    712: "part or all of the requested memory range is already mapped",
}


@dataclass
class FakeCudart:
    fail_at: int | None = None  # the index of the first cudaHostRegister call that fails
    error: int = 712  # ...with this error
    registered: list[tuple[int, int]] = field(default_factory=list)  # (pointer, size)
    unregistered: list[int] = field(default_factory=list)
    register_calls: int = 0
    last_error: int = 0

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        call, self.register_calls = self.register_calls, self.register_calls + 1
        if self.fail_at is not None and call >= self.fail_at:
            self.last_error = self.error
            return self.error
        self.registered.append((pointer, size))
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.unregistered.append(pointer)
        return 0

    def cudaGetLastError(self) -> int:
        error, self.last_error = self.last_error, 0
        return error

    def cudaGetErrorString(self, error: int) -> str:
        return ERROR_STRINGS.get(error, "unknown error")

    def launch(self) -> None:
        """A kernel launch: raises an error left pending, as torch's launch check does."""
        if self.last_error:
            error = self.cudaGetLastError()
            raise RuntimeError(f"CUDA error: {self.cudaGetErrorString(error)}")

    @property
    def pinned(self) -> set[int]:
        return {pointer for pointer, _ in self.registered} - set(self.unregistered)


class FakeStream:
    """torch.cuda.Stream's constructor, for movers that are made but never copy."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.cuda_stream = id(self)


@contextlib.contextmanager
def _no_device_switch(device: object) -> Iterator[None]:
    yield


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch, current_device: int = 0) -> FakeCudart:
    """Make this process look like it has CUDA (device `current_device`) with a fake runtime;
    registration counts start from zero."""
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current_device)
    monkeypatch.setattr(torch.cuda, "device", _no_device_switch)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(mapping_module, "cuda_runtime", lambda: cudart)
    monkeypatch.setattr(PoolMapping, "registrations", RegistrationStats())
    return cudart
