"""LoadBook: the scheduler side's pins and the loads dispatched out of them (no I/O here).

Why pins come first. When `has_cache_item(key)` answers True, vLLM's scheduler does not schedule
the encoder for that input: the worker must then find the tensor in its encoder cache, or the
forward pass raises "Encoder cache miss" (vllm/v1/worker/gpu/mm/encoder_runner.py) and takes the
whole engine down; a stand-in tensor would instead compute, and prefix-cache, the request's KV
from wrong embeddings. The decision cannot be taken back when the step's metadata is built, and
`take_unavailable_requests` is read only after the step ran. So the connector answers True only
for entries it already holds a pin on. A pin is of one of two kinds:

- a *lock pin* (docs/design.md §5, ec_protocol/pool/slot_locks.py): a shared lock on the entry's
  slot in the pool file, taken by the scheduler side itself, with no round trip, for an entry READY
  in this daemon's pool whose slot the ready view knows. It is given back here (`take_unlocks`)
  and it outlives a daemon restart: the lock belongs to the file.
- a *lease pin*: a lease ID from an Acquire, for what a lock pin cannot take: an entry
  committed a moment ago whose slot the view has not heard yet. Released by a Step: the caller
  takes what is owed (`take_releases`) and hands it to its client's Outbox, and gives back what
  did not reach the daemon (`requeue_releases`); a new session voids it.

The steps:

    admit (ensure_cache_available): a key the pool has READY and we hold no pin on is lock-pinned
        at once (the caller's `lock`), and the request admitted in the same call. A key that
        cannot be lock-pinned is *wanted*, and its request held back; but not a key this engine
        is saving (encoded a moment ago, its commit to come): vLLM's own encoder cache has it.
    flush (build_connector_meta): the still-wanted keys are *acquiring*: one Step pins them in
        the background, its answer taken before the next step -> Pin, or *missed*.
    next step: admit passes, has_cache_item is True, dispatch mints a transfer ID.
    workers report the transfer ID from every rank -> the pin is owed back (a lease released
        with the next Step, a lock dropped at once by the caller).

A missed key (evicted between the view's READY and the pin: the lock found another record, or
the Acquire nothing) is encoded by its request instead, and that request is not held back for
that key again, so nothing waits forever (with `wait_s`, not past that wait: see `admit`). Nor
is a request held back for a key already scheduled for it (loaded or encoded): a request whose
prefill spans several steps is asked about again every step, and its encoder output is on the
GPU by then.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ec_client.vllm.metadata import LoadOrder, WorkerRank
from ec_protocol.types import AcquireResult, Extent, Status, TensorSpec


@dataclass(slots=True)
class Pin:
    """A pin this engine holds on one READY entry, so it cannot be evicted: a lease (lease_id)
    or a lock on its slot (slot).

    Released once no waiting request counts on it (`holders` empty) and every copy dispatched
    out of it was reported by every rank (`transfers` empty).
    """

    extents: tuple[Extent, ...]
    spec: TensorSpec
    lease_id: int | None = None
    slot: int | None = None
    holders: set[str] = field(default_factory=set)
    transfers: set[int] = field(default_factory=set)


class LockMissed:
    """The caller's lock pin found the slot not holding the key (evicted meanwhile)."""


LOCK_MISSED = LockMissed()

# What `admit`'s `lock` answers for a key: the lock pin it took, as the Pin the book keeps (its
# slot, extents and spec; the book adds its holders), a miss, or None (no lock pin possible here:
# not READY in this daemon's pool, or its slot not known yet): then the Acquire path.
Lock = Callable[[str], Pin | LockMissed | None]


@dataclass(slots=True)
class Dispatch:
    """One copy of a pinned entry ordered to the workers, under a transfer ID never reused.
    Done when as many distinct ranks as the LoadBook needs reported it; `requests` are the
    requests that read it (they fail if the pin is lost before that)."""

    key: str
    requests: set[str]
    ranks: set[WorkerRank] = field(default_factory=set)


class LoadBook:
    def __init__(self, reports_needed: int) -> None:
        self._reports_needed = reports_needed
        self._pins: dict[str, Pin] = {}
        self._transfers: dict[int, Dispatch] = {}
        self._next_transfer_id = 0
        self._step: dict[str, LoadOrder] = {}  # this step's dispatches, one per key
        self._wanted: dict[str, set[str]] = {}  # key -> requests waiting for its pin
        self._acquiring: dict[str, set[str]] = {}  # the same, its Acquire on its way
        self._no_wait: set[tuple[str, str]] = set()  # (request, key): missed, or scheduled
        self._asked: set[tuple[str, str]] = set()  # (request, key): an Acquire found nothing
        self._absent_since: dict[tuple[str, str], float] = {}  # (request, key) -> first seen
        self._by_request: defaultdict[str, set[str]] = defaultdict(set)  # for forget()
        self._releases: list[int] = []  # lease pins owed back to the daemon
        self._unlocks: list[int] = []  # lock pins' slots, for the caller to unlock

    # ---- the scheduler's questions -------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        keys: Iterable[str],
        ready: Callable[[str], bool],
        now: float,
        wait_s: float,
        pending: Callable[[str], bool] = lambda key: False,
        lock: Lock = lambda key: None,
        elsewhere: bool = False,
        saving: Callable[[str], bool] = lambda key: False,
    ) -> bool:
        """Whether the request may be scheduled now: every key it still needs is pinned, or is
        to be encoded. A key with no pin is first offered to `lock`: a lock pin taken there
        admits it at once, a lock that missed has it encoded. Otherwise a key the pool has READY
        is wanted (pinned at the next flush); a key `pending` in the pool (a producer is
        writing it) is waited for until its fate is known, however long: committed, it is READY
        (then pinned and loaded); aborted (by its producer, at its process's death, or at the
        daemon's pending timeout), it is absent (then encoded). With `elsewhere` a key the view
        lacks is wanted too, once per request: its Acquire asks the daemon, which may know more
        than the view (the pool is shared through the cluster's store: a remote hit, or PENDING
        while another node writes it; or the view has not heard yet of an entry another engine
        allocated or committed a moment ago); its miss is encoded. With wait_s a key the pool
        lacks (asked first, with `elsewhere`) is waited for up to that long (another engine may
        be about to encode it). Any of these holds the request back this step. But a key `saving`
        (this engine encoded it a moment ago and its save is not committed yet) is not held for:
        vLLM looks in its own encoder cache before it asks the connector, and finds it there."""
        admitted = True
        for key in keys:
            self._by_request[request_id].add(key)
            if (request_id, key) in self._no_wait:
                continue
            pin = self._pins.get(key)
            if pin is not None:
                pin.holders.add(request_id)
                continue
            if key in self._acquiring:  # its Acquire answers first: one pin per key
                self._acquiring[key].add(request_id)
                admitted = False
                continue
            locked = lock(key)
            if isinstance(locked, Pin):
                waiting = self._wanted.pop(key, None)  # held back for its slot until now
                if waiting is not None:
                    locked.holders = waiting
                locked.holders.add(request_id)
                self._pins[key] = locked
                continue
            if locked is not None:  # missed: encoded, like a missed Acquire
                self._no_wait.add((request_id, key))
                continue
            if saving(key):  # our own PENDING entry: vLLM's encoder cache has its output
                continue
            asked = (request_id, key) in self._asked  # and found absent: not asked again
            if not asked and (key in self._wanted or ready(key)):
                self._wanted.setdefault(key, set()).add(request_id)
                admitted = False
            elif pending(key):  # single flight: its producer's commit, or abort, decides
                self._absent_since.pop((request_id, key), None)
                admitted = False
            elif elsewhere and not asked:  # the daemon may know more than the view
                self._wanted.setdefault(key, set()).add(request_id)
                admitted = False
            elif wait_s > 0:
                since = self._absent_since.setdefault((request_id, key), now)
                admitted = admitted and now - since >= wait_s
        return admitted

    def pinned(self, key: str) -> bool:
        return key in self._pins

    def scheduled(self, request_id: str, key: str) -> None:
        """The scheduler allocated this input of the request (to encode or to load)."""
        self._by_request[request_id].add(key)
        self._no_wait.add((request_id, key))

    def dispatch(self, request_id: str, key: str, copy: bool = True) -> bool:
        """Order a copy of the pinned `key` for this request (one per key per step, shared by
        the step's requests); False if there is no pin (the request cannot have it). Without
        `copy` (an encoder-only engine: the output is wanted in the pool, which has it, and
        nowhere else) nothing is copied: the request is done with the pin."""
        pin = self._pins.get(key)
        if pin is None:
            return False
        self.scheduled(request_id, key)
        pin.holders.discard(request_id)
        if not copy:
            self._release_if_unused(key)
            return True
        order = self._step.get(key)
        if order is None:
            order = LoadOrder(self._next_transfer_id, pin.extents, pin.spec)
            self._next_transfer_id += 1
            self._step[key] = order
            self._transfers[order.transfer_id] = Dispatch(key, set())
            pin.transfers.add(order.transfer_id)
        self._transfers[order.transfer_id].requests.add(request_id)
        return True

    def take_step(self) -> dict[str, LoadOrder]:
        step, self._step = self._step, {}
        return step

    # ---- what the daemon and the workers answered ----------------------------------------------

    def wanted(self, request_id: str | None = None) -> list[str]:
        """The keys wanted (by this request, or by any): READY, no pin, no Acquire on its way."""
        if request_id is None:
            return list(self._wanted)
        return [key for key, requests in self._wanted.items() if request_id in requests]

    def take_wanted(self) -> list[str]:
        """The keys wanted now, whose Acquire the caller sends: they are acquiring from now on
        (their requests stay held) until `acquired` or `give_up` answers them."""
        keys = list(self._wanted)
        self._acquiring.update(self._wanted)
        self._wanted.clear()
        return keys

    def acquired(
        self,
        keys: Sequence[str],
        results: Sequence[AcquireResult],
        usable: Callable[[TensorSpec], bool],
    ) -> list[str]:
        """Record one Acquire of `keys`; returns the keys that were not pinned (gone meanwhile,
        or of a shape this engine cannot use). A pin that is not usable is released. A key
        answered PENDING keeps its requests held, without a pin: admit decides again. A key
        found absent is not asked again for its requests (admit encodes it, or waits `wait_s`);
        one of a shape this engine cannot use is not waited for either."""
        missing = []
        for key, result in zip(keys, results, strict=True):
            requests = self._wanted.pop(key, set()) | self._acquiring.pop(key, set())
            if result.status is Status.HIT and key in self._pins:  # pinned meanwhile
                self._pins[key].holders |= requests
                self._releases.append(result.lease_id)
                continue
            if result.status is Status.HIT and result.spec is not None and usable(result.spec):
                pin = Pin(result.extents, result.spec, lease_id=result.lease_id, holders=requests)
                self._pins[key] = pin
                self._release_if_unused(key)  # its requests may have gone meanwhile
                continue
            if result.status is Status.PENDING:  # being written (here, or on another node):
                continue  # held on, as admit holds a key the view says PENDING
            if result.status is Status.HIT:  # not usable here
                self._releases.append(result.lease_id)
                self._no_wait.update((request_id, key) for request_id in requests)
            else:
                self._asked.update((request_id, key) for request_id in requests)
            missing.append(key)
        return missing

    def give_up(self, keys: Iterable[str] | None = None) -> None:
        """No pin for these keys (by default every wanted one): the daemon is away, or their
        Acquire failed. Their waiting requests encode instead."""
        for key in list(self._wanted) if keys is None else keys:
            requests = self._wanted.pop(key, set()) | self._acquiring.pop(key, set())
            self._no_wait.update((request_id, key) for request_id in requests)

    def report(self, transfer_id: int, rank: WorkerRank) -> None:
        """A rank finished a copy. Unknown IDs (late, repeated after completion, or from before
        a restart) change nothing; a rank counts once per transfer."""
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return
        transfer.ranks.add(rank)
        if len(transfer.ranks) < self._reports_needed:
            return
        del self._transfers[transfer_id]
        pin = self._pins[transfer.key]
        pin.transfers.discard(transfer_id)
        self._release_if_unused(transfer.key)

    def drop_holder(self, request_id: str, key: str) -> None:
        """The request no longer needs `key` (consumed it, or finished)."""
        pin = self._pins.get(key)
        if pin is not None:
            pin.holders.discard(request_id)
            self._release_if_unused(key)
        waiting = self._wanted.get(key)
        if waiting is not None:
            waiting.discard(request_id)
            if not waiting:
                del self._wanted[key]
        # An Acquire on its way stays recorded, holders or not: its pin must be released.
        acquiring = self._acquiring.get(key)
        if acquiring is not None:
            acquiring.discard(request_id)

    def forget(self, request_id: str) -> None:
        for key in self._by_request.pop(request_id, ()):
            self.drop_holder(request_id, key)
            self._no_wait.discard((request_id, key))
            self._asked.discard((request_id, key))
            self._absent_since.pop((request_id, key), None)

    def take_releases(self) -> list[int]:
        """The lease pins owed back, for the caller to send: no longer owed here."""
        releases, self._releases = self._releases, []
        return releases

    def requeue_releases(self, lease_ids: Iterable[int]) -> None:
        """Outbox back again: their Step did not reach the daemon, or an answer from before a new
        session pinned them for nobody."""
        self._releases.extend(lease_ids)

    def take_unlocks(self) -> list[int]:
        """The slots of the lock pins done with (no holder left, every copy reported by every
        rank): the caller unlocks each once."""
        unlocks, self._unlocks = self._unlocks, []
        return unlocks

    def void(self, locks_too: bool = True) -> set[str]:
        """Our pins are lost: the lease pins when our session is new (the daemon restarted, or
        our lease ran out: `locks_too=False`, the lock pins hold, they belong to the pool file),
        every pin when the pool file is new (the pool was recreated: the caller drops the old
        file's locks). Forget them and what is owed for them; return the requests whose copies
        under them may have raced an eviction: they fail."""
        lost = {key for key, pin in self._pins.items() if locks_too or pin.slot is None}
        failed: set[str] = set()
        for transfer_id, transfer in list(self._transfers.items()):
            if transfer.key in lost:
                failed |= transfer.requests
                del self._transfers[transfer_id]
        self.give_up(list(self._acquiring))
        for key in lost:
            del self._pins[key]
        self._releases.clear()
        if locks_too:
            self._unlocks.clear()
        return failed

    def busy(self) -> bool:
        """Copies not yet reported, pins to take or on their way, or releases owed."""
        return bool(self._transfers or self._wanted or self._acquiring or self._releases)

    def _release_if_unused(self, key: str) -> None:
        pin = self._pins[key]
        if not pin.holders and not pin.transfers:
            del self._pins[key]
            if pin.slot is not None:
                self._unlocks.append(pin.slot)
            elif pin.lease_id is not None:
                self._releases.append(pin.lease_id)
