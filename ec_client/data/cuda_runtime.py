"""The four CUDA runtime calls that registering a pool needs, from the libcudart torch loaded.

torch's own binding (`torch.cuda.cudart()`) has cudaHostRegister but not cudaGetLastError, and a
failed cudaHostRegister leaves CUDA's last error set: the next kernel launch anywhere in the
process (in vLLM: the forward pass) then raises it. So every call goes through the one runtime
library already loaded in the process, whose last-error state is the one torch's kernel launches
check; a failure can then be cleared where it happened.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Protocol

CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2


class CudaRuntime(Protocol):
    """What PoolMapping calls; tests substitute a fake that keeps a sticky error as CUDA does."""

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int: ...

    def cudaHostUnregister(self, pointer: int) -> int: ...

    def cudaGetLastError(self) -> int:
        """Return the last error and reset it to success."""
        ...

    def cudaGetErrorString(self, error: int) -> str: ...


class LoadedCudart:
    """libcudart through ctypes: the copy mapped into this process (by torch), never another."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int
        self._last_error = lib.cudaGetLastError
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        return int(self._register(pointer, size, flags))

    def cudaHostUnregister(self, pointer: int) -> int:
        return int(self._unregister(pointer))

    def cudaGetLastError(self) -> int:
        return int(self._last_error())

    def cudaGetErrorString(self, error: int) -> str:
        text = self._error_string(error)
        return text.decode() if text else f"unknown CUDA error {error}"


def loaded_library(name: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of the first shared object mapped into this process whose file name starts with
    `name` (e.g. "libcudart"), or None."""
    try:
        with open(maps) as lines:
            for line in lines:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and path.rsplit("/", 1)[-1].startswith(name + "."):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def cuda_runtime() -> CudaRuntime | None:
    """The process's CUDA runtime, or None when no libcudart is loaded (call it after CUDA was
    initialised, e.g. inside `torch.cuda.device(...)`)."""
    path = loaded_library("libcudart")
    return LoadedCudart(path) if path is not None else None
