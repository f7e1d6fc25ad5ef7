"""`ecd drop` sticks: a pool an operator dropped while clients held it (a Consumer following it,
a Producer writing it) is not made again by their libraries, before or after a daemon restart;
their next call says it was dropped, and only an explicit open_pool with a geometry makes it
again. The log says who created and who dropped it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from ecd_testing import Daemon, run_ecd, wait_until

from ec_client import Client, Consumer, EcdError, Producer, PutStatus

POOL = "dropped-pool"
BLOCK = 4096
CAPACITY = 64 * BLOCK
# Before, a client following the pool made it again 0.03-0.2 s after the drop: look for longer.
WATCHED_S = 1.5


@pytest.fixture
def reader(daemon: Daemon) -> Iterator[tuple[Client, Consumer]]:
    """A client that made the pool, put an entry and follows the pool with a Consumer."""
    with daemon.client(name="reader") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        Producer(c, POOL).put("k", torch.ones(16))
        consumer = Consumer(c, POOL)
        assert consumer.get("k", wait_ms=5000) is not None
        wait_until(lambda: c.view(POOL).synced)
        yield c, consumer


def ecd_drop(daemon: Daemon) -> None:
    run_ecd("drop", POOL, "--force", "--address", daemon.address, check=True)


def pools(daemon: Daemon) -> list[str]:
    with daemon.client(name="observer") as c:
        return [p.engine_id for p in c.stats().pools]


def assert_stays_gone(daemon: Daemon) -> None:
    deadline = time.monotonic() + WATCHED_S
    while time.monotonic() < deadline:
        assert pools(daemon) == [], "the pool was made again"
        time.sleep(0.05)


def assert_says_dropped(call: Callable[[], object]) -> None:
    """The call raises FAILED_PRECONDITION saying the pool was dropped, by whom, what to do."""
    with pytest.raises(EcdError) as error:
        call()
    assert error.value.code.name == "FAILED_PRECONDITION"
    assert f"pool was dropped: {POOL!r}, by ecd-cli (pid " in error.value.message
    assert "open_pool with its geometry" in error.value.message


def test_a_pool_dropped_under_a_consumer_stays_gone(
    daemon: Daemon, reader: tuple[Client, Consumer]
) -> None:
    ecd_drop(daemon)
    assert_stays_gone(daemon)


def test_a_consumers_next_get_from_a_dropped_pool_says_it_was_dropped(
    daemon: Daemon, reader: tuple[Client, Consumer]
) -> None:
    _, consumer = reader
    ecd_drop(daemon)
    assert_says_dropped(lambda: consumer.get("k"))
    assert pools(daemon) == []


def test_a_producers_next_put_into_a_dropped_pool_says_it_was_dropped(daemon: Daemon) -> None:
    with daemon.client(name="writer") as c:
        c.open_pool(POOL, BLOCK, CAPACITY)
        producer = Producer(c, POOL)
        assert producer.put("before", torch.ones(16)) is PutStatus.COMMITTING
        ecd_drop(daemon)
        assert_says_dropped(lambda: producer.put("after", torch.ones(16)))
        assert_stays_gone(daemon)


def test_a_dropped_pool_stays_gone_across_a_daemon_restart(
    daemon: Daemon, reader: tuple[Client, Consumer]
) -> None:
    _, consumer = reader
    ecd_drop(daemon)
    daemon.restart()  # SIGKILL: the new daemon knows of the drop from its mark alone
    assert_says_dropped(lambda: consumer.get("k"))  # a new session reopens the pool: refused
    assert_stays_gone(daemon)


def test_an_explicit_open_pool_makes_a_dropped_pool_again_and_its_clients_use_it(
    daemon: Daemon, reader: tuple[Client, Consumer]
) -> None:
    c, consumer = reader
    ecd_drop(daemon)
    assert c.open_pool(POOL, BLOCK, CAPACITY).created
    assert Producer(c, POOL).put("k2", torch.full((16,), 2.0)) is PutStatus.COMMITTING
    loaded = consumer.get("k2", wait_ms=5000)
    assert loaded is not None and bool((loaded == 2).all())


def test_the_log_names_who_created_and_who_dropped_a_pool(
    daemon: Daemon, reader: tuple[Client, Consumer]
) -> None:
    ecd_drop(daemon)
    log = daemon.log()
    [created] = [line for line in log.splitlines() if 'msg="pool created"' in line]
    [dropped] = [line for line in log.splitlines() if 'msg="pool dropped"' in line]
    assert "client=reader pid=" in created
    assert "client=ecd-cli pid=" in dropped and "held_by_others=1" in dropped
