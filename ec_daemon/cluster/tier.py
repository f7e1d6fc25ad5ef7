"""The cluster tier as the rest of the daemon sees it (docs/design.md §13): one object, made when
the daemon has `--store-master`, that the server starts and stops and the service asks for
remote hits. The core reaches the node only through the two callables it is built with (every
event it emits, for publishing; the node's Stats)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ec_client.types import StepResult
from ec_daemon.cluster.fetch import ClusterFetch
from ec_daemon.cluster.node import ClusterNode
from ec_daemon.cluster.republish import Republisher


class Cluster:
    """This daemon's part in the store: the node's thread, which owns the store client and
    publishes, the fetches that answer remote hits through it, and the republisher that
    publishes again what the store lost."""

    def __init__(self, node: ClusterNode, fetches: ClusterFetch, republisher: Republisher) -> None:
        self._node = node
        self._fetches = fetches
        self._republisher = republisher

    @property
    def connected(self) -> bool:
        """Whether the store's master answered the node's last call."""
        return self._node.connected

    def settle(self) -> None:
        """While the master does not answer, fail (counted) the publishes and lookups still
        queued for the node's thread, which a hung store call may hold for 30 s."""
        self._node.settle()

    def start(self) -> None:
        """Join the store on the node's thread (again and again while its master is away), and
        follow what the store keeps of the node's entries (on the running event loop)."""
        self._node.start()
        self._republisher.start()

    async def fetch(
        self, session_id: str, engine_id: str, keys: Sequence[bytes], wait_ms: int
    ) -> None:
        """Read the keys of a shared pool that are not here but that the store has, and wait
        for them up to the longer of wait_ms and the fetch timeout."""
        await self._fetches.fetch(session_id, engine_id, keys, wait_ms)

    async def step(
        self,
        session_id: str,
        engine_id: str,
        acquires: Sequence[bytes],
        local: Callable[[bool], StepResult],
    ) -> StepResult:
        """A Step's answer: `local` (the core's step, given whether to count the acquires'
        misses), then the acquires it missed that the store has read, and their misses counted
        (ClusterFetch.step)."""
        return await self._fetches.step(session_id, engine_id, acquires, local)

    async def stop(self, grace_s: float) -> None:
        """Stop republishing, abort the fetches in flight, then leave the store: before the pool
        files close, since the node reads them."""
        await self._republisher.stop()
        await self._fetches.close()
        await asyncio.to_thread(self._node.stop, grace_s)
