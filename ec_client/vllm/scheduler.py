"""SchedulerSide: the connector in vLLM's scheduler process, the only part that calls the daemon.

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
saves.py) are touched on the scheduler thread alone. Per step:

    ensure_cache_available   from local state, no round trip: a needed item READY in this
        daemon's pool whose slot the ready view knows is pinned right there, by a lock on its
        slot in the pool file (a lock pin: docs/design.md §5, ec_client/pool/slot_locks.py), and its
        request admitted in the same call; the hit goes to the daemon with the next Step (its
        counters and LRU order). The items a lock pin cannot take are pinned in the background
        and their request waits one step (see loads.py): those committed a moment ago whose
        slot the view has not heard yet, and an item the view lacks where misses are asked (in
        an engine that only consumes, and in a pool shared through the daemon's store): its
        Acquire is a hit the view had not heard of yet, or a remote hit, PENDING while another
        engine (here, or on another node) encodes it (then held as for an item PENDING in the
        view), or a miss (then encoded): single flight across engines and nodes.
    has_cache_item, update_state_after_alloc   bookkeeping.
    build_connector_meta     one background Step (step_soon): releases owed, aborts of failed
        copies, pins for the wanted items, entries for this step's new outputs. The metadata
        orders the workers' copies: loads out of pins held, saves into entries allocated by an
        earlier step's Step (this step's outputs are save *intents*: the worker keeps them until
        their order comes, see saves.py).
    update_connector_output  the workers' report: landed saves are committed at once, in a
        background Step (step_soon), so a just-saved item can be a hit at the next step; a lock
        pin whose copies every loading rank reported is unlocked at once.

Releases and aborts come before the Allocate so their space is free for it; Acquire comes before
Allocate so a step's allocations can never evict an entry about to be loaded (the eviction
hazard ECCPUConnector has within a step); and the daemon never evicts a lock-pinned entry.

The daemon is an optimisation, never a dependency of a request: while it is unreachable (the
Watch stream is down) the connector sends nothing, answers has_cache_item with False for every
item it holds no pin on and saves nothing, so requests are encoded as if there were no cache.
That holds from the start too: a daemon not reachable when the engine starts is tried again in
the background (`NothingReady` stands for the pool's view until then). The books keep what is
owed meanwhile; it is handed to Outbox once the view is synced again.

SchedulerSide is handed its client (`connect`, a `SchedulerClient`: ec_client.Client by default),
so that it can be driven in-process against a stand-in (tests/unit/test_scheduler_side.py), the
way vLLM tests its own connectors with stand-in requests.

An engine that reads the pool (ConnectorConfig.reads_pool: a consumer, or an encoder-only
producer) holds a request back while an item it needs is being written into the pool (the
view's `pending`: another engine is encoding it, or encoded it and its save is not committed
yet) until that entry is committed (then it loads it: single flight, docs/design.md §4) or
aborted (then it encodes it); the daemon bounds how long that can take (its producer's death
ends it at once, its --pending-timeout in any case). In the disaggregated flow the request
reaches this engine as soon as the encoder engine answered, a step or two before that engine
commits, and sometimes before this process heard of the entry at all (the Watch event is on
its way): so an engine that only consumes asks the daemon about an item its view lacks (see
`_ask_misses`) instead of encoding it at once.

An encoder-only engine (ec_producer with `--mm-encoder-only`) reads the pool the same way, and
so encodes no item the pool holds or another engine is writing; but its workers never load
(vLLM's encoder-only runner reads no encoder cache), so a pinned item is promised to vLLM
(`has_cache_item`) and its pin given back at once, with no copy ordered
(`LoadBook.dispatch(copy=False)`). A producer that runs the whole model does not read the pool:
vLLM would skip its encoder for an item promised so, yet load nothing into its workers (it
loads only on a consumer), so it encodes what it is sent, saving none the pool holds.

While requests are held so, vLLM would step the engine empty as fast as it can (its busy loop
steps while any request is unfinished, and offers a connector no way to park a request, nor to
be woken: KV connectors' requests waiting for remote KV spin the same way). So a step that
scheduled nothing, after one that scheduled nothing either, while requests are held for
others' work (and nothing of this side's own is in flight) waits in `build_connector_meta`, up
to `ecd_idle_wait_ms`, for the pool's view to change: the commit or abort it waits for ends that
wait at once. A step with anything scheduled never waits.

When our session is new (the daemon restarted, or our lease ran out), what the session held is
void: its lease pins and PENDING entries are gone, and requests whose loads under lease pins
were in flight fail (take_unavailable_requests) rather than risk bytes that may have been
overwritten. Lock pins hold across it (the locks belong to the pool file, not to the daemon), so
loads under them go on. When the pool was recreated (its UUID changed), every pin is void, lock
pins too (the workers map the new file): the old file's locks are dropped and its loads fail.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
    get_encoder_output_width,
)

from ec_client.control.client import Client
from ec_client.control.outbox import NOT_DELIVERED, Answered, DeferredOp, Outbox
from ec_client.errors import EcdError
from ec_client.pool.layout import LayoutError, tensor_nbytes
from ec_client.pool.slot_locks import SlotPins
from ec_client.types import (
    AllocateItem,
    ItemResult,
    LeaseResult,
    PoolInfo,
    Role,
    Stats,
    Status,
    StepResult,
    TensorSpec,
)
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.loads import LOCK_MISSED, LoadBook, LockMissed, Pin
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm.saves import SaveBook

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("ec_client.vllm")

CALL_TIMEOUT_S = 10.0
# How long what the client owes a quiet pool waits before Outbox's thread sends it alone. What this
# side owes goes at once with a step_soon of its own, so this only spaces the Steps that carry the
# hits and misses answered here (they wait ANSWERED_LINGER_S anyway) and keeps Outbox's thread from
# sending an op alone just before the step_soon that would have carried it.
LINGER_S = 1.0
# How soon the hits and misses owed go once vLLM finds the engine without requests, rather than
# ANSWERED_LINGER_S later. Not at once: a burst that follows at once (vLLM steps as soon as a
# request arrives) would meet a Step of their own, where a Step of its own carries them free.
IDLE_ANSWERED_S = 0.05
# The most output sizes whose spec is kept (`_save_spec`): images come in few sizes, but nothing
# bounds how many.
MAX_SAVE_SPECS = 4096
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


@dataclass
class Asked:
    """What one step_soon asked, to read its answer against; `generation` is the one it was
    asked in (an answer from another is void, see `_take_answers`)."""

    generation: tuple[str, str]
    acquires: list[str] = field(default_factory=list)
    allocates: dict[str, TensorSpec] = field(default_factory=dict)


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


class SchedulerSide:
    def __init__(
        self,
        vllm_config: VllmConfig,
        config: ConnectorConfig,
        connect: Callable[[], SchedulerClient] | None = None,
    ) -> None:
        """connect: opens a session on the daemon (default: `connect_client(config)`); an
        EcdError UNAVAILABLE from it is tried again in the background."""
        self._vllm_config = vllm_config
        self.config = config
        self._new_client: Callable[[], SchedulerClient] = connect or functools.partial(
            connect_client, config
        )
        self.loads = LoadBook(config.load_reports)
        self.saves = SaveBook()
        # Steps asked, by why (for `python -m ...bench`); all sent from Outbox's thread.
        self.rpcs: Counter[str] = Counter()
        self._closed = threading.Event()
        self._connecting = threading.Lock()  # a late connect against shutdown
        # The answers to what was asked (step_soon), read on the scheduler thread in order.
        self._asked: deque[tuple[Future[StepResult], Asked]] = deque()
        # What ops' answers change in the books, from Outbox's thread, done on the scheduler
        # thread (the books are its alone), in the order heard: an op owed again (its Step did
        # not reach the daemon), done in its generation only; a save's key free to be planned
        # again (None: whatever the generation), after it was owed again if it was.
        self._from_outbox: deque[tuple[tuple[str, str] | None, Callable[[], None]]] = deque()
        self._unavailable: set[str] = set()
        self._no_width: set[str] = set()  # modalities already warned about
        # The specs of outputs to save, by (modality, rows): a spec is never changed, so the
        # outputs of one size share one (built once, not per output on the scheduler thread).
        self._save_specs: dict[tuple[str, int], TensorSpec] = {}
        self._hits: list[bytes] = []  # lock pins taken this step: hits owed to the daemon
        self._misses = 0  # misses the view answered this step: owed too, with the hits
        # Whether this scheduling pass took the answers yet. Once a pass is enough: its later
        # requests would find nothing new, at a look (~1 us) each; what comes back meanwhile
        # is taken by build_connector_meta, which ends the pass, before the step's metadata.
        self._answers_taken = False
        # Whether this scheduling pass held a request back, and the view's change count when
        # the pass began: a step that scheduled nothing waits for it to move (`_idle`).
        self._held = False
        self._changes_seen = 0
        # Whether the step before scheduled nothing either: only then may a step wait. Under
        # vLLM's async scheduling the step before may still be running; if it ran requests,
        # their outputs are handled only after this step is scheduled, and must not wait.
        self._empty_before = False
        self.idle_waits = 0  # steps that waited so (for tests and the bench)
        # Set once, when the daemon is first reached: the view last, so that a synced view
        # always means a client and a generation to go with it.
        self.client: SchedulerClient | None = None
        self._generation = ("", "")
        self._slot_pins: SlotPins | None = None  # the lock pins on the current pool file
        # Whether a key the view lacks is asked of the daemon, in the background, its request
        # held one step, rather than encoded at once: in a pool shared through the daemon's
        # store (docs/design.md §13, single flight across nodes), and in an engine that only
        # consumes. There a request comes after its encoder engine answered (the disaggregated
        # flow), and a view that lacks the image has most likely not heard yet of the entry
        # that engine allocated or committed a moment ago: its Watch events reach this process
        # a few ms to tens of ms later under load, and a miss would encode again what is being
        # saved (docs/design.md §4). An engine that encodes and saves answers its misses from
        # the view alone, with no round trip.
        self._ask_misses = not self.config.is_producer
        self.view: PoolView = NothingReady()
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
        c = self.config
        client = self._new_client()
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
            else:
                client.open_pool(*pool, cluster_namespace=c.cluster_namespace)
                shared = bool(c.cluster_namespace)  # named: a store is meant to be there
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
        self.client = client
        if shared:  # the store may have what this node lacks, or another node be writing it
            self._ask_misses = True
        self._generation = self._current_generation(client)
        self._slot_pins = self._open_slot_pins(client)
        view = client.view(c.pool)  # reattaches by reopening the pool
        view.on_committed(self._read_ahead)
        view.wait_synced(c.connect_timeout_s)
        self.view = view

    def _connect_later(self) -> None:
        """Until the daemon is first reached: try again, backing off to CONNECT_RETRY_MAX_S."""
        delay = CONNECT_RETRY_FIRST_S
        while not self._closed.wait(delay):
            try:
                with self._connecting:
                    if self._closed.is_set():
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

    # ---- vLLM's scheduler calls, in step order -------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.config.reads_pool or not request.mm_features:
            return True
        if not self._answers_taken:
            self._answers_taken = True
            self._changes_seen = self.view.changes  # before anything is decided from it
            self._take_answers()
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        # ecd_wait_ms is a consumer's: an encoder engine is where new images are first encoded.
        wait_s = self.config.wait_s if self.view.synced and self.config.is_consumer else 0.0
        admitted = self.loads.admit(
            request.request_id,
            needed,
            self._ready,
            time.monotonic(),
            wait_s,
            pending=self._pending,
            lock=self._lock_pin,
            elsewhere=self._ask_misses and self.view.synced,
        )
        self._held = self._held or not admitted
        return admitted

    def has_cache_item(self, identifier: str) -> bool:
        return (
            self.config.reads_pool and not self._closed.is_set() and self.loads.pinned(identifier)
        )

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        key = feature.identifier
        # An encoder-only producer loads nothing: vLLM's worker there runs the encoder alone
        # and never reads its encoder cache (no start_load_caches).
        if self.config.reads_pool and self.loads.dispatch(
            request.request_id, key, copy=self.config.is_consumer
        ):
            return
        self.loads.scheduled(request.request_id, key)
        if self._ready(key):
            return
        if self.config.reads_pool and self.view.synced and not self._ask_misses:
            # A miss the view answered (nothing was asked of the daemon): its count rides on
            # the next Step, for the daemon's miss counters (see _step_soon). Where misses are
            # asked (admit's `elsewhere`), the daemon counted it then.
            self._misses += 1
        if self.config.is_producer:
            spec = self._save_spec(feature)
            if spec is not None:
                self.saves.plan(key, spec)

    def build_connector_meta(self, scheduled_nothing: bool = False) -> ECDaemonConnectorMetadata:
        """The step's metadata; `scheduled_nothing`: the step runs no request (then, if requests
        are held back, it first waits a little for the pool to change: see `_idle`)."""
        self._answers_taken = False  # the next pass takes them anew
        self._take_answers()
        self._unlock_done()
        if self.view.synced:
            self._step_soon("flush", self.loads.take_wanted(), self.saves.take_planned())
        else:  # the daemon is away: waiting requests encode, and this step saves nothing
            self.loads.give_up()
            self.saves.drop_planned()
        saves, cancelled = self.saves.take_orders()
        meta = ECDaemonConnectorMetadata(
            pool=self.client.pool_info(self.config.pool) if self.client else None,
            saves=saves,
            loads=self.loads.take_step(),
            save_intents=self.saves.intents(),
            cancelled=cancelled,
        )
        held, self._held = self._held, False
        empty_before, self._empty_before = self._empty_before, scheduled_nothing
        if held and scheduled_nothing and empty_before:
            self._idle()
        return meta

    def _idle(self) -> None:
        """A step with nothing to run, after one with nothing either, while requests are held
        back for others' work (entries PENDING, or `ecd_wait_ms`): rather than let vLLM step
        again at once (hundreds of empty steps a second, taking the CPU from the very encode
        waited for), wait for the pool's view to change, up to `ecd_idle_wait_ms`. Not while
        anything of this side's own is in flight (answers to read, copies to hear of, ops owed
        again): those want the next step."""
        if self.loads.busy() or self.saves.busy() or self._asked or not self.config.idle_wait_s:
            return
        self.idle_waits += 1
        self.view.wait_change(self._changes_seen, self.config.idle_wait_s)

    def take_unavailable_requests(self) -> set[str]:
        self._take_answers()
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def update_connector_output(self, output: ECConnectorOutput) -> None:
        meta = output.ec_connector_worker_meta
        if not isinstance(meta, ECDaemonWorkerMetadata):
            return
        self._take_answers()
        self.saves.report(meta.saved, meta.failed_saves)
        for transfer_id, rank in meta.loaded:
            self.loads.report(transfer_id, rank)
        self._unlock_done()  # every loading rank reported them: the copies have landed
        if self.view.synced:  # commit what landed at once: a hit next step
            self._step_soon("report")

    def update_state_after_free(self, request: Request, index: int) -> None:
        self.loads.drop_holder(request.request_id, request.mm_features[index].identifier)
        self._unlock_done()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.loads.forget(request.request_id)
        self._unlock_done()
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while this side has work for the scheduler thread: copies
        the workers have not reported yet, pins and allocations asked whose answers are still
        to be read (they order the loads and saves of a step to come), and what is owed again
        (an op whose Step did not reach the daemon, a lease pin to release). Not for what is
        merely on its way to the daemon (commits, releases, hits): Outbox's thread delivers it
        and hears its answer alone, and a step kept for it would cost the engine a whole empty
        iteration. An op whose Step fails after the engine went idle is owed again and goes with
        the engine's next step. Not while the daemon is away either: nothing could be sent, and
        an idle engine would spin; whatever is owed goes with the first step after it is back.

        vLLM asks this only once the engine has no request left (Scheduler.has_requests asks
        the connectors last), as it may go idle: then the hits and misses owed go within
        IDLE_ANSWERED_S (one wake of Outbox's thread), not ANSWERED_LINGER_S later, so that the
        daemon counts an engine's last requests as they end, and an engine stopped right after
        owes none."""
        self._take_answers()  # ops owed again are in the books from here on
        busy = self.loads.busy() or self.saves.busy() or self._asked
        if self.view.synced and not busy:
            outbox = self._reached().outbox
            self._hand_over_answered(outbox)
            outbox.send_answered(self.config.pool, IDLE_ANSWERED_S)
        return self.view.synced and bool(busy)

    def shutdown(self) -> None:
        """vLLM's Scheduler.shutdown calls this (the engine core's shutdown, on SIGTERM too, after
        its executor's). Everything owed goes first, and is waited for: the commits of saves
        whose copies landed, the releases of what the workers are done with, and the hits and
        misses answered here (the daemon's counters and LRU order), within CALL_TIMEOUT_S (a
        warning says what did not go). Then the session closes: the daemon aborts our other
        PENDING entries and releases our lease pins; our lock pins go with the pool file's
        descriptor. A private pool (the default, per-run name) cannot be found by anyone else:
        drop it. From now on nothing is promised: no pin survives the session."""
        with self._connecting:  # a late connect either finished or will not start
            if self._closed.is_set():
                return
            self._closed.set()
        client = self.client
        if client is None:
            return  # the daemon was never reached
        self._take_answers()
        if self.view.synced:
            self._step_soon("shutdown")
        self._hand_over_answered(client.outbox)  # if the view was not synced
        try:
            client.flush(CALL_TIMEOUT_S)
        except (EcdError, TimeoutError) as error:
            log.warning(
                "ecd: what this engine owed pool %s (commits, releases, hit and miss counts) "
                "did not all reach the daemon at shutdown: %s",
                self.config.pool,
                error,
            )
        self.view.close()
        if self._slot_pins is not None:
            self._slot_pins.close()
        if self.config.pool_is_private:
            with contextlib.suppress(EcdError):
                client.drop_pool(self.config.pool, force=True)
        client.close()

    # ---- Steps -----------------------------------------------------------------------------------

    def _step_soon(
        self,
        why: str,
        acquires: Sequence[str] = (),
        allocates: dict[str, TensorSpec] | None = None,
    ) -> None:
        """One Step from Outbox's thread, if anything is owed or asked: what the books owe now
        (releases, commits of landed saves, aborts of failed ones, each with what its answer
        does) and the hits and misses answered here since the last one, then what is asked, its
        answer taken by `_take_answers`. All of it is handed over in one call: each call into
        the outbox may wake its thread, a cost on the scheduler thread. With only hits and
        misses, no Step: they are handed over to ride on a later one."""
        outbox = self._reached().outbox
        releases, commits, aborts = self._ops()
        if not (releases or commits or aborts or acquires or allocates):
            self._hand_over_answered(outbox)
            return
        answered = Answered(self._misses, self._hits)
        self._hits, self._misses = [], 0
        asked = Asked(self._generation, list(acquires), allocates or {})
        items = [AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in asked.allocates.items()]
        self.rpcs[why] += 1
        future = outbox.step_soon(
            self.config.pool,
            asked.acquires,
            items,
            releases=releases,
            commits=commits,
            aborts=aborts,
            answered=answered,
        )
        if asked.acquires or asked.allocates:  # an answer to read; ops hear their own
            self._asked.append((future, asked))

    def _ops(self) -> tuple[list[DeferredOp], list[DeferredOp], list[DeferredOp]]:
        """What the books owe, as ops (no longer owed there): releases of lease pins, commits
        of landed saves, aborts of failed ones; each op's answer is heard on Outbox's thread."""
        generation = self._generation
        releases = [
            DeferredOp(functools.partial(self._released, generation, lease_id), lease_id=lease_id)
            for lease_id in self.loads.take_releases()
        ]
        commits = [
            DeferredOp(
                functools.partial(self._committed, generation, key, allocation),
                key=key.encode(),
                allocation=allocation,
            )
            for key, allocation in self.saves.take_landed()
        ]
        aborts = [
            DeferredOp(functools.partial(self._aborted, generation, key), key=key.encode())
            for key in self.saves.take_failed()
        ]
        return releases, commits, aborts

    def _hand_over_answered(self, outbox: Outbox) -> None:
        """The lock-pin hits (the daemon's hit counters and LRU order) and the misses the view
        answered, owed to ride on the pool's next Step (or to go alone once it is quiet)."""
        if self._hits:
            hits, self._hits = self._hits, []
            outbox.hits(self.config.pool, hits)
        if self._misses:
            misses, self._misses = self._misses, 0
            outbox.misses(self.config.pool, misses)

    def _take_answers(self) -> None:
        """Take what came back since the last call, in the order it came: ops owed again,
        then the answers to what was asked, in the order asked (each one's answer is applied
        before anything reads what it changes)."""
        self._check_generation()
        while self._from_outbox:
            generation, change = self._from_outbox.popleft()
            if generation in (None, self._generation):  # else void with its session or file
                change()
        while self._asked and self._asked[0][0].done():
            future, asked = self._asked.popleft()
            try:
                result = future.result()
            except EcdError as error:
                # Asked things go without: the requests encode, the outputs are not saved.
                log.warning("ecd Step failed, the cache is skipped this step: %s", error)
                self.loads.give_up(asked.acquires)
                self.saves.give_up(asked.allocates)
                continue
            if asked.generation != self._generation:
                self._void_answer(result)
                continue
            if not self._of_our_file(result):
                log.warning(
                    "ecd pool %s was recreated while a Step was answered: its pins and entries "
                    "are void here, the cache is skipped this step",
                    self.config.pool,
                )
                self._void_answer(result)
                self.loads.give_up(asked.acquires)
                self.saves.give_up(asked.allocates)
                continue
            for key in self.loads.acquired(asked.acquires, result.acquires, self._loadable):
                self.view.discard(key.encode())  # found gone: gone from the view too
            self.saves.allocated(list(asked.allocates), result.allocates)

    def _of_our_file(self, result: StepResult) -> bool:
        """Whether the extents of an answer are of the file this generation's workers map. The
        client learns of a recreated pool only when it reopens it, so an answer of the same
        generation may still come from the new file (the pool recreated before the daemon read
        the Step). The daemon says which file it answered from (StepResult.pool_uuid). Where it
        could not, the answer came from ours if the path still holds the file our lock pins
        opened: a pool's file, once replaced, never comes back. Without lock pins there is
        nothing to check against (the answer is taken)."""
        if not (result.acquires or result.allocates) or self._slot_pins is None:
            return True
        if result.pool_uuid:  # no stat of the path on the scheduler thread (tens of us)
            return result.pool_uuid == self._slot_pins.pool_uuid
        return self._slot_pins.still_at_path()

    def _void_answer(self, result: StepResult) -> None:
        """An answer from a daemon that restarted meanwhile, or to a recreated pool: what the
        Step took in the new session (pins, PENDING entries) nobody here will use: it is owed
        back, with the next Step."""
        self.loads.requeue_releases(r.lease_id for r in result.acquires if r.status is Status.HIT)
        self.saves.requeue(
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
                lambda: self.loads.requeue_releases([lease_id]),
            )
        else:
            self._log_refused("release", lease_id, answer)

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
                lambda: self.saves.requeue(landed=[(key, allocation)]),
            )
        elif answer.status.is_error:
            log.warning("ecd refused to commit %s: %s", key, answer.message)
        else:
            self.view.add(key.encode())  # thread-safe: READY for the very next step
        self._from_outbox.append((None, functools.partial(self.saves.answered, key)))

    def _aborted(
        self, generation: tuple[str, str], key: str, answer: ItemResult | EcdError
    ) -> None:
        if isinstance(answer, EcdError):
            self._not_delivered(
                generation, "abort", key, answer, lambda: self.saves.requeue(failed=[key])
            )
        else:
            self._log_refused("abort", key, answer)
        self._from_outbox.append((None, functools.partial(self.saves.answered, key)))

    def _not_delivered(
        self,
        generation: tuple[str, str],
        what: str,
        item: object,
        error: EcdError,
        owe_again: Callable[[], None],
    ) -> None:
        """An op's Step failed: one that did not reach the daemon is owed again (in the same
        generation: `_take_answers`); one the daemon refused as a whole is dropped, said."""
        if error.code in NOT_DELIVERED:
            self._from_outbox.append((generation, owe_again))
        else:
            log.warning("ecd could not %s %s: %s", what, item, error)

    @staticmethod
    def _log_refused(what: str, item: object, answer: ItemResult | LeaseResult) -> None:
        if answer.status.is_error and answer.status is not Status.NOT_FOUND:
            log.warning("ecd refused to %s %s: %s", what, item, answer.message)

    # ---- lock pins -----------------------------------------------------------------------------

    def _lock_pin(self, key: str) -> Pin | LockMissed | None:
        """A lock pin on `key` if the view knows it READY here and its slot (None otherwise:
        the book takes the Acquire path); LOCK_MISSED if the slot no longer holds it, or holds
        an output of a shape this engine cannot load."""
        pins = self._slot_pins
        raw = key.encode()
        slot = self.view.slot(raw)
        if pins is None or slot is None:
            return None
        pinned = pins.pin(slot, raw)
        if pinned is not None:
            if self._loadable(pinned.spec):
                self._hits.append(raw)
                return Pin(pinned.extents, pinned.spec, slot=slot)
            pins.unpin(slot)
        self.view.discard(raw)  # gone (or not ours): it is encoded, and saved again
        return LOCK_MISSED

    def _read_ahead(self, key: bytes, slot: int) -> None:
        """On the view's thread, as an entry's commit is heard of: its record read and checked
        now, so that a lock pin on it in `ensure_cache_available` need not parse it."""
        pins = self._slot_pins
        if pins is not None:
            pins.read_ahead(slot, key)

    def _unlock_done(self) -> None:
        """Unlock the lock pins the book is done with (every copy under them landed)."""
        unlocks = self.loads.take_unlocks()
        if unlocks and self._slot_pins is not None:
            self._slot_pins.unpin_many(unlocks)

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

    # ---- helpers --------------------------------------------------------------------------------

    def _reached(self) -> SchedulerClient:
        """The client, where the view is synced (so the daemon was reached)."""
        if self.client is None:
            raise RuntimeError("ecd was never reached: nothing may be sent")
        return self.client

    def _current_generation(self, client: SchedulerClient) -> tuple[str, str]:
        """Our lease pins and PENDING entries live as long as our session and the pool file,
        our lock pins as long as the pool file: a new session (daemon restarted, or our lease
        ran out) voids the former, a new pool UUID (the pool recreated) voids all."""
        return client.session_id, client.pool_info(self.config.pool).pool_uuid

    def _check_generation(self) -> None:
        if self.client is None:
            return
        generation = self._current_generation(self.client)
        if generation == self._generation:
            return
        new_file = generation[1] != self._generation[1]
        self._generation = generation
        failed = self.loads.void(locks_too=new_file)
        self.saves.void()
        if new_file:  # the workers remap the new file: the old one's locks pin nothing of use
            self._hits.clear()
            if self._slot_pins is not None:
                self._slot_pins.close()
            self._slot_pins = self._open_slot_pins(self.client)
        self._unavailable |= failed
        log.warning(
            "ecd %s %s is new (%s): %s and unfinished saves are void; %d request(s) with loads "
            "in flight under them fail",
            "pool" if new_file else "session with pool",
            self.config.pool,
            "pool recreated" if new_file else "daemon restart, or lease lost",
            "every pin" if new_file else "lease pins (lock pins hold)",
            len(failed),
        )

    def _ready(self, key: str) -> bool:
        return self.view.has(key.encode())

    def _pending(self, key: str) -> bool:
        return self.view.pending(key.encode())

    def _loadable(self, spec: TensorSpec) -> bool:
        """Encoder outputs are (rows, width) in the model dtype, a row as wide as a block (the
        model's width); anything else is not ours. The daemon reads a value of any width from
        its store (it does not know the model's): another model's, under a namespace that
        names this model, is never loaded here."""
        return (
            len(spec.shape) == 2
            and spec.dtype == self.config.dtype
            and spec.nbytes == spec.shape[0] * self.config.block_size_bytes
        )

    def _save_spec(self, feature: MultiModalFeatureSpec) -> TensorSpec | None:
        rows = feature.mm_position.get_num_embeds()
        spec = self._save_specs.get((feature.modality, rows))
        if spec is not None:  # one per modality and size: images of one size share it
            return spec
        try:
            width = get_encoder_output_width(self._vllm_config, feature.modality)
        except ValueError as error:
            if feature.modality not in self._no_width:
                self._no_width.add(feature.modality)
                log.warning("not saving %s outputs: %s", feature.modality, error)
            return None
        shape = (rows, width)
        spec = TensorSpec(shape, self.config.dtype, tensor_nbytes(shape, self.config.dtype))
        if len(self._save_specs) < MAX_SAVE_SPECS:
            self._save_specs[(feature.modality, rows)] = spec
        return spec
