"""Logs of a real daemon with --log-format json: every line is a JSON object, and info level has
one line per session open/close, lease expiry, pool create/adopt, eviction burst and start/stop;
never one line per item."""

from __future__ import annotations

import json
import time
from typing import Any

from cluster_testing import needs_mooncake, running_master, store_daemon
from ecd_testing import Daemon, running_daemon, wait_until

from ec_client import AllocateItem, Client
from ec_protocol.types import Status

POOL = "logs-pool"
BLOCK = 4096
SMALL = 8  # entries of 2 blocks fill the 16-block pool
KEYS = [f"item-{i}" for i in range(SMALL)]


def lines(daemon: Daemon) -> list[dict[str, Any]]:
    parsed = []
    for text in daemon.log().splitlines():
        line = json.loads(text)  # fails the test on any line that is not JSON
        assert {"ts", "level", "logger", "msg"} <= line.keys(), line
        parsed.append(line)
    return parsed


def wait_for(daemon: Daemon, msg: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(line["msg"] == msg for line in lines(daemon)):
        assert time.monotonic() < deadline, f"no {msg!r} line in:\n{daemon.log()}"
        time.sleep(0.05)


def test_json_lines_one_per_event_never_per_item() -> None:
    args = ("--log-format", "json", "--log-level", "info", "--max-bytes", "64MiB")
    with running_daemon(*args, "--lease-ttl", "1") as daemon:
        with daemon.client(name="busy") as client:  # kept alive meanwhile
            client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=16 * BLOCK)
            items = [AllocateItem(k, (2, BLOCK), "uint8") for k in KEYS]
            assert all(r.status is Status.ALLOCATED for r in client.allocate(POOL, items))
            client.commit(POOL, KEYS)
            leases = [r.lease_id for r in client.acquire(POOL, KEYS)]
            client.release(leases)
            # Four entries of four blocks: one batch that evicts all eight.
            big = [AllocateItem(f"big-{i}", (4, BLOCK), "uint8") for i in range(4)]
            assert all(r.status is Status.ALLOCATED for r in client.allocate(POOL, big))
            client.commit(POOL, [item.key for item in big])
            wait_for(daemon, "entries evicted")  # told by the daemon's reaper, within a second
            Client(daemon.address, name="silent", keepalive=False)  # goes silent, lease runs out
            wait_for(daemon, "session lease expired")
        assert daemon.stop() == 0
        first_run = lines(daemon)
        daemon.start()
        wait_for(daemon, "serving")
        assert daemon.stop() == 0
        second_run = lines(daemon)

    info = [line for line in first_run if line["level"] != "debug"]
    events = [line["msg"] for line in info if not line["msg"].startswith("startup check:")]
    assert events == [
        "serving",
        "session opened",
        "pool created",
        "entries evicted",
        "session opened",
        "session lease expired",
        "session closed",
        "stopping",
        "stopped",
    ], events
    by_msg = {line["msg"]: line for line in info}
    assert by_msg["entries evicted"]["evicted"] == SMALL
    assert by_msg["entries evicted"]["for_space"] == SMALL
    assert by_msg["entries evicted"]["engine_id"] == POOL
    assert by_msg["session lease expired"]["client"] == "silent"
    assert by_msg["session lease expired"]["level"] == "warning"
    assert by_msg["pool created"]["engine_id"] == POOL
    assert by_msg["session closed"]["client"] == "busy"
    # No key of any item reached a log line.
    assert not any(key in json.dumps(line) for line in first_run for key in KEYS)

    adopted = [line for line in second_run if line["msg"] == "pool adopted"]
    assert [(a["engine_id"], a["entries"]) for a in adopted] == [(POOL, 4)]


def test_a_full_pool_evicting_at_every_allocate_logs_one_summary_not_a_line_each() -> None:
    args = ("--log-format", "json", "--log-level", "info", "--max-bytes", "64MiB")
    with running_daemon(*args, "--lease-ttl", "1") as daemon, daemon.client() as client:
        client.open_pool(POOL, block_size_bytes=BLOCK, capacity_bytes=16 * BLOCK)
        for i in range(100):  # from the 17th on, each evicts one
            client.allocate(POOL, [AllocateItem(f"k{i}", (BLOCK,), "uint8")])
            client.commit(POOL, [f"k{i}"])
        wait_for(daemon, "entries evicted")
        told = [line for line in lines(daemon) if line["msg"] == "entries evicted"]
    assert len(told) == 1, told  # the next not before 10 s
    assert 1 <= told[0]["evicted"] <= 84


@needs_mooncake
def test_json_logs_carry_the_store_clients_lines_as_json_too() -> None:
    args = ("--log-format", "json", "--log-level", "debug")
    with running_master() as master, store_daemon(master, *args) as daemon:
        # Its store client logs with glog, in C++, while it joins.
        wait_until(lambda: "joined the store" in daemon.log(), 20)
        lines = daemon.log().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses
    native = [r for r in records if r["logger"] == "native"]
    assert any("transfer_metadata" in r["msg"] for r in native), native


@needs_mooncake
def test_a_store_daemon_joining_and_leaving_logs_no_error() -> None:
    args = ("--log-format", "json", "--log-level", "debug")
    with running_master() as master, store_daemon(master, *args) as daemon:
        wait_until(lambda: "joined the store" in daemon.log(), 20)
        # what the store client logged while it joined (a thread forwards it)
        wait_until(lambda: "metadata not found" in daemon.log(), 20)
        assert daemon.stop() == 0  # it leaves the store
        lines = daemon.log().splitlines()
    records = [json.loads(line) for line in lines]
    errors = [r for r in records if r["level"] in ("error", "critical")]
    assert not errors, errors


@needs_mooncake
def test_a_master_away_is_one_warning_of_the_store_client_not_an_error_at_each_retry() -> None:
    args = ("--log-format", "json", "--log-level", "debug")
    with running_master() as master, store_daemon(master, *args) as daemon:
        wait_until(lambda: "joined the store" in daemon.log(), 20)
        master.stop()
        wait_until(lambda: daemon.log().count("Client not available") >= 3, 30)
        lines = daemon.log().splitlines()
        master.start()  # back, so that the daemon leaves the store cleanly
    native = [json.loads(line) for line in lines if '"logger": "native"' in line]
    levels = [r["level"] for r in native if r["level"] != "debug"]
    assert levels == ["warning"], native
