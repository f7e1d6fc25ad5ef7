"""The cluster tier as the rest of the daemon sees it (docs/design.md §13): one object, made when
the daemon has `--store-master`, that the server starts and stops and the service asks for
remote hits. The core reaches it only through the two callables it is built with (`on_event`,
for every event it emits; `stats`, the node's ClusterStats): the cluster's policy (what is
published, claimed, counted) stays in ec_daemon.cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ec_daemon.cluster.fetch import ClusterFetch
from ec_daemon.cluster.node import ClusterNode
from ec_daemon.cluster.pending import Claims
from ec_daemon.cluster.republish import Republisher
from ec_daemon.core.store import Store
from ec_daemon.core.waits import WaitFor, Waits
from ec_protocol.types import ClusterStats, StepResult, WatchEvent


class Cluster:
    """This daemon's part in the store: the node's thread, which owns the store client and
    publishes, the claims of single flight, the fetches that answer remote hits through the
    node, and the republisher that publishes again what the store lost. Made before the store
    (which is built with its on_event and stats), then bound to it."""

    def __init__(
        self, node: ClusterNode, claims: Claims, republisher: Republisher, pull_timeout_s: float
    ) -> None:
        self._node = node
        self._claims = claims
        self._republisher = republisher
        self._pull_timeout_s = pull_timeout_s
        self._bound: ClusterFetch | None = None

    def bind(self, store: Store, waits: Waits, wait_for: WaitFor) -> None:
        """Give the parts the store they serve (before its pools are adopted), and the daemon's
        waits, which the fetches are registered with, and what waits for them."""
        fetches = ClusterFetch(store, self._node, self._pull_timeout_s, waits, wait_for)
        self._node.bind(store)
        self._claims.bind(store, waits.fetching, fetches.waits)
        self._republisher.bind(store)
        self._bound = fetches

    @property
    def _fetches(self) -> ClusterFetch:
        if self._bound is None:
            raise RuntimeError("the cluster is not bound to a store")
        return self._bound

    def on_event(self, event: WatchEvent) -> None:
        """Every event the core emits (on the event loop): to the node, then to the claims (a
        commit's publish is queued before its marker's removal)."""
        self._node.on_event(event)
        self._claims.on_event(event)

    def stats(self) -> ClusterStats:
        """The node's stats with the single-flight and the republishing counters."""
        return self._republisher.stats(self._claims.stats(self._node.stats()))

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
