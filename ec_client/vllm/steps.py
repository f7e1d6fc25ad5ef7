"""Steps: what the scheduler side owes the daemon and asks of it, handed to the client's Outbox,
and the answers that come back.

The scheduler thread waits on no round trip in steady state (docs/design.md §12), pins
included: everything owed to the daemon and asked of it goes in a Step (one RPC: Release,
Commit, Abort, Acquire, Allocate, in that order, with the hits and misses answered here since the
last one) sent from the client's one background thread (`Outbox`, ec_client/control/outbox.py). What
is owed (releases of lease pins, commits of landed saves, aborts of failed ones) is handed to the
client's Outbox as ops, with the hits and misses, in the `Outbox.step_soon` that asks what is
asked (pins, allocations) and carries them ahead of the asks: one hand-over, one wake of
Outbox's thread per Step. The answers to the asks are taken on the scheduler thread
at its next call into the connector, before anything depends on them; an op hears its own
answer on Outbox's thread, and what that changes in the books (an op owed again, its Step not
having reached the daemon) is handed to the scheduler thread the same way. The books (loads.py,
saves.py) are touched on the scheduler thread alone.

Releases and aborts come before the Allocate so their space is free for it; Acquire comes before
Allocate so a step's allocations can never evict an entry about to be loaded (the eviction
hazard ECCPUConnector has within a step); and the daemon never evicts a lock-pinned entry.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from ec_client.control.outbox import NOT_DELIVERED, Answered, DeferredOp, Outbox
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.connection import Connection
from ec_client.vllm.loads import LoadBook
from ec_client.vllm.saves import SaveBook
from ec_protocol.errors import EcdError
from ec_protocol.types import (
    AllocateItem,
    ItemResult,
    LeaseResult,
    Status,
    StepResult,
    TensorSpec,
)

log = logging.getLogger("ec_client.vllm")


@dataclass
class Asked:
    """What one step_soon asked, to read its answer against; `generation` is the one it was
    asked in (an answer from another is void, see `Steps.take_answers`), `at` when (monotonic:
    the waits for its answer are bounded from then, see `Steps.wait_allocated`)."""

    generation: tuple[str, str]
    acquires: list[str] = field(default_factory=list)
    allocates: dict[str, TensorSpec] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)


class Steps:
    """The Steps sent for the books, and their answers, read back onto the scheduler thread."""

    def __init__(
        self, config: ConnectorConfig, connection: Connection, loads: LoadBook, saves: SaveBook
    ) -> None:
        self._config = config
        self._connection = connection
        self._loads = loads
        self._saves = saves
        # Steps asked, by why (for `python -m ...bench`); all sent from Outbox's thread.
        self.rpcs: Counter[str] = Counter()
        # The answers to what was asked (step_soon), read on the scheduler thread in order.
        self.asked: deque[tuple[Future[StepResult], Asked]] = deque()
        # What ops' answers change in the books, from Outbox's thread, done on the scheduler
        # thread (the books are its alone), in the order heard: an op owed again (its Step did
        # not reach the daemon), done in its generation only; a save's key free to be planned
        # again (None: whatever the generation), after it was owed again if it was.
        self._from_outbox: deque[tuple[tuple[str, str] | None, Callable[[], None]]] = deque()
        self.hits: list[bytes] = []  # lock pins taken this step: hits owed to the daemon
        self.misses = 0  # misses the view answered this step: owed too, with the hits

    def step_soon(
        self,
        why: str,
        acquires: Sequence[str] = (),
        allocates: dict[str, TensorSpec] | None = None,
    ) -> None:
        """One Step from Outbox's thread, if anything is owed or asked: what the books owe now
        (releases, commits of landed saves, aborts of failed ones, each with what its answer
        does) and the hits and misses answered here since the last one, then what is asked, its
        answer taken by `take_answers`. All of it is handed over in one call: each call into
        the outbox may wake its thread, a cost on the scheduler thread. With only hits and
        misses, no Step: they are handed over to ride on a later one."""
        outbox = self._connection.reached().outbox
        releases, commits, aborts = self._ops()
        if not (releases or commits or aborts or acquires or allocates):
            self.hand_over_answered(outbox)
            return
        answered = Answered(self.misses, self.hits)
        self.hits, self.misses = [], 0
        asked = Asked(self._connection.generation, list(acquires), allocates or {})
        items = [AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in asked.allocates.items()]
        self.rpcs[why] += 1
        future = outbox.step_soon(
            self._config.pool,
            asked.acquires,
            items,
            releases=releases,
            commits=commits,
            aborts=aborts,
            answered=answered,
        )
        if asked.acquires or asked.allocates:  # an answer to read; ops hear their own
            self.asked.append((future, asked))

    def wait_allocated(self, keys: set[str], timeout_s: float) -> bool:
        """Wait for the answers of the Steps on their way that ask to allocate any of `keys`
        (the next take_answers takes them), up to `timeout_s` after they were asked: so the
        requests of one step that wait on one unanswered Step wait that long in all, not each;
        whether there was one."""
        unanswered = [
            (future, asked.at)
            for future, asked in self.asked
            if not future.done() and not keys.isdisjoint(asked.allocates)
        ]
        if unanswered:
            deadline = max(at for _, at in unanswered) + timeout_s
            futures = [future for future, _ in unanswered]
            concurrent.futures.wait(futures, max(deadline - time.monotonic(), 0.0))
        return bool(unanswered)

    def _ops(self) -> tuple[list[DeferredOp], list[DeferredOp], list[DeferredOp]]:
        """What the books owe, as ops (no longer owed there): releases of lease pins, commits
        of landed saves, aborts of failed ones; each op's answer is heard on Outbox's thread."""
        generation = self._connection.generation
        releases = [
            DeferredOp(functools.partial(self._released, generation, lease_id), lease_id=lease_id)
            for lease_id in self._loads.take_releases()
        ]
        commits = [
            DeferredOp(
                functools.partial(self._committed, generation, key, allocation),
                key=key.encode(),
                allocation=allocation,
            )
            for key, allocation in self._saves.take_landed()
        ]
        aborts = [
            DeferredOp(functools.partial(self._aborted, generation, key), key=key.encode())
            for key in self._saves.take_failed()
        ]
        return releases, commits, aborts

    def hand_over_answered(self, outbox: Outbox) -> None:
        """The lock-pin hits (the daemon's hit counters and LRU order) and the misses the view
        answered, owed to ride on the pool's next Step (or to go alone once it is quiet)."""
        if self.hits:
            hits, self.hits = self.hits, []
            outbox.hits(self._config.pool, hits)
        if self.misses:
            misses, self.misses = self.misses, 0
            outbox.misses(self._config.pool, misses)

    def take_answers(self) -> None:
        """Take what came back since the last call, in the order it came: ops owed again,
        then the answers to what was asked, in the order asked (each one's answer is applied
        before anything reads what it changes). The caller has moved to the current generation
        first (`Connection.next_generation`): an answer of another is void."""
        generation = self._connection.generation
        while self._from_outbox:
            of, change = self._from_outbox.popleft()
            if of in (None, generation):  # else void with its session or file
                change()
        while self.asked and self.asked[0][0].done():
            future, asked = self.asked.popleft()
            try:
                result = future.result()
            except EcdError as error:
                # Asked things go without: the requests encode, the outputs are not saved.
                log.warning("ecd Step failed, the cache is skipped this step: %s", error)
                self._give_up(asked)
                continue
            if asked.generation != generation:
                self._void_answer(result)
                continue
            if not self._of_our_file(result):
                log.warning(
                    "ecd pool %s was recreated while a Step was answered: its pins and entries "
                    "are void here, the cache is skipped this step",
                    self._config.pool,
                )
                self._void_answer(result)
                self._give_up(asked)
                continue
            view = self._connection.view
            for key in self._loads.acquired(asked.acquires, result.acquires, self._config.loadable):
                view.discard(key.encode())  # found gone: gone from the view too
            self._saves.allocated(list(asked.allocates), result.allocates)

    def _give_up(self, asked: Asked) -> None:
        """What was asked goes without: its requests encode, its outputs are not saved."""
        self._loads.give_up(asked.acquires)
        self._saves.give_up(asked.allocates)

    def _of_our_file(self, result: StepResult) -> bool:
        """Whether the extents of an answer are of the file this generation's workers map. The
        client learns of a recreated pool only when it reopens it, so an answer of the same
        generation may still come from the new file (the pool recreated before the daemon read
        the Step). The daemon says which file it answered from (StepResult.pool_uuid). Where it
        could not, the answer came from ours if the path still holds the file our lock pins
        opened: a pool's file, once replaced, never comes back. Without lock pins there is
        nothing to check against (the answer is taken)."""
        pins = self._connection.slot_pins
        if not (result.acquires or result.allocates) or pins is None:
            return True
        if result.pool_uuid:  # no stat of the path on the scheduler thread (tens of us)
            return result.pool_uuid == pins.pool_uuid
        return pins.still_at_path()

    def _void_answer(self, result: StepResult) -> None:
        """An answer from a daemon that restarted meanwhile, or to a recreated pool: what the
        Step took in the new session (pins, PENDING entries) nobody here will use: it is owed
        back, with the next Step."""
        self._loads.requeue_releases(r.lease_id for r in result.acquires if r.status is Status.HIT)
        self._saves.requeue(
            failed=[r.key.decode() for r in result.allocates if r.status is Status.ALLOCATED]
        )

    # The answers to ops, on Outbox's thread (or the caller of settle): the books are not
    # touched here; an op owed again is handed to the scheduler thread.

    def _released(
        self, generation: tuple[str, str], lease_id: int, answer: LeaseResult | EcdError
    ) -> None:
        if isinstance(answer, EcdError):
            self._not_delivered(
                generation,
                "release",
                lease_id,
                answer,
                lambda: self._loads.requeue_releases([lease_id]),
            )
        else:
            _log_refused("release", lease_id, answer)

    def _committed(
        self,
        generation: tuple[str, str],
        key: str,
        allocation: int,
        answer: ItemResult | EcdError,
    ) -> None:
        if isinstance(answer, EcdError):
            self._not_delivered(
                generation,
                "commit",
                key,
                answer,
                lambda: self._saves.requeue(landed=[(key, allocation)]),
            )
        elif answer.status.is_error:
            log.warning("ecd refused to commit %s: %s", key, answer.message)
        else:
            self._connection.view.add(key.encode())  # thread-safe: READY for the very next step
        self._from_outbox.append((None, functools.partial(self._saves.answered, key)))

    def _aborted(
        self, generation: tuple[str, str], key: str, answer: ItemResult | EcdError
    ) -> None:
        if isinstance(answer, EcdError):
            self._not_delivered(
                generation, "abort", key, answer, lambda: self._saves.requeue(failed=[key])
            )
        else:
            _log_refused("abort", key, answer)
        self._from_outbox.append((None, functools.partial(self._saves.answered, key)))

    def _not_delivered(
        self,
        generation: tuple[str, str],
        what: str,
        item: object,
        error: EcdError,
        owe_again: Callable[[], None],
    ) -> None:
        """An op's Step failed: one that did not reach the daemon is owed again (in the same
        generation: `take_answers`); one the daemon refused as a whole is dropped, said."""
        if error.code in NOT_DELIVERED:
            self._from_outbox.append((generation, owe_again))
        else:
            log.warning("ecd could not %s %s: %s", what, item, error)


def _log_refused(what: str, item: object, answer: ItemResult | LeaseResult) -> None:
    if answer.status.is_error and answer.status is not Status.NOT_FOUND:
        log.warning("ecd refused to %s %s: %s", what, item, answer.message)
