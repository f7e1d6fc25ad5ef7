"""The vLLM connector's worker side with CUDA tensors (skipped without a GPU): `make test-gpu`.

The worker runs in this process inside vLLM's real V2-runner wrapper (ActiveECConnector), as
vLLM's worker would, next to the scheduler side. Proves: an encoder output on the GPU is copied
into the pool only after the kernels producing it ran (the copy is ordered a step after the
encode, while they are held back) and committed only once the worker reported the copy landed;
a load puts a CUDA tensor in the encoder cache, bit-identical, usable at once on the compute
stream (its copy held back behind a busy load stream); the worker registered the pool with CUDA
at start. vLLM is not on the bare GPU machine, so `make gpu-check` skips this file: `make
test-gpu` runs it where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest.mock import patch

import pytest
import torch
from ecd_testing import Daemon
from stream_testing import SLEEP, cache_block

pytest.importorskip("vllm.config", reason="the vLLM connector's GPU test needs vLLM installed")

from vllm_testing import DTYPE, ROWS, WIDTH, Engine, EngineSpec, request

from ec_client import EntryState, PoolMapping, TensorMover
from ec_client.vllm import ECDaemonConnector
from ec_client.vllm.metadata import WorkerRank
from ec_client.vllm.offline import finish_step


class CudaWorker:
    """One TP rank in this process, its encoder cache on the GPU."""

    def __init__(self, spec: EngineSpec) -> None:
        import vllm.distributed.ec_transfer.ec_transfer_state as ec_state
        from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

        self._state = ec_state
        config = spec.vllm_config()
        with patch("ec_client.vllm.worker.worker_rank", return_value=WorkerRank(0, 0)):
            ec_state.ensure_ec_transfer_initialized(config)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.active = ActiveECConnector(config, self.encoder_cache)

    def step(self, engine: Engine, reqs: list, encode: dict[str, torch.Tensor]) -> set[str]:
        """One engine step: the scheduler's half, this worker's (encoder writes `encode`), and
        the scheduler's update. Returns the keys loaded into the encoder cache."""
        from vllm.v1.core.sched.output import SchedulerOutput

        step = engine.schedule(reqs)
        self.encoder_cache.clear()
        scheduler_output = SchedulerOutput.make_empty()
        scheduler_output.ec_connector_metadata = step.metadata
        with self.active.maybe_get_output(scheduler_output) as output:
            self.encoder_cache.update({k: v for k, v in encode.items() if k in step.encode})
        finish_step(engine.connector, None if output.is_empty() else output)
        engine.answered()  # a step outlasts the daemon's round trips
        return step.load

    def mover(self) -> TensorMover:
        """The worker's CUDA mover (made at its start)."""
        connector = self.active.ec_connector
        assert isinstance(connector, ECDaemonConnector)
        mover = connector.worker_side._mover
        assert mover is not None and mover.load_stream is not None
        return mover

    def close(self) -> None:
        self._state.ensure_ec_transfer_shutdown()


@pytest.fixture
def engine_and_worker(daemon: Daemon) -> Iterator[tuple[Engine, CudaWorker]]:
    spec = EngineSpec(daemon.address)
    engine = Engine(spec)
    worker = CudaWorker(spec)
    yield engine, worker
    worker.close()
    engine.close()


def flush(engine: Engine, worker: CudaWorker) -> None:
    for _ in range(50):  # a GPU copy may be reported a step or more later
        if not engine.connector.has_pending_push_work():
            return
        worker.step(engine, [], {})
        torch.cuda.synchronize()
    raise AssertionError("transfers still pending")


def saved(engine: Engine, worker: CudaWorker, key: str, expected: torch.Tensor) -> None:
    """`key` encoded in one step into a tensor whose producing kernels are still queued (behind
    a sleep) when the next step orders its copy: the save must wait for them, and the entry
    stays PENDING until the copy landed and the worker reported it."""
    output = torch.zeros_like(expected)
    worker.step(engine, [request(f"encode-{key}", key)], {key: output})  # kept, not copied yet
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    output.copy_(expected)  # "the encoder's kernels", queued behind the sleep
    worker.step(engine, [], {})  # orders the copy while the compute stream is still busy
    assert state(engine, key) is EntryState.PENDING  # not committed before the copy landed
    flush(engine, worker)
    assert state(engine, key) is EntryState.READY


def state(engine: Engine, key: str) -> EntryState:
    return engine.scheduler.client.lookup(engine.pool, [key])[0].state


def test_a_cuda_output_is_saved_once_its_kernels_ran_and_committed_once_its_copy_landed(
    engine_and_worker: tuple[Engine, CudaWorker],
) -> None:
    engine, worker = engine_and_worker
    expected = torch.randn(ROWS, WIDTH, device="cuda").to(DTYPE)
    saved(engine, worker, "img-a", expected)
    stored = engine.scheduler.client.pool_info(engine.pool)
    [hit] = engine.scheduler.client.acquire(engine.pool, ["img-a"])
    assert hit.spec is not None
    region = torch.cat([PoolMapping.open(stored).region(e) for e in hit.extents])
    engine.scheduler.client.release([hit.lease_id])
    assert torch.equal(region[: hit.spec.nbytes], expected.view(torch.uint8).flatten().cpu())


def test_a_load_is_in_the_encoder_cache_bit_identical_and_usable_at_once_on_the_compute_stream(
    engine_and_worker: tuple[Engine, CudaWorker],
) -> None:
    engine, worker = engine_and_worker
    expected = torch.randn(ROWS, WIDTH, device="cuda").to(DTYPE)
    saved(engine, worker, "img-a", expected)
    mover = worker.mover()
    nbytes = expected.numel() * expected.element_size()
    cache_block(mover.load_stream, nbytes)  # for the load's output
    cache_block(torch.cuda.current_stream(), expected.numel())  # for torch.equal's result
    torch.cuda.synchronize()
    with torch.cuda.stream(mover.load_stream):
        torch.cuda._sleep(SLEEP)  # the load's copy queues behind this
    engine.slot_known("img-a")  # its COMMITTED event came: a lock pin, taken at once
    loaded_keys = worker.step(engine, [request("r2", "img-a")], {})  # pinned at once: loads now
    assert loaded_keys == {"img-a"}
    loaded = worker.encoder_cache["img-a"]
    same = torch.equal(loaded, expected)  # on the compute stream, no host sync before it
    assert loaded.device.type == "cuda" and same
    flush(engine, worker)


def test_the_worker_registers_the_pool_with_cuda_before_its_first_step(
    engine_and_worker: tuple[Engine, CudaWorker],
) -> None:
    engine, _ = engine_and_worker
    info = engine.scheduler.client.pool_info(engine.pool)
    assert PoolMapping.open(info).cuda_registered
