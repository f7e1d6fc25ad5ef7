"""A daemon with a small --max-batch, and clients whose batches are larger: the client learns the
limit when it opens its session (OpenSessionReply.max_batch) and sends every batch in requests the
daemon accepts (ec_client/control/_session.py, `call`), so nothing fails for being large.

Proves: put_many and get_many of more items than the limit (and the Commits and Releases they owe,
which ride on Steps) store and load every item; Lookup, Acquire with a wait, Evict and Delete of
more keys answer every key, in order; a Step refused for the caller's own items leaves the hits and
misses it carried owed, and the daemon counts them with the next Step.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from ecd_testing import Daemon, running_daemon

from ec_client import (
    AllocateItem,
    Client,
    Consumer,
    EcdError,
    EntryState,
    Producer,
    PutStatus,
    Status,
)

POOL = "batched"
BLOCK = 4096
MAX_BATCH = 8
ITEMS = 3 * MAX_BATCH + 1


@pytest.fixture(scope="module")
def small_batches() -> Iterator[Daemon]:
    with running_daemon("--max-bytes", "64MiB", "--max-batch", str(MAX_BATCH)) as daemon:
        yield daemon


@pytest.fixture
def client(small_batches: Daemon, request: pytest.FixtureRequest) -> Iterator[Client]:
    with Client(small_batches.address, name=request.node.name[:100]) as c:
        c.open_pool(POOL, BLOCK, 256 * BLOCK)
        yield c


def tensors(prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}-{i}": torch.full((64,), i, dtype=torch.int32) for i in range(ITEMS)}


def test_the_client_learns_the_daemons_batch_limit_with_its_session(client: Client) -> None:
    assert client.max_batch == MAX_BATCH


def test_put_many_and_get_many_over_the_limit_store_and_load_every_item(client: Client) -> None:
    stored = tensors("many")
    producer = Producer(client, POOL)
    assert set(producer.put_many(stored).values()) == {PutStatus.COMMITTING}
    producer.flush()  # the Commits owed: more than one Step's worth
    got = Consumer(client, POOL, watch=False).get_many(list(stored))  # the daemon pins each
    assert all(torch.equal(got[k], t) for k, t in stored.items())  # type: ignore[arg-type]
    client.flush()  # the Releases owed
    assert {r.pins for r in client.lookup(POOL, list(stored))} == {0}


def test_keyed_calls_over_the_limit_answer_every_key_in_order(client: Client) -> None:
    keys = list(tensors("keyed"))
    Producer(client, POOL).put_many(tensors("keyed"))
    client.flush()
    assert [r.key.decode() for r in client.lookup(POOL, keys)] == keys
    hits = client.acquire(POOL, keys, wait_ms=1000)
    assert [(r.key.decode(), r.status) for r in hits] == [(k, Status.HIT) for k in keys]
    assert {r.status for r in client.release([r.lease_id for r in hits])} == {Status.OK}
    assert {r.status for r in client.evict(POOL, keys[: MAX_BATCH + 1])} == {Status.OK}
    assert {r.status for r in client.delete(POOL, keys)} == {Status.OK, Status.NOT_FOUND}
    assert {r.state for r in client.lookup(POOL, keys)} == {EntryState.ABSENT}


def test_a_step_refused_for_its_own_items_leaves_its_hits_and_misses_owed(
    small_batches: Daemon, client: Client
) -> None:
    Producer(client, POOL).put("counted", torch.ones(16))
    client.flush()
    with Client(small_batches.address, name="reader", role="consumer", linger_s=60) as reader:
        reader.open_pool(POOL)
        before = reader.stats(POOL).pools[0]
        reader.outbox.misses(POOL, 3)  # answered from its view of the pool, say
        reader.outbox.hits(POOL, [b"counted"])  # read under a lock pin, say
        with pytest.raises(EcdError) as refused:  # a consumer may not allocate
            reader.step(POOL, allocates=[AllocateItem("x", (16,), "uint8")])
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        reader.flush()  # what it owes goes now: the counts too
        after = reader.stats(POOL).pools[0]
    assert (after.misses - before.misses, after.hits - before.hits) == (3, 1)
