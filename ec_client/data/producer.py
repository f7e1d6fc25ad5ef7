"""Producer: store encoder outputs in a pool. One round trip per batch: Allocate.

    Producer(client, "qwen-vl-node1").put("mm-hash-1", tensor)   # -> PutStatus.COMMITTING

Results: COMMITTING (this call writes it: the copy is launched and its Commit on its way; STORED
once the daemon has the Commit, as `PutHandle.wait()` reports), EXISTS (already cached: skip the
encode), PENDING (another
producer is writing it: wait for it rather than encode twice), NO_SPACE (the pool is full of
entries that are pinned or being written), REFUSED (the daemon refused that item: a bad key or
spec, or an entry larger than the whole pool; `PutHandle.refused` says why, and `put` of one key
raises it). One refused item never sinks the others of its batch.

One round trip per put, whose Allocate rides in a Step with whatever the client owes the pool. When
a put becomes visible: `put` returns once the Allocate answered and the copy was launched (on CPU:
done). From then on the client owes its Commit (ec_client.control.outbox), sent only once the copy
has landed: with the client's next Step to the pool (the next put or get) or, if none comes within
the client's `linger_s` (1 ms by default), alone from a background thread. The entry is visible
to every client, and durable (a daemon killed and restarted serves it again), once the daemon has
the Commit: until then a crash of the daemon or of this process loses it, which is why `put`
answers COMMITTING, not STORED. To know it is STORED: `PutHandle.wait()` (from `put_many_async`),
which answers STORED for it, or `Producer.flush()`. A Consumer on the same Client always sees
the client's own puts. A Commit the daemon refuses (its session was lost to a restart or an
expired lease) reaches the caller: `wait()` / `flush()` raise it, it is logged, and
`failed_commits` counts it. If a copy fails, the entry is aborted, so no half-written entry is
ever visible.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ec_client.control.client import Client
from ec_client.control.outbox import DeferredOp
from ec_client.data.endpoint import PoolEndpoint, item_errors
from ec_client.data.mapping import stale
from ec_client.data.mover import TensorMover, Transfer, spec_of, wait_all
from ec_protocol.errors import EcdError
from ec_protocol.types import AllocateItem, AllocateResult, ItemResult, Key, Status, key_bytes

log = logging.getLogger("ec_client")


class PutStatus(enum.Enum):
    COMMITTING = "committing"  # this call writes it: copy launched, Commit on its way
    STORED = "stored"  # this call wrote it and the daemon has its Commit: visible and durable
    EXISTS = "exists"
    PENDING = "pending"
    NO_SPACE = "no_space"
    REFUSED = "refused"  # the daemon refused the item (bad key or spec, larger than the pool)


_PUT_STATUS = {
    Status.ALLOCATED: PutStatus.COMMITTING,
    Status.EXISTS: PutStatus.EXISTS,
    Status.PENDING: PutStatus.PENDING,
    Status.NO_SPACE: PutStatus.NO_SPACE,
}


@dataclass
class PutHandle:
    """A put whose Allocate answered: `statuses` are what it answered (COMMITTING for the
    entries it writes); the copies are launched and their Commit follows them. `wait()` returns
    once the daemon answered it, with those entries STORED (visible to all, durable), raising
    EcdError if it refused or a copy failed."""

    statuses: dict[Key, PutStatus]
    _copies: list[Transfer]
    _committed: Future[None] = field(default_factory=Future)
    refused: dict[Key, EcdError] = field(default_factory=dict)  # why each REFUSED item was

    def done(self) -> bool:
        """The Commit was answered (or there was nothing to commit)."""
        return self._committed.done()

    def copied(self) -> bool:
        """The copies have landed: the tensors may be reused."""
        return all(t.done() for t in self._copies)

    def wait(self, timeout_s: float | None = None) -> dict[Key, PutStatus]:
        self._committed.result(timeout_s)
        return {
            key: PutStatus.STORED if status is PutStatus.COMMITTING else status
            for key, status in self.statuses.items()
        }


class _PutCommits:
    """Collects the Commit answers of one put's entries into its handle's future."""

    def __init__(self, producer: Producer, keys: int, done: Future[None]) -> None:
        self._producer = producer
        self._left = keys
        self._error: EcdError | None = None
        self._done = done
        self._lock = threading.Lock()

    def record(self, key: bytes, answer: ItemResult | EcdError) -> None:
        error = answer if isinstance(answer, EcdError) else item_errors("Commit", [answer])
        if error is None:
            self._producer.client.known_ready(self._producer.endpoint.engine_id, [key])
        else:
            self._producer.failed(error)
        with self._lock:
            self._error = self._error or error
            self._left -= 1
            finished = self._left == 0
        if finished:
            if self._error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(self._error)


class Producer:
    def __init__(self, client: Client, engine_id: str, *, checksum: bool = False) -> None:
        """checksum: store a CRC-32 of each entry so consumers can verify what they read."""
        self.endpoint = PoolEndpoint(client, engine_id)
        self.checksum = checksum
        self.failed_commits = 0  # entries whose Commit the daemon refused, or whose copy failed
        self._lock = threading.Lock()
        self._failures: list[EcdError] = []  # for the next flush()

    @property
    def client(self) -> Client:
        return self.endpoint.client

    def put(self, key: Key, tensor: torch.Tensor) -> PutStatus:
        """One tensor; EcdError if the daemon refused it."""
        handle = self.put_many_async({key: tensor})
        if key in handle.refused:
            raise handle.refused[key]
        return handle.statuses[key]

    def put_many(self, tensors: Mapping[Key, torch.Tensor]) -> dict[Key, PutStatus]:
        return self.put_many_async(tensors).statuses

    def put_many_async(self, tensors: Mapping[Key, torch.Tensor]) -> PutHandle:
        """Allocate every key in one round trip and launch the copies; their Commit is owed from
        then on, and goes as soon as they landed (see the module's docstring)."""
        engine_id = self.endpoint.engine_id
        specs = [spec_of(t) for t in tensors.values()]  # ValueError for what cannot be stored
        items = [
            AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in zip(tensors, specs, strict=True)
        ]
        before = self.endpoint.file_at_path()  # which file the Step is answered of: see below
        results = self.client.step(engine_id, allocates=items).allocates
        committed: Future[None] = Future()
        ops: list[DeferredOp] = []
        copies: list[Transfer] = []
        try:
            count = sum(r.status is Status.ALLOCATED for r in results)
            devices = {t.device for t in tensors.values()} if count else set()
            movers = {d: self.endpoint.mover(d) for d in devices}
            if not all(self.endpoint.answered_of(m, before) for m in movers.values()):
                # The pool was recreated around the Step: these extents may be of another file
                # than the movers', where writing them would overwrite another entry's bytes.
                raise stale(
                    self.endpoint.mapping.info,
                    "the pool was recreated while this put was allocated; nothing was written, "
                    "put again",
                )
            commits = _PutCommits(self, count, committed)
            for (key, tensor), spec, result in zip(tensors.items(), specs, results, strict=True):
                if result.status is Status.ALLOCATED:
                    mover = movers[tensor.device]
                    copy = mover.save(tensor, result.extents)
                    copies.append(copy)
                    ops.append(
                        self._deferred_commit(
                            key_bytes(key), copy, commits, mover, result, spec.nbytes
                        )
                    )
        except BaseException:
            # Copies already launched must land before their blocks go back to the pool: another
            # writer may get them as soon as the Abort is through.
            with contextlib.suppress(Exception):
                wait_all(copies)
            allocated = [r.key for r in results if r.status is Status.ALLOCATED]
            if allocated:
                self.client.abort(engine_id, allocated)
            raise
        statuses: dict[Key, PutStatus] = {}
        refused: dict[Key, EcdError] = {}
        for key, result in zip(tensors, results, strict=True):
            error = item_errors("Allocate", [result])
            if error is None:
                statuses[key] = _PUT_STATUS[result.status]
            else:
                statuses[key], refused[key] = PutStatus.REFUSED, error
        if ops:
            self.client.outbox.commits(engine_id, ops)
        else:
            committed.set_result(None)
        return PutHandle(statuses, copies, committed, refused)

    def _deferred_commit(
        self,
        key: bytes,
        copy: Transfer,
        commits: _PutCommits,
        mover: TensorMover,
        result: AllocateResult,
        nbytes: int,
    ) -> DeferredOp:
        checksum = (lambda: mover.checksum(result.extents, nbytes)) if self.checksum else None
        return DeferredOp(
            lambda answer: commits.record(key, answer),
            copy,
            key,
            checksum=checksum,
            allocation=result.allocation,
        )

    def flush(self, timeout_s: float | None = None) -> None:
        """Commit every put so far now, and wait for the answers (then every entry put as
        COMMITTING is STORED: visible to all, durable); raise the first failure since the last
        flush."""
        self.client.flush(timeout_s)
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise failures[0]

    def failed(self, error: EcdError) -> None:
        """A put of this producer was not committed: counted, logged, raised by the next flush."""
        log.warning("ecd: a put into pool %s was not committed: %s", self.endpoint.engine_id, error)
        with self._lock:
            self.failed_commits += 1
            self._failures.append(error)
