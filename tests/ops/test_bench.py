"""`ecd bench --suite remote` as an operator runs it: it spawns two peered daemons, and reports
a remote get against a local get and a bare transfer-engine read, one read per remote hit."""

from __future__ import annotations

import json
from pathlib import Path

from ecd_testing import run_ecd
from peer_testing import needs_mooncake


@needs_mooncake
def test_the_remote_suite_compares_a_pull_with_a_local_get_and_a_bare_read(
    tmp_path: Path,
) -> None:
    output = tmp_path / "figures.json"
    done = run_ecd(
        "bench",
        "--spawn",
        "--suite",
        "remote",
        "--runs",
        "1",
        "--remote-sizes",
        "256KiB",
        "--remote-samples",
        "2",
        "--output",
        str(output),
    )
    assert done.returncode == 0, done.stderr
    assert "Remote get" in done.stdout and "bare_read_ms" in done.stdout
    [row] = json.loads(output.read_text())["remote"]
    assert row["size"] == "256.0 KiB" and row["reads_per_hit"] == 1
    assert row["remote_ms"] > 0 and row["local_ms"] > 0 and row["bare_read_ms"] > 0


def test_the_remote_suite_needs_two_daemons_and_says_so() -> None:
    done = run_ecd("bench", "--suite", "remote")
    assert done.returncode == 2
    assert "--spawn" in done.stderr
