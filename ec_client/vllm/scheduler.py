"""SchedulerSide: the connector in vLLM's scheduler process, the only part that calls the daemon.

Per step, vLLM calls: ensure_cache_available and has_cache_item (answered from local state: no
round trip), update_state_after_alloc (bookkeeping), build_connector_meta (the one place that
calls the daemon), then, after the workers ran, take_unavailable_requests and
update_connector_output (bookkeeping again). build_connector_meta runs every step, even when
nothing was scheduled and the workers reported nothing (update_connector_output is skipped
then), so it is where everything owed to the daemon is sent, one batched RPC per kind, in this
order:

    Commit   saves whose copies the saving rank reported landed
    Abort    saves whose copies failed or never happened
    Release  pins no request needs any more and every rank has reported
    Acquire  pins for the keys requests are waiting on (see loads.py)
    Allocate entries for the outputs encoded this step

Releases and aborts come before Allocate so their space is free for it; Acquire comes before
Allocate so this step's allocations can never evict an entry about to be loaded (the eviction
hazard ECCPUConnector has within a step).

The daemon is an optimisation, never a dependency of a request: while it is unreachable (the
Watch stream is down) the connector calls nothing, answers every has_cache_item with False and
saves nothing, so requests are encoded as if there were no cache. When our session is new (the
daemon restarted, or our lease ran out) or the pool was recreated, everything held in the old one
is void: its pins and PENDING entries are gone, and requests whose loads were in flight fail
(take_unavailable_requests) rather than risk bytes that may have been overwritten.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
    get_encoder_output_width,
)

from ec_client.client import Client
from ec_client.errors import EcdError
from ec_client.layout import tensor_nbytes
from ec_client.ready_view import ReadyView
from ec_client.types import AllocateItem, Role, TensorSpec
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.loads import LoadBook
from ec_client.vllm.metadata import (
    ECDaemonConnectorMetadata,
    ECDaemonWorkerMetadata,
    SaveOrder,
)
from ec_client.vllm.saves import SaveBook

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("ec_client.vllm")
T = TypeVar("T")

CALL_TIMEOUT_S = 10.0


class PoolRefused(RuntimeError):
    """The daemon will not give this engine the pool: another model, dtype, embedding width,
    vLLM version or capacity already owns that name."""


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        self._vllm_config = vllm_config
        self.config = config
        role = {(True, True): Role.BOTH, (True, False): Role.PRODUCER}.get(
            (config.is_producer, config.is_consumer), Role.CONSUMER
        )
        self.client = Client(
            config.address,
            name=config.client_name,
            role=role,
            connect_timeout_s=config.connect_timeout_s,
            call_timeout_s=CALL_TIMEOUT_S,
        )
        try:
            self._attach()
        except EcdError as error:
            self.client.close()
            if error.code is grpc.StatusCode.FAILED_PRECONDITION:
                raise PoolRefused(
                    f"ecd at {self.client.target} refused pool {config.pool!r} to this engine: "
                    f"{error.message}. Engines share a pool only with the same model, dtype, "
                    "embedding width, vLLM version and ec_cpu_bytes; give this engine another "
                    "ecd_pool."
                ) from None
            raise
        self.loads = LoadBook(config.load_reports)
        self.saves = SaveBook()
        self.rpcs: Counter[str] = Counter()  # RPCs made, by kind (for `python -m ...bench`)
        self._unavailable: set[str] = set()
        self._generation = self._current_generation()
        self._no_width: set[str] = set()  # modalities already warned about
        self.view = ReadyView(self.client, config.pool, self._attach)
        self.view.wait_synced(config.connect_timeout_s)

    def _attach(self) -> None:
        """OpenPool: create or attach; idempotent, so also the way back after a restart."""
        c = self.config
        self.client.open_pool(c.pool, c.block_size_bytes, c.capacity_bytes, c.compat_key)

    # ---- vLLM's scheduler calls, in step order -------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.config.is_consumer or not request.mm_features:
            return True
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        wait_s = self.config.wait_s if self.view.synced else 0.0
        return self.loads.admit(request.request_id, needed, self._ready, time.monotonic(), wait_s)

    def has_cache_item(self, identifier: str) -> bool:
        return self.config.is_consumer and self.loads.pinned(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        key = feature.identifier
        if self.config.is_consumer and self.loads.dispatch(request.request_id, key):
            return
        self.loads.scheduled(request.request_id, key)
        if self.config.is_producer and not self._ready(key):
            spec = self._save_spec(feature)
            if spec is not None:
                self.saves.plan(key, spec)

    def build_connector_meta(self) -> ECDaemonConnectorMetadata:
        self._check_generation()
        saves: dict[str, SaveOrder] = {}
        if self.view.synced:
            self._commit_and_abort()
            self._release()
            self._acquire()
            saves = self._allocate()
        else:  # the daemon is away: waiting requests encode, and this step saves nothing
            self.loads.give_up_wanted()
            self.saves.take_planned()
        return ECDaemonConnectorMetadata(
            pool=self.client.pool_info(self.config.pool), saves=saves, loads=self.loads.take_step()
        )

    def take_unavailable_requests(self) -> set[str]:
        self._check_generation()
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def update_connector_output(self, output: ECConnectorOutput) -> None:
        meta = output.ec_connector_worker_meta
        if not isinstance(meta, ECDaemonWorkerMetadata):
            return
        self.saves.report(meta.saved, meta.failed_saves)
        for transfer_id, rank in meta.loaded:
            self.loads.report(transfer_id, rank)

    def update_state_after_free(self, request: Request, index: int) -> None:
        self.loads.drop_holder(request.request_id, request.mm_features[index].identifier)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.loads.forget(request.request_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while something is owed to the daemon or not yet reported by
        the workers. Not while the daemon is away: nothing could be sent, and an idle engine
        would spin; whatever is owed goes with the first step after it is back."""
        return self.view.synced and (self.loads.busy() or self.saves.busy())

    def shutdown(self) -> None:
        """Closing the session makes the daemon abort our PENDING entries and release our pins.
        A private pool (the default, per-run name) cannot be found by anyone else: drop it."""
        self.view.close()
        if self.config.pool_is_private:
            with contextlib.suppress(EcdError):
                self.client.drop_pool(self.config.pool, force=True)
        self.client.close()

    # ---- the flush ------------------------------------------------------------------------------

    def _commit_and_abort(self) -> None:
        landed = self.saves.take_landed()
        if landed:
            results = self._call("commit", lambda: self.client.commit(self.config.pool, landed))
            if results is None:
                self.saves.requeue(landed=landed)
            else:
                for key, result in zip(landed, results, strict=True):
                    if not result.status.is_error:
                        self.view.add(key.encode())
        failed = self.saves.take_failed()
        if failed:
            aborted = self._call("abort", lambda: self.client.abort(self.config.pool, failed))
            if aborted is None:
                self.saves.requeue(failed=failed)

    def _release(self) -> None:
        leases = self.loads.take_releases()
        if leases and self._call("release", lambda: self.client.release(leases)) is None:
            self.loads.requeue_releases(leases)

    def _acquire(self) -> None:
        wanted = self.loads.wanted()
        if not wanted:
            return
        results = self._call("acquire", lambda: self.client.acquire(self.config.pool, wanted))
        if results is None:
            self.loads.give_up_wanted()
            return
        for key in self.loads.acquired(wanted, results, self._loadable):
            self.view.discard(key.encode())

    def _allocate(self) -> dict[str, SaveOrder]:
        planned = self.saves.take_planned()
        if not planned:
            return {}
        items = [AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in planned.items()]
        results = self._call("allocate", lambda: self.client.allocate(self.config.pool, items))
        return {} if results is None else self.saves.allocated(planned, results)

    def _call(self, kind: str, rpc: Callable[[], T]) -> T | None:
        """One RPC. A failure is logged and answered with None (the caller retries next step or
        goes without); a restart it revealed is absorbed before the caller records the answer,
        so the answer lands in the new generation, not voided with the old."""
        self.rpcs[kind] += 1
        try:
            result: T | None = rpc()
        except EcdError as error:
            log.warning("ecd %s failed, the cache is skipped this step: %s", kind, error)
            result = None
        self._check_generation()
        return result

    # ---- helpers --------------------------------------------------------------------------------

    def _current_generation(self) -> tuple[str, str]:
        """Our pins and PENDING entries live as long as our session and the pool file: a new
        session (daemon restarted, or our lease ran out) or a new pool UUID voids them."""
        return self.client.session_id, self.client.pool_info(self.config.pool).pool_uuid

    def _check_generation(self) -> None:
        generation = self._current_generation()
        if generation == self._generation:
            return
        self._generation = generation
        failed = self.loads.void()
        self.saves.void()
        self._unavailable |= failed
        log.warning(
            "ecd session or pool %s is new (daemon restart, lease lost, pool recreated): pins "
            "and unfinished saves are void; %d request(s) with loads in flight fail",
            self.config.pool,
            len(failed),
        )

    def _ready(self, key: str) -> bool:
        return self.view.has(key.encode())

    def _loadable(self, spec: TensorSpec) -> bool:
        """Encoder outputs are (rows, width) in the model dtype; anything else is not ours."""
        return len(spec.shape) == 2 and spec.dtype == self.config.dtype

    def _save_spec(self, feature: MultiModalFeatureSpec) -> TensorSpec | None:
        try:
            width = get_encoder_output_width(self._vllm_config, feature.modality)
        except ValueError as error:
            if feature.modality not in self._no_width:
                self._no_width.add(feature.modality)
                log.warning("not saving %s outputs: %s", feature.modality, error)
            return None
        shape = (feature.mm_position.get_num_embeds(), width)
        return TensorSpec(shape, self.config.dtype, tensor_nbytes(shape, self.config.dtype))
