"""An Acquire with wait_ms, through the service on a real store and event hub (only the gRPC
context is a stand-in): it waits for keys PENDING or not there yet, wakes at their commit, tells
"still PENDING" from "not there" when the time runs out, and holds nothing when the daemon's
shutdown ends its wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from core_testing import FakeClock, open_pool, session, spec

from ec_daemon.core.pools import PoolSettings
from ec_daemon.core.store import Store, StoreConfig
from ec_daemon.server.events import EventHub
from ec_daemon.server.service import EncoderCacheService
from ec_daemon.server.validate import Limits
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb

BLOCK = 4096
LONG_MS = 60_000


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class Context:
    """What the service uses of a grpc.aio ServicerContext."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}  # a Unix socket's: no certificate

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = dict(metadata)

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)


@pytest.fixture
def hub() -> EventHub:
    return EventHub()


@pytest.fixture
def store(shm_dir: Path, hub: EventHub) -> Iterator[Store]:
    s = Store(StoreConfig(PoolSettings(shm_dir, 1 << 30)), FakeClock(), hub.publish)
    open_pool(s, "p", BLOCK, 64 * BLOCK)
    yield s
    s.close()


@pytest.fixture
def service(store: Store, hub: EventHub) -> EncoderCacheService:
    return EncoderCacheService(store, hub, Limits())


def acquire(
    service: EncoderCacheService, sid: str, keys: list[bytes], wait_ms: int
) -> asyncio.Task[pb.AcquireReply]:
    request = pb.AcquireRequest(session_id=sid, engine_id="p", keys=keys, wait_ms=wait_ms)
    return asyncio.create_task(service.Acquire(request, Context()))  # type: ignore[arg-type]


async def waiting(task: asyncio.Task[Any]) -> bool:
    """Whether the task is still waiting once everything ready to run has run."""
    for _ in range(5):
        await asyncio.sleep(0)
    return not task.done()


def statuses(reply: pb.AcquireReply) -> list[str]:
    return [pb.ItemStatus.Name(r.status) for r in reply.results]


async def test_an_acquire_waits_for_a_key_not_allocated_yet_and_hits_at_its_commit(
    service: EncoderCacheService, store: Store
) -> None:
    consumer, producer = session(store, "decoder"), session(store, "encoder")
    asked = acquire(service, consumer, [b"k"], LONG_MS)
    assert await waiting(asked)
    store.allocate(producer, "p", [(b"k", spec(BLOCK))])
    assert await waiting(asked)
    store.commit(producer, "p", [(b"k", 0, 0)])
    assert statuses(await asyncio.wait_for(asked, 5)) == ["ITEM_HIT"]


async def test_a_key_aborted_while_waited_for_is_waited_for_again(
    service: EncoderCacheService, store: Store
) -> None:
    consumer, first, second = (session(store, n) for n in ("decoder", "enc-1", "enc-2"))
    store.allocate(first, "p", [(b"k", spec(BLOCK))])
    asked = acquire(service, consumer, [b"k"], LONG_MS)
    assert await waiting(asked)
    store.abort(first, "p", [b"k"])
    assert await waiting(asked)
    store.allocate(second, "p", [(b"k", spec(BLOCK))])
    store.commit(second, "p", [(b"k", 0, 0)])
    assert statuses(await asyncio.wait_for(asked, 5)) == ["ITEM_HIT"]


async def test_a_wait_that_runs_out_tells_a_key_still_pending_from_one_not_there(
    service: EncoderCacheService, store: Store
) -> None:
    consumer, producer = session(store, "decoder"), session(store, "encoder")
    store.allocate(producer, "p", [(b"pending", spec(BLOCK))])
    reply = await acquire(service, consumer, [b"pending", b"absent"], 50)
    assert statuses(reply) == ["ITEM_PENDING", "ITEM_MISS"]


async def test_a_wait_ended_by_the_daemons_shutdown_is_unavailable_and_pins_nothing(
    service: EncoderCacheService, store: Store, hub: EventHub
) -> None:
    consumer, producer = session(store, "decoder"), session(store, "encoder")
    store.allocate(producer, "p", [(b"k", spec(BLOCK))])
    store.commit(producer, "p", [(b"k", 0, 0)])
    asked = acquire(service, consumer, [b"k", b"absent"], LONG_MS)
    assert await waiting(asked)
    hub.end_waits()
    with pytest.raises(Aborted) as ended:
        await asyncio.wait_for(asked, 5)
    assert ended.value.code is grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in str(ended.value)
    assert store.stats("p").pools[0].pins == 0
    store.check()


async def test_an_acquire_without_wait_answers_at_once(
    service: EncoderCacheService, store: Store
) -> None:
    reply = await acquire(service, session(store), [b"absent"], 0)
    assert statuses(reply) == ["ITEM_MISS"]
