"""`python -m ec_bench.vllm --json` as a user runs it: one JSON line, ecd's burst beside
ECCPUConnector's."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ecd_testing import REPO, Daemon

from ec_bench import vllm as vllm_bench
from ec_bench.vllm import room_for

SMALL = ("--items", "8", "--runs", "1", "--json")
TTFT = {"ttft_cached_ms", "ttft_new_ms"}


def bench(
    address: str, capacity: str = "64MiB", *more: str, module: str = "ec_bench.vllm"
) -> subprocess.CompletedProcess[str]:
    """A small run of the bench against the daemon at `address`, as a user starts it."""
    command = [sys.executable, "-m", module, "--address", address]
    return subprocess.run(
        [*command, *SMALL, "--capacity", capacity, *more],
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


def test_the_old_module_path_runs_the_same_bench(daemon: Daemon) -> None:
    """`python -m ec_client.vllm.bench`, as docs and scripts written before it moved run it."""
    done = bench(daemon.address, "64MiB", "--no-eccpu", module="ec_client.vllm.bench")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert set(json.loads(line)) == {"ecd"}


def test_role_runs_the_burst_as_an_encoder_engine_whose_cached_images_wait_for_nothing(
    daemon: Daemon,
) -> None:
    done = bench(daemon.address, "64MiB", "--role", "ec_producer", "--no-eccpu")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    figures = json.loads(line)["ecd"]
    assert figures["held_steps"] == 0 and figures["scheduler_us"] > 0  # lock-pinned at once


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


def test_collect_first_starts_each_measured_pass_with_no_young_objects(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--collect-first`: the collection that the burst's own Requests would trigger is run
    before the measured pass, not inside a connector's calls."""
    young: list[int] = []  # the collector's young-generation count as each pass starts
    drive = vllm_bench.drive

    def counted(*args: Any) -> Any:
        young.append(gc.get_count()[0])
        return drive(*args)

    monkeypatch.setattr(vllm_bench, "drive", counted)
    workload = vllm_bench.Workload(8, 4, 16, 64, 64 << 20, 0.001)
    vllm_bench.one_run("ECDaemonConnector", workload, "burst", daemon.address)
    vllm_bench.one_run("ECDaemonConnector", workload, "burst", daemon.address, collect_first=True)
    _, left_alone, _, collected = young  # each run: its fill, then its measured pass
    assert collected < 50 < left_alone  # the fill's leftovers and the burst's Requests
