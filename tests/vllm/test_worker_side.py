"""The worker side alone, in this process: what it does at start and on later pipeline stages.

Proves: a worker maps the pool at start, and on a GPU registers it with CUDA then (not in the
first step); a private pool a worker created is dropped at its shutdown, and one lease after it
was killed, before any scheduler side existed; a pool the scheduler side holds is not; a worker
that cannot reach the daemon at start still starts and maps the pool
from its first step's metadata; a worker of a later pipeline stage (which never builds input
embeddings) neither loads nor saves nor reports; reports of two workers are counted apart
whatever their pipeline stage.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from unittest.mock import patch

import pytest
import torch
from cuda_fakes import FakeCudart, install_fake_cuda
from ecd_testing import Daemon, unmap_pools
from vllm_testing import (
    DTYPE,
    ROWS,
    WIDTH,
    EngineFactory,
    EngineSpec,
    WorkerPool,
    encoder_output,
    request,
)
from workload_testing import wait_until

from ec_client.vllm.loads import LoadBook
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, LoadOrder, SaveOrder, WorkerRank
from ec_client.vllm.worker import WorkerSide
from ec_protocol.types import AcquireResult, Extent, Status, TensorSpec

UNREACHABLE = "unix:///nonexistent/ecd.sock"
QUICK = {"ecd_connect_timeout_s": 0.2}
BLOCK = WIDTH * DTYPE.itemsize
SPEC = TensorSpec((ROWS, WIDTH), "float16", ROWS * BLOCK)
FIRST = WorkerRank(0, 0)


def worker(spec: EngineSpec, rank: WorkerRank = FIRST) -> WorkerSide:
    with patch("ec_client.vllm.worker.worker_rank", return_value=rank):
        return WorkerSide(spec.vllm_config())


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    yield install_fake_cuda(monkeypatch)
    unmap_pools()  # while the fake runtime is there to unregister


def test_a_gpu_worker_registers_the_pool_with_cuda_at_start(
    daemon: Daemon, fake_cuda: FakeCudart
) -> None:
    spec = EngineSpec(daemon.address)
    worker(spec)
    assert fake_cuda.pinned  # before any step
    with daemon.client() as c:
        assert c.stats(f"{spec.instance_id}_dp0").pools  # it created (or attached to) the pool


def pool_exists(daemon: Daemon, pool: str) -> bool:
    with daemon.client() as c:
        return any(p.engine_id == pool for p in c.stats().pools)


def test_a_private_pool_a_worker_created_is_dropped_at_its_shutdown(daemon: Daemon) -> None:
    spec = EngineSpec(daemon.address)  # no scheduler side: an engine that failed to start
    w = worker(spec)
    pool = f"{spec.instance_id}_dp0"
    assert pool_exists(daemon, pool)
    w.shutdown()
    assert not pool_exists(daemon, pool)


def test_a_private_pool_a_worker_created_goes_one_lease_after_the_worker_is_killed(
    daemon: Daemon, worker_pool: WorkerPool
) -> None:
    """An engine killed while loading its model: its workers had created the private pool, its
    scheduler side never existed."""
    spec = EngineSpec(daemon.address)
    [w] = worker_pool.take(spec)
    pool = f"{spec.instance_id}_dp0"
    with daemon.client() as c:
        assert {p.engine_id: p.ephemeral for p in c.stats().pools} == {pool: True}
    w.kill()
    wait_until(lambda: not pool_exists(daemon, pool), 2 * 2.0 + 1.0, "the pool to go")


def test_a_pool_the_scheduler_side_created_outlives_a_workers_shutdown(
    engine: EngineFactory, daemon: Daemon
) -> None:
    e = engine(workers=False)
    w = worker(e.spec)
    w.shutdown()
    assert pool_exists(daemon, e.pool)


def test_a_worker_that_cannot_reach_the_daemon_at_start_maps_the_pool_on_first_use(
    engine: EngineFactory,
) -> None:
    e = engine(workers=False)
    w = worker(EngineSpec(UNREACHABLE, instance_id=e.spec.instance_id, extra=QUICK))
    first = e.schedule([request("r1", "img-a")]).metadata
    assert isinstance(first, ECDaemonConnectorMetadata)
    w.begin(first)
    w.save(first, {"img-a": encoder_output("img-a")}, "img-a")  # kept: allocation on its way
    assert w.report() is None
    e.answered()
    second = e.schedule().metadata
    assert isinstance(second, ECDaemonConnectorMetadata)
    w.begin(second)  # the order: the kept output is copied
    report = w.report()
    assert report is not None and report.saved == ["img-a"]


def test_a_cancelled_intent_lets_the_kept_output_go(engine: EngineFactory) -> None:
    e = engine(workers=False)
    w = worker(e.spec)
    output = encoder_output("img-a")
    intent = ECDaemonConnectorMetadata(
        pool=e.scheduler.client.pool_info(e.pool), save_intents={"img-a"}
    )
    w.begin(intent)
    w.save(intent, {"img-a": output}, "img-a")
    kept = sys.getrefcount(output)
    w.begin(ECDaemonConnectorMetadata(pool=intent.pool, cancelled={"img-a"}))
    assert sys.getrefcount(output) == kept - 1  # no longer kept
    assert w.report() is None


def test_a_worker_of_a_later_pipeline_stage_neither_loads_nor_saves(daemon: Daemon) -> None:
    w = worker(EngineSpec(daemon.address), WorkerRank(1, 0))
    with daemon.client() as c:
        info = c.open_pool("pp", BLOCK, 4 * ROWS * BLOCK)
    meta = ECDaemonConnectorMetadata(
        pool=info,
        saves={"new": SaveOrder((Extent(0, ROWS),), SPEC)},
        loads={"old": LoadOrder(7, (Extent(ROWS, ROWS),), SPEC)},
    )
    cache = {"new": torch.zeros(ROWS, WIDTH, dtype=DTYPE)}
    w.begin(meta)
    w.load(meta, cache)
    w.save(meta, cache, "new")
    assert set(cache) == {"new"} and w.report() is None


def test_the_same_tensor_rank_on_two_pipeline_stages_counts_as_two_workers() -> None:
    book = LoadBook(reports_needed=2)
    book.admit("r1", ["k"], ready=lambda key: True, now=0.0, wait_s=0.0)
    hit = AcquireResult(b"k", Status.HIT, "", 42, (Extent(0, ROWS),), SPEC, 0)
    book.acquired(["k"], [hit], usable=lambda spec: True)
    assert book.dispatch("r1", "k")
    [order] = book.take_step().values()
    book.report(order.transfer_id, WorkerRank(0, 0))
    assert book.take_releases() == []
    book.report(order.transfer_id, WorkerRank(1, 0))
    assert book.take_releases() == [42]
