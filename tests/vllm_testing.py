"""Test support for the vLLM connector: engines made of vLLM's real pieces around ECDaemonConnector.

- Configs and requests come from ec_client.vllm.offline: built the way vLLM's own EC connector
  tests build them (a spec'd VllmConfig mock holding real ParallelConfig and ECTransferConfig),
  with vLLM's real Request, MultiModalFeatureSpec and PlaceholderRange.
- The scheduler side is built by vLLM's ECConnectorFactory in the test process and driven in the
  order vLLM's scheduler calls it (`Engine.schedule`, `Engine.finish`).
- Each worker (one TP rank) is a separate process running vLLM's real V2-runner wrapper,
  ActiveECConnector, around the connector vLLM's `ensure_ec_transfer_initialized` built; the
  "encoder" there writes `encoder_output(key, rows)`, a tensor determined by the key, so any
  process can tell right bytes from wrong ones by digest. Worker processes are slow to start
  (importing vLLM takes seconds), so a pool keeps them and rebinds them to each test's engine.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any
from unittest.mock import patch

import torch
from ecd_testing import wait_until
from vllm.config import VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from ec_client import Client
from ec_client.vllm import ECDaemonConnector
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, WorkerRank
from ec_client.vllm.offline import (
    ScheduledStep,
    finish_step,
    image_request,
    offline_config,
    schedule_step,
)
from ec_client.vllm.scheduler import SchedulerSide

WIDTH = 64  # LM input-embedding width of the pretend model
DTYPE = torch.float16  # so a block is 128 bytes
ROWS = 16  # embeddings per image unless a test says otherwise: 2 KiB, 16 blocks
CAPACITY = 1 << 20  # 8192 blocks
# An encode that another engine waits for: longer than the old connector's cap on waiting for a
# PENDING item (ecd_pending_wait_ms, 2 s), as a real encoder under load, a video or a queue would.
LONG_ENCODE_S = 2.5


@dataclass(frozen=True)
class EngineSpec:
    """Everything both sides of one pretend engine are built from; picklable, so a worker
    process builds the same config as the test."""

    address: str
    role: str = "ec_both"
    encoder_only: bool = False  # started with --mm-encoder-only (as an encoder engine is)
    pool: str | None = None
    tp: int = 1
    model: str = "test-org/tiny-vlm"
    width: int = WIDTH
    capacity: int | str | None = CAPACITY
    extra: dict[str, Any] = field(default_factory=dict)
    instance_id: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:8]}")

    def vllm_config(self, rank: int = 0) -> VllmConfig:
        extra = {"ecd_address": self.address, "ec_cpu_bytes": self.capacity, **self.extra}
        if self.capacity is None:
            del extra["ec_cpu_bytes"]
        if self.pool is not None:
            extra["ecd_pool"] = self.pool
        return offline_config(
            extra,
            instance_id=self.instance_id,
            role=self.role,
            model=self.model,
            width=self.width,
            dtype=DTYPE,
            tp=self.tp,
            rank=rank,
            encoder_only=self.encoder_only,
        )


def request(request_id: str, *keys: str, rows: int = ROWS) -> Request:
    return image_request(request_id, keys, rows)


def encoder_output(key: str, rows: int = ROWS, width: int = WIDTH) -> torch.Tensor:
    """What the pretend encoder outputs for `key`: a function of the key alone."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(rows, width, generator=generator).to(DTYPE)


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return f"{tuple(tensor.shape)}|{tensor.dtype}|{hashlib.sha256(data).hexdigest()}"


# ---- worker processes ---------------------------------------------------------------------------


@dataclass
class WorkerReply:
    output: ModelRunnerOutput
    loaded: dict[str, str]  # key -> digest of what the load put in the encoder cache
    saved_here: list[str]  # keys this rank copied into the pool this step


def _worker_main(conn: Connection) -> None:
    """A worker process: (re)bound to an engine, then runs steps exactly as vLLM's V2 model runner
    wraps them (ActiveECConnector.maybe_get_output)."""
    import vllm.distributed.ec_transfer.ec_transfer_state as ec_state
    from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

    active: ActiveECConnector | None = None
    encoder_cache: dict[str, torch.Tensor] = {}
    while True:
        command, args = conn.recv()
        try:
            if command == "bind":
                spec, rank = args
                ec_state.ensure_ec_transfer_shutdown()
                encoder_cache.clear()
                config = spec.vllm_config(rank)
                with patch("ec_client.vllm.worker.worker_rank", return_value=WorkerRank(0, rank)):
                    ec_state.ensure_ec_transfer_initialized(config)
                active = ActiveECConnector(config, encoder_cache)
                conn.send(("ok", None))
            elif command == "step":
                metadata, encode = args
                assert active is not None
                encoder_cache.clear()  # every earlier output was consumed and freed
                scheduler_output = SchedulerOutput.make_empty()
                scheduler_output.ec_connector_metadata = metadata
                with active.maybe_get_output(scheduler_output) as output:
                    encoder_cache.update({k: encoder_output(k, rows) for k, rows in encode.items()})
                loaded = {k: digest(encoder_cache[k]) for k in metadata.loads}
                meta = output.ec_connector_worker_meta
                saved = list(meta.saved) if meta is not None else []
                conn.send(
                    (
                        "ok",
                        WorkerReply(
                            ModelRunnerOutput.with_ec_conn_output_only(output), loaded, saved
                        ),
                    )
                )
            elif command == "exit":
                ec_state.ensure_ec_transfer_shutdown()
                conn.send(("ok", None))
                return
        except Exception as exc:  # reported to the test, which fails with it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class WorkerProcess:
    """One worker (one TP rank) in its own process."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def _ask(self, command: str, args: Any, timeout_s: float = 60) -> Any:
        self._conn.send((command, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"worker process gave no answer to {command} in {timeout_s} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker process failed: {value}")
        return value

    def bind(self, spec: EngineSpec, rank: int) -> None:
        self._ask("bind", (spec, rank))

    def step(self, metadata: ECDaemonConnectorMetadata, encode: dict[str, int]) -> WorkerReply:
        reply: WorkerReply = self._ask("step", (metadata, encode))
        return reply

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        if self.process.is_alive():
            self._ask("exit", None)
        self.process.join(10)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()


class WorkerPool:
    """Worker processes kept across tests: `take(n)` rebinds idle ones (vLLM's connector is a
    process-wide singleton, reset between engines) and starts more only when needed."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._idle = [WorkerProcess() for _ in range(size)]
        self._busy: list[WorkerProcess] = []

    def take(self, spec: EngineSpec) -> list[WorkerProcess]:
        self._idle = [w for w in self._idle if w.alive]
        while len(self._idle) < spec.tp:
            self._idle.append(WorkerProcess())
        workers, self._idle = self._idle[: spec.tp], self._idle[spec.tp :]
        for rank, worker in enumerate(workers):
            worker.bind(spec, rank)
        self._busy.extend(workers)
        return workers

    def give_back(self) -> None:
        """Return the busy workers; replace killed ones now, so they start while tests run."""
        self._idle.extend(w for w in self._busy if w.alive)
        self._busy.clear()
        self._idle.extend(WorkerProcess() for _ in range(self._size - len(self._idle)))

    def close(self) -> None:
        for worker in self._idle + self._busy:
            if worker.alive:
                worker.close()


# ---- the engine ---------------------------------------------------------------------------------


@dataclass
class StepResult:
    step: ScheduledStep
    replies: list[WorkerReply]
    failed: set[str]  # take_unavailable_requests

    @property
    def loaded(self) -> dict[str, str]:
        """Rank 0's digests of what it loaded."""
        return self.replies[0].loaded if self.replies else {}


class Engine:
    """A pretend vLLM engine: the scheduler-side connector here, `workers` as TP ranks."""

    def __init__(self, spec: EngineSpec, workers: Sequence[WorkerProcess] = ()) -> None:
        self.spec = spec
        self.workers = list(workers)
        connector = ECConnectorFactory.create_connector(
            spec.vllm_config(), ECConnectorRole.SCHEDULER
        )
        assert isinstance(connector, ECDaemonConnector)
        self.connector = connector

    @property
    def scheduler(self) -> SchedulerSide:
        return self.connector.scheduler_side

    @property
    def pool(self) -> str:
        return self.scheduler.config.pool

    def schedule(self, requests: Sequence[Request] = ()) -> ScheduledStep:
        return schedule_step(self.connector, requests)

    def run(self, step: ScheduledStep, ranks: Sequence[int] | None = None) -> list[WorkerReply]:
        """The workers' half of the step (all ranks unless told)."""
        chosen = range(len(self.workers)) if ranks is None else ranks
        return [self.workers[r].step(step.metadata, step.encode) for r in chosen]

    def finish(self, replies: Sequence[WorkerReply]) -> set[str]:
        """The scheduler's half after the workers: their outputs folded by vLLM's
        ECOutputAggregator, as the multiprocess executor does, then finish_step."""
        merged = ECOutputAggregator().aggregate([r.output for r in replies]) if replies else None
        return finish_step(self.connector, merged.ec_connector_output if merged else None)

    def step(self, *requests: Request) -> StepResult:
        """One whole step. The daemon's answers to the Steps it sent in the background arrive
        while the workers run and before the next step, as they do when a step takes longer
        than a round trip (answered()); tests of answers still on their way step by hand."""
        step = self.schedule(requests)
        replies = self.run(step)
        self.answered()
        failed = self.finish(replies)
        self.answered()
        return StepResult(step, replies, failed)

    def answered(self) -> None:
        """Wait until the daemon answered every Step the scheduler side sent."""
        if self.scheduler.client is not None:  # None: the daemon was never reached
            self.scheduler.client.flush(10)

    def admit(self, req: Request, max_steps: int = 3) -> tuple[int, StepResult]:
        """Step with `req` until it gets past ensure_cache_available; returns how many steps it
        was held back and the step that scheduled it."""
        for held in range(max_steps):
            result = self.step(req)
            if req.request_id not in result.step.held:
                return held, result
        raise AssertionError(f"{req.request_id} was held back {max_steps} steps")

    def save(self, request_id: str, key: str) -> StepResult:
        """A request that encodes `key`, then empty steps until its save is committed and the
        view heard its slot (the COMMITTED event, a moment after the commit's answer), as for
        an item saved a while ago: from then on a hit is lock-pinned at once."""
        _, result = self.admit(request(request_id, key))  # held a step if the store is asked
        self.flush()
        self.slot_known(key)
        return result

    def slot_known(self, key: str, timeout_s: float = 10.0) -> None:
        """Wait until the view knows where `key`'s record is, if the commit went through."""
        view = self.scheduler.view
        self.connector.has_pending_push_work()  # takes the answers come (the commit's) as vLLM
        if view.has(key.encode()):
            wait_until(lambda: view.slot(key.encode()) is not None, timeout_s)

    def locked(self) -> tuple[int, int]:
        """The daemon's count of this pool's (lease pins, lock-pinned entries)."""
        with Client(self.spec.address) as c:
            [pool] = c.stats(self.pool).pools
            return pool.pins, pool.entries_locked

    def flush(self, max_steps: int = 5) -> None:
        """Empty steps until nothing is owed to the daemon (as vLLM keeps stepping while
        has_pending_push_work)."""
        for _ in range(max_steps):
            if not self.connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError("the connector still has pending work after settling")

    def close(self) -> None:
        self.connector.shutdown()


EngineFactory = Callable[..., Engine]


def held_while(engine: Engine, waiting_id: str, seconds: float) -> int:
    """Step `engine` as vLLM's busy loop would, with only `waiting_id` unfinished, for
    `seconds`; assert it was held back every step; returns how many steps it took."""
    waiting = request(waiting_id, "img")
    steps = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = engine.step(waiting)
        assert result.step.held == {waiting_id}, f"admitted after {steps} steps"
        assert not result.step.encode
        steps += 1
    return steps  # the `engine` fixture: engine(**EngineSpec fields)
