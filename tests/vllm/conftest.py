from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ecd_testing import Daemon
from vllm_testing import Engine, EngineFactory, EngineSpec, WorkerPool


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """Worker processes shared by the session: importing vLLM costs seconds per process."""
    pool = WorkerPool(size=2)
    yield pool
    pool.close()


@pytest.fixture
def engine(daemon: Daemon, worker_pool: WorkerPool) -> Iterator[EngineFactory]:
    """engine(**spec) -> an Engine on the test's daemon, with spec.tp worker processes
    (workers=False: scheduler side only). Shut down at the end of the test."""
    engines: list[Engine] = []

    def make(workers: bool = True, **spec: Any) -> Engine:
        engine_spec = EngineSpec(daemon.address, **spec)
        built = Engine(engine_spec, worker_pool.take(engine_spec) if workers else ())
        engines.append(built)
        return built

    yield make
    for built in engines:
        built.close()
    worker_pool.give_back()
