"""What a client owes a pool (ec_client/control/outbox.py: commits, releases, aborts it sends with
its next Step) against a real daemon, when a Step that was to carry it does not go or is cut short.

Proves: a Step refused for the caller's own items (a key, shape, dtype or checksum list that
cannot make a Step) raises that error and leaves what is owed owed: the next Step carries it,
and a read of the key does not wait on it; a Step whose asyncio task is cancelled in flight
tells its ops so (CANCELLED), and nothing it carried is left waiting for an answer: flush
returns.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from ecd_testing import Daemon

from ec_client import AllocateItem, AsyncClient, Client, EcdError, ItemResult, Status
from ec_client.control.outbox import DeferredOp, Outbox

POOL = "owed"
BLOCK = 4096


def owe_commit(outbox: Outbox, key: bytes) -> list[ItemResult | EcdError]:
    """Owe the pool the Commit of `key` (its copy landed); its answers land in the list."""
    answers: list[ItemResult | EcdError] = []
    outbox.commits(POOL, [DeferredOp(on_result=answers.append, key=key)])
    return answers


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """call(), from another thread: failing the test, not hanging it, if it does not return."""
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"still waiting after {seconds} s"
    return done[0]


def allocate(key: bytes) -> list[AllocateItem]:
    return [AllocateItem(key, (BLOCK,), "uint8")]


REFUSED_ITEMS: dict[str, tuple[type[Exception], dict[str, Sequence[Any]]]] = {
    "a key that is neither bytes nor str": (TypeError, {"acquires": [12345]}),
    "a dtype that is not a name": (TypeError, {"allocates": [AllocateItem(b"x", (8,), object())]}),  # type: ignore[arg-type]
    "a shape no int64 holds": (ValueError, {"allocates": [AllocateItem(b"x", (2**70,), "uint8")]}),
    "checksums that do not match the commits": (
        ValueError,
        {"commits": [b"x"], "checksums": [1, 2]},
    ),
}


@pytest.mark.parametrize("items", list(REFUSED_ITEMS), ids=list(REFUSED_ITEMS))
def test_a_step_refused_for_its_own_items_leaves_what_is_owed_owed(
    daemon: Daemon, items: str
) -> None:
    error, parts = REFUSED_ITEMS[items]
    with Client(daemon.address, name="producer", linger_s=60) as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK)
        # A Step to the pool first: a pool never stepped to is quiet, and what it is owed would
        # go alone at once, from the background.
        [allocated] = c.step(POOL, allocates=allocate(b"owed")).allocates
        assert allocated.status is Status.ALLOCATED
        answers = owe_commit(c.outbox, b"owed")
        with pytest.raises(error):
            c.step(POOL, **parts)
        assert answers == []  # nothing went
        result = within(10, lambda: c.step(POOL, acquires=[b"owed"]))
        assert [a.status for a in answers] == [Status.OK]  # the next Step carried it
        assert [r.status for r in result.acquires] == [Status.HIT]


async def test_a_step_cancelled_in_flight_tells_its_ops_and_leaves_nothing_in_transit(
    daemon: Daemon,
) -> None:
    async with AsyncClient(daemon.address, name="producer", linger_s=60) as c:
        await c.open_pool(POOL, BLOCK, 64 * BLOCK)
        await c.step(POOL, allocates=allocate(b"owed"))
        answers = owe_commit(c.outbox, b"owed")
        step = asyncio.create_task(c.step(POOL, acquires=[b"other"]))
        await asyncio.sleep(0)  # the task takes what is owed and sends its Step
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert len(answers) == 1 and isinstance(answers[0], EcdError)
        assert answers[0].code is grpc.StatusCode.CANCELLED
        await c.flush(5)  # nothing is left waiting for an answer that will not come
