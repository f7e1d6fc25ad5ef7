"""A peer daemon SIGKILLed or stopped while another daemon pulls an entry from it
(docs/design.md §13).

The reader daemon stays up across the trials; the source daemon is killed mid-pull at a random
point and started again (it re-adopts its pool, entry included), and the reader follows it anew.
Whatever the kill interrupts: the get returns the entry bit-identical or a miss, never an error
and never past the pull's deadline; nothing partial is ever READY on the reader; no entry stays
PENDING and no block leaks; a read given up on holds its blocks until the transfer is over.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from ecd_testing import Daemon
from peer_testing import needs_mooncake, peered_daemons
from workload_testing import (
    FAULT_TRIALS,
    check_entry_bytes,
    make_tensor,
    record_figure,
    record_tally,
    tensor_bytes,
    trial_rng,
    wait_until,
)

from ec_client import Client, Consumer, EntryState, Producer
from ec_client.types import PoolStats

pytestmark = needs_mooncake

POOL = "vl"
BLOCK = 64 << 10
KEY = "big"
SIZE = 128 << 20  # 50-150 ms over loopback TCP here: room to land a kill mid-read
PULL_TIMEOUT_S = 1.0


@dataclass
class Nodes:
    source: Daemon
    reader: Daemon
    client: Client  # on the reader

    def stats(self) -> PoolStats:
        [pool] = self.client.stats(POOL).pools
        return pool

    def state(self) -> EntryState:
        [found] = self.client.lookup(POOL, [KEY])
        return found.state

    def reads_past(self, count: int) -> Callable[[], bool]:
        return lambda: self.stats().remote_reads > count

    def follow_source(self) -> None:
        """Until the reader follows the (restarted) source and offers its entry."""
        if not self.source.running:
            self.source.start()
        view = self.client.view(POOL)
        wait_until(
            lambda: view.has(KEY.encode()) and not view.has_local(KEY.encode()), 30, "the entry"
        )

    def drop_local_copy(self) -> None:
        if self.state() is EntryState.READY:
            self.client.evict(POOL, [KEY])
        wait_until(lambda: self.state() is EntryState.ABSENT, 10, "the local copy to go")

    def check_accounted(self) -> None:
        """No entry PENDING, nothing held, and every block free or in a listed entry."""
        wait_until(lambda: self.stats().entries_pending == 0, 5, "the pull to end")
        wait_until(lambda: self.stats().held_blocks == 0, 35, "held blocks to come back")
        held = sum(e.count for entry in self.client.iter_entries(POOL) for e in entry.extents)
        assert self.stats().free_blocks + held == self.stats().num_blocks


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    with peered_daemons(2, "--pull-timeout", str(PULL_TIMEOUT_S)) as (source, reader):
        with source.client(name="encoder") as producer:
            producer.open_pool(POOL, BLOCK, 2 * SIZE)
            Producer(producer, POOL).put(KEY, make_tensor(KEY, SIZE))
            producer.flush()
        with reader.client(name="decoder") as client:
            client.open_pool(POOL, BLOCK, 2 * SIZE)
            yield Nodes(source, reader, client)


def get_in_thread(nodes: Nodes, into: list[torch.Tensor | None]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.append(Consumer(nodes.client, POOL).get(KEY)))
    thread.start()
    return thread


@pytest.mark.fault_kind("peer SIGKILLed mid-pull")
@pytest.mark.parametrize("trial", range(FAULT_TRIALS))
def test_a_peer_killed_mid_pull_leaves_a_miss_or_the_whole_entry_and_no_leak(
    nodes: Nodes, trial: int
) -> None:
    rng, replay = trial_rng("peer-kill-mid-pull", trial)
    nodes.drop_local_copy()
    nodes.follow_source()
    got: list[torch.Tensor | None] = []
    asked = time.monotonic()
    getter = get_in_thread(nodes, got)
    time.sleep(rng.uniform(0.0, 0.15))
    nodes.source.kill()
    getter.join(PULL_TIMEOUT_S + 10)

    assert not getter.is_alive(), f"the get outlived its deadline; {replay}"
    record_figure("seconds from a get to its answer, source killed", time.monotonic() - asked)
    [tensor] = got
    record_tally("kill landed mid-pull (the get missed)", tensor is None)
    if tensor is not None:
        assert check_entry_bytes(KEY, tensor_bytes(tensor)) is None, replay
    nodes.check_accounted()
    if nodes.state() is EntryState.READY:  # whatever is READY is whole
        again = Consumer(nodes.client, POOL, watch=False).get(KEY)
        assert again is not None and check_entry_bytes(KEY, tensor_bytes(again)) is None, replay


@pytest.mark.fault_kind("peer stopped mid-read")
def test_a_peer_stopped_mid_read_is_a_miss_at_the_deadline_and_its_blocks_held_till_done(
    nodes: Nodes,
) -> None:
    for _ in range(10):  # until the stop lands while the read is in flight
        nodes.drop_local_copy()
        nodes.follow_source()
        read_started = nodes.reads_past(nodes.stats().remote_reads)
        got: list[torch.Tensor | None] = []
        asked = time.monotonic()
        getter = get_in_thread(nodes, got)
        wait_until(read_started, 10, "a read", period_s=0)
        assert nodes.source.proc is not None
        nodes.source.proc.send_signal(signal.SIGSTOP)
        try:
            getter.join(PULL_TIMEOUT_S + 10)
            answered = time.monotonic() - asked
            held = nodes.stats().held_blocks
            if got == [None] and held:
                break
        finally:
            nodes.source.proc.send_signal(signal.SIGCONT)
        nodes.check_accounted()
    else:
        pytest.fail("the stop never landed mid-read in 10 tries")
    assert answered < PULL_TIMEOUT_S + 1.0  # the caller was not kept for the stalled transfer
    assert nodes.state() is EntryState.ABSENT
    nodes.check_accounted()  # once the resumed transfer is over, its blocks come back
    assert nodes.state() is EntryState.ABSENT
