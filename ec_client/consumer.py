"""Consumer: read encoder outputs from a pool. One round trip per batch of hits, none per miss.

    t = Consumer(client, "qwen-vl-node1").get("mm-hash-1", device="cuda:0", wait_ms=500)

A hit comes back as a tensor of the stored shape and dtype; a miss (absent, or still being
written after wait_ms) as None. Steps of a get:

1. Misses without a round trip: the client follows the pool's READY keys (ReadyView, fed by
   Watch), so a key it does not know is answered None at once, without asking the daemon. While
   the view is not synced (starting, or the daemon away) every key is asked; with wait_ms every
   key is asked too, since the daemon is what waits (for a key PENDING or not there yet). A key
   another client committed a moment ago (the event's trip, well under a millisecond on one
   node) may still be such a miss: pass wait_ms to ask the daemon. Such misses are counted all
   the same: their count rides on the client's next Step to the pool (ec_client.owed), so the
   daemon's miss counters hold them.
2. One Step pins the hits (the round trip; it also carries what the client owes the pool, its
   own Commits first, so a client always reads its own writes), then their copies out of the
   pool are launched.
3. The pins are owed back from then on (ec_client.owed): released with the client's next Step to
   the pool, or alone once it has been quiet for `linger_s`, and never before the copies landed:
   the entry cannot be evicted or overwritten while it is being read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from ec_client.client import Client
from ec_client.endpoint import PoolEndpoint, item_errors
from ec_client.errors import EcdError
from ec_client.mover import TensorMover, Transfer, wait_all
from ec_client.owed import Debt
from ec_client.types import AcquireResult, Key, LeaseResult, Status, key_bytes

log = logging.getLogger("ec_client")


@dataclass
class _Read:
    """One pinned entry this call is copying out of the pool."""

    key: Key
    result: AcquireResult
    mover: TensorMover
    tensor: torch.Tensor
    transfer: Transfer


class GetHandle:
    """A get whose Acquire answered: its tensors exist and their copies are launched.

    On GPU the tensors are usable at once on the caller's current stream (it waits on the copies);
    `wait` blocks the host until the copies landed. Pins go back by themselves once they have.
    """

    def __init__(self, tensors: dict[Key, torch.Tensor | None], reads: list[_Read]) -> None:
        self.tensors = tensors
        self._reads = reads

    def done(self) -> bool:
        return all(r.transfer.done() for r in self._reads)

    def wait(self) -> dict[Key, torch.Tensor | None]:
        for read in self._reads:
            read.transfer.wait()
        return self.tensors


class Consumer:
    def __init__(
        self, client: Client, engine_id: str, *, verify: bool = False, watch: bool = True
    ) -> None:
        """verify: check each entry's stored CRC-32 (if its producer stored one) after reading.
        watch: answer misses from the client's view of the pool (no round trip); without it,
        every get asks the daemon."""
        self.endpoint = PoolEndpoint(client, engine_id)
        self.verify = verify
        self.failed_releases = 0  # pins whose Release did not reach the daemon (logged)
        self._view = client.view(engine_id) if watch else None

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
        ).tensors[key]

    def get_many(
        self, keys: Sequence[Key], device: torch.device | str = "cpu", wait_ms: int = 0
    ) -> dict[Key, torch.Tensor | None]:
        return self.get_many_async(keys, device, wait_ms).tensors

    def get_many_async(
        self,
        keys: Sequence[Key],
        device: torch.device | str = "cpu",
        wait_ms: int = 0,
        out: dict[Key, torch.Tensor] | None = None,
    ) -> GetHandle:
        """Acquire the keys that may be there in one round trip and launch their copies; their
        pins are owed back from then on, and go as soon as the copies landed."""
        engine_id = self.endpoint.engine_id
        tensors: dict[Key, torch.Tensor | None] = {key: None for key in keys}
        asked = self._worth_asking(keys, wait_ms)
        self.client.owed.misses(engine_id, len(keys) - len(asked))  # the view's answers
        if not asked:
            return GetHandle(tensors, [])
        if wait_ms:  # the daemon waits: an Acquire of its own, what is owed goes its own way
            results = self.client.acquire(engine_id, asked, wait_ms)
        else:
            results = self.client.step(engine_id, acquires=asked).acquires
        reads: list[_Read] = []
        try:
            error = item_errors("Acquire", results)
            if error is not None:
                raise error
            mover = self.endpoint.mover(device)
            for key, result in zip(asked, results, strict=True):
                if result.status is Status.HIT and result.spec is not None:
                    target = out.get(key) if out else None
                    tensor, transfer = mover.load(result.extents, result.spec, target)
                    reads.append(_Read(key, result, mover, tensor, transfer))
                elif result.status is Status.MISS and self._view is not None:
                    self._view.discard(key_bytes(key))
        except BaseException:
            with contextlib.suppress(Exception):  # no pin goes while a copy may still read
                wait_all(r.transfer for r in reads)
            self._release([r.lease_id for r in results if r.status is Status.HIT])
            raise
        if self.verify:
            self._verify(reads)  # waits for the copies; releases even if it raises
        tensors.update({r.key: r.tensor for r in reads})
        self.client.owed.releases(
            engine_id,
            [Debt(self._released, r.transfer, lease_id=r.result.lease_id) for r in reads],
        )
        return GetHandle(tensors, reads)

    def _worth_asking(self, keys: Sequence[Key], wait_ms: int) -> list[Key]:
        """The keys to Acquire: all of them unless the view is synced and no wait is asked for,
        in which case only those it has READY, and those whose Commit this client still owes
        (the same Step carries the Commit first: a client reads its own writes). The rest are
        misses, answered with no round trip."""
        owed = self.client.owed.commits_owed(self.endpoint.engine_id)
        if any(not owed[k] for k in map(key_bytes, keys) if k in owed):
            self.client.settle()  # a write of ours still being copied: let it land and commit
            owed = {}
        view = self._view
        if view is None or wait_ms or not view.synced:
            return list(keys)
        return [key for key in keys if (k := key_bytes(key)) in owed or view.has(k)]

    def _released(self, answer: LeaseResult | EcdError) -> None:
        error = answer if isinstance(answer, EcdError) else item_errors("Release", [answer])
        if error is not None:  # the pin goes with the session's lease all the same
            self.failed_releases += 1
            log.warning("ecd: release of a pin failed: %s", error)

    def _release(self, lease_ids: list[int]) -> None:
        """Release at once (a batch that broke: its copies have landed or never started)."""
        if not lease_ids:
            return
        try:
            error = item_errors("Release", self.client.release(lease_ids))
        except EcdError as exc:
            error = exc
        if error is not None:
            self.failed_releases += len(lease_ids)
            log.warning("ecd: release of %d pin(s) failed: %s", len(lease_ids), error)

    def _verify(self, reads: Sequence[_Read]) -> None:
        try:
            for read in reads:
                read.transfer.wait()
                stored = read.result.checksum
                if not stored or read.result.spec is None:
                    continue
                found = read.mover.checksum(read.result.extents, read.result.spec.nbytes)
                if found != stored:
                    raise EcdError(
                        grpc.StatusCode.DATA_LOSS,
                        f"entry {read.key!r}: checksum {found:#x} != stored {stored:#x}",
                    )
        except BaseException:
            self._release([r.result.lease_id for r in reads])
            raise
