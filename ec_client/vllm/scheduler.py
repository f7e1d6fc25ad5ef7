"""SchedulerSide: the connector in vLLM's scheduler process, the only part that calls the daemon.

It answers vLLM's scheduler calls from its books (loads.py, saves.py), touched on the scheduler
thread alone; what it owes the daemon and asks of it goes in background Steps (steps.py), over
its connection (connection.py), so that the scheduler thread waits on no round trip in steady
state (docs/design.md §12). Per step:

    ensure_cache_available   from local state, no round trip: a needed item READY in this
        daemon's pool whose slot the ready view knows is pinned right there, by a lock on its
        slot in the pool file (a lock pin: docs/design.md §5, ec_protocol/pool/slot_locks.py), and
        its request admitted in the same call; the hit goes to the daemon with the next Step (its
        counters and LRU order). The items a lock pin cannot take are pinned in the background
        and their request waits one step (see loads.py): those committed a moment ago whose
        slot the view has not heard yet, and an item the view lacks where misses are asked (in
        an engine that only consumes, and in a pool shared through the daemon's store:
        `Connection.ask_misses`): its Acquire is a hit the view had not heard of yet, or a
        remote hit, PENDING while another engine (here, or on another node) encodes it (then
        held as for an item PENDING in the view), or a miss (then encoded): single flight
        across engines and nodes.
    has_cache_item, update_state_after_alloc   bookkeeping.
    build_connector_meta     one background Step (step_soon): releases owed, aborts of failed
        copies, pins for the wanted items, entries for this step's new outputs. The metadata
        orders the workers' copies: loads out of pins held, saves into entries allocated by an
        earlier step's Step (this step's outputs are save *intents*: the worker keeps them until
        their order comes, see saves.py).
    update_connector_output  the workers' report: landed saves are committed at once, in a
        background Step (step_soon), so a just-saved item can be a hit at the next step; a lock
        pin whose copies every loading rank reported is unlocked at once.
    request_finished         a producer's answer waits for the Allocate of the request's
        outputs if it has not been answered yet (rarely: `_allocated_before_answer`), so that
        the engine the answer sends the request on to finds the entry PENDING.

The roles. An engine that reads the pool (ConnectorConfig.reads_pool: a consumer, or an
encoder-only producer) holds a request back while an item it needs is being written into the
pool (the view's `pending`: another engine is encoding it, or encoded it and its save is not
committed yet) until that entry is committed (then it loads it: single flight, docs/design.md
§4) or aborted (then it encodes it); the daemon bounds how long that can take (its producer's
death ends it at once, its --pending-timeout in any case). Not for its own save, though
(SaveBook.saving): vLLM reads its own encoder cache, which has that output, before it asks the
connector. In the disaggregated flow the request reaches this engine as soon as the encoder
engine answered, a step or two before that engine commits, and sometimes before this process
heard of the entry at all (the Watch event is on its way): so an engine that only consumes asks
the daemon about an item its view lacks instead of encoding it at once.

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
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
    get_encoder_output_width,
)

from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.connection import (
    CALL_TIMEOUT_S,
    Connection,
    PoolRefused,
    PoolView,
    SchedulerClient,
    connect_client,
)
from ec_client.vllm.loads import LOCK_MISSED, LoadBook, LockMissed, Pin
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm.saves import SaveBook
from ec_client.vllm.steps import Steps
from ec_protocol.errors import EcdError
from ec_protocol.pool.layout import tensor_nbytes
from ec_protocol.types import TensorSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

# The names callers import from here (the connector, the tests), wherever they are defined.
__all__ = ["PoolRefused", "PoolView", "SchedulerSide", "connect_client"]

log = logging.getLogger("ec_client.vllm")

# How soon the hits and misses owed go once vLLM finds the engine without requests, rather than
# ANSWERED_LINGER_S later. Not at once: a burst that follows at once (vLLM steps as soon as a
# request arrives) would meet a Step of their own, where a Step of its own carries them free.
IDLE_ANSWERED_S = 0.05
# The most output sizes whose spec is kept (`SaveSpecs`): images come in few sizes, but nothing
# bounds how many.
MAX_SAVE_SPECS = 4096


@dataclass(slots=True)
class SchedulingPass:
    """What one scheduling pass (vLLM's ensure_cache_available calls, ended by
    build_connector_meta) has done so far."""

    # Whether it took the answers yet. Once a pass is enough: its later requests would find
    # nothing new, at a look (~1 us) each; what comes back meanwhile is taken by
    # build_connector_meta, which ends the pass, before the step's metadata.
    answers_taken: bool = False
    # Whether it held a request back, and the view's change count when it began: a step that
    # scheduled nothing waits for it to move (`SchedulerSide._idle`).
    held: bool = False
    changes_seen: int = 0
    # Whether the step before scheduled nothing either: only then may a step wait. Under
    # vLLM's async scheduling the step before may still be running; if it ran requests,
    # their outputs are handled only after this step is scheduled, and must not wait.
    empty_before: bool = False


class SaveSpecs:
    """The specs of outputs to save, by (modality, rows): a spec is never changed, so the
    outputs of one size share one (built once, not per output on the scheduler thread)."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        self._vllm_config = vllm_config
        self._dtype = config.dtype
        self._specs: dict[tuple[str, int], TensorSpec] = {}
        self._no_width: set[str] = set()  # modalities already warned about

    def of(self, feature: MultiModalFeatureSpec) -> TensorSpec | None:
        """The spec of `feature`'s encoder output; None (said once) where its width is unknown."""
        rows = feature.mm_position.get_num_embeds()
        spec = self._specs.get((feature.modality, rows))
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
        spec = TensorSpec(shape, self._dtype, tensor_nbytes(shape, self._dtype))
        if len(self._specs) < MAX_SAVE_SPECS:
            self._specs[(feature.modality, rows)] = spec
        return spec


class SchedulerSide:
    """vLLM's scheduler calls of the connector (the module docstring), over `connection`."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: ConnectorConfig,
        connect: Callable[[], SchedulerClient] | None = None,
    ) -> None:
        """connect: opens a session on the daemon (default: `connect_client(config)`); an
        EcdError UNAVAILABLE from it is tried again in the background."""
        self.config = config
        # The books, touched on the scheduler thread alone.
        self.loads = LoadBook(config.load_reports)
        self.saves = SaveBook()
        self._save_specs = SaveSpecs(vllm_config, config)
        self._unavailable: set[str] = set()  # requests whose loads failed, for vLLM to take
        # The daemon, and the Steps that carry what the books owe and ask.
        self.connection = Connection(config, connect)
        self._steps = Steps(config, self.connection, self.loads, self.saves)
        # The engine's steps.
        self._pass = SchedulingPass()
        self.idle_waits = 0  # steps that waited for the view to change (for tests and the bench)
        self.answer_waits = 0  # answers that waited for their Allocate (_allocated_before_answer)
        self.connection.start()

    @property
    def client(self) -> SchedulerClient | None:
        """The client, once the daemon was first reached."""
        return self.connection.client

    @property
    def view(self) -> PoolView:
        """The pool's view (`NothingReady` until the daemon was first reached)."""
        return self.connection.view

    @property
    def rpcs(self) -> Counter[str]:
        """Steps asked, by why (for `python -m ...bench`)."""
        return self._steps.rpcs

    # ---- vLLM's scheduler calls, in step order -------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if not self.config.reads_pool or not request.mm_features:
            return True
        step = self._pass
        if not step.answers_taken:
            step.answers_taken = True
            step.changes_seen = self.connection.view.changes  # before anything is decided
            self._take_answers()
        view = self.connection.view
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        # ecd_wait_ms is a consumer's: an encoder engine is where new images are first encoded.
        wait_s = self.config.wait_s if view.synced and self.config.is_consumer else 0.0
        admitted = self.loads.admit(
            request.request_id,
            needed,
            self._ready,
            time.monotonic(),
            wait_s,
            pending=self._pending,
            lock=self._lock_pin,
            elsewhere=self.connection.ask_misses and view.synced,
            saving=self.saves.saving,
        )
        step.held = step.held or not admitted
        return admitted

    def has_cache_item(self, identifier: str) -> bool:
        return (
            self.config.reads_pool
            and not self.connection.closed.is_set()
            and self.loads.pinned(identifier)
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
        connection = self.connection
        if self.config.reads_pool and connection.view.synced and not connection.ask_misses:
            # A miss the view answered (nothing was asked of the daemon): its count rides on
            # the next Step, for the daemon's miss counters (see Steps.step_soon). Where misses are
            # asked (admit's `elsewhere`), the daemon counted it then.
            self._steps.misses += 1
        if self.config.is_producer:
            spec = self._save_specs.of(feature)
            if spec is not None:
                self.saves.plan(key, spec)

    def build_connector_meta(self, scheduled_nothing: bool = False) -> ECDaemonConnectorMetadata:
        """The step's metadata; `scheduled_nothing`: the step runs no request (then, if requests
        are held back, it first waits a little for the pool to change: see `_idle`)."""
        step = self._pass
        step.answers_taken = False  # the next pass takes them anew
        self._take_answers()
        self._unlock_done()
        if self.connection.view.synced:
            self._steps.step_soon("flush", self.loads.take_wanted(), self.saves.take_planned())
        else:  # the daemon is away: waiting requests encode, and this step saves nothing
            self.loads.give_up()
            self.saves.drop_planned()
        saves, cancelled = self.saves.take_orders()
        client = self.connection.client
        meta = ECDaemonConnectorMetadata(
            pool=client.pool_info(self.config.pool) if client else None,
            saves=saves,
            loads=self.loads.take_step(),
            save_intents=self.saves.intents(),
            cancelled=cancelled,
        )
        held, step.held = step.held, False
        empty_before, step.empty_before = step.empty_before, scheduled_nothing
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
        if (
            self.loads.busy()
            or self.saves.busy()
            or self._steps.asked
            or not self.config.idle_wait_s
        ):
            return
        self.idle_waits += 1
        self.connection.view.wait_change(self._pass.changes_seen, self.config.idle_wait_s)

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
        if self.connection.view.synced:  # commit what landed at once: a hit next step
            self._steps.step_soon("report")

    def update_state_after_free(self, request: Request, index: int) -> None:
        self.loads.drop_holder(request.request_id, request.mm_features[index].identifier)
        self._unlock_done()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self.config.is_producer:
            self._allocated_before_answer(request)
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
        busy = self.loads.busy() or self.saves.busy() or self._steps.asked
        synced = self.connection.view.synced
        if synced and not busy:
            outbox = self.connection.reached().outbox
            self._steps.hand_over_answered(outbox)
            outbox.send_answered(self.config.pool, IDLE_ANSWERED_S)
        return synced and bool(busy)

    def shutdown(self) -> None:
        """vLLM's Scheduler.shutdown calls this (the engine core's shutdown, on SIGTERM too, after
        its executor's). Everything owed goes first, and is waited for: the commits of saves
        whose copies landed, the releases of what the workers are done with, and the hits and
        misses answered here (the daemon's counters and LRU order), within CALL_TIMEOUT_S (a
        warning says what did not go). Then the session closes: the daemon aborts our other
        PENDING entries and releases our lease pins; our lock pins go with the pool file's
        descriptor. A private pool (the default, per-run name) cannot be found by anyone else:
        drop it. From now on nothing is promised: no pin survives the session."""
        if not self.connection.close_once():
            return
        client = self.connection.client
        if client is None:
            return  # the daemon was never reached
        self._take_answers()
        if self.connection.view.synced:
            self._steps.step_soon("shutdown")
        self._steps.hand_over_answered(client.outbox)  # if the view was not synced
        try:
            client.flush(CALL_TIMEOUT_S)
        except (EcdError, TimeoutError) as error:
            log.warning(
                "ecd: what this engine owed pool %s (commits, releases, hit and miss counts) "
                "did not all reach the daemon at shutdown: %s",
                self.config.pool,
                error,
            )
        self.connection.close_pool()
        if self.config.pool_is_private:
            with contextlib.suppress(EcdError):
                client.drop_pool(self.config.pool, force=True)
        client.close()

    def _allocated_before_answer(self, request: Request) -> None:
        """vLLM answers a finished request once this step's outputs are handled (after
        request_finished), and in the disaggregated flow that answer sends the request on to
        the prefill/decode engine, which asks the daemon about its image and encodes it if
        the daemon has no entry. So a producer's answer waits, here, for the Allocate of any
        of the request's outputs not answered yet, up to `ecd_connect_timeout_s` after it was
        sent (Steps.wait_allocated: a step's requests wait that long in all): the next
        engine then finds the entry PENDING (held for its commit), never missing. That
        Allocate went out before the forward pass (build_connector_meta), so it has usually
        been answered (a round trip of a fraction of a millisecond against a pass of
        milliseconds) and nothing waits; on a loaded machine Outbox's thread can lose that
        race to the answer, and without this wait the image was encoded twice (`answer_waits`
        counts the waits)."""
        keys = {feature.identifier for feature in request.mm_features}
        if keys and self._steps.wait_allocated(keys, self.config.connect_timeout_s):
            self.answer_waits += 1
            self._take_answers()

    # ---- lock pins -----------------------------------------------------------------------------

    def _lock_pin(self, key: str) -> Pin | LockMissed | None:
        """A lock pin on `key` if the view knows it READY here and its slot (None otherwise:
        the book takes the Acquire path); LOCK_MISSED if the slot no longer holds it, or holds
        an output of a shape this engine cannot load."""
        connection = self.connection
        pins = connection.slot_pins
        raw = key.encode()
        slot = connection.view.slot(raw)
        if pins is None or slot is None:
            return None
        pinned = pins.pin(slot, raw)
        if pinned is not None:
            if self.config.loadable(pinned.spec):
                self._steps.hits.append(raw)
                return Pin(pinned.extents, pinned.spec, slot=slot)
            pins.unpin(slot)
        connection.view.discard(raw)  # gone (or not ours): it is encoded, and saved again
        return LOCK_MISSED

    def _unlock_done(self) -> None:
        """Unlock the lock pins the book is done with (every copy under them landed)."""
        unlocks = self.loads.take_unlocks()
        pins = self.connection.slot_pins
        if unlocks and pins is not None:
            pins.unpin_many(unlocks)

    # ---- helpers --------------------------------------------------------------------------------

    def _take_answers(self) -> None:
        """Move to the current generation, then take what came back since the last call."""
        self._check_generation()
        self._steps.take_answers()

    def _check_generation(self) -> None:
        """A new session voids the books' lease pins and PENDING entries, a new pool file every
        pin (connection.py); the requests with loads in flight under them fail."""
        new_file = self.connection.next_generation()
        if new_file is None:
            return
        failed = self.loads.void(locks_too=new_file)
        self.saves.void()
        if new_file:  # the old file's lock pins are gone, and their hits with them
            self._steps.hits.clear()
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
        return self.connection.view.has(key.encode())

    def _pending(self, key: str) -> bool:
        return self.connection.view.pending(key.encode())
