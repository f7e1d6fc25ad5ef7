"""Consumer: read encoder outputs from a pool. acquire -> copy -> release, one RPC each per batch.

    t = Consumer(client, "qwen-vl-node1").get("mm-hash-1", device="cuda:0", wait_ms=500)

A hit comes back as a tensor of the stored shape and dtype; a miss (absent, or still being
written after wait_ms) as None. The entry stays pinned, so it cannot be evicted or overwritten,
until its copy has landed; only then is the pin released.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from ec_client.client import Client
from ec_client.endpoint import PoolEndpoint, raise_item_errors
from ec_client.errors import EcdError
from ec_client.mover import TensorMover, Transfer, wait_all
from ec_client.types import AcquireResult, Key, Status


@dataclass
class _Read:
    """One pinned entry this call is copying out of the pool."""

    key: Key
    result: AcquireResult
    mover: TensorMover
    tensor: torch.Tensor
    transfer: Transfer


class GetHandle:
    """A get in flight: copies launched, pins held. `wait` releases them once the copies landed.

    On GPU the tensors are usable at once on the caller's current stream (it waits on the copies);
    `wait` is only about giving the pins back.
    """

    def __init__(
        self, consumer: Consumer, tensors: dict[Key, torch.Tensor | None], reads: list[_Read]
    ):
        self._consumer = consumer
        self._tensors = tensors
        self._reads = reads
        self._released = False

    def done(self) -> bool:
        return all(r.transfer.done() for r in self._reads)

    def wait(self) -> dict[Key, torch.Tensor | None]:
        if not self._released:
            self._consumer._release(self._reads)
            self._released = True
        return self._tensors


class Consumer:
    def __init__(self, client: Client, engine_id: str, *, verify: bool = False) -> None:
        """verify: check each entry's stored CRC-32 (if its producer stored one) after reading."""
        self.endpoint = PoolEndpoint(client, engine_id)
        self.verify = verify

    @property
    def client(self) -> Client:
        return self.endpoint.client

    def get(
        self,
        key: Key,
        device: torch.device | str = "cpu",
        wait_ms: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The stored tensor on `device` (or copied into `out`), or None on a miss."""
        return self.get_many_async(
            [key], device, wait_ms, {key: out} if out is not None else None
        ).wait()[key]

    def get_many(
        self, keys: Sequence[Key], device: torch.device | str = "cpu", wait_ms: int = 0
    ) -> dict[Key, torch.Tensor | None]:
        return self.get_many_async(keys, device, wait_ms).wait()

    def get_many_async(
        self,
        keys: Sequence[Key],
        device: torch.device | str = "cpu",
        wait_ms: int = 0,
        out: dict[Key, torch.Tensor] | None = None,
    ) -> GetHandle:
        """Acquire every key in one RPC and launch the copies; the handle releases the pins."""
        results = self.client.acquire(self.endpoint.engine_id, keys, wait_ms)
        reads: list[_Read] = []
        try:
            raise_item_errors("Acquire", ((r.key, r.status, r.message) for r in results))
            mover = self.endpoint.mover(device)
            for key, result in zip(keys, results, strict=True):
                if result.status is Status.HIT and result.spec is not None:
                    target = out.get(key) if out else None
                    tensor, transfer = mover.load(result.extents, result.spec, target)
                    reads.append(_Read(key, result, mover, tensor, transfer))
        except BaseException:
            # Copies already launched must land before the pins go: the entries could be evicted
            # and rewritten under them.
            with contextlib.suppress(Exception):
                wait_all(r.transfer for r in reads)
            self.client.release([r.lease_id for r in results if r.status is Status.HIT])
            raise
        tensors: dict[Key, torch.Tensor | None] = {key: None for key in keys}
        tensors.update({r.key: r.tensor for r in reads})
        return GetHandle(self, tensors, reads)

    def _release(self, reads: Sequence[_Read]) -> None:
        if not reads:
            return
        try:
            wait_all(r.transfer for r in reads)
            if self.verify:
                self._verify(reads)
        finally:
            results = self.client.release([r.result.lease_id for r in reads])
        raise_item_errors(
            "Release", ((r.key, s.status, s.message) for r, s in zip(reads, results, strict=True))
        )

    @staticmethod
    def _verify(reads: Sequence[_Read]) -> None:
        for read in reads:
            stored = read.result.checksum
            if not stored or read.result.spec is None:
                continue
            found = read.mover.checksum(read.result.extents, read.result.spec.nbytes)
            if found != stored:
                raise EcdError(
                    grpc.StatusCode.DATA_LOSS,
                    f"entry {read.key!r}: checksum {found:#x} != stored {stored:#x}",
                )
