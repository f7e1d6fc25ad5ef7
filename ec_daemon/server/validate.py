"""Checks of client input that need no state: names, keys, sizes, tensor specs, batch limits.

Whole-request problems raise CoreError; per-item problems return a message, so one bad item of a
batch fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ec_daemon.core.errors import Code, CoreError
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.pool.layout import (
    DTYPES,
    ENGINE_ID_PATTERN,
    MAX_BLOCKS,
    MAX_COMPAT_KEY_BYTES,
    MAX_KEY_BYTES,
    MAX_NDIM,
    tensor_nbytes,
)
from ec_protocol.types import MAX_HITS_PER_STEP, MAX_MISSES_PER_STEP, TensorSpec

MAX_WAIT_MS = 600_000
MAX_BLOCK_SIZE = 1 << 30
MAX_CLIENT_NAME = 256


@dataclass(frozen=True)
class Limits:
    max_batch: int = 4096


def _invalid(message: str) -> CoreError:
    return CoreError(Code.INVALID_ARGUMENT, message)


def engine_id(value: str) -> str:
    if not ENGINE_ID_PATTERN.fullmatch(value):
        raise _invalid(
            f"bad engine_id {value!r}: expected 1-128 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return value


def batch(size: int, limits: Limits) -> None:
    if size > limits.max_batch:
        raise CoreError(
            Code.RESOURCE_EXHAUSTED,
            f"batch of {size} items is over the limit of {limits.max_batch}; split it",
        )


def answered(hits: int, misses: int) -> None:
    """StepRequest.hits and .misses: bounded by the protocol (MAX_HITS_PER_STEP,
    MAX_MISSES_PER_STEP, which clients keep to without asking), not by --max-batch: they are
    counts and recency, no work per item beyond a lookup, and a busy engine reads thousands a
    second under lock pins. The bound keeps one call from driving the pool's counters far."""
    for count, what, limit in (
        (hits, "hits", MAX_HITS_PER_STEP),
        (misses, "misses", MAX_MISSES_PER_STEP),
    ):
        if count > limit:
            raise CoreError(
                Code.RESOURCE_EXHAUSTED,
                f"{count} {what} in one Step, over the protocol's {limit}: send the rest "
                "in the next Step",
            )


def key_problem(key: bytes) -> str | None:
    if not key:
        return "empty key: expected 1 to 256 bytes (e.g. the mm_hash)"
    if len(key) > MAX_KEY_BYTES:
        return f"key of {len(key)} bytes is too long: expected at most {MAX_KEY_BYTES}"
    return None


def tensor_spec(key: bytes, spec: pb.TensorSpec) -> TensorSpec | str:
    """The validated spec of an Allocate item, or a message saying what is wrong with it."""
    problem = key_problem(key)
    if problem is not None:
        return problem
    dtype, nbytes, shape = spec.dtype, spec.nbytes, tuple(spec.shape)
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}"
    if not 1 <= len(shape) <= MAX_NDIM:
        return f"shape {list(shape)} has {len(shape)} dimensions: expected 1 to {MAX_NDIM}"
    if min(shape) <= 0:
        return f"shape {list(shape)} has a dimension that is not positive"
    if nbytes <= 0:
        return f"nbytes {nbytes} must be positive"
    expected = tensor_nbytes(shape, dtype)
    if nbytes != expected:
        return f"nbytes {nbytes} disagrees with shape {list(shape)} of {dtype}: expected {expected}"
    return TensorSpec(shape, dtype, nbytes)


MAX_NAMESPACE_BYTES = 512  # vLLM's namespaces (model, revision, encoder hash...) are ~200


def cluster_namespace(value: str) -> str:
    """An OpenPool's cluster namespace: the prefix of its entries' keys in the store."""
    if len(value.encode()) > MAX_NAMESPACE_BYTES:
        raise _invalid(f"cluster_namespace is longer than {MAX_NAMESPACE_BYTES} UTF-8 bytes")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise _invalid(f"cluster_namespace {value!r} holds a control character; expected text")
    return value


def pool_request(
    block_size_bytes: int, capacity_bytes: int, compat_key: str, max_entries: int = 0
) -> None:
    """A geometry to create the pool with (or attach with), or none at all: attach by name."""
    if len(compat_key.encode()) > MAX_COMPAT_KEY_BYTES:
        raise _invalid(f"compat_key is longer than {MAX_COMPAT_KEY_BYTES} bytes")
    if max_entries < 0:
        raise _invalid(
            f"max_entries {max_entries} is negative: expected a number of entries, or 0 for the "
            "daemon's default"
        )
    if block_size_bytes == 0 and capacity_bytes == 0:
        return
    if not 0 < block_size_bytes <= MAX_BLOCK_SIZE:
        raise _invalid(
            f"block_size_bytes {block_size_bytes} is out of range: expected 1 to {MAX_BLOCK_SIZE} "
            "(one embedding row: hidden size x element size), or 0 with capacity_bytes 0 to "
            "attach to an existing pool"
        )
    if capacity_bytes < block_size_bytes:
        raise _invalid(
            f"capacity_bytes {capacity_bytes} is less than one block of {block_size_bytes} bytes"
        )
    if capacity_bytes // block_size_bytes > MAX_BLOCKS:
        raise _invalid(
            f"capacity_bytes {capacity_bytes} makes {capacity_bytes // block_size_bytes} blocks of "
            f"{block_size_bytes} bytes: expected at most {MAX_BLOCKS}; use larger blocks"
        )


def wait_ms(value: int) -> int:
    if value > MAX_WAIT_MS:
        raise _invalid(f"wait_ms {value} is over the limit of {MAX_WAIT_MS}")
    return value


def client_name(value: str) -> str:
    if len(value) > MAX_CLIENT_NAME:
        raise _invalid(f"client_name is longer than {MAX_CLIENT_NAME} characters")
    return value
