"""`ecd bench` as an operator runs it: `--suite restart` kills its own daemon and times it
serving again; `--suite cluster` spawns a Mooncake master and two daemons in its store."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest
from cluster_testing import needs_mooncake
from ecd_testing import Daemon, run_ecd

from ec_daemon.tools import transfer_floor


def bench(daemon: Daemon, *flags: str) -> subprocess.CompletedProcess[str]:
    """`ecd bench` against a daemon that is already running, as an operator points it at one."""
    return run_ecd("bench", "--address", daemon.address, *flags)


@needs_mooncake
def test_the_cluster_suite_spawns_a_master_and_daemons_and_prints_its_tables(
    tmp_path: Path,
) -> None:
    output = tmp_path / "figures.json"
    done = run_ecd(
        "bench", "--spawn", "--suite", "cluster", "--runs", "1", "--cluster-samples", "2",
        "--cluster-nodes", "1,2", "--cluster-entries", "10", "--cluster-clients", "1,2",
        "--cluster-seconds", "0.2", "--republish-entries", "1000", "--output", str(output),
        timeout_s=180,  # a master, two daemons, four store clients, torch's import
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "remote_vs_vllm" in done.stdout and "master_b_per_entry" in done.stdout
    assert "lookups_per_s" in done.stdout
    figures = json.loads(output.read_text())
    [hit] = figures["cluster_hit"]
    assert hit["size"] == "8.0 MiB" and hit["reads_per_hit"] == 1
    assert hit["remote_ms"] > 0 and hit["local_ms"] > 0 and hit["vllm_ms"] > 0
    assert hit["floor_ms"] > 0 and hit["remote_vs_floor"] == hit["remote_ms"] / hit["floor_ms"]
    one, two = figures["cluster_directory"]
    assert (one["nodes"], one["entries_in_store"], two["entries_in_store"]) == (1, 10, 20)
    assert one["daemon_rss_mib"] > 0 and one["master_rss_mib"] > 0
    assert [row["clients"] for row in figures["cluster_lookups"]] == [1, 2]
    assert all(row["lookups_per_s"] > 0 for row in figures["cluster_lookups"])
    [republish] = figures["cluster_republish"]
    assert (republish["entries"], republish["read_back"]) == (1000, 250)
    assert republish["republished_s"] > 0 and republish["master_calls"] >= 3


@needs_mooncake
def test_the_floor_is_the_transfer_engines_own_read_timed_by_its_own_count() -> None:
    assert transfer_floor.read_ms(1 << 20, seconds=1) > 0


def running(binary: str) -> set[int]:
    """The processes running `binary`."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if cmdline.read_bytes().split(b"\0")[0] == binary.encode():
                pids.add(int(cmdline.parent.name))
    return pids


@needs_mooncake
def test_the_floor_leaves_no_transfer_engine_running() -> None:
    binary = transfer_floor.bench_binary()
    before = running(binary)
    transfer_floor.read_ms(1 << 20, seconds=1)
    assert running(binary) - before == set()


def test_a_floor_whose_transfer_engine_does_not_start_says_so_with_its_output() -> None:
    with pytest.raises(RuntimeError, match=r"target did not start: .*unrecognized option"):
        transfer_floor.read_ms(1 << 20, binary="/bin/ls")


def test_the_cluster_suite_needs_daemons_of_its_own_and_says_so() -> None:
    done = run_ecd("bench", "--suite", "cluster")
    assert done.returncode == 2
    assert done.stderr == "ecd: --suite cluster starts a master and daemons: it needs --spawn\n"


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


def test_the_handoff_suite_times_the_wake_and_the_other_process_hearing_the_entry_pending(
    daemon: Daemon, tmp_path: Path
) -> None:
    output = tmp_path / "figures.json"
    done = bench(daemon, "--suite", "handoff", "--iterations", "5", "--output", str(output))
    assert done.returncode == 0, done.stderr
    assert "single-flight window" in done.stdout
    [row] = json.loads(output.read_text())["handoff"]
    assert row["samples"] == 5
    assert 0 < row["p50_us"] <= row["p99_us"]
    # Every key heard (the consumer's view follows them in order: one never heard fails the
    # suite), within the run.
    assert row["pending_heard_p50_us"] <= row["pending_heard_p99_us"] <= row["pending_heard_max_us"]
    assert row["pending_heard_max_us"] < 10e6
