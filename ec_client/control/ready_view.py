"""ReadyView: which keys of one pool are READY, as last heard from the daemon's Watch stream.

A miss must cost no round trip (docs/design.md §12): a Consumer, or vLLM's scheduler asking
`has_cache_item` for every encoder input, answers from this view instead of asking the daemon.
A background thread follows Watch(pool, snapshot=True): every READY key, then SYNCED, then
COMMITTED / EVICTED / ABORTED / DELETED / POOL_DROPPED as they happen. Answering is a set lookup.

The view is a hint, never a promise: it can say READY for a key evicted a moment ago (the
Acquire that follows finds out) and miss a key committed a moment ago (while its event is on
its way). Until the stream has delivered its snapshot, and whenever it is
broken (daemon down or restarting, pool dropped), it knows nothing: `synced` is False, and users
fall back to asking the daemon (Consumer) or to encoding (vLLM). The thread reconnects with
backoff, reattaching first (reopening the pool: notices a restarted daemon, a pool made anew),
and takes a fresh snapshot. A pool dropped while this client had it is not made again by the
reattaching (docs/design.md §3): the view says so once, at warning, and stays unsynced until
someone opens the pool with its geometry again.

Each local READY key comes with its slot in the pool file (the events carry it), where a reader
takes a lock pin and finds the entry's record (`slot`: docs/design.md §5,
ec_protocol/pool/slot_locks.py): a hit with no round trip. A slot from the view is a hint too: the
lock pin checks the record. Whoever takes those pins can have each committed entry's slot told to it
as the event comes
(`on_committed`), on this thread: to read the record ahead, off its own hot path.

It also follows the keys being written (include_pending: PENDING events, in the snapshot too),
so that `pending` tells a caller a producer is writing a key right now: worth waiting for its
commit rather than encoding the item again (single flight: another engine encoding the same
image; or the disaggregated flow, where the same request reaches the consumer as soon as the
encoder engine answered, before its save is committed).

A caller that waits for such a commit (or abort) need not poll: `changes` counts the events
that changed the view, and `wait_change` sleeps until it moves past a count read earlier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from ec_client.control._connection import FIRST_BACKOFF_S, MAX_BACKOFF_S
from ec_protocol.errors import EcdError
from ec_protocol.types import EventType, Key, WatchEvent, key_bytes

log = logging.getLogger("ec_client")

_GONE = (EventType.EVICTED, EventType.ABORTED, EventType.DELETED)


class Stream(Protocol):
    """An open Watch call (Client.open_watch): iterate for events; cancel from any thread."""

    def __iter__(self) -> Iterator[WatchEvent]: ...

    def cancel(self) -> None: ...


class Watcher(Protocol):
    def open_watch(self, engine_id: str, snapshot: bool, include_pending: bool) -> Stream: ...


class ReadyView:
    def __init__(
        self, client: Watcher, engine_id: str, reattach: Callable[[], object] = lambda: None
    ) -> None:
        """reattach: called before every reconnect; raises EcdError while the daemon is away."""
        self._client = client
        self._engine_id = engine_id
        self._reattach = reattach
        self._lock = threading.Lock()
        self._ready: dict[bytes, int | None] = {}  # READY here -> its slot (None: not heard yet)
        self._pending: set[bytes] = set()  # keys being written into this daemon's pool
        self._added: set[bytes] = set()  # add()ed since the stream opened: merged at SYNCED
        self._on_committed: list[Callable[[bytes, int], None]] = []
        # Bumped at every event that changes what the view answers (and when the stream
        # breaks), on the view's thread alone: a waiter reads it, decides, then sleeps until it
        # moves (`wait_change`). The condition is notified only while someone waits on it, so
        # an event costs the view's thread two attribute looks when nobody does.
        self.changes = 0
        self._waiting = 0
        self._change = threading.Condition(threading.Lock())
        # Whether the view holds a whole snapshot and what followed it: a plain bool for the
        # hot-path reads (a look at an attribute, not a call into an Event), set and cleared
        # with the Event that `wait_synced` waits on, both on the view's thread alone.
        self.synced = False
        self._synced = threading.Event()
        self._closed = threading.Event()
        self._stream: Stream | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"ecd-watch-{engine_id}", daemon=True
        )
        self._thread.start()

    def wait_synced(self, timeout_s: float) -> bool:
        return self._synced.wait(timeout_s)

    def has(self, key: bytes) -> bool:
        """READY in the daemon's pool."""
        # A dict lookup under the GIL is atomic: no lock on this, the hottest path.
        return key in self._ready and self.synced

    def slot(self, key: bytes) -> int | None:
        """Where `key`'s record is, if it is READY here and the view has heard of its slot."""
        return self._ready.get(key) if self.synced else None

    def slots_known(self, keys: Iterable[Key]) -> bool:
        """Whether the view knows every key's slot: a get of them is a lock-pinned read, no
        round trip (what a bench or a test waits for after its own puts)."""
        return all(self.slot(key_bytes(key)) is not None for key in keys)

    def pending(self, key: bytes) -> bool:
        """PENDING in this daemon's pool: a producer is writing it; its commit is to come."""
        return key in self._pending and self.synced

    def wait_change(self, since: int, timeout_s: float) -> bool:
        """Sleep until `changes` is no longer `since` (at once if it already is), at most
        timeout_s; whether it changed."""
        with self._change:
            # Counted before the look at `changes`: an event that comes after that look sees
            # a waiter, and notifies once it waits (the lock is held until then).
            self._waiting += 1
            try:
                return self._change.wait_for(lambda: self.changes != since, timeout_s)
            finally:
                self._waiting -= 1

    def _changed(self) -> None:
        self.changes += 1
        if self._waiting:
            with self._change:
                self._change.notify_all()

    def add(self, key: bytes) -> None:
        """This process committed `key` itself: known READY before the event comes back."""
        with self._lock:
            self._ready.setdefault(key, None)  # its slot comes with its COMMITTED event
            self._added.add(key)
            self._pending.discard(key)

    def on_committed(self, listener: Callable[[bytes, int], None]) -> None:
        """Call `listener(key, slot)` for every entry committed here from now on, as its event
        comes: on the view's thread, outside its lock (SlotPins.read_ahead)."""
        self._on_committed.append(listener)

    def discard(self, key: bytes) -> None:
        """An Acquire found `key` gone before the event came."""
        with self._lock:
            self._ready.pop(key, None)
            self._added.discard(key)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = FIRST_BACKOFF_S
        told_dropped = False  # a pool dropped under it is said once, not at every try
        while not self._closed.is_set():
            try:
                if self._follow():
                    delay, told_dropped = FIRST_BACKOFF_S, False
            except EcdError as error:
                log.debug("watch of pool %s broke: %s", self._engine_id, error)
            self.synced = False
            self._synced.clear()
            self._changed()  # it knows nothing now: whoever waits on it decides anew
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, MAX_BACKOFF_S)
            try:
                self._reattach()
            except EcdError as error:
                if error.reason == "pool_dropped" and not told_dropped:
                    told_dropped = True
                    log.warning("ecd: the view of pool %s stops: %s", self._engine_id, error)
                else:
                    log.debug("cannot reattach pool %s yet: %s", self._engine_id, error)

    def _follow(self) -> bool:
        """Follow one Watch stream until it ends; returns whether it got as far as SYNCED."""
        with self._lock:
            self._added.clear()
        stream = self._client.open_watch(self._engine_id, snapshot=True, include_pending=True)
        with self._lock:
            self._stream = stream
        if self._closed.is_set():
            stream.cancel()  # close() ran between the loop's check and the assignment
        snapshot: dict[bytes, int | None] = {}
        pending: set[bytes] = set()
        for event in stream:
            if event.type is EventType.SNAPSHOT:
                snapshot[event.key] = event.slot
            elif event.type is EventType.PENDING:
                with self._lock:
                    (self._pending if self.synced else pending).add(event.key)
            elif event.type is EventType.SYNCED:
                with self._lock:
                    # A key committed here after the stream opened may be missing from the
                    # snapshot, its event still to come: the client must read its own writes.
                    self._ready = dict.fromkeys(self._added) | snapshot
                    self._pending = pending - self._ready.keys()
                self.synced = True
                self._synced.set()
            elif event.type is EventType.COMMITTED:
                with self._lock:
                    self._ready[event.key] = event.slot
                    self._pending.discard(event.key)
                if event.slot is not None:
                    self._tell_committed(event.key, event.slot)
            elif event.type in _GONE:
                with self._lock:
                    self._ready.pop(event.key, None)
                    self._added.discard(event.key)
                    self._pending.discard(event.key)
            elif event.type is EventType.POOL_DROPPED:
                break  # reattached once the pool is there again; then a fresh snapshot
            if self.synced:
                self._changed()
        stream.cancel()
        return self.synced

    def _tell_committed(self, key: bytes, slot: int) -> None:
        for listener in self._on_committed:
            try:
                listener(key, slot)
            except Exception:  # a listener's failure must not stop the view
                log.exception("a listener of pool %s's commits failed", self._engine_id)


class Views:
    """A client's ReadyViews, one per pool: each made on first ask (by `follow`) and followed
    until close."""

    def __init__(self, follow: Callable[[str], ReadyView]) -> None:
        self._follow = follow
        self._lock = threading.Lock()
        self._views: dict[str, ReadyView] = {}

    def get(self, engine_id: str) -> ReadyView:
        with self._lock:
            view = self._views.get(engine_id)
            if view is None:
                view = self._views[engine_id] = self._follow(engine_id)
        return view

    def known_ready(self, engine_id: str, keys: Sequence[Key]) -> None:
        """The client committed `keys`: its view of the pool (if it follows one) has them READY
        before the daemon's events come back."""
        view = self._views.get(engine_id)
        if view is not None:
            for key in keys:
                view.add(key_bytes(key))

    def close(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for view in views:
            view.close()
