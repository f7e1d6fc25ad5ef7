"""Connection: the scheduler side's session on the daemon, its pool, the view of it, and their
generations.

The daemon is an optimisation, never a dependency of a request: while it is unreachable (the
Watch stream is down) the connector sends nothing, answers has_cache_item with False for every
item it holds no pin on and saves nothing, so requests are encoded as if there were no cache.
That holds from the start too: a daemon not reachable when the engine starts is tried again in
the background (`NothingReady` stands for the pool's view until then). The books keep what is
owed meanwhile; it is handed to Outbox once the view is synced again.

What this side holds lives as long as its generation (`generation`: the session and the pool
file's UUID). When our session is new (the daemon restarted, or our lease ran out), what the
session held is void: its lease pins and PENDING entries are gone, and requests whose loads
under lease pins were in flight fail (take_unavailable_requests) rather than risk bytes that
may have been overwritten. Lock pins hold across it (the locks belong to the pool file, not to
the daemon), so loads under them go on. When the pool was recreated (its UUID changed), every
pin is void, lock pins too (the workers map the new file): the old file's locks are dropped
and its loads fail. `Connection.next_generation` says which happened; the scheduler side voids
its books accordingly.

The side is handed its client (`connect`, a `SchedulerClient`: ec_client.Client by default), so
that it can be driven in-process against a stand-in (tests/unit/test_scheduler_side.py), the
way vLLM tests its own connectors with stand-in requests.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from ec_client.control.client import Client
from ec_client.control.outbox import Outbox
from ec_client.vllm.config import ConnectorConfig
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import LayoutError
from ec_protocol.pool.slot_locks import SlotPins
from ec_protocol.types import PoolInfo, Role, Stats

log = logging.getLogger("ec_client.vllm")

CALL_TIMEOUT_S = 10.0
# How long what the client owes a quiet pool waits before Outbox's thread sends it alone. What this
# side owes goes at once with a step_soon of its own, so this only spaces the Steps that carry the
# hits and misses answered here (they wait ANSWERED_LINGER_S anyway) and keeps Outbox's thread from
# sending an op alone just before the step_soon that would have carried it.
LINGER_S = 1.0
# While the daemon was never reached, how often the connector tries again.
CONNECT_RETRY_FIRST_S = 0.5
CONNECT_RETRY_MAX_S = 5.0


class PoolRefused(RuntimeError):
    """The daemon will not give this engine the pool: another model, dtype, embedding width,
    vLLM version or capacity already owns that name."""


class PoolView(Protocol):
    """What SchedulerSide reads of the pool's view (ec_client.control.ready_view.ReadyView)."""

    @property
    def synced(self) -> bool: ...

    def has(self, key: bytes) -> bool: ...

    def pending(self, key: bytes) -> bool: ...

    def slot(self, key: bytes) -> int | None: ...

    @property
    def changes(self) -> int: ...

    def wait_change(self, since: int, timeout_s: float) -> bool: ...

    def add(self, key: bytes) -> None: ...

    def discard(self, key: bytes) -> None: ...

    def close(self) -> None: ...


class ReadyPoolView(PoolView, Protocol):
    """The view as the client hands it: one that is being synced with the daemon."""

    def wait_synced(self, timeout_s: float) -> bool: ...

    def on_committed(self, listener: Callable[[bytes, int], None]) -> None: ...


class SchedulerClient(Protocol):
    """What SchedulerSide uses of its client (ec_client.Client): its pool, the view of it, and
    its Outbox, through which everything is sent."""

    outbox: Outbox

    @property
    def session_id(self) -> str: ...

    @property
    def target(self) -> str: ...

    def open_pool(
        self,
        engine_id: str,
        block_size_bytes: int,
        capacity_bytes: int,
        compat_key: str,
        ephemeral: bool = False,
        *,
        cluster_namespace: str = "",
    ) -> PoolInfo: ...

    def stats(self, engine_id: str = "") -> Stats: ...

    def pool_info(self, engine_id: str) -> PoolInfo: ...

    def view(self, engine_id: str) -> ReadyPoolView: ...

    def flush(self, timeout_s: float | None = None) -> None: ...

    def drop_pool(self, engine_id: str, force: bool = False) -> int: ...

    def close(self, flush_timeout_s: float = 10.0) -> None: ...


def connect_client(config: ConnectorConfig) -> Client:
    """The default client of a SchedulerSide: a session of the engine's role on its daemon. A
    producer that reads the pool (an encoder-only one: ConnectorConfig.reads_pool) opens it as
    `both`: it pins what it finds there, and what it asks of the daemon (a pool shared through
    the store)."""
    role = {(True, True): Role.BOTH, (True, False): Role.PRODUCER}.get(
        (config.is_producer, config.reads_pool), Role.CONSUMER
    )
    config.await_daemon()
    return Client(
        config.address,
        name=config.client_name,
        role=role,
        connect_timeout_s=config.connect_timeout_s,
        call_timeout_s=CALL_TIMEOUT_S,
        linger_s=LINGER_S,
    )


class NothingReady:
    """The view of the pool before the daemon was first reached: nothing READY, never synced,
    so the connector sends nothing and every input is encoded."""

    synced = False

    def has(self, key: bytes) -> bool:
        return False

    pending = has

    def slot(self, key: bytes) -> int | None:
        return None

    changes = 0

    def wait_change(self, since: int, timeout_s: float) -> bool:
        return False  # nothing is held for it: it never changes

    def add(self, key: bytes) -> None:
        pass

    discard = add

    def close(self) -> None:
        pass


class Connection:
    """The client, the pool's view and lock pins, and their generation; set once, when the
    daemon is first reached (at construction, or later from a thread of its own): the view last,
    so that a synced view always means a client and a generation to go with it."""

    def __init__(
        self, config: ConnectorConfig, connect: Callable[[], SchedulerClient] | None
    ) -> None:
        """connect: opens a session on the daemon (default: `connect_client(config)`); an
        EcdError UNAVAILABLE from it is tried again in the background."""
        self.config = config
        self._new_client: Callable[[], SchedulerClient] = connect or functools.partial(
            connect_client, config
        )
        self.closed = threading.Event()
        self._connecting = threading.Lock()  # a late connect against shutdown
        self.client: SchedulerClient | None = None
        self.generation = ("", "")
        self.slot_pins: SlotPins | None = None  # the lock pins on the current pool file
        # Whether a key the view lacks is asked of the daemon, in the background, its request
        # held one step, rather than encoded at once: in a pool shared through the daemon's
        # store (docs/design.md §13, single flight across nodes), and in an engine that only
        # consumes. There a request comes after its encoder engine answered (the disaggregated
        # flow), and a view that lacks the image has most likely not heard yet of the entry
        # that engine allocated or committed a moment ago: its Watch events reach this process
        # a few ms to tens of ms later under load, and a miss would encode again what is being
        # saved (docs/design.md §4). An engine that encodes and saves answers its misses from
        # the view alone, with no round trip.
        self.ask_misses = not config.is_producer
        self.view: PoolView = NothingReady()

    def start(self) -> None:
        """Reach the daemon now, or, if it is not there, keep trying from a thread of its own."""
        try:
            self._connect()
        except EcdError as error:
            if error.code is not grpc.StatusCode.UNAVAILABLE:
                raise
            # The daemon is an optimisation, never a dependency of the engine: it may start
            # after the engine (pods and units start in any order) or be restarting.
            log.warning(
                "ecd is not reachable, the engine encodes everything until it is: %s", error
            )
            threading.Thread(target=self._connect_later, name="ecd-connect", daemon=True).start()

    def _connect(self) -> None:
        """Open a session and the pool (create or attach), then follow the pool. PoolRefused if
        the pool is another engine's: a configuration error, said at once."""
        client = self._new_client()
        shared = self._open_pool(client)
        self.client = client
        if shared:  # the store may have what this node lacks, or another node be writing it
            self.ask_misses = True
        self.generation = self._current_generation(client)
        self.slot_pins = self._open_slot_pins(client)
        view = client.view(self.config.pool)  # reattaches by reopening the pool
        view.on_committed(self._read_ahead)
        view.wait_synced(self.config.connect_timeout_s)
        self.view = view

    def _open_pool(self, client: SchedulerClient) -> bool:
        """Open the pool on `client` (closed, and PoolRefused raised, if the daemon refuses it);
        whether it is shared through the daemon's store."""
        c = self.config
        # A private pool (per-run name) goes with our session, however the engine ends.
        pool = (c.pool, c.block_size_bytes, c.capacity_bytes, c.compat_key, c.pool_is_private)
        try:
            if c.namespace_if_store:
                # "auto": shared only through a daemon that has a store, which the pool's Stats
                # says (that of every pool needs an admin's token), so the pool is opened, then
                # opened again with the namespace. At connect only: the client reopens the pool
                # as it was last opened.
                client.open_pool(*pool)
                shared = client.stats(c.pool).cluster is not None
                if shared:
                    client.open_pool(*pool, cluster_namespace=c.cluster_namespace)
                return shared
            client.open_pool(*pool, cluster_namespace=c.cluster_namespace)
            return bool(c.cluster_namespace)  # named: a store is meant to be there
        except EcdError as error:
            client.close()
            if error.code is grpc.StatusCode.FAILED_PRECONDITION:
                raise PoolRefused(
                    f"ecd at {client.target} refused pool {c.pool!r} to this engine: "
                    f"{error.message}. Engines share a pool only with the same model, dtype, "
                    "embedding width, vLLM version, ec_cpu_bytes and cluster namespace; give "
                    "this engine another ecd_pool."
                ) from None
            raise

    def _connect_later(self) -> None:
        """Until the daemon is first reached: try again, backing off to CONNECT_RETRY_MAX_S."""
        delay = CONNECT_RETRY_FIRST_S
        while not self.closed.wait(delay):
            try:
                with self._connecting:
                    if self.closed.is_set():
                        return
                    self._connect()
            except PoolRefused as refused:
                log.error("%s The engine runs without the cache.", refused)
                return
            except EcdError as error:
                log.debug("ecd still not reachable: %s", error)
                delay = min(2 * delay, CONNECT_RETRY_MAX_S)
                continue
            log.info("ecd reached at %s: the cache is in use", self.config.address or "default")
            return

    def close_once(self) -> bool:
        """Mark the connection closed (a late connect either finished or will not start);
        False if it already was."""
        with self._connecting:
            if self.closed.is_set():
                return False
            self.closed.set()
            return True

    def reached(self) -> SchedulerClient:
        """The client, where the view is synced (so the daemon was reached)."""
        if self.client is None:
            raise RuntimeError("ecd was never reached: nothing may be sent")
        return self.client

    def _current_generation(self, client: SchedulerClient) -> tuple[str, str]:
        """Our lease pins and PENDING entries live as long as our session and the pool file,
        our lock pins as long as the pool file: a new session (daemon restarted, or our lease
        ran out) voids the former, a new pool UUID (the pool recreated) voids all."""
        return client.session_id, client.pool_info(self.config.pool).pool_uuid

    def next_generation(self) -> bool | None:
        """Move to the client's current generation: None if it is the one we had; else whether
        the pool file is new (then the old file's lock pins are closed and the new file's
        opened), rather than the session alone."""
        if self.client is None:
            return None
        generation = self._current_generation(self.client)
        if generation == self.generation:
            return None
        new_file = generation[1] != self.generation[1]
        self.generation = generation
        if new_file:  # the workers remap the new file: the old one's locks pin nothing of use
            if self.slot_pins is not None:
                self.slot_pins.close()
            self.slot_pins = self._open_slot_pins(self.client)
        return new_file

    def _open_slot_pins(self, client: SchedulerClient) -> SlotPins | None:
        """The lock pins of the pool's current file; None if it cannot be opened (then every
        cached item is pinned by a background Acquire, its request waiting one step)."""
        info = client.pool_info(self.config.pool)
        try:
            return SlotPins(info.path, info.pool_uuid)
        except (OSError, LayoutError) as error:
            log.warning(
                "cannot open the pool file %s for lock pins; cached items are pinned through "
                "the daemon, a step later: %s",
                info.path,
                error,
            )
            return None

    def _read_ahead(self, key: bytes, slot: int) -> None:
        """On the view's thread, as an entry's commit is heard of: its record read and checked
        now, so that a lock pin on it in `ensure_cache_available` need not parse it."""
        pins = self.slot_pins
        if pins is not None:
            pins.read_ahead(slot, key)

    def close_pool(self) -> None:
        """Stop following the pool and drop our lock pins on its file."""
        self.view.close()
        if self.slot_pins is not None:
            self.slot_pins.close()
