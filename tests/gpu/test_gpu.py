"""The CUDA path, on a machine with a GPU (skipped elsewhere): `make test-gpu`.

Proves: saves from GPU and loads to GPU are bit-identical; the mover's stream waits for the
producer's kernels and the caller's stream waits for loads (no host sync needed to use a loaded
tensor); commits happen only after the device-to-host copy landed; the pool is registered with
CUDA. Prints D2H/H2D bandwidth from the registered pool against torch pinned and pageable memory.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from ecd_testing import Daemon

from ec_client import Client, Consumer, EntryState, PoolMapping, Producer, PutStatus, TensorMover
from ec_client.mover import byte_view

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POOL = "gpu"
BLOCK = 7168
MiB = 1 << 20


@pytest.fixture
def client(daemon: Daemon) -> Client:
    with daemon.client(name="gpu") as c:
        c.open_pool(POOL, BLOCK, 200 * MiB // BLOCK * BLOCK)
        yield c  # type: ignore[misc]


def test_the_pool_mapping_is_registered_with_cuda(client: Client) -> None:
    mapping = PoolMapping.open(client.pool_info(POOL))
    assert mapping.cuda_registered
    assert PoolMapping.registrations.failed == 0


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
)
def test_gpu_save_and_gpu_load_are_bit_identical(client: Client, dtype: torch.dtype) -> None:
    tensor = torch.randn(1024, 3584, device="cuda").to(dtype)
    assert Producer(client, POOL).put(f"t-{dtype}", tensor) is PutStatus.STORED
    loaded = Consumer(client, POOL).get(f"t-{dtype}", device="cuda")
    assert loaded is not None and loaded.device.type == "cuda"
    assert torch.equal(byte_view(loaded), byte_view(tensor))


def test_a_save_waits_for_the_kernels_that_produced_the_tensor(client: Client) -> None:
    base = torch.randn(4096, 4096, device="cuda")
    tensor = base @ base  # still running when the save is issued
    Producer(client, POOL).put("matmul", tensor)
    expected = tensor.cpu()
    loaded = Consumer(client, POOL).get("matmul")
    assert loaded is not None and torch.equal(loaded, expected)


def test_the_callers_stream_is_ordered_after_a_load(client: Client) -> None:
    cpu = torch.arange(64 * MiB // 4, dtype=torch.float32)
    Producer(client, POOL).put("ordered", cpu)
    handle = Consumer(client, POOL).get_many_async(["ordered"], device="cuda")
    loaded = handle.wait()["ordered"]
    assert loaded is not None
    total = loaded.sum()  # on the current stream, no host sync before it
    assert total.item() == cpu.sum().item()


def test_a_commit_happens_only_after_the_copy_landed(client: Client) -> None:
    producer = Producer(client, POOL)
    tensor = torch.randn(8192, 3584, device="cuda", dtype=torch.bfloat16)
    handle = producer.put_many_async({"late": tensor})
    assert client.lookup(POOL, ["late"])[0].state is EntryState.PENDING
    handle.wait()
    assert handle.done()
    assert client.lookup(POOL, ["late"])[0].state is EntryState.READY


def _gbs(nbytes: int, copy: object, runs: int = 10) -> float:
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        started = time.perf_counter()
        copy()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def test_print_bandwidth_of_registered_pool_memory_against_pinned_and_pageable(
    client: Client,
) -> None:
    size = 64 * MiB
    mapping = PoolMapping.open(client.pool_info(POOL))
    mover = TensorMover(mapping, "cuda")
    region = mapping.flat[:size]
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.fill_(1)
    rows = {
        "pool (registered)": (
            _gbs(size, lambda: region.copy_(device, non_blocking=True)),
            _gbs(size, lambda: device.copy_(region, non_blocking=True)),
        ),
        "torch pinned": (
            _gbs(size, lambda: pinned.copy_(device, non_blocking=True)),
            _gbs(size, lambda: device.copy_(pinned, non_blocking=True)),
        ),
        "torch pageable": (
            _gbs(size, lambda: pageable.copy_(device)),
            _gbs(size, lambda: device.copy_(pageable)),
        ),
    }
    print(f"\n64 MiB copies, GB/s (median of 10), registered={mapping.cuda_registered}")
    print(f"{'memory':<20} {'D2H':>8} {'H2D':>8}")
    for name, (d2h, h2d) in rows.items():
        print(f"{name:<20} {d2h:>8.1f} {h2d:>8.1f}")
    assert mover.stream is not None
    registered_h2d, pinned_h2d = rows["pool (registered)"][1], rows["torch pinned"][1]
    assert registered_h2d > 0.5 * pinned_h2d, "registered pool memory copies like pageable memory"
