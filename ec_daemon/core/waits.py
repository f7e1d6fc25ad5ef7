"""Every wait for an entry, in one place (docs/design.md §6, §13): an Acquire's `wait_ms`, an
asker joining the fetches from the cluster's store of the keys it lacks (a Step's acquires too),
and the placeholders' bounds, which the pending markers of other nodes' writers set.

As in Ray's plasma store (`GetRequestQueue`), a wait is one object, whatever it waits for, with
one deadline rule (`Waits.deadline`), told of the events that end it: the core's events (a commit,
an abort, an eviction, a deletion, a dropped pool: `on_event`), the end of a fetch (`finish`),
and the daemon's stop (`shut_down`). Its deadline ends it (`expire`), answered EXPIRED. What runs
the waiters (asyncio futures, the server's) hears of the end through the callback each wait is
registered with; this module keeps no timer: whoever registers a wait asks `expire` at its
deadline.

What a wait waits for:

- ENTRY: a key's entry to settle, READY or gone. An allocation settles nothing (its commit or its
  abort will). A wait the daemon's stop ends is answered SHUT_DOWN, and so is one registered after
  the stop: no commit can come once new calls are refused.
- FETCH: the fetch of a key from the cluster's store (`start`) to end, whatever it found: its
  keys are then READY, or PENDING placeholders of another node's writer, or not there. The stop
  does not end it: a fetch is bounded by itself and the cluster's stop cancels it.

Synchronous pure Python with an injected clock, like the rest of the core.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ec_protocol.types import EventType, WatchEvent

# How long past the bound of the work it joins (a fetch) a wait still lasts: on a loaded loop its
# timer could fire before the work's, answering an entry about to go as still PENDING.
LATE_S = 0.5


def deadline(since: float, wait_s: float, work_s: float = 0.0) -> float:
    """The one deadline rule: a wait begun at `since` lasts the longer of what its asker gives it
    (`wait_s`) and the bound of the work it waits for (`work_s`: a fetch's timeout, the bound a
    pending marker gives its writer's beat)."""
    return since + max(wait_s, work_s)


class For(enum.Enum):
    """What a wait waits for, key by key."""

    ENTRY = "entry"  # the key's entry committed or gone
    FETCH = "fetch"  # the key's fetch from the cluster's store over


class Outcome(enum.Enum):
    """How a wait ended."""

    SETTLED = "settled"  # every key it waited for settled
    EXPIRED = "expired"  # its deadline passed first
    SHUT_DOWN = "shut_down"  # the daemon is stopping
    CANCELLED = "cancelled"  # its waiter went away (its callback is not called)


@dataclass(eq=False)
class Wait:
    """One wait: the keys of one pool not settled yet, its deadline (the clock's time), and who
    hears how it ended (once)."""

    kind: For
    engine_id: str
    keys: set[bytes]
    deadline: float
    on_end: Callable[[Outcome], None]
    outcome: Outcome | None = None


@dataclass(eq=False)
class Work:
    """A fetch from the cluster's store in flight: the keys of one pool it reads."""

    engine_id: str
    keys: list[bytes] = field(default_factory=list)


Subject = tuple[For, str, bytes]
# What runs a wait to its end, in the event loop's code that waits (EventHub.wait_for): kind,
# pool, keys, deadline -> how it ended.
WaitFor = Callable[[For, str, Sequence[bytes], float], Awaitable[Outcome]]


class Waits:
    """The waits in progress and the fetches they may wait for."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._waits: dict[Subject, list[Wait]] = defaultdict(list)
        # Deadlines, soonest first; a wait that ended before its deadline stays until popped, or
        # until the ended ones are half the heap (then it is rebuilt).
        self._deadlines: list[tuple[float, int, Wait]] = []
        self._ended_early = 0
        self._order = itertools.count()
        self._working: dict[tuple[str, bytes], Work] = {}
        self.shut = False

    def deadline(self, wait_s: float, work_s: float = 0.0, since: float | None = None) -> float:
        """The deadline (the module's rule) of a wait begun at `since`, by default now."""
        return deadline(self.clock() if since is None else since, wait_s, work_s)

    def joining(self, wait_s: float, work_s: float) -> float:
        """The deadline of a wait for work bounded by `work_s` from now (a fetch): LATE_S more,
        so that it hears the work's outcome rather than its own timer."""
        return self.deadline(wait_s, work_s) + LATE_S

    def register(
        self,
        kind: For,
        engine_id: str,
        keys: Iterable[bytes],
        deadline: float,
        on_end: Callable[[Outcome], None],
    ) -> Wait:
        """A wait for every one of `keys`; `on_end` hears how it ended, at once if it ends here
        (its deadline past, no key to wait for, the daemon stopping for an ENTRY wait)."""
        wait = Wait(kind, engine_id, set(keys), deadline, on_end)
        if deadline <= self.clock():
            self._end(wait, Outcome.EXPIRED)
        elif not wait.keys:
            self._end(wait, Outcome.SETTLED)
        elif kind is For.ENTRY and self.shut:
            self._end(wait, Outcome.SHUT_DOWN)
        else:
            for key in wait.keys:
                self._waits[(kind, engine_id, key)].append(wait)
            heapq.heappush(self._deadlines, (deadline, next(self._order), wait))
        return wait

    def cancel(self, wait: Wait) -> None:
        """Forget a wait whose waiter went away (its call cancelled); its callback hears
        nothing more. A wait that already ended is left as it is."""
        if wait.outcome is None:
            self._forget(wait)
            wait.outcome = Outcome.CANCELLED
            self._ended_early += 1
            self._compact()

    def on_event(self, event: WatchEvent) -> None:
        """Every event of the core: any other than an allocation settles its key's ENTRY waits
        (READY, or gone); a dropped pool settles every key of the pool."""
        if event.type is EventType.PENDING or not self._waits:  # every commit publishes: the
            return  # common case, no wait in progress, costs one test
        if event.type is EventType.POOL_DROPPED:
            subjects = [s for s in self._waits if s[0] is For.ENTRY and s[1] == event.engine_id]
        else:
            subjects = [(For.ENTRY, event.engine_id, event.key)]
        self._settle(subjects)

    def start(self, engine_id: str, keys: Sequence[bytes]) -> Work:
        """A fetch of `keys` (none already being fetched) begins."""
        work = Work(engine_id, list(keys))
        for key in keys:
            self._working[(engine_id, key)] = work
        return work

    def fetching(self, engine_id: str, key: bytes) -> bool:
        """Whether `key` is being fetched (its PENDING entry, if any, is a read from the store)."""
        return (engine_id, key) in self._working

    def finish(self, work: Work) -> None:
        """The fetch is over, whatever it found: its keys' FETCH waits settle."""
        for key in work.keys:
            if self._working.get((work.engine_id, key)) is work:
                del self._working[(work.engine_id, key)]
        self._settle([(For.FETCH, work.engine_id, key) for key in work.keys])

    def expire(self, now: float | None = None) -> None:
        """End, EXPIRED, every wait whose deadline is `now` (by default the clock's) or earlier.
        A timer set for a wait's deadline passes that deadline, so that a timer that fires a
        little early still ends its wait."""
        now = self.clock() if now is None else now
        while self._deadlines and self._deadlines[0][0] <= now:
            wait = heapq.heappop(self._deadlines)[2]
            if wait.outcome is None:
                self._forget(wait)
                self._end(wait, Outcome.EXPIRED)
            else:
                self._ended_early -= 1

    def shut_down(self) -> None:
        """The daemon is stopping: every ENTRY wait ends now, and any later one at once."""
        self.shut = True
        self._settle([s for s in self._waits if s[0] is For.ENTRY], Outcome.SHUT_DOWN)

    def waiting(self) -> int:
        """How many waits are in progress."""
        return len(self._deadlines) - self._ended_early

    def check(self) -> None:
        """The invariants: every wait registered under a key is in progress and waits for that
        key, and the ended ones still in the heap are counted."""
        for (kind, engine_id, key), waits in self._waits.items():
            assert waits, "an empty list of waits is dropped"
            for wait in waits:
                assert wait.outcome is None and wait.kind is kind
                assert wait.engine_id == engine_id and key in wait.keys
        assert self._ended_early == sum(w.outcome is not None for _, _, w in self._deadlines)

    def _settle(self, subjects: Iterable[Subject], outcome: Outcome = Outcome.SETTLED) -> None:
        for subject in subjects:
            for wait in self._waits.pop(subject, []):
                wait.keys.discard(subject[2])
                if not wait.keys or outcome is not Outcome.SETTLED:
                    self._forget(wait)
                    self._ended_early += 1
                    self._end(wait, outcome)
        self._compact()

    def _forget(self, wait: Wait) -> None:
        """Take the wait off every key it still waits for (not off the heap)."""
        for key in wait.keys:
            subject = (wait.kind, wait.engine_id, key)
            waits = self._waits.get(subject, [])
            if wait in waits:
                waits.remove(wait)
                if not waits:
                    del self._waits[subject]

    def _end(self, wait: Wait, outcome: Outcome) -> None:
        wait.outcome = outcome
        wait.on_end(outcome)

    def _compact(self) -> None:
        if self._ended_early * 2 > len(self._deadlines):
            self._deadlines = [d for d in self._deadlines if d[2].outcome is None]
            heapq.heapify(self._deadlines)
            self._ended_early = 0
