"""Single flight across the cluster (docs/design.md §13): a key a producer on one node is writing
is seen by the other nodes as pending, and their askers wait for it as they would on a node.

Mooncake Store cannot show it by itself: a put in progress is invisible to other clients (a
lookup, a get, a replica query all answer "absent" until it ends), and a put of a key the store
has answers success without writing (Mooncake 0.3.x). So ecd writes a *marker* of its own:

- **Its key** is the value's key with `@ecd-pending:` in place of the `@`: `{namespace}@ecd-
  pending:id:{key}`; vLLM builds only `{namespace}@id:` keys, so it never asks for one.
- **Its value** (`Marker`): the writer node's identity (a random 16 bytes per daemon), the
  entry's size, and its *bound*: how long a reader may see the writer's beat unchanged before it
  takes the writer for dead. The *beat* is the size of the value under the writer's own key
  (`alive_key`), which the writer changes every REFRESH_S while it holds claims. No time of any
  clock: nodes' wall clocks need not agree, nor their --pending-timeout (each writer ends its
  own claims: its daemon aborts an entry past its own pending timeout, which removes the marker).
- **The writer** (`Claims`, on the event loop, its store calls on the node's thread in turn with
  the publishes): an Allocate in a shared pool (its PENDING event) puts the marker in the
  background, nobody waits on it, in the node's own segment (so that the node's death takes it:
  the master drops a dead client's segment after its --client_ttl), then reads it back: the
  store keeps the first value put under a key, so the writer whose marker it reads holds the
  claim; another node's marker means both encode (counted, `claims_lost`: a claimant cannot
  tell a live writer's marker from a dead one's at one look); one of its own of an earlier
  entry, or one that cannot be read (its replica was on a node that died), is removed and put
  again; one the store refuses for space while its master has just taken over (the nodes'
  segments not back with it yet: ClusterNode.refused_while_settling) is tried again every
  SETTLE_RETRY_S while the entry is written. While it holds claims, a thread of its own asks
  the node's thread every REFRESH_S to write its beat again, changed (one upsert, whatever the
  number of claims; a marker itself is never written again: a lookup during an upsert finds
  the key absent, measured). The commit removes the marker after the value's publish (same
  queue, so in that order: a reader never finds neither while the value is on its way); an
  abort, an eviction or a delete of the entry removes it at once (a producer's death is an
  abort: the life marks of ec_protocol/pool/life_marks.py). Removals are forced: a reader's
  lookup holds a lease on the marker that would refuse them.
- **A reader** (`RemoteWaits`): an Acquire's lookup at the master (ec_daemon.cluster.fetch) asks
  for the value and the marker in the same batch; a key with no value but a marker is read once
  (its writer, its size) and allocated here PENDING (a placeholder under a pull's session: local
  askers wait on it as on any PENDING entry, the vLLM connector's view hears it and holds its
  request, a local producer is told PENDING). Then one batched lookup every POLL_S for every
  placeholder of the node (its value, its marker, its writer's beat): the value there, it is
  read into the placeholder's extents and committed (a remote hit: an encode saved,
  `waits_hit`); the marker gone without a value, or its writer's beat unchanged for its bound by
  this node's own monotonic clock (its writer's daemon died, or cannot reach the master), the
  placeholder is aborted (`waits_missed`) and its askers encode; a marker so taken for dead is
  removed, so that the next writer's claim takes its place.

The window where two nodes both encode: from the first asker's lookup that found nothing to its
own producer's marker landing in the store (its engine's step to Allocate, the background Step's
round trip, the put); a second node's lookup inside it finds nothing either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from ec_daemon.cluster import codec
from ec_daemon.cluster.mooncake import StoreClient, own_segment
from ec_daemon.cluster.node import SETTLE_RETRY_S, ClusterNode
from ec_daemon.core.store import PullSlot, Store
from ec_daemon.core.waits import deadline
from ec_protocol.types import ClusterStats, EventType, WatchEvent

log = logging.getLogger("ecd.cluster")

_MARKER = struct.Struct("<4sHdQ16s")  # magic, version, bound (s), nbytes, writer
_MAGIC, _VERSION = b"ECDP", 2  # version 1 held a deadline on the writer's wall clock
# How often a node that waits for other nodes' writers asks the master whether they are done.
POLL_S = 0.05
# How often a writer holding claims bumps its beat.
REFRESH_S = 0.5
# A writer's beat is the size of the value under its alive key, 1 to BEATS bytes in turn: the
# lookup a reader's poll makes anyway answers it (no call more), where a read of the value would
# go to the writer's node, and a dead node's holds the reader's node thread for seconds.
BEATS = 64
# How long a reader sees the same beat before it takes the writer for dead. A live writer's
# beats come REFRESH_S apart and a reader sees each a poll after it lands: the rest is for a
# writer's node thread held up (a batch of publishes before the beat's turn), or a reader's.
BOUND_S = 4 * REFRESH_S
# The events after which a claimed entry is no longer being written.
_ENDED = (EventType.COMMITTED, EventType.ABORTED, EventType.EVICTED, EventType.DELETED)


def marker_key(namespace: str, key: bytes) -> str:
    """The key of the marker saying `key` of a pool shared under `namespace` is being written."""
    return f"{namespace}@ecd-pending:{codec.store_key(namespace, key)[len(namespace) + 1 :]}"


def alive_key(writer: bytes) -> str:
    """The key of a writer's beat (no namespace: one per daemon; vLLM builds no such key)."""
    return f"ecd@alive:{writer.hex()}"


@dataclass(frozen=True)
class Marker:
    """What a marker holds: who writes the entry, its size, and how readers tell it is alive."""

    writer: bytes  # 16 bytes, one daemon's
    nbytes: int
    bound_s: float  # the writer's beat unchanged this long by a reader's clock: it is dead

    def pack(self) -> bytes:
        return _MARKER.pack(_MAGIC, _VERSION, self.bound_s, self.nbytes, self.writer)

    @classmethod
    def parse(cls, raw: bytes) -> Marker | None:
        """The marker in `raw`; None if it is not one (absent, another format)."""
        if len(raw) != _MARKER.size:
            return None
        magic, version, bound_s, nbytes, writer = _MARKER.unpack(raw)
        if magic != _MAGIC or version != _VERSION:
            return None
        return cls(writer, nbytes, bound_s)


class Refused(RuntimeError):
    """The store refused a marker's put, wherever it was placed: its answer."""

    def __init__(self, answer: int) -> None:
        super().__init__(f"the store answered {answer} to the marker's put")
        self.answer = answer


class Pools(Protocol):
    def cluster_namespace(self, engine_id: str) -> str: ...


class Claims:
    """The markers this node writes for the entries its producers write in shared pools."""

    def __init__(
        self, node: ClusterNode, placement: Callable[[StoreClient], Any] = own_segment
    ) -> None:
        """placement: where a marker is put (this node's own segment)."""
        self._node = node
        self._placement = placement
        self._placed: Any = None  # the node thread's, made at its first claim
        self.writer = os.urandom(16)
        self._pools: Pools | None = None
        self._fetching: Callable[[str, bytes], bool] = lambda engine_id, key: False
        self._waits: RemoteWaits | None = None
        self._claimed: dict[tuple[str, bytes], str] = {}  # the event loop's: marker keys put
        # The node thread's: markers found another daemon's, which our entry's end leaves be;
        # the markers of the claims held (while there are any, the beat goes on).
        self._lost: set[str] = set()
        self._held: set[str] = set()
        # The node thread's: claims refused for space by a master that had just taken over,
        # to be tried again (`_again`) unless their entry ends first.
        self._refused: dict[str, Callable[[StoreClient], None]] = {}  # key -> its claim
        self._beat = 0
        self._beats: threading.Thread | None = None  # started at the first claim held
        # The node thread's counters (read by stats() too: plain ints).
        self.claims = self.claims_lost = 0

    def bind(
        self, pools: Pools, fetching: Callable[[str, bytes], bool], waits: RemoteWaits
    ) -> None:
        """fetching: whether a PENDING entry is a fetch's (read from the store, not written
        here); waits: the node's placeholders (for their counters)."""
        self._pools, self._fetching, self._waits = pools, fetching, waits

    def stats(self, node: ClusterStats) -> ClusterStats:
        """The node's stats with the single-flight counters."""
        waits = self._waits
        return dataclasses.replace(
            node,
            claims=self.claims,
            claims_lost=self.claims_lost,
            waits_hit=waits.waits_hit if waits is not None else 0,
            waits_missed=waits.waits_missed if waits is not None else 0,
        )

    def on_event(self, event: WatchEvent) -> None:
        """Every event the core emits (on the event loop, after the node's own on_event: a
        commit's publish is queued before the marker's removal)."""
        if self._pools is None:
            return
        claim = (event.engine_id, event.key)
        if event.type is EventType.PENDING:
            namespace = self._pools.cluster_namespace(event.engine_id)
            if not namespace or not self._node.joined or self._fetching(*claim):
                return
            key = self._claimed[claim] = marker_key(namespace, event.key)
            _logged(self._node.ask(self._claim(key, event.nbytes)), "claim")
        elif event.type in _ENDED and claim in self._claimed:
            _logged(self._node.ask(self._removal(self._claimed.pop(claim))), "marker removal")
        elif event.type is EventType.POOL_DROPPED:  # dropped by force, its entries with it
            for dropped in [c for c in self._claimed if c[0] == event.engine_id]:
                _logged(self._node.ask(self._removal(self._claimed.pop(dropped))), "marker removal")

    def _claim(self, key: str, nbytes: int) -> Callable[[StoreClient], None]:
        def work(store: StoreClient) -> None:
            try:
                self._place(store, key, nbytes)
            except Refused as refused:
                # A master that has just taken over has the nodes' segments back only a few
                # seconds later: the claim is tried again while the entry is written.
                if not self._node.refused_while_settling([refused.answer]):
                    raise
                self._refused[key] = work
                timer = threading.Timer(SETTLE_RETRY_S, self._again, (key,))
                timer.daemon = True  # a daemon stopping does not wait for it
                timer.start()

        return work

    def _again(self, key: str) -> None:
        """(A timer's thread) Ask the node's thread to claim `key` again, unless its entry ended
        meanwhile (its removal came first); the latest entry's claim, if the key was allocated
        again since."""

        def work(store: StoreClient) -> None:
            claim = self._refused.pop(key, None)
            if claim is not None:
                claim(store)

        _logged(self._node.ask(work), "claim")

    def _place(self, store: StoreClient, key: str, nbytes: int) -> None:
        """Put the marker and read back which the store holds: ours holds the claim."""
        marker = Marker(self.writer, nbytes, BOUND_S)
        raw = marker.pack()
        if self._placed is None:
            self._placed = self._placement(store)
        found = self._put_and_read(store, key, raw)
        if found is None or (found != marker and found.writer == self.writer):
            # Not readable (its replica's node is gone), or ours of an earlier entry of the
            # key: a put would keep it, so it goes.
            store.batch_remove([key], True)
            found = self._put_and_read(store, key, raw)
        if found is None:
            raise RuntimeError("the marker written could not be read back")
        if found != marker:  # another node's producer writes it too
            self.claims_lost += 1
            self._lost.add(key)
            return
        self.claims += 1
        self._held.add(key)
        if self._beats is None:
            self._beats = threading.Thread(target=self._beating, name="ecd-claims", daemon=True)
            self._beats.start()

    def _put_and_read(self, store: StoreClient, key: str, raw: bytes) -> Marker | None:
        """Put the marker (kept only if the store has no value under the key) in this node's
        segment, or where the master places it if that cannot take it (no segment, full), and
        read back the one the store holds; None if it holds none that can be read."""
        if store.put(key, raw, self._placed) < 0 and (answer := store.put(key, raw)) < 0:
            raise Refused(answer)
        return Marker.parse(store.get(key))

    def _beating(self) -> None:
        """This thread's, until the node leaves the store: every REFRESH_S, while claims are
        held, ask the node's thread for a beat (not while one is still queued there, nor while
        the master does not answer: a writer that cannot reach it is taken for dead, as it
        should be, since its values could not be published either)."""
        refreshing: Future[None] | None = None
        while self._node.joined:
            time.sleep(REFRESH_S)
            if self._held and self._node.connected and (refreshing is None or refreshing.done()):
                refreshing = self._node.ask(self._refresh)
                _logged(refreshing, "beat")

    def _refresh(self, store: StoreClient) -> None:
        """Write the beat again, changed (an upsert: a put would keep the old value), where the
        markers go."""
        if not self._held:
            return
        self._beat += 1
        key, raw = alive_key(self.writer), bytes(1 + self._beat % BEATS)
        if store.upsert(key, raw, self._placed) < 0 and (answer := store.upsert(key, raw)) < 0:
            raise RuntimeError(f"the store answered {answer} to the beat's upsert")

    def _removal(self, key: str) -> Callable[[StoreClient], None]:
        """Work for the node's thread, after the claim's (the queue keeps their order)."""

        def work(store: StoreClient) -> None:
            if key in self._lost:  # another node's: its writer removes it
                self._lost.discard(key)
                return
            if self._refused.pop(key, None) is not None:  # never placed: no retry, no removal
                return
            self._held.discard(key)
            store.batch_remove([key], True)  # forced: readers' lookups hold leases on it

        return work


def _logged(future: Future[Any], what: str) -> None:
    """Log a store call nobody waits on if it fails (the node logs the master's silence)."""

    def done(future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.info(f"a {what} failed", extra={"why": str(future.exception())})

    future.add_done_callback(done)


@dataclass
class Awaited:
    """A placeholder: a local PENDING entry standing for one another node's producer writes."""

    slot: PullSlot
    store_key: str
    marker_key: str
    marker: Marker
    beat: int  # its writer's, as last seen (0: not seen yet)
    seen_at: float  # time.monotonic() when this node made it or saw the beat change

    def dead(self, now: float) -> bool:
        """Whether its writer is taken for dead: its beat unchanged longer than its bound (the
        waits' deadline rule, from when it was last seen)."""
        return now > deadline(self.seen_at, 0.0, self.marker.bound_s)


# Reads the values of placeholders whose values landed into their extents and commits them (or
# aborts them): ClusterFetch.fill.
Fill = Callable[[str, list[tuple[PullSlot, str]], float], Awaitable[int]]


class RemoteWaits:
    """The placeholders of this node, each waiting for another node's producer."""

    def __init__(self, store: Store, node: ClusterNode, fill: Fill) -> None:
        self._store = store
        self._node = node
        self._fill = fill
        self._awaited: dict[tuple[str, bytes], Awaited] = {}
        self._task: asyncio.Task[None] | None = None
        self.waits_hit = self.waits_missed = 0

    async def wait_for(self, engine_id: str, namespace: str, keys: list[bytes]) -> None:
        """`keys` have no value in the store but a marker: read the markers, and allocate a
        placeholder for each (its askers wait on it until the poll ends it)."""
        markers = [marker_key(namespace, key) for key in keys]
        raws = await asyncio.wrap_future(self._node.ask(lambda store: store.get_batch(markers)))
        now = time.monotonic()
        for key, key_of_marker, raw in zip(keys, markers, raws, strict=True):
            marker = Marker.parse(raw)
            if marker is None or not self._store.has_pool(engine_id):
                continue
            slot = self._store.pull_allocate(engine_id, key, marker.nbytes, "another node")
            if slot is not None:
                store_key = codec.store_key(namespace, key)
                placeholder = Awaited(slot, store_key, key_of_marker, marker, 0, now)
                self._awaited[(engine_id, key)] = placeholder
        if self._awaited and self._task is None:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        try:
            while self._awaited:
                await asyncio.sleep(POLL_S)
                await self._poll_once(list(self._awaited.values()))
        finally:
            self._task = None

    async def _poll_once(self, awaited: list[Awaited]) -> None:
        beats = sorted({alive_key(a.marker.writer) for a in awaited})
        keys = [a.store_key for a in awaited] + [a.marker_key for a in awaited] + beats
        # The store not answering, they wait on, up to their writers' bounds.
        sizes = [0] * len(awaited) + [1] * len(awaited) + [0] * len(beats)
        if self._node.joined:  # else an ask would wait for the join
            with contextlib.suppress(Exception):
                sizes = await asyncio.wrap_future(self._node.ask(self._node.sizes(keys)))
        started = time.monotonic()
        beat_of = dict(zip(beats, sizes[2 * len(awaited) :], strict=True))
        landed: dict[str, list[tuple[PullSlot, str]]] = {}
        dead: list[str] = []
        values, marks = sizes[: len(awaited)], sizes[len(awaited) : 2 * len(awaited)]
        for a, size, marked in zip(awaited, values, marks, strict=True):
            beat = beat_of[alive_key(a.marker.writer)]
            if beat and beat != a.beat:  # 0: not seen (absent, or being written again)
                a.beat, a.seen_at = beat, started
            if size > codec.HEADER.size:
                landed.setdefault(a.slot.engine_id, []).append((a.slot, a.store_key))
            elif marked and not a.dead(started):
                continue  # still being written
            else:
                self._store.pull_abort(a.slot)  # its writer gave up, or died
                self.waits_missed += 1
                if marked:
                    dead.append(a.marker_key)
            del self._awaited[(a.slot.engine_id, a.slot.key)]
        if dead and self._node.joined:  # the next writer's claim takes their place; forced:
            # other readers' lookups hold leases on them
            removal = self._node.ask(lambda store: store.batch_remove(dead, True))
            _logged(removal, "dead markers' removal")
        for engine_id, slots in landed.items():
            hits = await self._fill(engine_id, slots, started)
            self.waits_hit += hits
            self.waits_missed += len(slots) - hits

    async def close(self) -> None:
        """Stop polling and abort the placeholders (their askers encode)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for a in self._awaited.values():
            self._store.pull_abort(a.slot)
        self._awaited.clear()
