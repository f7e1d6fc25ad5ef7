"""ExtentAllocator: contiguous first, best fit, coalescing, bounded fragmentation."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_daemon.core.allocator import Extent, ExtentAllocator


def test_a_fresh_allocator_has_one_free_run_of_every_block() -> None:
    allocator = ExtentAllocator(100)
    assert allocator.free_runs() == [Extent(0, 100)]
    assert allocator.free_blocks == 100


def test_allocation_is_one_contiguous_extent_when_a_run_is_long_enough() -> None:
    allocator = ExtentAllocator(100)
    assert allocator.allocate(30, max_extents=4) == [Extent(0, 30)]
    assert allocator.free_runs() == [Extent(30, 70)]


def test_best_fit_takes_the_smallest_run_that_fits() -> None:
    allocator = ExtentAllocator.with_used(100, [(10, 10), (25, 75)])
    # free runs: [0,10) and [20,25); a 4-block entry goes in the 5-block hole
    assert allocator.allocate(4, max_extents=4) == [Extent(20, 4)]


def test_freed_neighbours_coalesce_into_one_run() -> None:
    allocator = ExtentAllocator(30)
    a, b, c = (allocator.allocate(10, 1) for _ in range(3))
    assert a and b and c
    allocator.free(a)
    allocator.free(c)
    assert allocator.free_extents == 2
    allocator.free(b)
    assert allocator.free_runs() == [Extent(0, 30)]
    allocator.check()


def test_fragmented_space_is_allocated_as_several_extents_largest_first() -> None:
    allocator = ExtentAllocator.with_used(20, [(3, 2), (9, 2), (14, 6)])
    # free runs: [0,3) [5,9) [11,14) -> 3 + 4 + 3 blocks
    extents = allocator.allocate(8, max_extents=4)
    assert extents is not None
    assert sum(e.count for e in extents) == 8
    assert Extent(5, 4) in extents  # the largest run is used whole
    assert allocator.free_blocks == 2
    allocator.check()


def test_allocation_needing_more_extents_than_allowed_fails_and_changes_nothing() -> None:
    allocator = ExtentAllocator.with_used(20, [(3, 2), (9, 2), (14, 6)])
    before = allocator.free_runs()
    assert allocator.allocate(8, max_extents=2) is None
    assert allocator.free_runs() == before


def test_allocation_larger_than_free_space_fails() -> None:
    allocator = ExtentAllocator(10)
    assert allocator.allocate(11, max_extents=4) is None


def test_double_free_is_refused() -> None:
    allocator = ExtentAllocator(10)
    extents = allocator.allocate(4, 1)
    assert extents is not None
    allocator.free(extents)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(extents)


def test_rebuilding_from_overlapping_used_extents_is_refused() -> None:
    with pytest.raises(ValueError, match="not free"):
        ExtentAllocator.with_used(10, [(0, 5), (4, 2)])


@pytest.mark.parametrize("used", [[(8, 3)], [(-1, 2)], [(3, 0)], [(2, 2)] * 2])
def test_rebuilding_from_used_extents_outside_the_pool_empty_or_twice_is_refused(
    used: list[tuple[int, int]],
) -> None:
    with pytest.raises(ValueError, match="not free"):
        ExtentAllocator.with_used(10, used)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=30), st.randoms())
def test_rebuilding_from_used_extents_frees_exactly_the_gaps_between_them(
    gaps_and_counts: list[tuple[int, int]], rng: random.Random
) -> None:
    used, start = [], 0
    for gap, count in gaps_and_counts:
        used.append(Extent(start + gap, count))
        start += gap + count
    num_blocks = start + 3
    rng.shuffle(used)
    allocator = ExtentAllocator.with_used(num_blocks, [(e.start, e.count) for e in used])
    allocator.check()
    taken = ExtentAllocator(num_blocks)  # the same, one extent at a time
    for extent in used:
        taken.take(extent)
    assert allocator.free_runs() == taken.free_runs()
    assert allocator.free_blocks == taken.free_blocks == num_blocks - sum(e.count for e in used)
    assert allocator.largest_free_extent == taken.largest_free_extent


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_random_allocations_and_frees_keep_every_block_in_exactly_one_place(
    ops: list[tuple[bool, int]],
) -> None:
    allocator = ExtentAllocator(128)
    held: list[list[Extent]] = []
    for allocate, size in ops:
        if allocate or not held:
            extents = allocator.allocate(size, max_extents=3)
            if extents is not None:
                assert sum(e.count for e in extents) == size
                held.append(extents)
        else:
            allocator.free(held.pop(size % len(held)))
        allocator.check()
        runs = sorted([e for h in held for e in h] + allocator.free_runs())
        assert sum(e.count for e in runs) == 128
        assert all(a.end <= b.start for a, b in itertools.pairwise(runs))


def test_an_extent_is_a_frozen_value_built_by_position_or_by_name() -> None:
    extent = Extent(3, count=4)
    assert (extent.start, extent.count, extent.end) == (3, 4, 7)
    assert extent == Extent(start=3, count=4) and hash(extent) == hash(Extent(3, 4))
    assert sorted([Extent(3, 5), extent, Extent(1, 9)]) == [Extent(1, 9), extent, Extent(3, 5)]
    assert dataclasses.replace(extent, count=1) == Extent(3, 1)
    assert pickle.loads(pickle.dumps(extent)) == extent
    with pytest.raises(dataclasses.FrozenInstanceError):
        extent.start = 0  # type: ignore[misc]
