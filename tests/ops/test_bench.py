"""`ecd bench` as an operator runs it: `--suite restart` kills its own daemon and times it
serving again."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from ecd_testing import Daemon, run_ecd


def bench(daemon: Daemon, *flags: str) -> subprocess.CompletedProcess[str]:
    """`ecd bench` against a daemon that is already running, as an operator points it at one."""
    return run_ecd("bench", "--address", daemon.address, *flags)


def test_the_restart_suite_kills_its_own_daemon_and_times_it_serving_again(
    tmp_path: Path,
) -> None:
    output = tmp_path / "figures.json"
    done = run_ecd(
        "bench",
        "--spawn",
        "--suite",
        "restart",
        "--runs",
        "1",
        "--restart-entries",
        "300",
        "--output",
        str(output),
        timeout_s=180,  # four daemon starts, the first compiling its bytecode, and torch's import
    )
    assert done.returncode == 0, done.stderr
    assert "Warm restart" in done.stdout and "serving_s" in done.stdout
    [row] = json.loads(output.read_text())["restart"]
    assert row["entries"] == 300
    assert row["empty_start_s"] > 0 and 0 < row["serving_s"] <= row["serving_max_s"]
    assert row["serving_s"] <= row["hit_s"]
    assert row["put_us_item_first"] > 0 and row["put_us_item_last"] > 0


def test_the_restart_suite_needs_a_daemon_of_its_own_and_says_so() -> None:
    done = run_ecd("bench", "--suite", "restart")
    assert done.returncode == 2
    assert "--spawn" in done.stderr


def test_the_data_suite_runs_with_a_single_entry_size() -> None:
    done = run_ecd("bench", "--spawn", "--suite", "data", "--runs", "1", "--sizes", "8MiB")
    assert done.returncode == 0, done.stderr
    assert "Data path" in done.stdout and "8.0 MiB" in done.stdout


def test_a_suite_that_fails_leaves_no_pool_behind(daemon: Daemon) -> None:
    # 6000 scratch regions are more entries than the pool's slot table holds (4088): the suite
    # fails midway.
    done = bench(daemon, "--suite", "data", "--runs", "1", "--sizes", "4KiB", "--batch", "3000")
    assert done.returncode == 1
    assert "RESOURCE_EXHAUSTED" in done.stderr and "Traceback" not in done.stderr
    with daemon.client() as c:
        assert not c.stats().pools


def test_a_suite_leaves_no_pool_behind_and_draws_no_progress_bar_into_a_pipe(
    daemon: Daemon,
) -> None:
    done = bench(daemon, "--suite", "control", "--runs", "1", "--iterations", "2")
    assert done.returncode == 0, done.stderr
    assert "Control plane" in done.stdout
    assert "\r" not in done.stderr and "[#" not in done.stderr
    with daemon.client() as c:
        assert not c.stats().pools


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--suite", "bogus"), "unknown suite(s) bogus"),
        (("--sizes", "8XB"), "'8XB' is not a size"),
        (("--runs", "0"), "'0' is not a count"),
    ],
)
def test_a_bad_bench_flag_is_a_usage_error_naming_it(flags: tuple[str, ...], words: str) -> None:
    done = run_ecd("bench", *flags)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: ecd bench") and words in done.stderr
