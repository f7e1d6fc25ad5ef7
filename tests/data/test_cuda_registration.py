"""Registration of pool mappings with CUDA, with the CUDA runtime replaced by a fake that keeps
errors as the real one does (this machine has no GPU; tests/gpu covers the real thing).

Proves: only a CUDA mover registers, once per mapping; chunks are whole blocks and are
unregistered on close; a failed registration undoes the chunks already registered, leaves no
pending CUDA error behind, names CUDA's error, and copies still work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from cuda_fakes import FakeCudart, install_fake_cuda
from ecd_testing import Daemon, unmap_pools

from ec_client import Client, Consumer, Producer
from ec_client.data import mapping as mapping_module
from ec_client.data.mapping import PoolMapping
from ec_client.data.mover import TensorMover

POOL = "cuda-reg"
BLOCK = 3072  # not a divisor of 2 MiB: chunks are multiples of both, 6 MiB
BLOCKS = 6826  # 20 MiB: four chunks, the last one short


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    monkeypatch.setattr(mapping_module, "CUDA_REGISTER_CHUNK", 1 << 20)
    yield install_fake_cuda(monkeypatch)
    unmap_pools()  # while the fake runtime is there to unregister


@pytest.fixture
def client(daemon: Daemon) -> Client:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, BLOCKS * BLOCK)
        yield c  # type: ignore[misc]


def mapping(client: Client) -> PoolMapping:
    return PoolMapping.open(client.pool_info(POOL))


def test_mapping_a_pool_does_not_register_it(client: Client, fake_cuda: FakeCudart) -> None:
    assert not mapping(client).cuda_registered
    assert fake_cuda.register_calls == 0


def test_cpu_copies_never_register_the_pool_even_with_cuda_present(
    client: Client, fake_cuda: FakeCudart
) -> None:
    Producer(client, POOL).put("cpu", torch.arange(1000))
    assert Consumer(client, POOL).get("cpu") is not None
    assert fake_cuda.register_calls == 0


def test_a_cuda_mover_registers_the_pool_once_per_mapping(
    client: Client, fake_cuda: FakeCudart
) -> None:
    pool = mapping(client)
    TensorMover(pool, "cuda")
    calls = fake_cuda.register_calls
    TensorMover(pool, "cuda:0")
    assert pool.cuda_registered and calls > 0
    assert fake_cuda.register_calls == calls
    assert PoolMapping.registrations.registered == 1


def test_registration_chunks_are_whole_blocks_on_2_mib_boundaries_covering_the_pool(
    client: Client, fake_cuda: FakeCudart
) -> None:
    pool = mapping(client)
    pool.register_cuda(torch.device("cuda", 0))
    sizes = [size for _, size in fake_cuda.registered]
    assert sizes[:-1] == [6 << 20] * 3 and sizes[-1] % BLOCK == 0
    assert sum(sizes) == BLOCKS * BLOCK
    starts = [pointer for pointer, _ in fake_cuda.registered]
    ends = [pointer + size for pointer, size in fake_cuda.registered]
    assert starts[0] == pool.flat.data_ptr() and starts[1:] == ends[:-1]
    assert all((start - starts[0]) % (2 << 20) == 0 for start in starts)


def test_closing_a_mapping_unregisters_every_chunk(client: Client, fake_cuda: FakeCudart) -> None:
    pool = mapping(client)
    pool.register_cuda(torch.device("cuda", 0))
    pool.close()
    assert fake_cuda.registered and not fake_cuda.pinned


def test_a_failed_registration_leaves_no_cuda_error_for_the_next_kernel(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at = 2
    with pytest.warns(RuntimeWarning):
        registered = mapping(client).register_cuda(torch.device("cuda", 0))
    assert not registered
    fake_cuda.launch()  # raises if the error were still pending


def test_a_failed_registration_unregisters_the_chunks_already_registered(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at = 2
    with pytest.warns(RuntimeWarning):
        mapping(client).register_cuda(torch.device("cuda", 0))
    assert len(fake_cuda.registered) == 2 and not fake_cuda.pinned


def test_a_failed_registration_is_reported_with_cudas_own_error(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at = 0
    with pytest.warns(RuntimeWarning, match="already mapped") as warned:
        mapping(client).register_cuda(torch.device("cuda", 0))
    assert "memlock" not in str(warned[0].message)  # that hint only fits out-of-memory
    assert PoolMapping.registrations.failed == 1


def test_an_out_of_memory_registration_points_at_the_memlock_limit(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at, fake_cuda.error = 0, 2
    with pytest.warns(RuntimeWarning, match=r"out of memory.*memlock"):
        mapping(client).register_cuda(torch.device("cuda", 0))


def test_a_failed_registration_is_not_retried_by_the_next_mover(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at = 0
    pool = mapping(client)
    with pytest.warns(RuntimeWarning):
        TensorMover(pool, "cuda")
    TensorMover(pool, "cuda")
    assert fake_cuda.register_calls == 1 and PoolMapping.registrations.failed == 1


def test_copies_still_work_after_a_failed_registration(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail_at = 0
    with pytest.warns(RuntimeWarning):
        mapping(client).register_cuda(torch.device("cuda", 0))
    Producer(client, POOL).put("still-works", torch.arange(100))
    loaded = Consumer(client, POOL).get("still-works")
    assert loaded is not None and torch.equal(loaded, torch.arange(100))


def test_without_libcudart_in_the_process_the_pool_is_left_unregistered(
    client: Client, fake_cuda: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapping_module, "cuda_runtime", lambda: None)
    with pytest.warns(RuntimeWarning, match="libcudart is not loaded"):
        assert not mapping(client).register_cuda(torch.device("cuda", 0))


def test_each_pool_is_mapped_once_per_process(client: Client) -> None:
    info = client.pool_info(POOL)
    assert PoolMapping.open(info) is PoolMapping.open(info)
