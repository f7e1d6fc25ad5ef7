"""Fixtures of the end-to-end suite: the tiny model, a baseline engine, a daemon per test, and
engines that are shut down when their test ends."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_model
from e2e_testing import Engine, Engines, EngineSpec
from ecd_testing import Daemon, running_daemon

# Images the scenarios use; the baseline engine answers each once.
IMAGES = tuple(range(1, 7))


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
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A real `ecd serve` on a private socket and shm directory."""
    with running_daemon("--max-bytes", "512MiB", "--log-level", "debug") as d:
        yield d
        for log in d.workdir.glob("daemon-*.log"):  # the workdir goes with the daemon
            shutil.copy(log, tmp_path)


@pytest.fixture
def engines(model: str, daemon: Daemon, tmp_path: Path) -> Iterator[Engines]:
    started = Engines(model, daemon, tmp_path)
    try:
        yield started
    finally:
        started.close()
