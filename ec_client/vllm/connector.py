"""ECDaemonConnector: vLLM's EC connector interface over the ecd daemon.

vLLM builds the class twice per engine: role SCHEDULER in the engine-core process (the side that
talks to the daemon: scheduler.py) and role WORKER in every worker process (the side that maps
the pool and copies: worker.py). This class only routes vLLM's calls to the side it was built
as, the way ECCPUConnector does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.metadata import ECDaemonConnectorMetadata
from ec_client.vllm.scheduler import SchedulerSide
from ec_client.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request


class ECDaemonConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if not vllm_config.use_v2_model_runner:
            # The worker side is built and tested against the V2 runner's call order
            # (ActiveECConnector); as ECCPUConnector does, refuse the V1 runner rather than run
            # untested.
            raise ValueError(
                "ECDaemonConnector requires vLLM's V2 model runner: set VLLM_USE_V2_MODEL_RUNNER=1"
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            side = SchedulerSide(vllm_config, ConnectorConfig.from_vllm(vllm_config))
            self._scheduler = side
            # vLLM's scheduler makes these four calls for each request of a step (256 in a burst
            # of 64): they go straight to the side, not through a forwarding method and the
            # `scheduler_side` property, about 0.05 us a call on the scheduler thread
            # (docs/performance.md). The methods of the class stay: vLLM's interface declares
            # them, and on the worker-role connector they refuse a scheduler-side call.
            self.ensure_cache_available = side.ensure_cache_available  # type: ignore[method-assign]
            self.has_cache_item = side.has_cache_item  # type: ignore[method-assign]
            self.update_state_after_alloc = side.update_state_after_alloc  # type: ignore[method-assign]
            self.request_finished = side.request_finished  # type: ignore[method-assign]
        elif role == ECConnectorRole.WORKER:
            self._worker = WorkerSide(vllm_config)
        else:
            raise ValueError(f"unknown EC connector role {role}")

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker-side connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler-side connector")
        return self._worker

    def _metadata(self) -> ECDaemonConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ECDaemonConnectorMetadata):
            raise TypeError(f"expected ECDaemonConnectorMetadata, got {type(meta).__name__}")
        return meta

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # ---- worker side ----------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.begin(self._metadata())

    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        if encoder_cache is not None:
            self.worker_side.save_present(self._metadata(), encoder_cache)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.worker_side.load(self._metadata(), encoder_cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self.worker_side.save(self._metadata(), encoder_cache, mm_hash)

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self.worker_side.report()

    # ---- scheduler side -------------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self.scheduler_side.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler_side.has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, index)

    def update_state_after_free(self, request: Request, index: int) -> None:
        self.scheduler_side.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput | None) -> ECConnectorMetadata:
        # vLLM's own EC connector tests pass None (tests/v1/ec_connector/unit/cpu/): a step of
        # unknown size, taken as one that ran something, so it never waits (`_idle`).
        return self.scheduler_side.build_connector_meta(
            scheduled_nothing=scheduler_output is not None
            and scheduler_output.total_num_scheduled_tokens == 0
        )

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler_side.take_unavailable_requests()

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side.has_pending_push_work()
