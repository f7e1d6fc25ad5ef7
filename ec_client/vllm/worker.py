"""WorkerSide: the connector in one vLLM worker process. Maps the pool, copies, reports; it never
calls the daemon on the way (the scheduler side allocated, pinned and will commit or release).

At start it maps the pool and, on a GPU, registers it with CUDA (seconds for a large pool: better
before serving than in the first step). It learns the pool from a client of its own, by the same
create-or-attach OpenPool the scheduler side makes; a daemon not reachable then is no error: the
pool is mapped on first use, from the step's metadata, and again whenever the daemon recreated it.
Workers start before the scheduler side, so a worker may create the engine's private pool: it
opens it ephemeral too, and keeps its session (and its KeepAlive) while it lives, so that the
pool goes when the last of the engine's processes ends, however (an engine killed while loading
its model, before its scheduler side existed, leaves no pool behind). With a named pool the
client lives for that one call.

Each step (vLLM's V2 model runner order): `begin` with the step's orders, `save_present` copies
the ordered saves (outputs of an earlier step, kept since or still in the encoder cache), `load`
every ordered load into the encoder cache, the encoder runs, `save` keeps each newly encoded
output the step names a save intent (its order comes with a later step, once the scheduler
knows where it goes), then `report`.

- Only the first pipeline stage builds input embeddings, so only its workers load (every one of
  them: each needs the embeddings) and only its first worker saves (the outputs are identical on
  every rank) and reports saves; under an executor that hands the scheduler one worker's output
  ("uni", "external_launcher") that worker saves for itself. Loads are reported per WorkerRank,
  so the scheduler counts each worker once.
- On GPU the copies run on the mover's CUDA streams (one per direction): a load makes the
  compute stream wait on its event, so the forward can use the tensor at once; a save waits for
  the encoder's kernels. A copy is reported only once its event fired, so the scheduler never
  commits bytes still in flight nor releases a pin still being read. Unreported copies are
  reported in a later step.
- A save order whose output does not match what was allocated (shape, dtype), or whose output
  is gone (neither kept nor in the encoder cache), is reported failed and the scheduler aborts
  it: only bytes of the announced shape are ever committed.
- Kept outputs are references to the encoder's tensors: an intent holds its output's GPU memory
  one step longer than vLLM would (until its order or its cancellation comes), no more.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

import torch
from vllm.distributed.parallel_state import (
    get_pcp_group,
    get_pp_group,
    get_tensor_model_parallel_rank,
)

from ec_client.control.client import Client
from ec_client.data.mapping import PoolMapping
from ec_client.data.mover import Load, TensorMover, Transfer, spec_of, wait_all
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.metadata import (
    ECDaemonConnectorMetadata,
    ECDaemonWorkerMetadata,
    WorkerRank,
)
from ec_protocol.errors import EcdError
from ec_protocol.types import PoolInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("ec_client.vllm")
T = TypeVar("T")


def worker_rank(tensor_parallel_size: int) -> WorkerRank:
    """This worker's pipeline stage and its rank within the stage's TP x PCP group."""
    tensor = get_pcp_group().rank_in_group * tensor_parallel_size
    return WorkerRank(get_pp_group().rank_in_group, tensor + get_tensor_model_parallel_rank())


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.config = config = ConnectorConfig.from_vllm(vllm_config)
        self.rank = worker_rank(vllm_config.parallel_config.tensor_parallel_size)
        self.loads = self.rank.pipeline == 0
        self.saves = self.loads and (config.worker_is_alone or self.rank.tensor == 0)
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._mover: TensorMover | None = None
        self._unsaved: set[str] = set()  # this step's save orders not carried out yet
        self._intents: set[str] = set()  # this step's save intents: outputs to keep
        self._kept: dict[str, torch.Tensor] = {}  # outputs kept for an order still to come
        self._saving: list[tuple[str, Transfer]] = []
        self._loading: list[tuple[int, Transfer]] = []
        self._saved: list[str] = []
        self._failed: list[str] = []
        self._loaded: list[int] = []
        self._holder: Client | None = None  # holds the private pool while this worker lives
        if self.loads or self.saves:
            self._map_at_start()

    def _map_at_start(self) -> None:
        c = self.config
        client: Client | None = None
        try:
            c.await_daemon()
            client = Client(
                c.address,
                name=f"{c.client_name}-worker",
                connect_timeout_s=c.connect_timeout_s,
                keepalive=c.pool_is_private,  # a holder's session must not run out
            )
            info = client.open_pool(
                c.pool, c.block_size_bytes, c.capacity_bytes, c.compat_key, c.pool_is_private
            )
        except EcdError as error:
            if client is not None:
                client.close()
            log.warning("pool %s not mapped at start, will be on first use: %s", c.pool, error)
            return
        if c.pool_is_private:
            self._holder = client
        else:
            client.close()
        self._map(info)

    def begin(self, meta: ECDaemonConnectorMetadata) -> None:
        if not (self.loads or self.saves):
            return
        if meta.pool is not None:  # None until the scheduler side reached the daemon
            self._map(meta.pool)
        if self.saves:
            self._unsaved = set(meta.saves)
            self._intents = meta.save_intents
            for key in meta.cancelled:
                self._kept.pop(key, None)
            for key in self._unsaved & self._kept.keys():  # launch the copies at once
                self._save(meta, key, self._kept.pop(key))

    def save_present(
        self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor]
    ) -> None:
        """Ordered saves whose output was not kept but is still in the encoder cache: vLLM
        will not call save_caches for them."""
        for key in self._unsaved & encoder_cache.keys():
            self._save(meta, key, encoder_cache[key])

    def load(self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        if not self.loads:
            return  # a later pipeline stage: it never reads input embeddings
        orders = []
        for key, order in meta.loads.items():
            if key in encoder_cache:  # already here: nothing is read from the pool
                self._loaded.append(order.transfer_id)
            else:
                orders.append((key, order))
        if not orders:
            return
        tensors, transfer = self._mover_of(meta).load_many(
            [Load(order.extents, order.spec) for _, order in orders]
        )  # one batch: on GPU one event for the step's loads
        for (key, order), tensor in zip(orders, tensors, strict=True):
            encoder_cache[key] = tensor
            self._loading.append((order.transfer_id, transfer))

    def save(
        self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor], key: str
    ) -> None:
        """A newly encoded output: kept if the step names it a save intent (its entry is being
        allocated), copied at once if it is ordered already."""
        if key in self._intents:
            self._kept[key] = encoder_cache[key]
        elif key in self._unsaved:
            self._save(meta, key, encoder_cache[key])

    def _save(self, meta: ECDaemonConnectorMetadata, key: str, tensor: torch.Tensor) -> None:
        self._unsaved.discard(key)
        order = meta.saves[key]
        try:
            spec = spec_of(tensor)
        except ValueError as error:  # nothing a pool can hold: never fail the engine's step
            spec, why = None, str(error)
        else:
            why = f"output is {spec}, {order.spec} was allocated"
        if spec != order.spec:
            log.warning("not saving %s: %s", key, why)
            self._failed.append(key)
            return
        self._saving.append((key, self._mover_of(meta).save(tensor, order.extents)))

    def report(self) -> ECDaemonWorkerMetadata | None:
        """Close the step: orders never carried out failed; finished copies are reported."""
        self._failed.extend(self._unsaved)
        self._unsaved = set()
        self._saved.extend(_finished(self._saving))
        self._loaded.extend(_finished(self._loading))
        if not (self._saved or self._failed or self._loaded):
            return None
        meta = ECDaemonWorkerMetadata(
            saved=self._saved,
            failed_saves=self._failed,
            loaded=[(transfer_id, self.rank) for transfer_id in self._loaded],
        )
        self._saved, self._failed, self._loaded = [], [], []
        return meta

    def shutdown(self) -> None:
        self._kept.clear()
        wait_all(transfer for _, transfer in self._saving + self._loading)
        if self._mover is not None:
            self._mover.mapping.close()
            self._mover = None
        if self._holder is not None:  # the pool goes if no other session of the engine holds it
            self._holder.close()
            self._holder = None

    def _mover_of(self, meta: ECDaemonConnectorMetadata) -> TensorMover:
        """The mover for a step that orders copies: it names its pool."""
        if meta.pool is None:
            raise RuntimeError("a step ordered copies without naming the pool")
        return self._map(meta.pool)

    def _map(self, pool: PoolInfo) -> TensorMover:
        """The mover for this pool; maps it on first use and again if the daemon recreated it."""
        mover = self._mover
        if mover is None or mover.mapping.info.pool_uuid != pool.pool_uuid:
            if mover is not None:
                mover.mapping.close()
            mover = self._mover = TensorMover(PoolMapping.open(pool), self._device)
        return mover


def _finished(transfers: list[tuple[T, Transfer]]) -> list[T]:
    """Remove and return the items whose copies have landed, keeping the rest in order."""
    finished, pending = [], []
    for item, transfer in transfers:
        if transfer.done():
            transfer.wait()  # drops what it kept alive for the copy
            finished.append(item)
        else:
            pending.append((item, transfer))
    transfers[:] = pending
    return finished
