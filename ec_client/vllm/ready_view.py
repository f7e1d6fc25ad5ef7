"""ReadyView: which keys of one pool are READY, as last heard from the daemon's Watch stream.

vLLM asks `has_cache_item` for every encoder input its GPU cache misses, inside the scheduler
loop; a round trip per question would cost more than the loop itself. A background thread follows
Watch(pool, snapshot=True) instead: every READY key, then SYNCED, then COMMITTED / EVICTED /
ABORTED / DELETED / POOL_DROPPED as they happen. Answering is a set lookup.

The view is a hint, never a promise: it can say READY for a key evicted a moment ago (the
Acquire that follows finds out) and miss a key committed a moment ago (it is encoded again).
Until the stream has delivered its snapshot, and whenever it is broken (daemon down or
restarting, pool dropped), it knows nothing: every key is a miss, and `synced` is False, which
the scheduler also takes as "do not call the daemon now". The thread reconnects with backoff,
reattaching first (OpenPool: notices a restarted daemon, recreates a dropped pool), and takes a
fresh snapshot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ec_client._session import FIRST_BACKOFF_S, MAX_BACKOFF_S
from ec_client.client import Client, WatchStream
from ec_client.errors import EcdError
from ec_client.types import EventType

log = logging.getLogger("ec_client.vllm")

_GONE = (EventType.EVICTED, EventType.ABORTED, EventType.DELETED)


class ReadyView:
    def __init__(self, client: Client, engine_id: str, reattach: Callable[[], object]) -> None:
        """reattach: called before every reconnect; raises EcdError while the daemon is away."""
        self._client = client
        self._engine_id = engine_id
        self._reattach = reattach
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self._synced = threading.Event()
        self._closed = threading.Event()
        self._stream: WatchStream | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"ecd-watch-{engine_id}", daemon=True
        )
        self._thread.start()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def wait_synced(self, timeout_s: float) -> bool:
        return self._synced.wait(timeout_s)

    def has(self, key: str) -> bool:
        with self._lock:
            return self._synced.is_set() and key in self._ready

    def add(self, key: str) -> None:
        """The scheduler committed `key` itself: known READY before the event comes back."""
        with self._lock:
            self._ready.add(key)

    def discard(self, key: str) -> None:
        """An Acquire found `key` gone before the event came."""
        with self._lock:
            self._ready.discard(key)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = FIRST_BACKOFF_S
        while not self._closed.is_set():
            try:
                if self._follow():
                    delay = FIRST_BACKOFF_S
            except EcdError as error:
                log.debug("watch of pool %s broke: %s", self._engine_id, error)
            self._synced.clear()
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, MAX_BACKOFF_S)
            try:
                self._reattach()
            except EcdError as error:
                log.debug("cannot reattach pool %s yet: %s", self._engine_id, error)

    def _follow(self) -> bool:
        """Follow one Watch stream until it ends; returns whether it got as far as SYNCED."""
        stream = self._client.open_watch(self._engine_id, snapshot=True)
        with self._lock:
            self._stream = stream
        if self._closed.is_set():
            stream.cancel()  # close() ran between the loop's check and the assignment
        snapshot: set[str] = set()
        for event in stream:
            key = event.key.decode("utf-8", "surrogateescape")
            if event.type is EventType.SNAPSHOT:
                snapshot.add(key)
            elif event.type is EventType.SYNCED:
                with self._lock:
                    self._ready = snapshot
                self._synced.set()
            elif event.type is EventType.COMMITTED:
                self.add(key)
            elif event.type in _GONE:
                self.discard(key)
            elif event.type is EventType.POOL_DROPPED:
                break  # reattaching recreates the pool; then a fresh snapshot
        stream.cancel()
        return self._synced.is_set()
