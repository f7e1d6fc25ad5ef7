"""Producer: store encoder outputs in a pool. One round trip per batch: Allocate.

    Producer(client, "qwen-vl-node1").put("mm-hash-1", tensor)   # -> PutStatus.STORED

Results: STORED (this call writes it), EXISTS (already cached: skip the encode), PENDING (another
producer is writing it: wait for it rather than encode twice), NO_SPACE (the pool is full of
entries that are pinned or being written).

When a put becomes visible. `put` returns once the Allocate answered and the copy was launched
(on CPU: done). The Commit goes out on the client's background thread as soon as the copy has
landed, never before, batched with the other commits waiting then; the entry is visible to every
client once the daemon has it, normally within one round trip of `put` returning. To know it is
visible: `PutHandle.wait()` (from `put_many_async`) or `Producer.flush()`; a Consumer on the same
Client always sees its own client's puts (it waits for them first). A Commit the daemon refuses
(the daemon restarted, the lease ran out) reaches the caller: `wait()` / `flush()` raise it, it is
logged, and `failed_commits` counts it. If a copy fails, the entry is aborted, so no half-written
entry is ever visible.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ec_client.client import Client
from ec_client.endpoint import PoolEndpoint, item_errors
from ec_client.errors import EcdError
from ec_client.mover import TensorMover, Transfer, spec_of, wait_all
from ec_client.types import AllocateItem, AllocateResult, Extent, Key, Status

log = logging.getLogger("ec_client")


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
    """One entry a put allocated and is copying into; `done` is its put's commit answer."""

    key: Key
    extents: tuple[Extent, ...]
    nbytes: int
    mover: TensorMover
    transfer: Transfer
    done: Future[None]


@dataclass
class PutHandle:
    """A put whose Allocate answered: `statuses` are final; the copies are launched and the
    Commit follows them. `wait()` returns once the daemon answered the Commit (the STORED entries
    are then visible to all), raising EcdError if it refused."""

    statuses: dict[Key, PutStatus]
    _copies: list[Transfer]
    _committed: Future[None] = field(default_factory=Future)

    def done(self) -> bool:
        """The Commit was answered (or there was nothing to commit)."""
        return self._committed.done()

    def copied(self) -> bool:
        """The copies have landed: the tensors may be reused."""
        return all(t.done() for t in self._copies)

    def wait(self, timeout_s: float | None = None) -> dict[Key, PutStatus]:
        self._committed.result(timeout_s)
        return self.statuses


class Producer:
    def __init__(self, client: Client, engine_id: str, *, checksum: bool = False) -> None:
        """checksum: store a CRC-32 of each entry so consumers can verify what they read."""
        self.endpoint = PoolEndpoint(client, engine_id)
        self.checksum = checksum
        self.failed_commits = 0  # entries whose Commit the daemon refused, or whose copy failed
        self._lock = threading.Lock()
        self._unsent: list[_Write] = []  # copies launched, Commit not sent yet
        self._failures: list[EcdError] = []  # for the next flush()

    @property
    def client(self) -> Client:
        return self.endpoint.client

    def put(self, key: Key, tensor: torch.Tensor) -> PutStatus:
        return self.put_many({key: tensor})[key]

    def put_many(self, tensors: Mapping[Key, torch.Tensor]) -> dict[Key, PutStatus]:
        return self.put_many_async(tensors).statuses

    def put_many_async(self, tensors: Mapping[Key, torch.Tensor]) -> PutHandle:
        """Allocate every key in one RPC and launch the copies; their Commit follows in the
        background once they landed."""
        engine_id = self.endpoint.engine_id
        specs = [spec_of(t) for t in tensors.values()]
        items = [
            AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in zip(tensors, specs, strict=True)
        ]
        results = self.client.allocate(engine_id, items)
        committed: Future[None] = Future()
        writes: list[_Write] = []
        try:
            raise_errors("Allocate", results)
            for (key, tensor), spec, result in zip(tensors.items(), specs, results, strict=True):
                if result.status is Status.ALLOCATED:
                    mover = self.endpoint.mover(tensor.device)
                    transfer = mover.save(tensor, result.extents)
                    writes.append(
                        _Write(key, result.extents, spec.nbytes, mover, transfer, committed)
                    )
        except BaseException:
            # Copies already launched must land before their blocks go back to the pool: another
            # writer may get them as soon as the Abort is through.
            with contextlib.suppress(Exception):
                wait_all(w.transfer for w in writes)
            allocated = [r.key for r in results if r.status is Status.ALLOCATED]
            if allocated:
                self.client.abort(engine_id, allocated)
            raise
        statuses = {key: _PUT_STATUS[r.status] for key, r in zip(tensors, results, strict=True)}
        handle = PutHandle(statuses, [w.transfer for w in writes], committed)
        if writes:
            self._commit_later(writes)
        else:
            committed.set_result(None)
        return handle

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every put so far is committed (visible); raise the first Commit failure
        since the last flush."""
        self.client.settle(timeout_s)
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise failures[0]

    # ---- the background commit ---------------------------------------------------------------

    def _commit_later(self, writes: list[_Write]) -> None:
        """Queue the writes; one background job sends every write queued by the time it runs,
        so puts made while a Commit is in flight share the next one."""
        with self._lock:
            first = not self._unsent
            self._unsent.extend(writes)
        if first:
            self.client.later(self._send_commits)

    def _send_commits(self) -> None:
        with self._lock:
            writes, self._unsent = self._unsent, []
        if not writes:
            return
        landed, failures = self._landed(writes)
        committed: list[_Write] = []
        if landed:
            try:
                results = self.client.commit(
                    self.endpoint.engine_id, [w.key for w in landed], self._checksums(landed)
                )
            except EcdError as error:
                failures += [(w, error) for w in landed]
            else:
                for write, result in zip(landed, results, strict=True):
                    refused = item_errors("Commit", [result])
                    if refused is None:
                        committed.append(write)
                    else:
                        failures.append((write, refused))
        if committed:
            self.client.known_ready(self.endpoint.engine_id, [w.key for w in committed])
        self._settle(writes, failures)

    def _landed(self, writes: list[_Write]) -> tuple[list[_Write], list[tuple[_Write, EcdError]]]:
        """The writes whose copies landed; those whose copies failed are aborted."""
        landed, failed = [], []
        for write in writes:
            try:
                write.transfer.wait()
                landed.append(write)
            except Exception as exc:  # a device error surfaces here, on the event
                failed.append((write, EcdError.copy_failed(write.key, exc)))
        if failed:
            try:
                self.client.abort(self.endpoint.engine_id, [w.key for w, _ in failed])
            except EcdError as error:  # the producer's lease will abort them all the same
                log.warning("abort of failed copies did not reach ecd: %s", error)
        return landed, failed

    def _checksums(self, writes: Sequence[_Write]) -> list[int] | None:
        if not self.checksum:
            return None
        return [w.mover.checksum(w.extents, w.nbytes) for w in writes]

    def _settle(self, writes: Iterable[_Write], failures: list[tuple[_Write, EcdError]]) -> None:
        """Answer every put's handle: its first failure, else done."""
        failed: dict[int, EcdError] = {}
        for write, error in failures:
            failed.setdefault(id(write.done), error)
        if failures:
            self.failed_commits += len(failures)
            log.warning(
                "ecd: %d put(s) into pool %s not committed: %s",
                len(failures),
                self.endpoint.engine_id,
                failures[0][1],
            )
            with self._lock:
                self._failures.append(failures[0][1])
        for done in {id(w.done): w.done for w in writes}.values():
            first = failed.get(id(done))
            if first is None:
                done.set_result(None)
            else:
                done.set_exception(first)


def raise_errors(what: str, results: Sequence[AllocateResult]) -> None:
    error = item_errors(what, [r for r in results if r.status.is_error])
    if error is not None:
        raise error
