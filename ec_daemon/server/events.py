"""Fan-out of core events to the RPCs that wait on them: the waits (ec_daemon.core.waits, whose
asyncio side this is: an Acquire's wait_ms, an asker joining fetches from the cluster's store)
and Watch streams.

The core publishes synchronously from inside a handler; waiters are asyncio futures and queues on
the same (single) event loop, so a waiter registered in the same synchronous step as the lookup
that found a key PENDING cannot miss the commit that follows.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ec_daemon.core.errors import CoreError
from ec_daemon.core.waits import For, Outcome, Waits
from ec_protocol.types import EventType, WatchEvent


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
    def __init__(self, watch_queue_limit: int = 100_000, waits: Waits | None = None) -> None:
        """waits: the daemon's (by default on time.monotonic, the clock of its deadlines)."""
        self.waits = waits if waits is not None else Waits(time.monotonic)
        self._subscriptions: set[Subscription] = set()
        self._watch_queue_limit = watch_queue_limit
        self.streams_shut = False  # the daemon is stopping: every Watch stream ends at once
        self._ending: set[asyncio.Future[Any]] = set()  # the calls of streams shut_down ended

    def publish(self, event: WatchEvent) -> None:
        self.waits.on_event(event)
        for subscription in self._subscriptions:
            subscription.offer(event)

    async def wait_for(
        self, kind: For, engine_id: str, keys: Sequence[bytes], deadline: float
    ) -> Outcome:
        """Wait for every key (Waits.register), until `deadline` (the waits' clock) at the
        latest, and answer how the wait ended.

        The wait is registered before the first await: a caller that looked the keys up in the
        same synchronous step misses no event. A caller that goes away (cancelled) leaves
        nothing behind."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[Outcome] = loop.create_future()

        def end(outcome: Outcome) -> None:
            if not ended.done():  # cancelled: its waiter has gone, and forgets the wait
                ended.set_result(outcome)

        wait = self.waits.register(kind, engine_id, keys, deadline, end)
        if ended.done():
            return ended.result()
        waits = self.waits
        timer = loop.call_later(max(deadline - waits.clock(), 0), waits.expire, deadline)
        try:
            return await ended
        finally:
            timer.cancel()
            waits.cancel(wait)

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
        """The daemon is about to stop: every wait for an entry returns now, and any later one
        at once (Waits.shut_down)."""
        self.waits.shut_down()
