"""AsyncClient against a real daemon, for the calls it shares with Client beyond the plain RPCs:
health, paging through entries, reopening a pool, what is owed (carried by a Step, sent alone
once the pool is quiet, waited for by settle) and the view of a pool's READY keys. Producer and
Consumer refuse it, naming the way from asyncio code (a Client, called on threads)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
import torch
from ecd_testing import Daemon

from ec_client import (
    AllocateItem,
    AsyncClient,
    Client,
    Consumer,
    EcdError,
    EntryState,
    ItemResult,
    Producer,
    PutStatus,
    Status,
)
from ec_client.control.outbox import DeferredOp, OutboxBatch

POOL = "vl"
BLOCK = 4096


async def allocated(client: AsyncClient, keys: Sequence[bytes]) -> None:
    items = [AllocateItem(k, (BLOCK,), "uint8") for k in keys]
    assert {r.status for r in await client.allocate(POOL, items)} == {Status.ALLOCATED}


async def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def owe_commits(client: AsyncClient, keys: Sequence[bytes]) -> list[ItemResult]:
    """Owe the pool the Commits of `keys` (copies landed); the answers land in the list."""
    answers: list[ItemResult] = []
    client.outbox.commits(POOL, [DeferredOp(on_result=answers.append, key=k) for k in keys])
    return answers


async def test_health_answers_serving_on_the_clients_own_channel(daemon: Daemon) -> None:
    async with AsyncClient(daemon.address, name="probe") as c:
        assert await c.health() == "SERVING"
        assert c.target == daemon.address


async def test_iter_entries_pages_through_every_entry_in_key_order(daemon: Daemon) -> None:
    keys = [b"k%02d" % i for i in range(7)]
    async with AsyncClient(daemon.address, name="lister") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await allocated(c, keys)
        listed = [e.key async for e in c.iter_entries(POOL, page=3)]
    assert listed == keys


async def test_reopen_pool_does_not_make_a_pool_dropped_by_someone_else_again(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="owner") as c:
        with pytest.raises(EcdError, match="not opened by this client"):
            await c.reopen_pool(POOL)
        first = await c.open_pool(POOL, BLOCK, 64 * BLOCK, "model-a")
        async with AsyncClient(daemon.address, name="ops", role="admin") as ops:
            await ops.drop_pool(POOL)
        with pytest.raises(EcdError, match="pool was dropped") as refused:
            await c.reopen_pool(POOL)
        assert refused.value.code.name == "FAILED_PRECONDITION"
        again = await c.open_pool(POOL, BLOCK, 64 * BLOCK, "model-a")  # explicitly: made again
        assert again.created and again.pool_uuid != first.pool_uuid
        assert (await c.reopen_pool(POOL)).pool_uuid == again.pool_uuid


async def test_a_step_carries_what_is_owed_ahead_of_its_own_parts(daemon: Daemon) -> None:
    async with AsyncClient(daemon.address, name="producer", linger_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        # A Step to the pool first: a pool never stepped to is quiet, and its ops would go
        # alone at once.
        first = await c.step(POOL, allocates=[AllocateItem(b"owed", (BLOCK,), "uint8")])
        assert [r.status for r in first.allocates] == [Status.ALLOCATED]
        answers = owe_commits(c, [b"owed"])
        result = await c.step(POOL, acquires=[b"owed"])
        assert [a.status for a in answers] == [Status.OK]  # the op heard its own answer
        assert result.commits == [] and [r.status for r in result.acquires] == [Status.HIT]


async def carrying_commit(c: AsyncClient, key: bytes) -> OutboxBatch:
    """A Commit of `key` on its way in another Step (the outbox thread's): taken, not sent
    yet. Sent by `deliver`. Allocated by a Step, not `allocated`: a pool never stepped to is
    quiet, and the owed Commit would go alone before the test takes it."""
    await c.step(POOL, allocates=[AllocateItem(key, (BLOCK,), "uint8")])
    owe_commits(c, [key])
    carrying = c.outbox.take(POOL)
    assert [op.key for op in carrying.commits] == [key]
    return carrying


async def deliver(c: AsyncClient, carrying: OutboxBatch) -> None:
    """The outbox thread's part: send the Step carrying the batch, on the client's loop."""
    await c._send_batch(carrying, carrying.step(POOL))


async def test_a_step_acquiring_a_key_hears_the_commit_of_it_another_step_carries_first(
    daemon: Daemon,
) -> None:
    """Its Acquire could otherwise reach the daemon ahead of the Commit and miss the client's
    own write. It waits off the event loop, which goes on (it carries the other Step)."""
    async with AsyncClient(daemon.address, name="producer", linger_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        carrying = await carrying_commit(c, b"k")
        reading = asyncio.create_task(c.step(POOL, acquires=[b"k"]))
        await asyncio.sleep(0.2)
        assert not reading.done()
        await deliver(c, carrying)
        result = await asyncio.wait_for(reading, 5)
        assert [r.status for r in result.acquires] == [Status.HIT]


async def test_a_step_cancelled_while_it_waits_for_another_leaves_what_is_owed_owed(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch its wait takes once the other Step is answered carries what was owed since: it
    is given back, not lost (nor left in transit, which a flush would wait on for ever)."""
    async with AsyncClient(daemon.address, name="producer", linger_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await allocated(c, [b"later"])
        carrying = await carrying_commit(c, b"k")
        later = owe_commits(c, [b"later"])  # owed after the carrying Step was taken
        taken = threading.Event()
        take = c.outbox.take

        def take_and_tell(*args: Any, **kwargs: Any) -> OutboxBatch:
            batch = take(*args, **kwargs)
            taken.set()
            return batch

        monkeypatch.setattr(c.outbox, "take", take_and_tell)
        reading = asyncio.create_task(c.step(POOL, acquires=[b"k"]))
        await asyncio.sleep(0.2)
        reading.cancel()
        await deliver(c, carrying)
        assert await asyncio.to_thread(taken.wait, 5)  # the wait took "later" after all
        await eventually(lambda: c.outbox.commits_owed(POOL) == {b"later": True}, "given back")
        await c.flush(5)
        assert [a.status for a in later] == [Status.OK]


async def test_what_is_owed_goes_alone_once_the_pool_is_quiet_and_settle_waits_for_it(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="producer") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await allocated(c, [b"alone", b"settled"])
        alone = owe_commits(c, [b"alone"])
        await eventually(lambda: bool(alone), "the owed Commit sent from the background")
        assert [a.status for a in alone] == [Status.OK]

        settled = owe_commits(c, [b"settled"])
        await c.flush(5)
        assert [a.status for a in settled] == [Status.OK]
        states = [r.state for r in await c.lookup(POOL, [b"alone", b"settled"])]
        assert states == [EntryState.READY, EntryState.READY]


async def test_close_sends_what_is_owed_before_the_session_ends(daemon: Daemon) -> None:
    async with AsyncClient(daemon.address, name="producer", linger_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await allocated(c, [b"last"])
        answers = owe_commits(c, [b"last"])
    assert [a.status for a in answers] == [Status.OK]
    async with AsyncClient(daemon.address, name="reader") as reader:
        await reader.open_pool(POOL)
        [found] = await reader.lookup(POOL, [b"last"])
        assert found.state is EntryState.READY


async def test_a_view_follows_the_pools_ready_keys_and_stops_at_close(daemon: Daemon) -> None:
    async with AsyncClient(daemon.address, name="producer") as producer:
        await producer.open_pool(POOL, BLOCK, 64 * BLOCK)
        async with AsyncClient(daemon.address, name="consumer") as c:
            await c.open_pool(POOL)
            view = c.view(POOL)
            assert c.view(POOL) is view
            assert await asyncio.to_thread(view.wait_synced, 5)
            await allocated(producer, [b"seen"])
            await producer.commit(POOL, [b"seen"])
            await eventually(lambda: view.has(b"seen"), "the commit in the view")
            await producer.evict(POOL, [b"seen"])
            await eventually(lambda: not view.has(b"seen"), "the eviction in the view")
            c.known_ready(POOL, [b"mine"])
            assert view.has(b"mine")
        assert not view.synced


@pytest.mark.parametrize("kind", [Producer, Consumer], ids=["Producer", "Consumer"])
async def test_producer_and_consumer_refuse_an_async_client_naming_the_way_from_asyncio(
    daemon: Daemon, kind: type[Producer] | type[Consumer]
) -> None:
    async with AsyncClient(daemon.address, name="asyncio") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        with pytest.raises(TypeError) as info:
            kind(c, POOL)  # type: ignore[arg-type]
    assert "need an ec_client.Client, not AsyncClient" in str(info.value)
    assert "asyncio.to_thread(" in str(info.value)


async def test_a_client_on_a_thread_gives_asyncio_code_the_tensor_path(daemon: Daemon) -> None:
    """The way the refusal names: a Client, its Producer and Consumer called on threads."""
    with Client(daemon.address, name="asyncio") as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        stored = torch.arange(256, dtype=torch.float32)
        put = await asyncio.to_thread(Producer(c, POOL).put, "img", stored)
        assert put is PutStatus.COMMITTING
        got = await asyncio.to_thread(Consumer(c, POOL).get, "img", "cpu", 1000)
        assert got is not None and torch.equal(got, stored)


async def test_an_async_client_with_wait_for_daemon_s_carries_on_through_a_daemon_restart(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="asyncio", wait_for_daemon_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await asyncio.to_thread(daemon.kill)
        comeback = threading.Timer(0.5, daemon.start)
        comeback.start()
        try:  # begun with no daemon there: waits for the next one
            [result] = await c.allocate(POOL, [AllocateItem(b"after", (BLOCK,), "uint8")])
        finally:
            await asyncio.to_thread(comeback.join)
        assert result.status is Status.ALLOCATED


async def test_an_async_acquire_whose_wait_ends_during_a_daemon_outage_answers_miss(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="asyncio") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        waiting = asyncio.ensure_future(c.acquire(POOL, [b"never"], wait_ms=2000))
        await asyncio.to_thread(daemon.kill)  # and back only once the wait ended
        [result] = await waiting
        await asyncio.to_thread(daemon.start)
    assert result.status is Status.MISS and "was away until the wait ran out" in result.message


async def test_a_closed_async_client_refuses_every_call_saying_it_is_closed(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="producer") as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
    for call in (
        lambda: c.allocate(POOL, [AllocateItem(b"after", (BLOCK,), "uint8")]),
        c.stats,
        c.health,
    ):
        with pytest.raises(EcdError, match="this client is closed") as refused:
            await call()
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert c.session_id not in refused.value.message
    with pytest.raises(EcdError, match="this client is closed"):
        c.open_watch(POOL)
