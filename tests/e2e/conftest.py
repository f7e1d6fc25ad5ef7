"""Fixtures of the end-to-end suite: the tiny model, a baseline engine, a daemon per test, and
engines that are shut down when their test ends; and the suite's report (per scenario, each
engine's role, requests, encoder outputs and median request latency), printed at the end and
written with the figures to ECD_E2E_JSON when set."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_model
from e2e_testing import DAEMON_FLAGS, Engine, Engines, EngineSpec
from ecd_testing import Daemon, running_daemon

# Images the scenarios use; the baseline engine answers each once.
IMAGES = tuple(range(1, 7))
REPORT: dict[str, Any] = {"scenarios": {}, "figures": {}}


@pytest.fixture
def figures() -> dict[str, Any]:
    """Where a test leaves figures for the report."""
    return REPORT["figures"]  # type: ignore[no-any-return]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    rows = REPORT["scenarios"]
    if not rows and not REPORT["figures"]:
        return
    terminalreporter.section("ecd end to end: engines per scenario")
    terminalreporter.write_line(
        f"{'scenario':70} {'role':12} {'requests':>8} {'encoded':>7} {'p50 ms':>8}"
    )
    for test, engines in rows.items():
        for row in engines:
            terminalreporter.write_line(
                f"{test[:70]:70} {row['role']:12} {row['requests']:>8} {row['encoded']:>7} "
                f"{row['latency_ms_p50']:>8.0f}"
            )
    if REPORT["figures"]:
        terminalreporter.write_line(json.dumps(REPORT["figures"], indent=2))
    if path := os.environ.get("ECD_E2E_JSON"):
        Path(path).write_text(json.dumps(REPORT, indent=2))


@pytest.fixture(scope="session")
def model() -> str:
    return str(tiny_model.model_dir())


@pytest.fixture(scope="session")
def baseline(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    """Greedy tokens of each image from an engine with no connector: what every engine with
    one must answer, whether it loaded the embeddings or encoded them."""
    engine = Engine(EngineSpec(model), tmp_path_factory.mktemp("baseline"), "baseline")
    try:
        answer = engine.generate(*IMAGES)
    finally:
        engine.close()
    assert answer.encoded == len(IMAGES)
    return dict(zip(IMAGES, answer.tokens, strict=True))


@pytest.fixture
def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A real `ecd serve` on a private socket and shm directory.

    DAEMON_FLAGS (e2e_testing.py) give it --pending-timeout 300 rather than 30: these tests
    check single flight and the connector, not the timeout (tests/unit/test_store.py and
    tests/vllm do), and on this loaded 2-core machine a producer's first step (its encode, and
    vLLM's Triton kernels interpreted on CPU for the first time) has taken 16-23 s with vLLM's
    workers pinned to one core (e2e_testing.Engine unpins them), about 6 s unpinned, more beside
    CPU hogs: the default could abort the entry of a producer that is alive and let the waiting
    engine encode too. A test module adds flags of its own in DAEMON_ARGS."""
    extra = getattr(request.module, "DAEMON_ARGS", ())
    with running_daemon(*DAEMON_FLAGS, *extra) as d:
        yield d
        for log in d.workdir.glob("daemon-*.log"):  # the workdir goes with the daemon
            shutil.copy(log, tmp_path)


@pytest.fixture
def engines(
    model: str, daemon: Daemon, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Engines]:
    started = Engines(model, daemon, tmp_path)
    try:
        yield started
    finally:
        started.close()
        REPORT["scenarios"][request.node.name] = [
            {
                "role": engine.spec.role or "none",
                "requests": sum(len(a.tokens) for a in engine.answers),
                "encoded": sum(a.encoded for a in engine.answers),
                "latency_ms_p50": 1000
                * statistics.median([t for a in engine.answers for t in a.latency_s] or [0.0]),
                "start_s": engine.start_s,
            }
            for engine in started.started
        ]
