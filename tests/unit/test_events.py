"""EventHub alone: waiters (the waits' asyncio side) settle on any event about their key, a
dropped pool settles all of its waiters, Watch subscriptions filter by pool, overflow and shutdown
end a stream (one that begins after the shutdown at once), and a stop can wait for the ended
streams' calls to send their ends."""

from __future__ import annotations

import asyncio

from ec_daemon.core.waits import For, Outcome
from ec_daemon.server.events import EventHub, StreamEnd
from ec_protocol.types import EventType, WatchEvent


def event(type: EventType, key: bytes = b"k", engine_id: str = "p") -> WatchEvent:
    return WatchEvent(type, engine_id, key, 1, "epoch")


async def wait_settled(
    hub: EventHub, engine_id: str, keys: list[bytes], timeout_s: float
) -> Outcome:
    """A wait for the keys' entries, timeout_s from now at the latest."""
    return await hub.wait_for(For.ENTRY, engine_id, keys, hub.waits.deadline(timeout_s))


async def test_a_waiter_returns_when_its_key_is_committed() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"k"], 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    hub.publish(event(EventType.COMMITTED))
    await asyncio.wait_for(waiting, 1.0)


async def test_a_waiter_returns_when_its_key_goes_away() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"k"], 5.0))
    await asyncio.sleep(0)
    hub.publish(event(EventType.ABORTED))
    await asyncio.wait_for(waiting, 1.0)


async def test_a_waiter_of_several_keys_waits_for_every_one() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"a", b"b"], 5.0))
    await asyncio.sleep(0)
    hub.publish(event(EventType.COMMITTED, b"a"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    hub.publish(event(EventType.COMMITTED, b"b"))
    await asyncio.wait_for(waiting, 1.0)


async def test_events_of_other_pools_and_keys_do_not_wake_a_waiter() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"k"], 0.2))
    await asyncio.sleep(0)
    hub.publish(event(EventType.COMMITTED, b"other"))
    hub.publish(event(EventType.COMMITTED, b"k", engine_id="q"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await waiting  # times out quietly


async def test_a_dropped_pool_settles_all_its_waiters() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"a", b"b"], 5.0))
    await asyncio.sleep(0)
    hub.publish(event(EventType.POOL_DROPPED, b""))
    await asyncio.wait_for(waiting, 1.0)


async def test_a_waiter_that_timed_out_leaves_nothing_behind() -> None:
    hub = EventHub()
    await wait_settled(hub, "p", [b"k"], 0.01)
    assert hub.waits.waiting() == 0


async def test_a_subscription_sees_only_its_pool() -> None:
    hub = EventHub()
    mine, everything = hub.subscribe("p"), hub.subscribe("")
    hub.publish(event(EventType.COMMITTED, b"a", engine_id="p"))
    hub.publish(event(EventType.COMMITTED, b"b", engine_id="q"))
    assert mine.queue.qsize() == 1 and everything.queue.qsize() == 2


async def test_a_subscriber_that_falls_behind_is_cut_off_with_overflow() -> None:
    hub = EventHub(watch_queue_limit=2)
    subscription = hub.subscribe("")
    for key in (b"a", b"b", b"c", b"d"):
        hub.publish(event(EventType.COMMITTED, key))
    items = [subscription.queue.get_nowait() for _ in range(subscription.queue.qsize())]
    assert items[-1] is StreamEnd.OVERFLOW and len(items) == 3


async def test_shutdown_ends_every_stream() -> None:
    hub = EventHub()
    subscription = hub.subscribe("p")
    hub.shut_down()
    assert subscription.queue.get_nowait() is StreamEnd.SHUTDOWN
    hub.publish(event(EventType.COMMITTED))
    assert subscription.queue.empty()  # an ended stream takes nothing more


async def test_a_stream_that_begins_after_shutdown_ends_at_once() -> None:
    hub = EventHub()
    hub.shut_down()
    subscription = hub.subscribe("p")
    assert subscription.ended and subscription.queue.get_nowait() is StreamEnd.SHUTDOWN


async def test_streams_ended_waits_for_the_calls_of_the_streams_shutdown_ended() -> None:
    hub = EventHub()
    sending_the_end = asyncio.get_running_loop().create_future()  # a Watch call's task
    hub.subscribe("p", call=sending_the_end)
    hub.shut_down()
    waiting = asyncio.create_task(hub.streams_ended(60.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    sending_the_end.set_result(None)
    await asyncio.wait_for(waiting, 1.0)
    await asyncio.wait_for(hub.streams_ended(60.0), 1.0)  # none left to wait for


async def test_streams_ended_gives_up_on_a_call_after_its_timeout() -> None:
    hub = EventHub()
    hub.subscribe("p", call=asyncio.get_running_loop().create_future())  # never sends its end
    hub.shut_down()
    await asyncio.wait_for(hub.streams_ended(0.01), 1.0)


async def test_ending_waits_settles_every_waiter_and_every_later_wait_at_once() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"k"], 60.0))
    await asyncio.sleep(0)
    hub.end_waits()
    await asyncio.wait_for(waiting, 1.0)
    await asyncio.wait_for(wait_settled(hub, "q", [b"k"], 60.0), 1.0)
    assert hub.waits.waiting() == 0


async def test_an_allocation_does_not_settle_a_waiter_its_commit_does() -> None:
    hub = EventHub()
    waiting = asyncio.create_task(wait_settled(hub, "p", [b"k"], 5.0))
    await asyncio.sleep(0)
    hub.publish(event(EventType.PENDING))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    hub.publish(event(EventType.COMMITTED))
    await asyncio.wait_for(waiting, 1.0)


async def test_pending_events_reach_only_subscriptions_that_asked_for_them() -> None:
    hub = EventHub()
    plain, pending = hub.subscribe("p"), hub.subscribe("p", include_pending=True)
    hub.publish(event(EventType.PENDING))
    hub.publish(event(EventType.COMMITTED))
    assert [plain.queue.get_nowait()] == [event(EventType.COMMITTED)]
    assert [pending.queue.get_nowait(), pending.queue.get_nowait()] == [
        event(EventType.PENDING),
        event(EventType.COMMITTED),
    ]
