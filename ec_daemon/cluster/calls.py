"""Every call of the node's thread on the store client, through one path that tells whether the
master answered it (docs/design.md §13b: loss noticed at once).

What the store client does when its master is lost (Mooncake 0.3.13, measured here): a master
killed, a call fails at once or after ~4 s (its reconnect) with RPC_FAIL; a master that stops
answering (SIGSTOPped, or a link that drops every packet) holds each call 30 s (its RPC timeout),
then RPC_TIMEOUT. Its calls that return bytes or a dict answer empty either way, as for a key
the store lacks. So a call is judged by its result where the result can tell, and by its time:

- a call whose result carries RPC_FAIL or RPC_TIMEOUT, or that raises, marks the node
  disconnected; one whose result shows the master answered marks it connected;
- a call to the master (a lookup, a marker's put, get or removal) that has not returned within
  CALL_BOUND_S marks the node disconnected from that moment on (`MasterState.connected` reads
  it while the call still runs: lookups, publishes and health stop waiting on a thread held up
  to 30 s); one that returns later than that with a result that cannot tell counts as timed
  out, one whose result shows the master answered marks the node connected again (a master
  that resumes answers the calls it held at once: that is the rejoin).

Transfers (a publish's put, a remote hit's read) carry the entries' bytes, which may take longer
than a master call on a loaded link: they are judged by their results alone. Calls that touch
only this process (registering memory, leaving) are made directly, not through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from ec_daemon.cluster.mooncake import StoreClient, answered

T = TypeVar("T")

# How long a call to the master may take before the node counts it as lost. A master answers a
# lookup in about a millisecond here; a second leaves room for a loaded host and still says
# "disconnected" within a second of a call that will not return.
CALL_BOUND_S = 1.0


class MasterState:
    """Whether the store's master answers, as the node's calls found it. Written by the node's
    thread, read by the event loop (plain attributes: each write is one assignment)."""

    def __init__(
        self,
        on_lost: Callable[[str], None] = lambda why: None,
        on_back: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """on_lost: told what, on the node's thread, whenever a call finds the master gone;
        on_back: called there when a call finds it answering again after that."""
        self._on_lost = on_lost
        self._on_back = on_back
        self._clock = clock
        self._answered = False
        self._why = "not joined yet"
        self._calling: tuple[str, float] | None = None  # the master call running, since when

    @property
    def connected(self) -> bool:
        """Whether the master answered the last call and none has been running past the bound."""
        return self._answered and self._overdue() is None

    @property
    def error(self) -> str:
        """Why the node is not connected; empty while it is."""
        overdue = self._overdue()
        if overdue is not None:
            return overdue
        return "" if self._answered else self._why

    def answered(self) -> None:
        self._answered, self._why = True, ""

    def lost(self, why: str) -> None:
        self._answered, self._why = False, why

    def _overdue(self) -> str | None:
        calling = self._calling  # one read: the thread may end the call meanwhile
        if calling is None or self._clock() - calling[1] <= CALL_BOUND_S:
            return None
        return f"the master has not answered a {calling[0]} within {CALL_BOUND_S:g} s"

    def call(
        self,
        what: str,
        work: Callable[[], T],
        judge: Callable[[T], bool | None],
        bounded: bool = True,
    ) -> T:
        """Run `work`, a call on the store client, and record what it tells: `judge` says from
        its result whether the master answered (None: the result cannot tell); a bounded call
        that took longer than CALL_BOUND_S did not answer in time whatever it returned."""
        started = self._clock()
        if bounded:
            self._calling = (what, started)
        try:
            result = work()
        except Exception as exc:
            self.lost(f"a {what} failed: {exc}")
            self._on_lost(what)
            raise
        finally:
            self._calling = None
        verdict = judge(result)
        took = self._clock() - started
        if verdict is None and bounded and took > CALL_BOUND_S:
            verdict = False  # it did not answer in time (a result that shows it did: it is back)
        if verdict:
            back = not self._answered
            self.answered()
            if back:
                self._on_back()
        elif verdict is not None:
            self.lost(f"the master did not answer a {what} (it took {took:.1f} s)")
            self._on_lost(what)
        return result


def _code(result: int) -> bool:
    return answered([result])


def _untold(result: object) -> None:
    return None


class WatchedStore:
    """The store client, each call of the node's thread through `MasterState.call` (a
    StoreClient itself: the work the event loop hands the thread gets this one)."""

    def __init__(self, store: StoreClient, state: MasterState) -> None:
        self._store = store
        self._state = state

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._state.call("lookup", lambda: self._store.batch_is_exist(keys), answered)

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]:
        return self._state.call("lookup", lambda: self._store.batch_get_replica_desc(keys), _untold)

    def batch_put_from_multi_buffers(
        self, keys: list[str], buffers: list[list[int]], sizes: list[list[int]], config: Any
    ) -> list[int]:
        return self._state.call(
            "put",
            lambda: self._store.batch_put_from_multi_buffers(keys, buffers, sizes, config),
            answered,
            bounded=False,
        )

    def batch_get_into_multi_buffers(
        self, keys: list[str], buffers: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        return self._state.call(
            "read",
            lambda: self._store.batch_get_into_multi_buffers(keys, buffers, sizes),
            answered,
            bounded=False,
        )

    def put(self, key: str, value: bytes, config: Any = None) -> int:
        if config is None:  # the client's own default placement
            return self._state.call("marker put", lambda: self._store.put(key, value), _code)
        return self._state.call("marker put", lambda: self._store.put(key, value, config), _code)

    def get(self, key: str) -> bytes:
        return self._state.call("marker get", lambda: self._store.get(key), _untold)

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return self._state.call("marker get", lambda: self._store.get_batch(keys), _untold)

    def upsert(self, key: str, value: bytes, config: Any = None) -> int:
        if config is None:  # the client's own default placement
            return self._state.call("beat", lambda: self._store.upsert(key, value), _code)
        return self._state.call("beat", lambda: self._store.upsert(key, value, config), _code)

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return self._state.call(
            "marker removal", lambda: self._store.batch_remove(keys, force), answered
        )

    def register_buffer(self, address: int, length: int) -> int:
        return self._store.register_buffer(address, length)

    def unregister_buffer(self, address: int) -> int:
        return self._store.unregister_buffer(address)

    def health_check(self) -> int:
        # The client's own view of its master: no call leaves the process.
        return self._store.health_check()

    def get_hostname(self) -> str:
        return self._store.get_hostname()

    def close(self) -> int:
        return self._store.close()
