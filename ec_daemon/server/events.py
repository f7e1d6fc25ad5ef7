"""Fan-out of core events to the RPCs that wait on them: Acquire with wait_ms and Watch streams.

The core publishes synchronously from inside a handler; waiters are asyncio futures and queues on
the same (single) event loop, so a waiter registered in the same synchronous step as the lookup
that found a key PENDING cannot miss the commit that follows.
"""

from __future__ import annotations

import asyncio
import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ec_client.types import EventType, WatchEvent
from ec_daemon.core.errors import CoreError


class StreamEnd(enum.Enum):
    """Why a Watch stream's queue ends."""

    OVERFLOW = "overflow"  # the subscriber fell too far behind: it must resubscribe
    SHUTDOWN = "shutdown"  # the daemon is stopping: end the stream now, not at the grace deadline


@dataclass(eq=False)
class Subscription:
    """A Watch stream's queue. A subscriber that falls `limit` events behind is cut off rather
    than let the daemon's memory grow without bound. A stream ended by a CoreError ends with
    that error (its caller is no longer allowed to watch: a reload of the token file)."""

    engine_id: str
    limit: int
    include_pending: bool = False  # also PENDING events (entries allocated, being written)
    queue: asyncio.Queue[WatchEvent | StreamEnd | CoreError] = field(default_factory=asyncio.Queue)
    ended: bool = False
    # The Watch call's task: done once the stream's end (its final status) has been written to
    # the client's connection (grpc.aio sends it from the task that ran the handler).
    call: asyncio.Future[Any] | None = None

    def offer(self, event: WatchEvent) -> None:
        if self.ended or (self.engine_id and event.engine_id != self.engine_id):
            return
        if event.type is EventType.PENDING and not self.include_pending:
            return
        if self.queue.qsize() >= self.limit:
            self.end(StreamEnd.OVERFLOW)
        else:
            self.queue.put_nowait(event)

    def end(self, why: StreamEnd | CoreError) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(why)


class EventHub:
    def __init__(self, watch_queue_limit: int = 100_000) -> None:
        self._waiters: dict[tuple[str, bytes], list[asyncio.Future[None]]] = defaultdict(list)
        self._subscriptions: set[Subscription] = set()
        self._watch_queue_limit = watch_queue_limit
        self.waits_ended = False  # the daemon is stopping: no wait lasts any longer
        self.streams_shut = False  # the daemon is stopping: every Watch stream ends at once
        self._ending: set[asyncio.Future[Any]] = set()  # the calls of streams shut_down ended

    def publish(self, event: WatchEvent) -> None:
        # Any other event about a key settles its waiters: it became READY or went away. A
        # dropped pool settles every waiter of that pool. An allocation settles nothing: the
        # waiters wait for the commit.
        settled: list[tuple[str, bytes]]
        if event.type is EventType.PENDING:
            settled = []
        elif event.type is EventType.POOL_DROPPED:
            settled = [k for k in self._waiters if k[0] == event.engine_id]
        else:
            settled = [(event.engine_id, event.key)]
        for waiter_key in settled:
            for future in self._waiters.pop(waiter_key, []):
                if not future.done():
                    future.set_result(None)
        for subscription in self._subscriptions:
            subscription.offer(event)

    async def wait_settled(self, engine_id: str, keys: list[bytes], timeout_s: float) -> None:
        """Return once every key was committed or went away, or after timeout_s, or once the
        daemon is stopping (`waits_ended`).

        The waiters are registered before the first await: a caller that looked the keys up in
        the same synchronous step misses no event."""
        if self.waits_ended:
            return
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[None]] = [loop.create_future() for _ in keys]
        for key, future in zip(keys, futures, strict=True):
            self._waiters[(engine_id, key)].append(future)
        try:
            await asyncio.wait(futures, timeout=timeout_s)
        finally:
            for key, future in zip(keys, futures, strict=True):
                waiting = self._waiters.get((engine_id, key), [])
                if future in waiting:
                    waiting.remove(future)
                    if not waiting:
                        del self._waiters[(engine_id, key)]

    def subscribe(
        self,
        engine_id: str,
        include_pending: bool = False,
        call: asyncio.Future[Any] | None = None,
    ) -> Subscription:
        """A Watch stream's queue; `call` is the Watch call's task (see Subscription.call). Once
        the hub is shut down, one that ends at once."""
        subscription = Subscription(engine_id, self._watch_queue_limit, include_pending, call=call)
        self._subscriptions.add(subscription)
        if self.streams_shut:
            self._shut(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    def shut_down(self) -> None:
        """End every Watch stream, and any that begins from now on (clients resubscribe to the
        next daemon)."""
        self.streams_shut = True
        for subscription in self._subscriptions:
            self._shut(subscription)

    def _shut(self, subscription: Subscription) -> None:
        subscription.end(StreamEnd.SHUTDOWN)
        if subscription.call is not None and not subscription.call.done():
            self._ending.add(subscription.call)
            subscription.call.add_done_callback(self._ending.discard)

    async def streams_ended(self, timeout_s: float) -> None:
        """Return once every Watch call that shut_down ended has written its stream's end to
        its client's connection, or after timeout_s (a client that reads nothing holds back the
        end of its stream behind what the stream sent before)."""
        if self._ending:
            await asyncio.wait(set(self._ending), timeout=timeout_s)

    def end_waits(self) -> None:
        """The daemon is about to stop: every wait returns now, and any later one at once."""
        self.waits_ended = True
        for futures in self._waiters.values():
            for future in futures:
                if not future.done():
                    future.set_result(None)
        self._waiters.clear()
