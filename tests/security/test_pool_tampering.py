"""A pool file changed behind the daemon's back is noticed, refused and kept for inspection,
while the daemon and its other pools carry on."""

from __future__ import annotations

import os
import time

import grpc
import pytest
from ecd_testing import running_daemon

from ec_client import AllocateItem, EcdError, EntryState, EventType

BLOCK = 4096


@pytest.mark.parametrize("tamper", ["truncate", "overwrite header"])
def test_a_tampered_pool_is_refused_and_the_daemon_carries_on(tamper: str) -> None:
    args = ("--max-bytes", "64MiB", "--pool-check-interval", "0.2")
    with running_daemon(*args) as daemon, daemon.client() as c:
        victim = c.open_pool("victim", BLOCK, 64 * BLOCK)
        c.open_pool("bystander", BLOCK, 64 * BLOCK)
        for pool in ("victim", "bystander"):
            c.allocate(pool, [AllocateItem("k", (16,), "uint8")])
            c.commit(pool, ["k"])
        events = c.watch("victim")
        if tamper == "truncate":
            os.truncate(victim.path, victim.data_offset)
        else:
            with open(victim.path, "r+b") as f:
                f.write(b"\0" * 64)
        assert next(events).type is EventType.POOL_DROPPED
        events.close()
        with pytest.raises(EcdError) as info:
            c.lookup("victim", ["k"])
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(EcdError) as reopened:
            c.open_pool("victim", BLOCK, 64 * BLOCK)
        assert reopened.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "changed under the daemon" in reopened.value.message
        assert os.path.exists(victim.path)  # kept for inspection
        assert c.lookup("bystander", ["k"])[0].state is EntryState.READY
        assert "pool refused" in daemon.log()
        time.sleep(0.5)
        assert daemon.running
