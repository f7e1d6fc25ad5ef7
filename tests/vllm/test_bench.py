"""`python -m ec_client.vllm.bench --json` as a user runs it: one JSON line, ecd's burst beside
ECCPUConnector's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ecd_testing import REPO, Daemon

from ec_client.vllm.bench import room_for

SMALL = ("--items", "8", "--runs", "1", "--json")
TTFT = {"ttft_cached_ms", "ttft_new_ms"}


def bench(address: str, capacity: str = "64MiB") -> subprocess.CompletedProcess[str]:
    """A small run of the bench against the daemon at `address`, as a user starts it."""
    command = [sys.executable, "-m", "ec_client.vllm.bench", "--address", address]
    return subprocess.run(
        [*command, *SMALL, "--capacity", capacity],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_json_reports_the_burst_against_eccpu(daemon: Daemon) -> None:
    done = bench(daemon.address)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    figures = json.loads(line)
    assert set(figures) == {"ecd", "eccpu"}
    ecd_keys = {"scheduler_us", "steps", "held_steps", "held_requests", "rpcs"}
    assert set(figures["ecd"]) == ecd_keys | TTFT
    assert set(figures["eccpu"]) == {"scheduler_us", "steps"} | TTFT
    assert figures["eccpu"]["steps"] == 1  # its saves and loads land within the burst's step
    assert figures["ecd"]["steps"] >= 2  # a save is ordered a step after its encode (intents)
    assert figures["ecd"]["held_steps"] == 0  # cached requests are lock-pinned at once
    assert figures["ecd"]["rpcs"] >= 1 and figures["eccpu"]["scheduler_us"] > 0
    assert all(figures[c][t] > 0 for c in ("ecd", "eccpu") for t in TTFT)


def test_with_no_daemon_it_says_where_it_looked_and_how_to_start_one(tmp_path: Path) -> None:
    address = f"unix://{tmp_path}/ecd.sock"
    done = bench(address)
    assert done.returncode != 0 and done.stdout == ""
    assert f"ecd is not reachable at {address}: start it" in done.stderr


def test_a_pool_the_daemon_has_no_room_for_is_said_with_how_to_fix_it(daemon: Daemon) -> None:
    done = bench(daemon.address, capacity="1GiB")  # the test daemon's budget is 256 MiB
    assert done.returncode != 0 and done.stdout == ""
    assert "ecd has no room for the bench's pool of 1.0 GiB" in done.stderr
    assert "smaller --capacity, or the daemon a larger --max-bytes" in done.stderr


def test_its_default_pool_holds_every_image_of_the_run() -> None:
    """A pool too small for the run would compare what each connector skips, not the burst."""
    images = 64 * 1369 * 3584 * 2  # 64 images of 1369 rows, bf16: 628 MB
    assert images < room_for(64, 1369, 3584) < 2 * images
    assert room_for(64, 256, 3584) == 512 << 20  # a run that fits the former default keeps it
