"""Consumer: read encoder outputs from a pool. No round trip for a local hit or a miss.

    t = Consumer(client, "qwen-vl-node1").get("mm-hash-1", device="cuda:0", wait_ms=500)

A hit comes back as a tensor of the stored shape and dtype; a miss (absent, or still being
written after wait_ms) as None. Steps of a get (docs/design.md §12):

1. The client follows the pool's READY keys and their slots (ReadyView, fed by Watch). A key it
   does not know is a miss, answered at once. A key it knows READY here is pinned by a lock pin
   on its slot (ec_protocol/pool/slot_locks.py: a shared lock, about 2 us, no daemon; the batch's
   together, SlotPins.pin_many), which also reads the entry's record (extents, shape, dtype,
   checksum): a local hit makes no round trip. A lock pin that finds another entry in the slot
   (the view was behind an eviction) is a miss.
2. Everything else asks the daemon, in one Step for the batch: keys whose slot the view has
   not heard yet, keys whose Commit this client still owes (the same Step carries the Commit
   first, or waits for the Step of the outbox's thread that carries it now: a client reads its
   own writes),
   and every key while the view is not synced (starting, or the daemon away) or with wait_ms
   (the daemon is what waits, for a key PENDING or not there yet). Without wait_ms the Step
   is local_only: the daemon answers from the node's pools, as the view does, and never reads
   a key from a cluster's store (only a get with wait_ms does), so a get answers the same
   whether or not the view has synced.
3. The copies out of the pool are launched, each batch's together (the lock-pinned ones, then
   the daemon's: TensorMover.load_many checks them all, then copies back to back). Pins are
   given back only once their copies landed:
   lock pins are unlocked (at once for a CPU copy, else by the outbox thread), leases are released
   with the client's next Step to the pool or alone once it has been quiet
   (ec_client.control.outbox).
4. What the client answered itself reaches the daemon owed, with its next Step: the misses as a
   count, the local hits as keys (the daemon's hit counter and LRU order).

A key another client committed a moment ago (the event's trip, well under a millisecond on one
node) may still be a miss: pass wait_ms to ask the daemon.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from ec_client.control.client import Client
from ec_client.control.outbox import DeferredOp
from ec_client.data.endpoint import PoolEndpoint, item_errors
from ec_client.data.mover import Load, TensorMover, Transfer, wait_all
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import LayoutError
from ec_protocol.pool.slot_locks import PinnedEntry, SlotPins
from ec_protocol.types import Extent, Key, LeaseResult, Status, TensorSpec, key_bytes

log = logging.getLogger("ec_client")


@dataclass
class _Read:
    """One pinned entry this call is copying out of the pool, under a lease (`lease_id`, from
    an Acquire) or a lock pin (`slot` of `pins`)."""

    key: Key
    extents: tuple[Extent, ...]
    spec: TensorSpec
    checksum: int
    mover: TensorMover
    tensor: torch.Tensor
    transfer: Transfer
    lease_id: int = 0
    pins: SlotPins | None = None
    slot: int = -1


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
        """Pin the hits (lock pins here, one Step for what only the daemon can answer) and
        launch their copies; the pins go back as soon as the copies landed."""
        engine_id = self.endpoint.engine_id
        tensors: dict[Key, torch.Tensor | None] = {key: None for key in keys}
        local, asked = self._plan(keys, wait_ms)
        reads: list[_Read] = []
        unread: list[int] = []  # leases of hits whose copy was not launched
        try:
            if local:
                self._read_locally(local, device, out, reads)
            misses = len(keys) - len(asked) - len(reads)
            self.client.outbox.misses(engine_id, misses)  # answered with no round trip
            self.client.outbox.hits(engine_id, [key_bytes(r.key) for r in reads])
            if asked:
                self._read_from_daemon(asked, device, wait_ms, out, reads, unread)
            if self.verify:
                self._verify(reads)
        except BaseException:
            with contextlib.suppress(Exception):  # no pin goes while a copy may still read
                wait_all(r.transfer for r in reads)
            self._give_back_now(reads, unread)
            raise
        tensors.update({r.key: r.tensor for r in reads})
        self._give_back(reads)
        self._release(unread)
        return GetHandle(tensors, reads)

    def _plan(
        self, keys: Sequence[Key], wait_ms: int
    ) -> tuple[list[tuple[Key, bytes, int]], list[Key]]:
        """(key, its bytes, slot) of the keys to lock-pin here, and the keys to ask the daemon
        for; the rest are misses. See the module's steps 1 and 2."""
        raws = [key_bytes(key) for key in keys]
        owed = self.client.outbox.commits_owed(self.endpoint.engine_id)
        if owed and any(not owed[k] for k in raws if k in owed):
            self.client.flush()  # a write of ours still being copied: let it land and commit
            owed = {}
        view = self._view
        if view is None or wait_ms or not view.synced:
            return [], list(keys)
        local: list[tuple[Key, bytes, int]] = []
        asked: list[Key] = []
        for key, k in zip(keys, raws, strict=True):
            if k in owed:
                asked.append(key)
            elif (slot := view.slot(k)) is not None:
                local.append((key, k, slot))
            elif view.has(k):
                asked.append(key)
        return local, asked

    def _read_locally(
        self,
        local: list[tuple[Key, bytes, int]],
        device: torch.device | str,
        out: dict[Key, torch.Tensor] | None,
        reads: list[_Read],
    ) -> None:
        """Lock-pin each (key, its bytes, slot), then launch the copies of those pinned; a slot
        that no longer holds the key is a miss (the view was behind)."""
        mover = self.endpoint.mover(device)  # maps a newer file first, if there is one
        try:
            pins = self.endpoint.pins()
        except (LayoutError, OSError) as error:  # the pool is being recreated: all misses
            log.debug("ecd: cannot lock-pin pool %s now: %s", self.endpoint.engine_id, error)
            return
        hits: list[tuple[Key, int, PinnedEntry]] = []
        try:
            found = pins.pin_many([(slot, raw) for _, raw, slot in local])
            hits.extend(
                (key, slot, pinned)
                for (key, _, slot), pinned in zip(local, found, strict=True)
                if pinned is not None
            )
            tensors, transfer = mover.load_many(
                [Load(p.extents, p.spec, out.get(key) if out else None) for key, _, p in hits]
            )
        except BaseException:
            pins.unpin_many(slot for _, slot, _ in hits)
            raise
        for (key, slot, p), tensor in zip(hits, tensors, strict=True):
            read = _Read(key, p.extents, p.spec, p.checksum, mover, tensor, transfer)
            read.pins, read.slot = pins, slot
            reads.append(read)

    def _read_from_daemon(
        self,
        asked: list[Key],
        device: torch.device | str,
        wait_ms: int,
        out: dict[Key, torch.Tensor] | None,
        reads: list[_Read],
        unread: list[int],
    ) -> None:
        """One round trip pins the keys only the daemon can answer; launch their copies. The
        leases of hits whose copy was not launched stay in `unread`, for the caller to release
        (after the copies launched landed, should this raise)."""
        engine_id = self.endpoint.engine_id
        before = self.endpoint.file_at_path()  # which file the Step is answered of: see below
        if wait_ms:  # the daemon waits: an Acquire of its own, what is owed goes its own way
            results = self.client.acquire(engine_id, asked, wait_ms)
        else:  # answered as the view would: no read from a cluster's store, synced view or not
            results = self.client.step(engine_id, acquires=asked, local_only=True).acquires
        unread.extend(r.lease_id for r in results if r.status is Status.HIT)
        error = item_errors("Acquire", results)
        if error is not None:
            raise error
        mover = self.endpoint.mover(device) if unread else None
        if mover is not None and not self.endpoint.answered_of(mover, before):
            # The pool was recreated around the Step: its hits may be of a file this mapping is
            # not. They are misses (their leases go back, void or not), never another's bytes.
            return
        hits = []
        for key, result in zip(asked, results, strict=True):
            if result.status is Status.MISS and self._view is not None:
                self._view.discard(key_bytes(key))
            if mover is not None and result.status is Status.HIT and result.spec is not None:
                hits.append((key, result, result.spec))
        if mover is None or not hits:
            return
        tensors, transfer = mover.load_many(
            [Load(r.extents, spec, out.get(key) if out else None) for key, r, spec in hits]
        )
        for (key, r, spec), tensor in zip(hits, tensors, strict=True):
            reads.append(
                _Read(key, r.extents, spec, r.checksum, mover, tensor, transfer, r.lease_id)
            )
            unread.remove(r.lease_id)

    def _give_back(self, reads: list[_Read]) -> None:
        """Each pin goes back once its copy landed: a lock pin whose copy is done (a CPU copy)
        at once, the others owed (ec_client.control.outbox)."""
        engine_id = self.endpoint.engine_id
        leases = [r for r in reads if r.pins is None]
        self.client.outbox.releases(
            engine_id, [DeferredOp(self._released, r.transfer, lease_id=r.lease_id) for r in leases]
        )
        later = []
        for pins, transfer, slots in _lock_pinned(reads):
            if transfer.done():
                pins.unpin_many(slots)
            else:
                later.append(DeferredOp(functools.partial(_unpin, pins, slots), transfer))
        if later:
            self.client.outbox.unlocks(engine_id, later)

    def _give_back_now(self, reads: list[_Read], unread: list[int]) -> None:
        """Give every pin back at once (a batch that broke: its copies landed or never began)."""
        for pins, _, slots in _lock_pinned(reads):
            pins.unpin_many(slots)
        self._release([r.lease_id for r in reads if r.pins is None] + unread)

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
        """Check each entry's stored CRC-32 once its copy landed (raises DATA_LOSS; the caller
        gives the pins back)."""
        for read in reads:
            read.transfer.wait()
            if not read.checksum:
                continue
            found = read.mover.checksum(read.extents, read.spec.nbytes)
            if found != read.checksum:
                # Both are CRC-32s with bit 32 set (mover.checksum): shown without that bit.
                crc, stored = found & 0xFFFF_FFFF, read.checksum & 0xFFFF_FFFF
                raise EcdError(
                    grpc.StatusCode.DATA_LOSS,
                    f"entry {read.key!r}: checksum (CRC-32) {crc:#010x} != stored {stored:#010x}",
                )


def _lock_pinned(reads: Sequence[_Read]) -> list[tuple[SlotPins, Transfer, list[int]]]:
    """The slots of the lock-pinned reads, one list per pins and copy (a batch's loads share
    one): what one unpin_many each gives back, once that copy landed."""
    groups: dict[tuple[int, int], tuple[SlotPins, Transfer, list[int]]] = {}
    for read in reads:
        if read.pins is not None:
            group: tuple[SlotPins, Transfer, list[int]] = (read.pins, read.transfer, [])
            groups.setdefault((id(read.pins), id(read.transfer)), group)[2].append(read.slot)
    return list(groups.values())


def _unpin(pins: SlotPins, slots: list[int], answer: object) -> None:
    pins.unpin_many(slots)
