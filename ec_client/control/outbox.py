"""What a client owes the daemon with nobody waiting for it: the Commit of a put once its copy
landed, the Release of a get once its copy landed, the Abort of a copy that failed; and the Steps
asked of it with nobody waiting on the caller's thread (`step_soon`). Outbox is a client's one
background mechanism (docs/design.md §12): its one thread sends all of these.

A put or a get waits on one round trip, so ops never get one of their own on the caller's
time. They ride on the client's next Step to the same pool (the next put's Allocate, the next
get's Acquire, the next `step_soon`: one round trip carries everything owed then), or, once the
pool has been quiet for `linger_s`, the background thread sends them in a Step of their own.
Nothing is sent before the copy it depends on has landed: a Commit never exposes bytes still in
flight, a Release never lets an entry go while it is still being read.

`step_soon` is for a caller that must not wait on a round trip but needs its answer later (the
vLLM scheduler side's pins and allocations): the background thread sends its Steps as soon as it
can, in the order asked, each carrying what is owed to its pool then, and resolves each one's
future with the caller's part of the answer.

Each op carries `on_result`, called once with its answer (an ItemResult / LeaseResult) or with the
EcdError that kept it from the daemon.

A Step of the background thread that fails with anything but an EcdError is a bug somewhere (a
closed channel, an item the wire cannot encode, an op's handler): it is logged, what it carried
hears INTERNAL (not owed again, to fail again at once for ever) and its asker too, and the thread
goes on to the next Step: it stops only when the outbox is closed.

What a client answered itself, with no round trip, is owed too (`Answered`): the misses it
answered from its view of the pool, as a count (StepRequest.misses), and the hits it read under
lock pins, as keys (StepRequest.hits), so that the daemon's counters hold every hit and miss and
its LRU order every hit. They ride on the next Step to the pool, or go alone once it has been
quiet for ANSWERED_LINGER_S (they wait longer than a pin: nothing is held meanwhile). Handing
them over wakes nobody (a wake costs the caller tens of microseconds, on the vLLM scheduler
thread at every step): the background thread looks at least every ANSWERED_LINGER_S. So they
reach the daemon at most max(linger_s, ANSWERED_LINGER_S) after they were handed over, plus one
Step's trip, with no further call; `send_answered` sends them sooner (a caller gone quiet). A
Step carries at most MAX_HITS_PER_STEP hits and MAX_MISSES_PER_STEP misses, the rest owed to the
next one; a full Step's worth of either goes at once. A Step that fails gives them back to the
next one, as the daemon counts them only in a Step that succeeds, unless it carried nothing else
and the daemon refused it (they are what it refused, or the pool is gone): those are dropped,
logged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from ec_client.control import _wire
from ec_protocol.errors import EcdError
from ec_protocol.types import (
    MAX_HITS_PER_STEP,
    MAX_MISSES_PER_STEP,
    AllocateItem,
    CommitItem,
    Key,
    StepResult,
    key_bytes,
)

log = logging.getLogger("ec_client")

OnResult = Callable[[Any], None]  # an ItemResult / LeaseResult, or the EcdError

# A Step carrying the batch ahead of the asks (acquires, allocates), sent through the
# client's call rules; returns the caller's part of the answer, raises the EcdError (each op
# heard of it).
Send = Callable[[str, "OutboxBatch", Sequence[Key], Sequence[AllocateItem]], StepResult]

# How long the hits and misses owed to a quiet pool wait for a Step to ride on before they go
# alone: recency a second late changes little, and one Step then carries many.
ANSWERED_LINGER_S = 1.0

# The errors of a Step that did not reach the daemon (or was cut off as it stopped, its counters
# going with it): its hits and misses go with the next Step.
NOT_DELIVERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Copy(Protocol):
    """A copy in flight (mover.Transfer), without importing torch here."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


@dataclass
class DeferredOp:
    """One operation deferred to a later Step, with nobody waiting for it: the Commit or Abort
    of the entry `key`, the Release of the lease pin `lease_id`, or the unlock of a lock pin
    (never sent: `on_result` drops the lock). `copy` must land before it is sent; `checksum`,
    for commits, is computed once it has. A commit names the `allocation` its bytes were
    written into (0: whichever the session has PENDING), so that it cannot commit a later
    allocation of the key. `on_result` hears the answer, once."""

    on_result: OnResult
    copy: Copy | None = None
    key: bytes = b""
    lease_id: int = 0
    checksum: Callable[[], int] | None = None
    allocation: int = 0

    def landed(self) -> bool:
        try:
            return self.copy is None or self.copy.done()
        except Exception:  # a failed copy has landed as far as it ever will: its wait says how
            return True


@dataclass
class Answered:
    """What the client answered itself since its last Step to a pool: misses from its view,
    hits (keys) under lock pins."""

    misses: int = 0
    hits: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.misses or self.hits)

    def add(self, other: Answered) -> None:
        self.misses += other.misses
        self.hits += other.hits

    def full(self) -> bool:
        """Whether a Step's worth of hits or misses is owed: it goes at once."""
        return len(self.hits) >= MAX_HITS_PER_STEP or self.misses >= MAX_MISSES_PER_STEP

    def take(self) -> Answered:
        """What one Step carries, taken out: at most MAX_MISSES_PER_STEP misses and the first
        MAX_HITS_PER_STEP hits (the rest wait for the next Step)."""
        taken = Answered(min(self.misses, MAX_MISSES_PER_STEP), self.hits[:MAX_HITS_PER_STEP])
        self.misses -= taken.misses
        del self.hits[:MAX_HITS_PER_STEP]
        return taken


@dataclass
class OutboxBatch:
    """The part of one Step that comes from the outbox: its ops, in the order of the Step's
    parts, and the hits and misses answered since the pool's last Step. `on_done` is told once the
    Step is answered (or failed), so the keys it commits stop counting as in transit; `give_back`
    once it is known that the Step never went: what it carried is owed again."""

    releases: list[DeferredOp] = field(default_factory=list)
    commits: list[DeferredOp] = field(default_factory=list)
    aborts: list[DeferredOp] = field(default_factory=list)
    on_done: Callable[[OutboxBatch], None] = lambda batch: None
    unlocks: list[DeferredOp] = field(default_factory=list)  # lock pins: dropped here, never sent
    answered: Answered = field(default_factory=Answered)  # since the pool's last Step
    returned: Callable[[Answered], None] = lambda answered: None  # a failed Step's, owed again
    give_back: Callable[[OutboxBatch], None] = lambda batch: None  # a Step that never went
    settled: bool = field(default=False, init=False)  # resolved or failed: every op heard
    # Its Step carried more than the hits and misses: ops, or the caller's own items.
    carried_more: bool = field(default=False, init=False)

    def __bool__(self) -> bool:
        return bool(self.releases or self.commits or self.aborts or self.answered)

    def release_ids(self) -> list[int]:
        return [d.lease_id for d in self.releases]

    def commit_items(self) -> list[CommitItem]:
        return [(d.key, d.checksum() if d.checksum else 0, d.allocation) for d in self.commits]

    def abort_keys(self) -> list[bytes]:
        return [d.key for d in self.aborts]

    def resolve(self, result: StepResult) -> StepResult:
        """Hand each op its answer; returns the rest of the Step's answers (the caller's)."""
        unanswered = EcdError(
            grpc.StatusCode.INTERNAL, "the daemon's answer to the Step had no answer for it"
        )
        try:
            _tell_each(self._answers(result, unanswered))
        finally:  # an op's handler that raises must not keep its keys in transit for ever
            self._settle()
        return StepResult(
            result.releases[len(self.releases) :],
            result.commits[len(self.commits) :],
            result.aborts[len(self.aborts) :],
            result.acquires,
            result.allocates,
            result.pool_uuid,
        )

    def fail(self, error: EcdError, answered: StepResult | None = None) -> None:
        """The Step failed with `error`; `answered`: the answers of the parts of a split Step
        that went before the one that failed. Each op hears its answer, else the error.

        The hits and misses it carried are owed again (the daemon counts them only in a Step
        that succeeds, and they ride on a split Step's last part), unless the Step carried
        nothing else and the daemon refused it: then they were what it refused (or the pool is
        gone), and would be refused again at every turn."""
        counts, self.answered = self.answered, Answered()
        if counts and (error.code in NOT_DELIVERED or self.carried_more):
            self.returned(counts)
        elif counts:
            log.warning(
                "ecd: %d miss(es) and %d hit(s) the client answered not counted: %s",
                counts.misses,
                len(counts.hits),
                error,
            )
        try:
            _tell_each(self._answers(answered, error))
        finally:
            self._settle()

    def _answers(
        self, result: StepResult | None, otherwise: EcdError
    ) -> Iterator[tuple[DeferredOp, object]]:
        """Each op with its answer in `result` (its Step's, or those of the parts of it that
        were answered), else `otherwise`."""
        heard: tuple[Sequence[object], ...] = (
            (result.releases, result.commits, result.aborts) if result else ((), (), ())
        )
        for ops, answers in zip((self.releases, self.commits, self.aborts), heard, strict=True):
            for i, op in enumerate(ops):
                yield op, answers[i] if i < len(answers) else otherwise

    def _settle(self) -> None:
        self.settled = True
        self.on_done(self)

    def step(
        self,
        engine_id: str,
        releases: Sequence[int] = (),
        commits: Sequence[CommitItem] = (),
        aborts: Sequence[Key] = (),
        acquires: Sequence[Key] = (),
        allocates: Sequence[AllocateItem] = (),
        local_only: bool = False,
    ) -> _wire.Call[StepResult]:
        """A Step carrying this batch, each part ahead of the caller's own items. If the
        caller's items cannot make a Step (a key, shape or dtype that cannot be encoded), that
        error is raised and the batch given back: nothing went, so nothing it carried is lost
        (the background thread's batches are not given back: see `Outbox._step`)."""
        self.carried_more = bool(
            self.releases
            or self.commits
            or self.aborts
            or releases
            or commits
            or aborts
            or acquires
            or allocates
        )
        try:
            return _wire.step(
                engine_id,
                self.release_ids() + list(releases),
                self.commit_items() + list(commits),
                self.abort_keys() + list(aborts),
                acquires,
                allocates,
                self.answered.misses,
                self.answered.hits,
                local_only,
            )
        except BaseException:
            self.give_back(self)
            raise


@dataclass
class _Ask:
    """A Step asked for by step_soon, not sent yet."""

    engine_id: str
    acquires: Sequence[Key]
    allocates: Sequence[AllocateItem]
    future: Future[StepResult] = field(default_factory=Future)


@dataclass
class _Pool:
    """What is owed to one pool (the releases of pins taken from it too: any Step of the session
    could carry those, but this way each pool's ops wait for that pool's traffic alone)."""

    releases: list[DeferredOp] = field(default_factory=list)
    commits: list[DeferredOp] = field(default_factory=list)
    aborts: list[DeferredOp] = field(default_factory=list)
    unlocks: list[DeferredOp] = field(default_factory=list)
    last_step: float = 0.0  # when a Step to this pool last went out
    in_transit: set[bytes] = field(default_factory=set)  # commits taken, not answered yet
    aborting: set[bytes] = field(default_factory=set)  # aborts taken, not answered yet
    answered: Answered = field(default_factory=Answered)  # not sent yet
    # When the answered go at the latest (`Outbox.send_answered`), until a Step takes them.
    answered_by: float | None = None

    def ops(self) -> bool:
        return bool(self.releases or self.commits or self.aborts or self.unlocks)

    def owing(self) -> bool:
        return self.ops() or bool(self.answered)

    def due_at(self, linger_s: float) -> float:
        """When the background thread sends what is owed, if no Step goes before: hits or misses
        that fill a Step go at once (a busy engine reads thousands a second under lock pins,
        more than one Step may carry)."""
        if self.ops():
            return self.last_step + linger_s
        if self.answered.full():
            return self.last_step
        due = self.last_step + max(linger_s, ANSWERED_LINGER_S)
        return due if self.answered_by is None else min(due, self.answered_by)


class Outbox:
    """A client's outbox: per pool, the DeferredOps it owes the daemon, the hits and misses it
    answered itself, and the Steps asked with `step_soon`. Whoever hands something over goes on
    at once; the next Step to the pool carries it, or the outbox's one thread sends it once due.
    """

    def __init__(
        self, send: Send, linger_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """send(engine_id, batch, acquires, allocates): a Step (see `Send`), from the
        background thread or a flush."""
        self._send = send
        self._linger_s = linger_s
        self._clock = clock
        self._lock = threading.Condition()
        self._pools: dict[str, _Pool] = {}
        self._asks: deque[_Ask] = deque()  # step_soon's, in order, not taken yet
        self._sending: list[str] = []  # the pools the background thread is sending to now
        self._thread: threading.Thread | None = None
        self._closed = False

    # ---- what the client owes ----------------------------------------------------------------

    def commits(self, engine_id: str, ops: Sequence[DeferredOp]) -> None:
        if ops:  # waking the background thread for nothing costs the caller the GIL
            self._owe(lambda: self._pool(engine_id).commits.extend(ops))

    def releases(self, engine_id: str, ops: Sequence[DeferredOp]) -> None:
        if ops:
            self._owe(lambda: self._pool(engine_id).releases.extend(ops))

    def aborts(self, engine_id: str, ops: Sequence[DeferredOp]) -> None:
        if ops:
            self._owe(lambda: self._pool(engine_id).aborts.extend(ops))

    def unlocks(self, engine_id: str, ops: Sequence[DeferredOp]) -> None:
        """Lock pins to drop (each op's on_result) once their copies landed. Nothing is sent for
        them: they ride with the pool's other ops only to share the waiting for copies."""
        if ops:
            self._owe(lambda: self._pool(engine_id).unlocks.extend(ops))

    def misses(self, engine_id: str, count: int) -> None:
        """`count` misses answered from the view of the pool, for the daemon's counters."""
        if count > 0:
            self._answered(engine_id, Answered(misses=count))

    def hits(self, engine_id: str, keys: Sequence[bytes]) -> None:
        """Entries read under lock pins, for the daemon's counters and its LRU order."""
        if keys:
            self._answered(engine_id, Answered(hits=list(keys)))

    def _answered(self, engine_id: str, answered: Answered) -> None:
        """Owed with no wake of the background thread, unless they fill a Step: they wait
        ANSWERED_LINGER_S for a Step to ride on anyway, and the thread looks that often while
        it has nothing else to wait for (`_run`). A wake costs the caller tens of microseconds,
        on the vLLM scheduler thread at every step that reads hits under lock pins."""
        with self._lock:
            pool = self._pool(engine_id)
            pool.answered.add(answered)
            self._wake(notify=pool.answered.full())

    def send_answered(self, engine_id: str, within_s: float = 0.0) -> None:
        """The hits and misses owed to the pool go within `within_s` (from the background
        thread, unless a Step carries them first), not ANSWERED_LINGER_S later: for a caller
        that has gone quiet (vLLM's engine with no request left), so that the daemon's counters
        hold them soon. A look under the lock when none are owed; one wake of the thread when
        this brings their time forward."""
        with self._lock:
            pool = self._pools.get(engine_id)
            if pool is None or not pool.answered:
                return
            at = self._clock() + within_s
            if pool.answered_by is None or at < pool.answered_by:
                pool.answered_by = at
                self._wake(notify=True)

    def _returned(self, pool: _Pool, answered: Answered) -> None:
        with self._lock:
            pool.answered.add(answered)
            self._lock.notify_all()

    def step_soon(
        self,
        engine_id: str,
        acquires: Sequence[Key] = (),
        allocates: Sequence[AllocateItem] = (),
        *,
        releases: Sequence[DeferredOp] = (),
        commits: Sequence[DeferredOp] = (),
        aborts: Sequence[DeferredOp] = (),
        answered: Answered | None = None,
    ) -> Future[StepResult]:
        """A Step from the background thread as soon as it can, after every one asked before:
        Release, Commit, Abort of what is owed to the pool then, and the acquires (without
        waiting) and allocates. Its future holds the answers to the acquires and allocates (and
        nothing else), or the EcdError. With nothing owed and nothing asked, nothing is sent and
        the answer is empty.

        The ops, hits and misses handed over with it are owed as by `releases`, `commits`,
        `aborts`, `hits` and `misses`, and so ride on it: one hold of the lock and one wake of
        the thread for all of them, where a call each would wake it each time (every wake costs
        the caller the GIL, on the vLLM scheduler thread once per step)."""
        ask = _Ask(engine_id, list(acquires), list(allocates))

        def add() -> None:
            pool = self._pool(engine_id)
            pool.releases.extend(releases)
            pool.commits.extend(commits)
            pool.aborts.extend(aborts)
            if answered:
                pool.answered.add(answered)
            if self._closed:  # nobody would send it
                ask.future.set_exception(_closed())
            else:
                self._asks.append(ask)

        self._owe(add)
        return ask.future

    def commits_owed(self, engine_id: str) -> dict[bytes, bool]:
        """The keys whose Commit is still owed to the pool (PENDING until it goes), each with
        whether its copy has landed (so that it can ride on the next Step)."""
        with self._lock:
            pool = self._pools.get(engine_id)
            if pool is None:
                return {}
            # A commit on its way is not visible yet either: whoever waits for it must flush.
            owed = dict.fromkeys(pool.in_transit, False)
            owed.update((d.key, d.landed()) for d in pool.commits)
            return owed

    # ---- paying ------------------------------------------------------------------------------

    def take(
        self,
        engine_id: str,
        wait: bool = False,
        reading: Sequence[Key] = (),
        writing: Sequence[Key] = (),
        *,
        give_back: bool = True,
    ) -> OutboxBatch:
        """What a Step to this pool should carry now: every op whose copy landed (with wait,
        every op, once its copy has landed). The caller sends it and resolves it.

        give_back: whether the batch is owed again if its Step cannot be built (a caller's
        Step: its own items were at fault, `OutboxBatch.step`); the background thread's is
        failed instead (`_step`).

        reading: the keys the caller's Step acquires, writing: those it allocates. A Commit of
        one of them, or an Abort of one it allocates, that another Step carries right now (the
        background thread's) is waited for first: the daemon may take the caller's Step before
        that one, and a client reads its own writes, and a key it allocates again is never
        freed under the new copy by its Abort arriving late (nor its Commit made READY under
        it)."""
        batch = self._take(engine_id, wait, reading, writing, give_back, block=True)
        assert batch is not None  # a blocking take waits instead
        return batch

    def try_take(
        self, engine_id: str, reading: Sequence[Key] = (), writing: Sequence[Key] = ()
    ) -> OutboxBatch | None:
        """`take` for a caller that must not block: None where take would wait for a Step on
        its way (an event loop's, which may be the one carrying that Step: AsyncClient takes
        it off the loop then)."""
        return self._take(engine_id, False, reading, writing, True, block=False)

    def _take(
        self,
        engine_id: str,
        wait: bool,
        reading: Sequence[Key],
        writing: Sequence[Key],
        give_back: bool,
        block: bool,
    ) -> OutboxBatch | None:
        with self._lock:
            pool = self._pool(engine_id)
            if (pool.in_transit or pool.aborting) and (reading or writing):
                reads = {key_bytes(k) for k in reading}
                writes = {key_bytes(k) for k in writing}
                while not (
                    pool.in_transit.isdisjoint(reads | writes) and pool.aborting.isdisjoint(writes)
                ):
                    if not block:
                        return None
                    self._lock.wait()  # `_batch_done` notifies
            pool.last_step = self._clock()
            pool.answered_by = None
            batch = OutboxBatch(
                _split(pool.releases, wait),
                _split(pool.commits, wait),
                _split(pool.aborts, wait),  # and those of commits whose copy failed, as found
                lambda on_done: self._batch_done(pool, on_done),
                _split(pool.unlocks, wait),
                pool.answered.take(),
                lambda answered: self._returned(pool, answered),
                (lambda given: self._given_back(pool, given))
                if give_back
                else (lambda given: None),
            )
            pool.in_transit.update(d.key for d in batch.commits)
            pool.aborting.update(d.key for d in batch.aborts)
        return self._landed(batch)

    @staticmethod
    def _landed(batch: OutboxBatch) -> OutboxBatch:
        """Wait for the batch's copies (landed already, unless taken with wait). A commit
        whose copy failed becomes an abort: its bytes must never be exposed. A pin goes back
        whatever its copy did (the reader learns of a failed copy from its own handle); lock
        pins are dropped here."""
        # A get's loads share one copy (TensorMover.load_many): each copy is waited for once.
        ops = batch.releases + batch.aborts + batch.unlocks
        for copy in {id(op.copy): op.copy for op in ops if op.copy is not None}.values():
            with contextlib.suppress(Exception):
                copy.wait()
        for op in batch.unlocks:
            op.on_result(None)
        for op in list(batch.commits):
            try:
                if op.copy is not None:
                    op.copy.wait()
            except Exception as exc:  # a device error surfaces on the copy's event
                op.on_result(EcdError.copy_failed(op.key, exc))
                batch.commits.remove(op)
                batch.aborts.append(DeferredOp(on_result=_ignore, key=op.key))
        return batch

    def _batch_done(self, pool: _Pool, batch: OutboxBatch) -> None:
        with self._lock:
            # aborts too: a commit whose copy failed left as an abort
            pool.in_transit.difference_update(d.key for d in batch.commits + batch.aborts)
            pool.aborting.difference_update(d.key for d in batch.aborts)
            self._lock.notify_all()

    def _given_back(self, pool: _Pool, batch: OutboxBatch) -> None:
        """A batch whose Step never went: its ops are owed again, ahead of those owed since
        (in the order they were owed), and its keys are no longer in transit."""
        with self._lock:  # one hold (the Condition's lock is reentrant): no take sees it half back
            pool.releases[:0] = batch.releases
            pool.commits[:0] = batch.commits
            pool.aborts[:0] = batch.aborts
            self._returned(pool, batch.answered)
            self._batch_done(pool, batch)

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything owed now, from the caller's thread (as many Steps as the hits and
        misses owed fill), and wait for what the background thread is sending and the Steps
        asked of it so far (TimeoutError past timeout_s)."""
        with self._lock:
            engine_ids = [e for e, p in self._pools.items() if p.owing()]
        for engine_id in engine_ids:
            while self._send_alone(engine_id, self.take(engine_id, wait=True)):
                pass
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._lock:
            while self._sending or self._asks or any(p.in_transit for p in self._pools.values()):
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"Steps owed to the daemon still running after {timeout_s} s"
                    )
                self._lock.wait(left)

    def close(self) -> None:
        """Stop the background thread; the Steps asked and not sent fail (CANCELLED)."""
        with self._lock:
            self._closed = True
            asks, self._asks = self._asks, deque()
            self._lock.notify_all()
        for ask in asks:
            ask.future.set_exception(_closed())
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- the background thread ----------------------------------------------------------------

    def _owe(self, add: Callable[[], None]) -> None:
        with self._lock:
            add()
            self._wake(notify=True)

    def _wake(self, notify: bool) -> None:
        """Start the background thread if it is not running yet, else wake it if `notify`.
        Under the lock."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ecd-outbox", daemon=True)
            self._thread.start()
        elif notify:
            self._lock.notify_all()

    def _run(self) -> None:
        """Send the Steps asked for, in order, and what is owed to pools quiet for linger_s,
        until closed."""
        while True:
            with self._lock:
                # One hold of the lock from the check to the wait: whatever is handed over
                # meanwhile notifies a waiting thread, never one between the two (a lost wake-up
                # would leave a step_soon waiting out the linger).
                while True:
                    if self._closed:
                        return
                    now = self._clock()
                    ask = self._asks.popleft() if self._asks else None
                    if ask is not None:
                        due = [ask.engine_id]
                        break
                    owing = {
                        e: p.due_at(self._linger_s) for e, p in self._pools.items() if p.owing()
                    }
                    due = [e for e, at in owing.items() if at <= now]
                    if due:
                        break
                    # Hits and misses are handed over with no wake (`_answered`): look at least
                    # this often.
                    self._lock.wait(min([*owing.values(), now + ANSWERED_LINGER_S]) - now)
                self._sending = due
            try:
                if ask is not None:
                    self._send_asked(ask)
                else:
                    for engine_id in due:
                        with contextlib.suppress(EcdError):  # each op heard of it
                            self._step(engine_id, wait=True)
            finally:
                with self._lock:
                    self._sending = []
                    self._lock.notify_all()

    def _send_asked(self, ask: _Ask) -> None:
        """A step_soon's Step: what is owed to the pool now (ops whose copy landed: the asks
        wait for no copy), then the asks."""
        try:
            result = self._step(ask.engine_id, ask.acquires, ask.allocates)
        except EcdError as error:
            ask.future.set_exception(error)
        else:
            ask.future.set_result(result)

    def _step(
        self,
        engine_id: str,
        acquires: Sequence[Key] = (),
        allocates: Sequence[AllocateItem] = (),
        wait: bool = False,
    ) -> StepResult:
        """A Step of the background thread: what is owed to the pool (with wait, once every
        copy landed), then the acquires and allocates, unless there is nothing to send. Raises
        EcdErrors only, so that the thread goes on: the one each op heard, or, for anything
        else (a bug), an INTERNAL one, logged, that the ops which heard nothing yet hear too.
        The batch is not given back: it would fail again at every turn of the thread."""
        batch: OutboxBatch | None = None
        try:
            batch = self.take(engine_id, wait=wait, give_back=False)
            if not (batch or acquires or allocates):
                return StepResult([], [], [], [], [])
            return self._send(engine_id, batch, acquires, allocates)
        except EcdError:
            raise
        except Exception as exc:
            log.exception("ecd: the outbox thread's Step to pool %s failed", engine_id)
            error = EcdError(
                grpc.StatusCode.INTERNAL,
                f"not sent: the client's outbox failed to send its Step to pool {engine_id} "
                f"({type(exc).__name__}: {exc}), a bug (see the ec_client log)",
            )
            if batch is not None and not batch.settled:
                try:
                    batch.fail(error)
                except Exception:  # every op heard it all the same (`_tell_each`)
                    log.exception("ecd: an op's handler raised as it heard: %s", error)
            raise error from exc

    def _send_alone(self, engine_id: str, batch: OutboxBatch) -> bool:
        """A Step of the batch alone, if it carries anything (flush's: what it raises, the
        caller hears). Whether it went with a full Step's worth of hits or misses: more of them
        may be owed."""
        if not batch:
            return False
        try:
            self._send(engine_id, batch, (), ())
        except EcdError:  # each op heard of it; what it carried is owed again, or dropped
            return False
        return batch.answered.full()

    def _pool(self, engine_id: str) -> _Pool:
        pool = self._pools.get(engine_id)
        if pool is None:  # quiet from now on, not since the clock's start
            pool = self._pools[engine_id] = _Pool(last_step=self._clock())
        return pool


def _closed() -> EcdError:
    return EcdError(grpc.StatusCode.CANCELLED, "the client closed before this Step went")


def _ignore(answer: object) -> None:
    """For ops whose outcome nobody needs (the abort of a failed copy: if it does not reach
    the daemon, the producer's lease aborts the entry all the same)."""


def _tell_each(answers: Iterable[tuple[DeferredOp, object]]) -> None:
    """Each op its answer, even after one's handler raised (a bug there must not keep the
    others from theirs); the first handler's error is raised once all have heard."""
    raised: Exception | None = None
    for op, answer in answers:
        try:
            op.on_result(answer)
        except Exception as exc:
            raised = raised or exc
    if raised is not None:
        raise raised


def _split(ops: list[DeferredOp], all_of_them: bool) -> list[DeferredOp]:
    """Remove and return the ops ready to go (all of them, or those whose copy landed)."""
    ready: list[DeferredOp] = []
    waiting: list[DeferredOp] = []
    for op in ops:
        (ready if all_of_them or op.landed() else waiting).append(op)
    ops[:] = waiting
    return ready


def batch_sender(deliver: Callable[[OutboxBatch, _wire.Call[StepResult]], StepResult]) -> Send:
    """Outbox's send: a Step of the batch and the asks, on_done through the client's call rules
    (`_session.SessionState.step`)."""

    def send(
        engine_id: str,
        batch: OutboxBatch,
        acquires: Sequence[Key],
        allocates: Sequence[AllocateItem],
    ) -> StepResult:
        return deliver(batch, batch.step(engine_id, acquires=acquires, allocates=allocates))

    return send
