"""Producer: store encoder outputs in a pool. allocate -> copy -> commit, one RPC each per batch.

    Producer(client, "qwen-vl-node1").put("mm-hash-1", tensor)   # -> PutStatus.STORED

Results: STORED (this call wrote it), EXISTS (already cached: skip the encode), PENDING (another
producer is writing it: wait for it rather than encode twice), NO_SPACE (the pool is full of
entries that are pinned or being written). An entry is committed only after its copy has landed;
if a copy fails, the batch's allocations are aborted, so no half-written entry is ever visible.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ec_client.client import Client
from ec_client.endpoint import PoolEndpoint, raise_item_errors
from ec_client.mover import TensorMover, Transfer, spec_of, wait_all
from ec_client.types import AllocateItem, AllocateResult, Extent, Key, Status


class PutStatus(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"
    PENDING = "pending"
    NO_SPACE = "no_space"


_PUT_STATUS = {
    Status.ALLOCATED: PutStatus.STORED,
    Status.EXISTS: PutStatus.EXISTS,
    Status.PENDING: PutStatus.PENDING,
    Status.NO_SPACE: PutStatus.NO_SPACE,
}


@dataclass
class _Write:
    """One entry this call allocated and is copying into."""

    key: Key
    extents: tuple[Extent, ...]
    nbytes: int
    mover: TensorMover
    transfer: Transfer


class PutHandle:
    """A put in flight: copies launched, not yet committed. `wait` commits once they landed."""

    def __init__(self, producer: Producer, statuses: dict[Key, PutStatus], writes: list[_Write]):
        self._producer = producer
        self._statuses = statuses
        self._writes = writes
        self._committed = False

    def done(self) -> bool:
        """The copies have landed: wait() will not block on the device."""
        return all(w.transfer.done() for w in self._writes)

    def wait(self) -> dict[Key, PutStatus]:
        if not self._committed:
            self._producer._commit(self._writes)
            self._committed = True
        return self._statuses


class Producer:
    def __init__(self, client: Client, engine_id: str, *, checksum: bool = False) -> None:
        """checksum: store a CRC-32 of each entry so consumers can verify what they read."""
        self.endpoint = PoolEndpoint(client, engine_id)
        self.checksum = checksum

    @property
    def client(self) -> Client:
        return self.endpoint.client

    def put(self, key: Key, tensor: torch.Tensor) -> PutStatus:
        return self.put_many({key: tensor})[key]

    def put_many(self, tensors: Mapping[Key, torch.Tensor]) -> dict[Key, PutStatus]:
        return self.put_many_async(tensors).wait()

    def put_many_async(self, tensors: Mapping[Key, torch.Tensor]) -> PutHandle:
        """Allocate every key in one RPC and launch the copies; the handle commits them."""
        engine_id = self.endpoint.engine_id
        specs = [spec_of(t) for t in tensors.values()]
        items = [
            AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in zip(tensors, specs, strict=True)
        ]
        results = self.client.allocate(engine_id, items)
        writes: list[_Write] = []
        try:
            raise_item_errors("Allocate", ((r.key, r.status, r.message) for r in results))
            for (key, tensor), spec, result in zip(tensors.items(), specs, results, strict=True):
                if result.status is Status.ALLOCATED:
                    mover = self.endpoint.mover(tensor.device)
                    transfer = mover.save(tensor, result.extents)
                    writes.append(_Write(key, result.extents, spec.nbytes, mover, transfer))
        except BaseException:
            # Copies already launched must land before the entries go back: a late copy would
            # write into blocks handed to another writer.
            with contextlib.suppress(Exception):
                wait_all(w.transfer for w in writes)
            self._abort(results)
            raise
        statuses = {key: _PUT_STATUS[r.status] for key, r in zip(tensors, results, strict=True)}
        return PutHandle(self, statuses, writes)

    def _commit(self, writes: Sequence[_Write]) -> None:
        if not writes:
            return
        engine_id = self.endpoint.engine_id
        try:
            wait_all(w.transfer for w in writes)
        except BaseException:
            self.client.abort(engine_id, [w.key for w in writes])
            raise
        checksums = (
            [w.mover.checksum(w.extents, w.nbytes) for w in writes] if self.checksum else None
        )
        results = self.client.commit(engine_id, [w.key for w in writes], checksums)
        raise_item_errors("Commit", ((r.key, r.status, r.message) for r in results))

    def _abort(self, results: Sequence[AllocateResult]) -> None:
        allocated = [r.key for r in results if r.status is Status.ALLOCATED]
        if allocated:
            self.client.abort(self.endpoint.engine_id, allocated)
