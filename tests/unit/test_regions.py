"""The shared pools' data regions as the cluster node maps them (ec_daemon/cluster/regions.py):
an entry's byte runs, and regions that a late transfer may still touch after they are let go."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from ec_client import Extent
from ec_daemon.cluster.regions import MappedRegions, byte_runs

BLOCK = 4096
DATA_OFFSET = 4096  # where a test "pool file" keeps its data region (a page, as mmap needs)


def pool_file(directory: Path, name: str, data: bytes) -> Path:
    """A file with a header page of zeros and then `data`, like a pool file's data region."""
    path = directory / name
    path.write_bytes(bytes(DATA_OFFSET) + data)
    return path


def test_an_entrys_byte_runs_follow_its_extents_and_stop_at_its_size() -> None:
    runs = list(byte_runs([Extent(5, 2), Extent(1, 1)], BLOCK, 2 * BLOCK + 100))
    assert runs == [(5 * BLOCK, 2 * BLOCK), (BLOCK, 100)]


def test_extents_holding_fewer_bytes_than_the_entry_are_refused() -> None:
    with pytest.raises(ValueError, match="hold fewer than"):
        list(byte_runs([Extent(0, 1)], BLOCK, BLOCK + 1))


def test_a_region_the_file_does_not_have_is_refused(shm_dir: Path) -> None:
    regions = MappedRegions()
    path = pool_file(shm_dir, "small", bytes(BLOCK))
    with pytest.raises(ValueError, match="has no region of 8192 bytes"):
        regions.map("small", path, DATA_OFFSET, 2 * BLOCK)


def test_a_pool_mapped_twice_is_refused(shm_dir: Path) -> None:
    regions = MappedRegions()
    regions.map("p", pool_file(shm_dir, "one", bytes(BLOCK)), DATA_OFFSET, BLOCK)
    try:
        with pytest.raises(ValueError, match="mapped already"):
            regions.map("p", pool_file(shm_dir, "again", bytes(BLOCK)), DATA_OFFSET, BLOCK)
    finally:
        regions.unmap_all()


def test_a_retired_region_stays_mapped_but_no_longer_touches_the_file(shm_dir: Path) -> None:
    """A late access by the store's transfer engine (a publish's read, or an abandoned remote
    hit landing) must neither crash the daemon nor reach a pool file that is gone or reused."""
    regions = MappedRegions()
    path = pool_file(shm_dir, "src", b"\x5a" * BLOCK)
    region = regions.map("p", path, DATA_OFFSET, BLOCK)
    try:
        assert ctypes.string_at(region.address, 4) == b"\x5a" * 4
        regions.retire("p")

        assert ctypes.string_at(region.address, BLOCK) == bytes(BLOCK)
        ctypes.memset(region.address, 0x11, BLOCK)
        assert path.read_bytes()[DATA_OFFSET:] == b"\x5a" * BLOCK
    finally:
        regions.unmap_all()
