"""The pure parts of the copy path: registration chunks, copies cut at chunk boundaries, device
names, waiting for transfers.

Proves: registration chunks are whole blocks on 2 MiB boundaries, covering the region; a copy
is cut exactly where it crosses a chunk boundary and nowhere else; "cuda" means the current
device; waiting for a batch waits for every transfer even when one fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_client.data.mapping import Span, chunk_bytes, register_chunks, split_at
from ec_client.data.mover import Transfer, cuda_device, wait_all


def test_a_chunk_is_the_most_whole_blocks_and_whole_2_mib_under_the_limit() -> None:
    assert chunk_bytes(7168, 8 << 30) == 585 * (14 << 20)  # 7168 and 2 MiB meet every 14 MiB
    assert chunk_bytes(4096, 8 << 30) == 8 << 30


def test_a_chunk_below_one_common_multiple_is_one_common_multiple() -> None:
    assert chunk_bytes(7168, 1 << 20) == 14 << 20


@given(block=st.integers(1, 70_000), blocks=st.integers(1, 5_000), limit=st.integers(1, 1 << 30))
def test_registration_chunks_are_whole_blocks_on_2_mib_boundaries_covering_the_region(
    block: int, blocks: int, limit: int
) -> None:
    chunk = chunk_bytes(block, limit)
    pieces = register_chunks(blocks * block, chunk)
    assert all(length % block == 0 and 0 < length <= chunk for _, length in pieces)
    assert all(offset % (2 << 20) == 0 for offset, _ in pieces)
    assert [offset for offset, _ in pieces] == list(range(0, blocks * block, chunk))
    assert sum(length for _, length in pieces) == blocks * block


def test_a_copy_crossing_chunk_boundaries_is_cut_at_each_one() -> None:
    assert split_at([(900, 0, 2500)], 1000) == [
        (900, 0, 100),
        (1000, 100, 1000),
        (2000, 1100, 1000),
        (3000, 2100, 400),
    ]


def test_a_copy_inside_one_chunk_is_left_whole() -> None:
    assert split_at([(1000, 0, 1000), (2500, 1000, 10)], 1000) == [
        (1000, 0, 1000),
        (2500, 1000, 10),
    ]


def byte_pairs(plan: list[Span]) -> list[tuple[int, int]]:
    """Every (pool byte, tensor byte) a plan of copies moves, in order."""
    return [(pool_at + i, at + i) for pool_at, at, length in plan for i in range(length)]


@settings(deadline=None)  # a loaded 2-core machine: an example can take a second
@given(
    copies=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 4096)), max_size=8),
    chunk=st.integers(1, 8192),
)
def test_cut_copies_move_the_same_bytes_and_none_crosses_a_chunk(
    copies: list[tuple[int, int]], chunk: int
) -> None:
    offsets = [sum(length for _, length in copies[:i]) for i in range(len(copies))]
    plan = [(pool_at, at, length) for (pool_at, length), at in zip(copies, offsets, strict=True)]
    pieces = split_at(plan, chunk)
    assert byte_pairs(pieces) == byte_pairs(plan)
    assert all(pool_at // chunk == (pool_at + length - 1) // chunk for pool_at, _, length in pieces)


def test_an_unindexed_cuda_device_means_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert cuda_device("cuda") == torch.device("cuda", 3)
    assert cuda_device(torch.device("cuda")) == torch.device("cuda", 3)


def test_indexed_and_cpu_devices_are_kept() -> None:
    assert cuda_device("cuda:1") == torch.device("cuda", 1)
    assert cuda_device("cpu") == torch.device("cpu")


@dataclass
class Fence:
    """An event stand-in: records that it was waited for, and may fail like a CUDA error."""

    name: str
    log: list[str]
    fails: bool = False

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"CUDA error in {self.name}")


def test_waiting_for_transfers_waits_for_every_one_then_raises_the_first_error() -> None:
    log: list[str] = []
    transfers = [
        Transfer(Fence("a", log, fails=True)),
        Transfer(Fence("b", log)),
        Transfer(Fence("c", log, fails=True)),
    ]
    with pytest.raises(RuntimeError, match="in a"):
        wait_all(transfers)
    assert log == ["a", "b", "c"]


def test_a_transfer_is_done_only_when_its_event_fired() -> None:
    assert Transfer().done()
    assert not Transfer(Fence("a", [])).done()
