"""The fault-injection suite: real daemon, real client processes, real files, real SIGKILLs.

ECD_FAULT_TRIALS sets how many trials each randomized fault kind runs (a small sample by default,
as part of `make test`; `make test-faults` runs 50). ECD_FAULT_SEED makes the random points
reproducible (each trial prints its seed when it fails). At the end the run prints, per fault
kind, trials run and survived, and the figures measured (time from a client's death to its
blocks being free, restart times); ECD_FAULT_JSON names a file to write them to as well.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from workload_testing import FAULT_SEED, FAULT_TRIALS, FIGURES, TALLIES, Interpreters


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault_kind(name): the fault a test injects, for the tally")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("fault_kind")
        if marker is not None:
            item.user_properties.append(("fault_kind", marker.args[0]))


_outcomes: dict[str, Counter[str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    kind = dict(report.user_properties).get("fault_kind")
    if kind is None:
        return
    tally = _outcomes.setdefault(str(kind), Counter())
    if report.when == "call":
        tally["run"] += 1
        tally["survived"] += report.passed
        tally["known failure (xfail, reported)"] += hasattr(report, "wasxfail")
    elif report.failed:  # a setup or teardown error counts as a failed trial
        tally["run"] += report.when == "setup"


def _figures() -> dict[str, Any]:
    return {
        name: {
            "n": len(values),
            "min": min(values),
            "median": statistics.median(values),
            "max": max(values),
        }
        for name, values in sorted(FIGURES.items())
        if values
    }


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _outcomes and not FIGURES and not TALLIES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("fault injection")
    write(f"seed {FAULT_SEED}, {FAULT_TRIALS} trial(s) per randomized kind")
    write(f"{'fault kind':<58} {'run':>5} {'survived':>9} {'xfail':>6}")
    for kind, tally in sorted(_outcomes.items()):
        xfail = tally["known failure (xfail, reported)"]
        write(f"{kind:<58} {tally['run']:>5} {tally['survived']:>9} {xfail:>6}")
    for name, f in _figures().items():
        write(f"{name}: n={f['n']} min={f['min']:.3f} median={f['median']:.3f} max={f['max']:.3f}")
    for name, (yes, total) in sorted(TALLIES.items()):
        write(f"{name}: {yes} of {total}")
    path = os.environ.get("ECD_FAULT_JSON")
    if path:
        report = {
            "seed": FAULT_SEED,
            "trials_per_kind": FAULT_TRIALS,
            "kinds": {k: dict(v) for k, v in _outcomes.items()},
            "figures": _figures(),
            "tallies": {name: {"yes": y, "of": n} for name, (y, n) in TALLIES.items()},
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


@pytest.fixture(scope="module")
def interpreters() -> Iterator[Interpreters]:
    """Client processes warmed up ahead of the trials that kill them."""
    pool = Interpreters()
    yield pool
    pool.close()
