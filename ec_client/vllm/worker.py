"""WorkerSide: the connector in one vLLM worker process. Maps the pool, copies, reports; it never
calls the daemon (the scheduler side allocated, pinned and will commit or release).

Each step (vLLM's V2 model runner order): `begin` with the step's orders, `save_present` for
ordered saves already in the encoder cache, `load` every ordered load into the encoder cache,
the encoder runs, `save` each newly encoded output that has an order, then `report`.

- Every rank loads (each needs the embeddings); only rank 0 of the TP x PCP group saves (the
  outputs are identical on every rank) and reports saves.
- On GPU the copies run on the mover's CUDA stream: a load makes the compute stream wait on its
  event, so the forward can use the tensor at once; a save waits for the encoder's kernels. A copy
  is reported only once its event fired, so the scheduler never commits bytes still in flight nor
  releases a pin still being read. Unreported copies are reported in a later step.
- A save order whose output does not match what was allocated (shape, dtype), or that the encoder
  never produced this step, is reported failed and the scheduler aborts it: only bytes of the
  announced shape are ever committed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

import torch
from vllm.distributed.parallel_state import get_pcp_group, get_tensor_model_parallel_rank

from ec_client.mapping import PoolMapping
from ec_client.mover import TensorMover, Transfer, spec_of
from ec_client.types import PoolInfo
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("ec_client.vllm")
T = TypeVar("T")


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig) -> None:
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.rank = get_pcp_group().rank_in_group * tp_size + get_tensor_model_parallel_rank()
        self.saves = self.rank == 0
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._mover: TensorMover | None = None
        self._unsaved: set[str] = set()  # this step's save orders not carried out yet
        self._saving: list[tuple[str, Transfer]] = []
        self._loading: list[tuple[int, Transfer]] = []
        self._saved: list[str] = []
        self._failed: list[str] = []
        self._loaded: list[int] = []

    def begin(self, meta: ECDaemonConnectorMetadata) -> None:
        self._map(meta.pool)
        if self.saves:
            self._unsaved = set(meta.saves)

    def save_present(
        self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor]
    ) -> None:
        """Ordered saves whose output is already in the encoder cache (encoded in an earlier
        step): vLLM will not call save_caches for them."""
        for key in self._unsaved & encoder_cache.keys():
            self.save(meta, encoder_cache, key)

    def load(self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        mover = self._map(meta.pool)
        for key, order in meta.loads.items():
            if key in encoder_cache:  # already here: nothing is read from the pool
                self._loaded.append(order.transfer_id)
                continue
            tensor, transfer = mover.load(order.extents, order.spec)
            encoder_cache[key] = tensor
            self._loading.append((order.transfer_id, transfer))

    def save(
        self, meta: ECDaemonConnectorMetadata, encoder_cache: dict[str, torch.Tensor], key: str
    ) -> None:
        if key not in self._unsaved:
            return  # not ordered (cached already, no space, or not the saving rank)
        self._unsaved.discard(key)
        order = meta.saves[key]
        tensor = encoder_cache[key]
        if spec_of(tensor) != order.spec:
            log.warning(
                "not saving %s: output is %s, %s was allocated", key, spec_of(tensor), order.spec
            )
            self._failed.append(key)
            return
        self._saving.append((key, self._map(meta.pool).save(tensor, order.extents)))

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
        for _, transfer in self._saving + self._loading:
            transfer.wait()
        if self._mover is not None:
            self._mover.mapping.close()
            self._mover = None

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
