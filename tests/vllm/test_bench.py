"""`python -m ec_client.vllm.bench --json` as a user runs it: one JSON line, for the pin mode
asked for, beside ECCPUConnector's figure."""

from __future__ import annotations

import json
import subprocess
import sys

from ecd_testing import REPO, Daemon

ARGS = ("--items", "8", "--runs", "1", "--capacity", "64MiB", "--pins", "ahead", "--json")


def test_json_reports_the_burst_for_the_first_pin_mode_asked_for(daemon: Daemon) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ec_client.vllm.bench", "--address", daemon.address, *ARGS],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    figures = json.loads(line)
    assert set(figures) == {"ecd", "eccpu"}
    assert set(figures["ecd"]) == {"scheduler_us", "held_steps", "held_requests", "rpcs"}
    assert figures["ecd"]["held_steps"] == 1  # ahead: every cached request waits one step
    assert figures["ecd"]["rpcs"] >= 1 and figures["eccpu"]["scheduler_us"] > 0
