"""Free-extent allocator over the blocks of one pool.

Free space is kept as maximal runs of free blocks ("extents"), indexed twice: by start (to find
the neighbours a freed extent coalesces with) and by (count, start) (to find the best fit).
Allocation and free are O(log n) in the number of free extents.

Invariant (checked by `check`): free extents never overlap, never touch (touching runs are always
merged) and both indexes hold the same set.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from sortedcontainers import SortedDict, SortedList

from ec_protocol.types import Extent


class ExtentAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._by_start: SortedDict = SortedDict()  # start -> count
        self._by_size: SortedList = SortedList()  # (count, start)
        self.free_blocks = 0
        self._insert(0, num_blocks)

    @classmethod
    def with_used(cls, num_blocks: int, used: Iterable[tuple[int, int]]) -> ExtentAllocator:
        """An allocator whose free space is everything but the `used` extents, as (start, count)
        pairs (recovery after a restart).

        Raises ValueError if used extents overlap or fall outside the pool. The free runs are
        the gaps between the used extents in order, indexed in one go: a pool of 100,000
        entries is rebuilt in milliseconds, not in 100,000 updates of the indexes. Pairs, not
        Extents: they sort and unpack in C.
        """
        runs, end = [], 0  # the free runs, and where the used extents so far end
        for start, count in sorted(used):
            if count <= 0 or start < end or start + count > num_blocks:
                raise ValueError(f"{Extent(start, count)} is not free")
            if start > end:
                runs.append((end, start - end))
            end = start + count
        if end < num_blocks:
            runs.append((end, num_blocks - end))
        allocator = cls(num_blocks)
        allocator._by_start = SortedDict(runs)
        allocator._by_size = SortedList((count, start) for start, count in runs)
        allocator.free_blocks = sum(count for _, count in runs)
        return allocator

    @property
    def free_extents(self) -> int:
        return len(self._by_size)

    @property
    def largest_free_extent(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def allocate(self, count: int, max_extents: int) -> list[Extent] | None:
        """Reserve `count` blocks in at most `max_extents` extents, or None (nothing changes).

        One contiguous extent if any free run is long enough (the smallest such run, to keep
        large runs for large entries); otherwise the largest runs, fewest first.
        """
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        if count > self.free_blocks:
            return None
        i = self._by_size.bisect_left((count, -1))
        if i < len(self._by_size):
            run_count, run_start = self._by_size[i]
            self._remove(run_start, run_count)
            if run_count > count:
                self._insert(run_start + count, run_count - count)
            return [Extent(run_start, count)]
        chosen: list[Extent] = []
        remaining = count
        for run_count, run_start in reversed(self._by_size):
            if len(chosen) == max_extents:
                return None
            chosen.append(Extent(run_start, min(run_count, remaining)))
            remaining -= chosen[-1].count
            if remaining == 0:
                break
        for extent in chosen:
            self.take(extent)
        return sorted(chosen)

    def take(self, extent: Extent) -> None:
        """Reserve exactly `extent`, which must lie inside one free run."""
        i = self._by_start.bisect_right(extent.start) - 1
        if i < 0 or extent.count <= 0:
            raise ValueError(f"{extent} is not free")
        run = Extent(*self._by_start.peekitem(i))
        if extent.end > run.end:
            raise ValueError(f"{extent} is not free")
        self._remove(run.start, run.count)
        if run.start < extent.start:
            self._insert(run.start, extent.start - run.start)
        if extent.end < run.end:
            self._insert(extent.end, run.end - extent.end)

    def free(self, extents: list[Extent] | tuple[Extent, ...]) -> None:
        """Return extents to the pool, merging each with free neighbours."""
        for extent in extents:
            start, end = extent.start, extent.end
            if extent.count <= 0 or start < 0 or end > self.num_blocks:
                raise ValueError(f"{extent} is outside the pool of {self.num_blocks} blocks")
            i = self._by_start.bisect_right(start) - 1
            if i >= 0:
                prev = Extent(*self._by_start.peekitem(i))
                if prev.end > start:
                    raise ValueError(f"double free: {extent} overlaps free {prev}")
                if prev.end == start:
                    self._remove(prev.start, prev.count)
                    start = prev.start
            j = self._by_start.bisect_left(extent.start)
            if j < len(self._by_start):
                nxt = Extent(*self._by_start.peekitem(j))
                if nxt.start < end:
                    raise ValueError(f"double free: {extent} overlaps free {nxt}")
                if nxt.start == end:
                    self._remove(nxt.start, nxt.count)
                    end = nxt.end
            self._insert(start, end - start)

    def free_runs(self) -> list[Extent]:
        return [Extent(start, count) for start, count in self._by_start.items()]

    def check(self) -> None:
        """Raise AssertionError unless the two indexes agree and runs are disjoint and maximal."""
        runs = self.free_runs()
        assert sorted((e.count, e.start) for e in runs) == list(self._by_size)
        assert sum(e.count for e in runs) == self.free_blocks
        for a, b in itertools.pairwise(runs):
            assert a.end < b.start, f"free runs {a} and {b} touch or overlap"
        assert all(e.start >= 0 and e.end <= self.num_blocks for e in runs)

    # Runs as plain (start, count) here: an Extent per run costs as much as the index update.

    def _insert(self, start: int, count: int) -> None:
        self._by_start[start] = count
        self._by_size.add((count, start))
        self.free_blocks += count

    def _remove(self, start: int, count: int) -> None:
        del self._by_start[start]
        self._by_size.remove((count, start))
        self.free_blocks -= count
