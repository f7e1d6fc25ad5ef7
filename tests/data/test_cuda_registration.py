"""Registration of pool mappings with CUDA, with the CUDA runtime replaced by a recorder (this
machine has no GPU; tests/gpu covers the real thing)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from ecd_testing import Daemon

from ec_client import Client, Consumer, Producer
from ec_client import mapping as mapping_module
from ec_client.mapping import PoolMapping

POOL = "cuda-reg"
BLOCK = 4096


@dataclass
class FakeCudart:
    fail: bool = False
    registered: list[tuple[int, int]] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((pointer, size))
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.unregistered.append(pointer)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(PoolMapping, "registrations", mapping_module.RegistrationStats())
    yield cudart


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 1024 * BLOCK)
        yield c


def test_a_large_mapping_is_registered_in_contiguous_chunks_and_unregistered_on_close(
    client: Client, fake_cuda: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mapping_module, "CUDA_REGISTER_CHUNK", 1 << 20)
    mapping = PoolMapping(client.pool_info(POOL))
    assert mapping.cuda_registered
    assert [size for _, size in fake_cuda.registered] == [1 << 20] * 4
    starts = [pointer for pointer, _ in fake_cuda.registered]
    assert starts == [starts[0] + i * (1 << 20) for i in range(4)]
    mapping.close()
    assert fake_cuda.unregistered == starts


def test_a_failed_registration_is_counted_and_warned_and_copies_still_work(
    client: Client, fake_cuda: FakeCudart
) -> None:
    fake_cuda.fail = True
    with pytest.warns(RuntimeWarning, match="memlock"):
        mapping = PoolMapping(client.pool_info(POOL))
    assert not mapping.cuda_registered
    assert PoolMapping.registrations.failed == 1
    Producer(client, POOL).put("still-works", torch.arange(100))
    loaded = Consumer(client, POOL).get("still-works")
    assert loaded is not None and torch.equal(loaded, torch.arange(100))


def test_each_pool_is_mapped_once_per_process(client: Client) -> None:
    info = client.pool_info(POOL)
    assert PoolMapping.open(info) is PoolMapping.open(info)
