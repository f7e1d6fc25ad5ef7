"""The directory comes back (docs/design.md §13): when the store has lost what this node
published, the node publishes its shared pools' READY entries again, batched and rate-limited,
so that every entry some node still holds is a remote hit again.

How the loss is seen, with no call on any hot path: the node's **mark**, a small value of
ecd's own under a key of its own (`ecd@node:` and 32 random hex digits, new at every start of
the daemon), put in the node's own segment and hard-pinned (the master never evicts it). The
store without it has lost what this node published: a master restarted without high
availability (its directory empty), a failover that lost the directory, or this node's segment
dropped by the master (its `--client_ttl` ran out while the node was cut off: the values there
went with it, the mark too). This task asks for it (one `batch_is_exist`, on the node's thread)
every MARK_EVERY_S while the node is connected, and at once when the node connects again; a
daemon just started finds none, so it offers its pools' entries too (its adopted entries' values
went with its old segment).

The mark missing, it is put back first (so that a loss after that is seen at the next check),
then every shared pool is walked: its slot table read a batch of READY entries at a time on the
node's thread (`ClusterNode.publish_again`: one lookup for the batch, then each entry the store
lacks lock-pinned and checked as a commit's publish is and put, one put for them; an entry
evicted or removed since is skipped), each batch queued behind the node's other work (publishes,
remote hits' lookups and reads), at most `rate` entries a second (`--republish-rate`): the
event loop only awaits. A pool seen shared for the first time (created, or reopened with its
namespace after a restart) is walked once; a walk cut short (the master stopped answering) is
walked again once the node is back.

The mark speaks for this node's own segment and the directory as a whole, not for one value: a
value this node holds but did not put (it found the key stored at its commit, or read it from
the store) lives in another node's segment, or in this node's segment of an earlier run, and it
goes with that segment (its node died: the master drops it after its `--client_ttl`) or when
someone removes it, with the mark still there. So each shared pool is also walked again `every`
seconds after its last walk ended (`--republish-every`): the same walk, one lookup per batch of
entries, a put only for those the store lacks, so that such an entry is a remote hit again
within that period and a walk. A publish the store answered with a refusal (full) is not tried
again, as a commit's is not: the store's eviction is its own to make (but for one a master that
has just taken over refuses before the segments are back with it: node.SETTLE_S). What a walk
fails to publish, or cannot, is not counted again: its commit's publish counted it.
`ClusterNode.republish_missing` (from any thread) has every pool walked again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ec_daemon.cluster.mooncake import StoreClient, answered, own_segment
from ec_daemon.cluster.node import OBJECT_ALREADY_EXISTS, ClusterNode, SharedPool
from ec_protocol.types import ClusterStats, PoolInfo

log = logging.getLogger("ecd.cluster")
T = TypeVar("T")

MARK_EVERY_S = 5.0  # how often a connected node asks whether the store still has its mark
TICK_S = 0.25  # how often the task looks at the node (no store call)
RETRY_S = 1.0  # how soon a mark the store could not take is put again
MARK_VALUE = b"ecd"  # its key says all: the value only has to be there


class Pools(Protocol):
    """What the republisher asks the daemon's store about pools (on the event loop)."""

    def engine_ids(self) -> list[str]: ...

    def cluster_namespace(self, engine_id: str) -> str: ...

    def pool_info(self, engine_id: str) -> PoolInfo: ...


class Republisher:
    """Publishes again what the store lost of this node's shared pools."""

    def __init__(
        self,
        node: ClusterNode,
        rate: int,
        every: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """rate: entries offered to the store a second, at most (--republish-rate); every:
        seconds from a pool's walk to its next (--republish-every; 0: none but those a lost
        mark or republish_missing asks for)."""
        self._node = node
        self._rate = rate
        self._every = every
        self._clock = clock
        self._wall = wall
        self.mark_key = f"ecd@node:{os.urandom(16).hex()}"
        self._pools: Pools | None = None
        self._marked = False  # the mark put since the store was last found without it
        # (engine_id, pool_uuid) of the pools walked to their end since the mark was last put:
        # when (self._clock) the last walk of each ended
        self._walked: dict[tuple[str, str], float] = {}
        self._task: asyncio.Task[None] | None = None
        self.republished = self.batches = 0
        self.last = 0.0  # Unix time a walk that put entries ended; 0: never

    def bind(self, pools: Pools) -> None:
        self._pools = pools

    def start(self) -> None:
        """Follow the node (on the running event loop) until stop."""
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def stats(self, node: ClusterStats) -> ClusterStats:
        """The node's stats with the republishing counters."""
        return dataclasses.replace(
            node,
            republished=self.republished,
            republish_batches=self.batches,
            last_republish=self.last,
        )

    async def _run(self) -> None:
        due = 0.0  # when the mark is asked for next
        while True:
            await asyncio.sleep(TICK_S)
            if not (self._node.joined and self._node.connected):
                due = 0.0  # asked for at once when the node is back
                continue
            if self._node.republish_wanted():
                self._walked.clear()
            if self._clock() >= due:
                due = self._clock() + MARK_EVERY_S
                if not await self._check_mark():
                    due = self._clock() + RETRY_S
            if self._marked:
                await self._walk()

    async def _check_mark(self) -> bool:
        """Whether the store has the mark, put back (every pool to be walked again) if it had
        lost it; False if the master did not answer or the mark could not be put."""
        present = await self._ask(self._has_mark)
        if present is None:
            return False
        if present:
            return True
        if self._marked:
            log.warning(
                "the store lost what this node published: publishing its shared pools again",
                extra={"master": self._node.settings.master, "mark": self.mark_key},
            )
        self._walked.clear()
        self._marked = bool(await self._ask(self._put_mark))
        return self._marked

    def _has_mark(self, store: StoreClient) -> bool | None:
        found = store.batch_is_exist([self.mark_key])
        return found == [1] if answered(found) else None

    def _put_mark(self, store: StoreClient) -> bool:
        """Put the mark in this node's segment, hard-pinned; where the master places it if that
        segment cannot take it (the node lends the store none)."""
        config = own_segment(store)
        config.with_hard_pin = True
        result = store.put(self.mark_key, MARK_VALUE, config)
        if result not in (0, OBJECT_ALREADY_EXISTS):
            config.preferred_segment = ""
            result = store.put(self.mark_key, MARK_VALUE, config)
        return result in (0, OBJECT_ALREADY_EXISTS)

    async def _walk(self) -> None:
        """Walk each shared pool not walked whole since the store last lost the mark, or not
        for `every` seconds."""
        for pool in self._shared():
            walked = (pool.info.engine_id, pool.info.pool_uuid)
            if self._due(walked) and await self._offer(pool):
                self._walked[walked] = self._clock()

    def _due(self, walked: tuple[str, str]) -> bool:
        ended = self._walked.get(walked)
        return ended is None or (self._every > 0 and self._clock() - ended >= self._every)

    def _shared(self) -> list[SharedPool]:
        pools = self._pools
        if pools is None:
            return []
        shared = ((e, pools.cluster_namespace(e)) for e in pools.engine_ids())
        return [SharedPool(ns, pools.pool_info(e)) for e, ns in shared if ns]

    async def _offer(self, pool: SharedPool) -> bool:
        """Offer the store the pool's READY entries again, a batch at a time, at most `rate`
        a second; whether the walk reached the end of the pool's table."""
        slot: int | None = 0
        put, due = 0, self._clock()
        while slot is not None:
            if not self._node.connected:  # each call would fail: the walk goes on when back
                return False
            step = await self._ask(self._node.publish_again(pool, slot))
            if step is None:
                return False
            if step.offered:
                self.batches += 1
            self.republished += step.put
            put += step.put
            slot = step.next_slot
            due = max(due, self._clock()) + step.offered / self._rate
            await asyncio.sleep(due - self._clock())
        if put:
            self.last = self._wall()
            log.info(
                "published entries of a shared pool again",
                extra={"engine_id": pool.info.engine_id, "entries": put},
            )
        return True

    async def _ask(self, work: Callable[[StoreClient], T]) -> T | None:
        """`work` run on the node's thread; None if it could not be (the master gone)."""
        try:
            return await asyncio.wrap_future(self._node.ask(work))
        except Exception as exc:
            log.debug("a republish call failed", extra={"why": str(exc) or type(exc).__name__})
            return None
