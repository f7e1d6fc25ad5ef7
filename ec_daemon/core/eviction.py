"""Eviction policies: which READY entry goes first when an allocation needs space.

As in Ray's plasma store, the policy only chooses; the index tells it of lifecycle events and
evicts what it proposes. It sees every READY entry, pinned or not: the index skips pinned ones, so
a pin does not change an entry's place in line.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def on_ready(self, key: bytes) -> None:
        """The entry was committed."""

    def on_ready_many(self, keys: Iterable[bytes]) -> None:
        """on_ready of each key, in order: the entries re-adopted after a restart, oldest commit
        first (100,000 of them in a large pool: one call, not one each)."""

    def on_access(self, key: bytes) -> None:
        """A consumer hit the entry."""

    def on_removed(self, key: bytes) -> None:
        """The entry left the index (evicted, deleted, or its pool dropped)."""

    def candidates(self) -> Iterator[bytes]:
        """READY keys, first victim first, lazily: finish iterating before removing any."""
        ...


class FIFOPolicy:
    """Evict in commit order, as vLLM's ECCPUConnector does; hits do not matter."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_ready(self, key: bytes) -> None:
        self._order[key] = None

    def on_ready_many(self, keys: Iterable[bytes]) -> None:
        # In C, as on_ready one by one: a key already in line keeps its place.
        self._order.update(zip(keys, itertools.repeat(None)))

    def on_access(self, key: bytes) -> None:
        pass

    def on_removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)


class LRUPolicy(FIFOPolicy):
    """Evict the least recently committed or hit entry first."""

    def on_access(self, key: bytes) -> None:
        self._order.move_to_end(key)


POLICIES: dict[str, type[FIFOPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy}
