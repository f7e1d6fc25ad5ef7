"""The vLLM connector's worker side with CUDA tensors (skipped without a GPU): `make test-gpu`.

The worker runs in this process inside vLLM's real V2-runner wrapper (ActiveECConnector), as
vLLM's worker would, next to the scheduler side. Proves: encoder outputs on the GPU are saved
into the pool and committed only once the worker reported the device-to-host copy landed; a
load puts a CUDA tensor in the encoder cache, bit-identical, usable at once on the compute
stream; the worker registered the pool with CUDA at start, before its first step.
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest.mock import patch

import pytest
import torch
from ecd_testing import Daemon

pytest.importorskip("vllm.config", reason="the vLLM connector's GPU test needs vLLM installed")

from vllm_testing import DTYPE, ROWS, WIDTH, Engine, EngineSpec, request

from ec_client import EntryState, PoolMapping
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


def settle(engine: Engine, worker: CudaWorker) -> None:
    for _ in range(50):  # a GPU copy may be reported a step or more later
        if not engine.connector.has_pending_push_work():
            return
        worker.step(engine, [], {})
        torch.cuda.synchronize()
    raise AssertionError("transfers still pending")


def test_a_cuda_output_is_saved_and_loaded_back_to_cuda_bit_identical(
    engine_and_worker: tuple[Engine, CudaWorker], daemon: Daemon
) -> None:
    engine, worker = engine_and_worker
    base = torch.randn(ROWS, WIDTH, device="cuda")
    output = (base @ torch.randn(WIDTH, WIDTH, device="cuda")).to(DTYPE)  # kernels in flight
    worker.step(engine, [request("r1", "img-a")], {"img-a": output})
    settle(engine, worker)
    with daemon.client() as c:
        assert c.lookup(engine.pool, ["img-a"])[0].state is EntryState.READY
    r2 = request("r2", "img-a")
    loaded_keys: set[str] = set()
    for _ in range(3):
        loaded_keys = worker.step(engine, [r2], {})
        if loaded_keys:
            break
    assert loaded_keys == {"img-a"}
    loaded = worker.encoder_cache["img-a"]
    assert loaded.device.type == "cuda"
    assert torch.equal(loaded.view(torch.int16), output.view(torch.int16))  # bit-identical
    settle(engine, worker)


def test_the_worker_registers_the_pool_with_cuda_before_its_first_step(
    engine_and_worker: tuple[Engine, CudaWorker],
) -> None:
    engine, _ = engine_and_worker
    info = engine.scheduler.client.pool_info(engine.pool)
    assert PoolMapping.open(info).cuda_registered
