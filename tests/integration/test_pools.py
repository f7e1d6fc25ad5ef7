"""Pools on a real daemon as users meet them: attaching by name alone, a pool as large as the
budget, and pool files that cost little more than their capacity."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from ecd_testing import Daemon, run_ecd, running_daemon

from ec_client import AllocateItem, Client, Consumer, EcdError, Producer, PutStatus, Status

POOL = "qwen-vl-node1"
BLOCK = 7168
COMPAT = "Qwen2.5-VL-7B|bf16|3584"
MiB = 1 << 20


def test_a_consumer_attaches_by_name_alone_and_reads_what_the_producer_wrote(
    daemon: Daemon,
) -> None:
    with daemon.client(name="encoder") as encoder, daemon.client(name="decoder") as decoder:
        created = encoder.open_pool(POOL, BLOCK, 512 * BLOCK, COMPAT)
        tensor = torch.randn(16, 3584).to(torch.bfloat16)
        assert Producer(encoder, POOL).put("img", tensor) is PutStatus.COMMITTING
        attached = decoder.open_pool(POOL)
        assert not attached.created
        assert (attached.block_size_bytes, attached.num_blocks, attached.compat_key) == (
            BLOCK,
            512,
            COMPAT,
        )
        assert attached.pool_uuid == created.pool_uuid
        # The put is visible to others once its owed Commit arrived: ask the daemon to wait.
        loaded = Consumer(decoder, POOL).get("img", wait_ms=5000)
        assert loaded is not None and torch.equal(loaded, tensor)


def test_attaching_by_name_to_a_pool_that_does_not_exist_is_not_found(daemon: Daemon) -> None:
    with daemon.client() as c, pytest.raises(EcdError) as info:
        c.open_pool("nobody-made-it")
    assert info.value.code.name == "NOT_FOUND"
    assert "'nobody-made-it' does not exist" in info.value.message


def test_a_pool_attached_by_name_is_attached_again_after_a_daemon_restart(daemon: Daemon) -> None:
    with daemon.client(name="encoder") as encoder:
        encoder.open_pool(POOL, BLOCK, 512 * BLOCK, COMPAT)
        Producer(encoder, POOL).put("img", torch.ones(4, 3584))
    decoder = daemon.client(name="decoder", connect_timeout_s=30)
    decoder.open_pool(POOL)
    consumer = Consumer(decoder, POOL, watch=False)
    daemon.restart()
    loaded = consumer.get("img")  # a new session, the pool attached again by name
    assert loaded is not None and bool((loaded == 1).all())
    again = decoder.reopen_pool(POOL)
    assert not again.created and again.compat_key == COMPAT
    decoder.close()


def test_a_pool_as_large_as_the_budget_fits_in_a_file_about_two_percent_larger() -> None:
    with running_daemon("--max-bytes", "100MiB") as daemon, daemon.client() as c:
        info = c.open_pool(POOL, BLOCK, 100 * MiB, COMPAT)
        capacity = info.num_blocks * BLOCK
        assert capacity > 100 * MiB - BLOCK
        assert os.stat(info.path).st_size == info.file_size
        assert info.file_size - capacity == 2 * MiB  # header and slot table: 2% of 100 MiB
        stats = c.stats()
        assert (stats.capacity_bytes, stats.reserved_bytes) == (capacity, info.file_size)
        with pytest.raises(EcdError) as over:
            c.open_pool("one-more", BLOCK, BLOCK)
        assert over.value.code.name == "RESOURCE_EXHAUSTED"
        assert "100.0 MiB budget" in over.value.message


def test_a_pool_file_whose_name_ecd_would_refuse_is_not_adopted_at_restart(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        c.open_pool(POOL, BLOCK, 64 * BLOCK, COMPAT)
    daemon.stop()
    stray = daemon.shm_dir / "ecd-ecd-bench\n.pool"
    os.link(daemon.shm_dir / f"ecd-{POOL}.pool", stray)
    daemon.start()
    with daemon.client() as c:
        assert [p.engine_id for p in c.stats().pools] == [POOL]
    assert stray.exists()
    assert "is not a pool ecd could have made" in daemon.log()


@contextmanager
def restarted_under_a_smaller_budget() -> Iterator[Daemon]:
    """A daemon that made pools of 48 MiB and 32 MiB, restarted with --max-bytes 64MiB: it
    adopts 80 MiB of capacity, 16 MiB over its budget."""
    with running_daemon("--max-bytes", "256MiB", "--lease-ttl", "2") as daemon:
        with daemon.client() as c:
            c.open_pool("big", MiB, 48 * MiB)
            c.open_pool("small", MiB, 32 * MiB)
        daemon.stop()
        daemon.args = ("--max-bytes", "64MiB", "--lease-ttl", "2")
        yield daemon.start()


def test_a_daemon_restarted_under_a_budget_smaller_than_its_pools_says_so_and_keeps_them() -> None:
    with restarted_under_a_smaller_budget() as daemon, daemon.client() as c:
        assert sorted(p.engine_id for p in c.stats().pools) == ["big", "small"]  # still served
        log = daemon.log()
        assert "pools adopted over the budget" in log
        for figure in ('capacity="80.0 MiB"', 'max_bytes="64.0 MiB"', 'over_by="16.0 MiB"'):
            assert figure in log
        assert 'pools="big=48.0 MiB, small=32.0 MiB"' in log


def test_a_pool_asked_for_over_an_exceeded_budget_is_refused_without_a_negative_size() -> None:
    with restarted_under_a_smaller_budget() as daemon, daemon.client() as c:
        with pytest.raises(EcdError) as over:
            c.open_pool("one-more", MiB, MiB)
        assert over.value.code.name == "RESOURCE_EXHAUSTED"
        assert "-" not in over.value.message.replace("--max-bytes", "").replace("one-more", "")
        assert "hold 80.0 MiB, 16.0 MiB over the daemon's 64.0 MiB budget" in over.value.message


def put_small_entries(c: Client, engine_id: str, count: int) -> None:
    """`count` entries of 64 bytes, committed in batches."""
    for first in range(0, count, 1000):
        keys = [f"k{i}" for i in range(first, min(first + 1000, count))]
        results = c.allocate(engine_id, [AllocateItem(k, (64,), "uint8") for k in keys])
        assert {r.status for r in results} == {Status.ALLOCATED}
        assert {r.status for r in c.commit(engine_id, keys)} == {Status.OK}


def test_a_pool_that_asks_for_more_entries_holds_more_and_evictions_say_why(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        default = c.open_pool("default", 512, 8 * MiB)
        asks = c.open_pool("asks", 512, 8 * MiB, max_entries=6000)
        assert (default.max_entries, asks.max_entries) == (4088, 6000)
        put_small_entries(c, "default", 6000)
        put_small_entries(c, "asks", 6000)
        by_name = {p.engine_id: p for p in c.stats().pools}
        held = by_name["default"]  # 4088 slots of 16,384 blocks: evicted for slots, not space
        assert (held.entries_ready, held.evictions) == (4088, 1912)
        assert (held.evictions_for_entries, held.evictions_for_space) == (1912, 0)
        assert by_name["asks"].entries_ready == 6000 and by_name["asks"].evictions == 0
        stats = run_ecd("stats", "default", "--address", daemon.address, check=True).stdout
        assert "FOR_SPACE/ENTRIES" in stats and " 0/1912 " in stats


def test_open_pool_with_another_max_entries_than_the_pools_is_refused_naming_both(
    daemon: Daemon,
) -> None:
    with daemon.client() as c:
        c.open_pool("asks", 512, 8 * MiB, max_entries=6000)
        with pytest.raises(EcdError) as info:
            c.open_pool("asks", 512, 8 * MiB, max_entries=8000)
    assert info.value.code.name == "FAILED_PRECONDITION"
    assert "max_entries=6000" in info.value.message and "max_entries=8000" in info.value.message
