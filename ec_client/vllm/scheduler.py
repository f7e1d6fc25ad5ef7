"""SchedulerSide: the connector in vLLM's scheduler process, the only part that calls the daemon.

The scheduler thread waits on no round trip in steady state (docs/design.md §12): everything owed
to the daemon and asked of it goes in a Step (one RPC: Release, Commit, Abort, Acquire, Allocate,
in that order) sent from the client's background thread, and its answer is taken on the scheduler
thread at its next call into the connector, before anything depends on it. Per step:

    ensure_cache_available   from local state (the ready view, the pins held): no round trip,
        except that a request with cached items nobody pinned yet may have them pinned at once,
        by a synchronous Step: the first such request of a step always, later ones while the
        step's waiting stays within a share of the step's time (`ecd_pins`, see pins.py), so a
        lone request is never held back; the others have their items pinned in the background
        and wait one step (see loads.py). Items only a peer daemon holds (the ready view counts
        them: docs/design.md §13) are never pinned at once: their Acquire pulls them from the
        peer and waits for the transfer, so they are pinned in the background, and their request
        waits a step.
    has_cache_item, update_state_after_alloc   bookkeeping.
    build_connector_meta     one background Step: releases owed, aborts of failed copies, pins
        for the wanted items, entries for this step's new outputs. The metadata orders the
        workers' copies: loads out of pins held, saves into entries allocated by an earlier
        step's Step (this step's outputs are save *intents*: the worker keeps them until their
        order comes, see saves.py).
    update_connector_output  the workers' report: landed saves are committed at once, in a
        background Step, so a just-saved item can be a hit at the next step.

Releases and aborts come before the Allocate so their space is free for it; Acquire comes before
Allocate so a step's allocations can never evict an entry about to be loaded (the eviction
hazard ECCPUConnector has within a step).

The daemon is an optimisation, never a dependency of a request: while it is unreachable (the
Watch stream is down) the connector sends nothing, answers every has_cache_item with False and
saves nothing, so requests are encoded as if there were no cache. That holds from the start too:
a daemon not reachable when the engine starts is tried again in the background (`NothingReady`
stands for the pool's view until then).

A consumer holds a request back while an item it needs is being written into the pool (the
view's `pending`: another engine encoded it, its save is not committed yet), up to
`ecd_pending_wait_ms`, then loads it: in the disaggregated flow the request reaches this engine
as soon as the encoder engine answered, a step or two before that engine commits.

When our session is new (the daemon restarted, or our lease ran out) or the pool was recreated,
everything held in the old one is void: its pins and PENDING entries are gone, and requests
whose loads were in flight fail (take_unavailable_requests) rather than risk bytes that may have
been overwritten.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
    get_encoder_output_width,
)

from ec_client.client import Client
from ec_client.errors import EcdError
from ec_client.layout import tensor_nbytes
from ec_client.ready_view import ReadyView
from ec_client.types import (
    AcquireResult,
    AllocateItem,
    ItemResult,
    LeaseResult,
    Role,
    Status,
    StepResult,
    TensorSpec,
)
from ec_client.vllm.config import ConnectorConfig
from ec_client.vllm.loads import LoadBook
from ec_client.vllm.metadata import ECDaemonConnectorMetadata, ECDaemonWorkerMetadata
from ec_client.vllm.pins import PinPolicy
from ec_client.vllm.saves import SaveBook

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("ec_client.vllm")

CALL_TIMEOUT_S = 10.0
# While the daemon was never reached, how often the connector tries again.
CONNECT_RETRY_FIRST_S = 0.5
CONNECT_RETRY_MAX_S = 5.0


class PoolRefused(RuntimeError):
    """The daemon will not give this engine the pool: another model, dtype, embedding width,
    vLLM version or capacity already owns that name."""


@dataclass
class Sent:
    """What one background Step carried, to read its answer against; `generation` is the one
    it was sent in (an answer from another is void, see `_absorb`)."""

    generation: tuple[str, str]
    releases: list[int] = field(default_factory=list)
    commits: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    acquires: list[str] = field(default_factory=list)
    allocates: dict[str, TensorSpec] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.releases or self.commits or self.aborts or self.acquires or self.allocates)


class NothingReady:
    """The view of the pool before the daemon was first reached: nothing READY, never synced,
    so the connector sends nothing and every input is encoded."""

    synced = False

    def has(self, key: bytes) -> bool:
        return False

    has_local = pending = has

    def add(self, key: bytes) -> None:
        pass

    discard = add

    def close(self) -> None:
        pass


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        self._vllm_config = vllm_config
        self.config = config
        self.loads = LoadBook(config.load_reports)
        self.saves = SaveBook()
        self.rpcs: Counter[str] = Counter()  # Steps sent, by where (for `python -m ...bench`)
        self.pins = PinPolicy(config.pins, config.pin_share, time.perf_counter)
        self._closed = threading.Event()
        self._connecting = threading.Lock()  # a late connect against shutdown
        self._sent: deque[tuple[Future[StepResult], Sent]] = deque()
        self._unavailable: set[str] = set()
        self._no_width: set[str] = set()  # modalities already warned about
        # Set once, when the daemon is first reached: the view last, so that a synced view
        # always means a client and a generation to go with it.
        self.client: Client | None = None
        self._generation = ("", "")
        self.view: ReadyView | NothingReady = NothingReady()
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
        role = {(True, True): Role.BOTH, (True, False): Role.PRODUCER}.get(
            (c.is_producer, c.is_consumer), Role.CONSUMER
        )
        client = Client(
            c.address,
            name=c.client_name,
            role=role,
            connect_timeout_s=c.connect_timeout_s,
            call_timeout_s=CALL_TIMEOUT_S,
            wait_for_daemon_s=c.connect_timeout_s,  # it may be starting alongside
        )
        try:
            client.open_pool(c.pool, c.block_size_bytes, c.capacity_bytes, c.compat_key)
        except EcdError as error:
            client.close()
            if error.code is grpc.StatusCode.FAILED_PRECONDITION:
                raise PoolRefused(
                    f"ecd at {client.target} refused pool {c.pool!r} to this engine: "
                    f"{error.message}. Engines share a pool only with the same model, dtype, "
                    "embedding width, vLLM version and ec_cpu_bytes; give this engine another "
                    "ecd_pool."
                ) from None
            raise
        self.client = client
        self._generation = self._current_generation(client)
        view = client.view(c.pool)  # reattaches by reopening the pool
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
        if not self.config.is_consumer or not request.mm_features:
            return True
        self._absorb()
        needed = [
            f.identifier
            for f in request.mm_features
            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        wait_s = self.config.wait_s if self.view.synced else 0.0
        admitted = self._admit(request.request_id, needed, wait_s)
        if admitted or not self._may_pin_now():
            return admitted
        # Only items READY in this daemon's pool: an item only a peer daemon holds is pulled
        # by the Acquire that pins it, which waits for the transfer: that is for the background.
        wanted = [
            k for k in self.loads.wanted(request.request_id) if self.view.has_local(k.encode())
        ]
        if not wanted:
            return False  # held for another reason (waiting for an item not in the pool)
        self._pin_now(wanted)
        return self._admit(request.request_id, needed, wait_s)

    def has_cache_item(self, identifier: str) -> bool:
        return (
            self.config.is_consumer and not self._closed.is_set() and self.loads.pinned(identifier)
        )

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        key = feature.identifier
        if self.config.is_consumer and self.loads.dispatch(request.request_id, key):
            return
        self.loads.scheduled(request.request_id, key)
        if self.config.is_consumer and self.view.synced and not self._ready(key):
            # A miss the view answered (nothing was asked of the daemon): its count rides on
            # the next Step, for the daemon's miss counters.
            self._reached().owed.misses(self.config.pool, 1)
        if self.config.is_producer and not self._ready(key):
            spec = self._save_spec(feature)
            if spec is not None:
                self.saves.plan(key, spec)

    def build_connector_meta(self) -> ECDaemonConnectorMetadata:
        self._absorb()
        self.pins.step_began()
        if self.view.synced:
            self._send_owed(
                "flush", acquires=self.loads.take_wanted(), allocates=self.saves.take_planned()
            )
        else:  # the daemon is away: waiting requests encode, and this step saves nothing
            self.loads.give_up()
            self.saves.drop_planned()
        saves, cancelled = self.saves.take_orders()
        return ECDaemonConnectorMetadata(
            pool=self.client.pool_info(self.config.pool) if self.client else None,
            saves=saves,
            loads=self.loads.take_step(),
            save_intents=self.saves.intents(),
            cancelled=cancelled,
        )

    def take_unavailable_requests(self) -> set[str]:
        self._absorb()
        unavailable, self._unavailable = self._unavailable, set()
        return unavailable

    def update_connector_output(self, output: ECConnectorOutput) -> None:
        meta = output.ec_connector_worker_meta
        if not isinstance(meta, ECDaemonWorkerMetadata):
            return
        self._absorb()
        self.saves.report(meta.saved, meta.failed_saves)
        for transfer_id, rank in meta.loaded:
            self.loads.report(transfer_id, rank)
        if self.view.synced:  # commit what landed at once: a hit for the very next step
            self._send_owed("report")

    def update_state_after_free(self, request: Request, index: int) -> None:
        self.loads.drop_holder(request.request_id, request.mm_features[index].identifier)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.loads.forget(request.request_id)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while something is owed to the daemon, on its way, or not
        yet reported by the workers. Not while the daemon is away: nothing could be sent, and
        an idle engine would spin; whatever is owed goes with the first step after it is
        back."""
        self._absorb()
        return self.view.synced and bool(self.loads.busy() or self.saves.busy() or self._sent)

    def shutdown(self) -> None:
        """Commit the saves whose copies landed and release what the workers are done with,
        then close the session: the daemon aborts our other PENDING entries and releases our
        pins. A private pool (the default, per-run name) cannot be found by anyone else: drop
        it. From now on nothing is promised: no pin survives the session."""
        with self._connecting:  # a late connect either finished or will not start
            if self._closed.is_set():
                return
            self._closed.set()
        client = self.client
        if client is None:
            return  # the daemon was never reached
        self._absorb()
        if self.view.synced:
            self._send_owed("shutdown")
        self.view.close()
        if self.config.pool_is_private:
            with contextlib.suppress(EcdError):
                client.drop_pool(self.config.pool, force=True)
        client.close()  # after the background Steps are answered (within its settle time)

    # ---- Steps -----------------------------------------------------------------------------------

    def _send_owed(
        self,
        why: str,
        acquires: Sequence[str] = (),
        allocates: dict[str, TensorSpec] | None = None,
    ) -> None:
        """One Step with everything owed (releases, commits of landed saves, aborts of failed
        ones) and what is asked."""
        self._send(
            why,
            releases=self.loads.take_releases(),
            commits=self.saves.take_landed(),
            aborts=self.saves.take_failed(),
            acquires=acquires,
            allocates=allocates,
        )

    def _send(
        self,
        why: str,
        releases: Sequence[int] = (),
        commits: Sequence[str] = (),
        aborts: Sequence[str] = (),
        acquires: Sequence[str] = (),
        allocates: dict[str, TensorSpec] | None = None,
    ) -> None:
        """One Step from the background thread, if there is anything to send."""
        sent = Sent(
            self._generation,
            list(releases),
            list(commits),
            list(aborts),
            list(acquires),
            allocates or {},
        )
        if not sent:
            return
        items = [AllocateItem(k, s.shape, s.dtype, s.nbytes) for k, s in sent.allocates.items()]
        pool = self.config.pool
        self.rpcs[why] += 1
        client = self._reached()
        future = client.later(
            lambda: client.step(
                pool,
                releases=sent.releases,
                commits=sent.commits,
                aborts=sent.aborts,
                acquires=sent.acquires,
                allocates=items,
            )
        )
        self._sent.append((future, sent))

    def _absorb(self) -> None:
        """Take the answers of the background Steps that have come, in the order they were
        sent (each one's answer is applied before anything reads what it changes)."""
        self._check_generation()
        while self._sent and self._sent[0][0].done():
            future, sent = self._sent.popleft()
            try:
                result = future.result()
            except EcdError as error:
                self._lost(sent, error)
                continue
            if sent.generation != self._generation:
                self._void_answer(result)
            else:
                self._apply(sent, result)

    def _apply(self, sent: Sent, result: StepResult) -> None:
        for key, answer in zip(sent.commits, result.commits, strict=True):
            if answer.status.is_error:
                log.warning("ecd refused to commit %s: %s", key, answer.message)
            else:
                self.view.add(key.encode())
        self._log_refused("abort", zip(sent.aborts, result.aborts, strict=True))
        self._log_refused("release", zip(sent.releases, result.releases, strict=True))
        self._pinned(sent.acquires, result.acquires)
        self.saves.allocated(list(sent.allocates), result.allocates)

    def _pinned(self, keys: Sequence[str], answers: Sequence[AcquireResult]) -> None:
        """The daemon answered pins of `keys`: the book takes the hits; a key found gone is
        gone from the view too."""
        for key in self.loads.acquired(keys, answers, self._loadable):
            self.view.discard(key.encode())

    def _lost(self, sent: Sent, error: EcdError) -> None:
        """The Step did not reach the daemon: owed things are owed again, asked things go
        without (the requests encode, the outputs are not saved)."""
        log.warning("ecd Step failed, the cache is skipped this step: %s", error)
        if sent.generation == self._generation:
            self.loads.requeue_releases(sent.releases)
            self.saves.requeue(landed=sent.commits, failed=sent.aborts)
        self.loads.give_up(sent.acquires)
        self.saves.give_up(sent.allocates)

    def _void_answer(self, result: StepResult) -> None:
        """An answer from a daemon that restarted meanwhile, or to a recreated pool: what the
        Step took in the new session (pins, PENDING entries) nobody here will use: give it back."""
        leases = [r.lease_id for r in result.acquires if r.status is Status.HIT]
        allocated = [r.key.decode() for r in result.allocates if r.status is Status.ALLOCATED]
        self._send("void", releases=leases, aborts=allocated)

    def _log_refused(
        self, what: str, answers: Iterable[tuple[object, ItemResult | LeaseResult]]
    ) -> None:
        for item, answer in answers:
            if answer.status.is_error and answer.status is not Status.NOT_FOUND:
                log.warning("ecd refused to %s %s: %s", what, item, answer.message)

    # ---- pins at once --------------------------------------------------------------------------

    def _may_pin_now(self) -> bool:
        return self.view.synced and self.pins.may_pin_now()

    def _pin_now(self, keys: list[str]) -> None:
        """Pin a request's cached items by a synchronous Step, so the request is not held back
        a step: a round trip on the scheduler thread (see pins.py)."""
        self.rpcs["pin"] += 1
        started = time.perf_counter()
        try:
            acquired = self._reached().step(self.config.pool, acquires=keys).acquires
        except EcdError as error:
            log.warning("ecd pin failed, the items are encoded: %s", error)
            self.loads.give_up(keys)
            return
        finally:
            self.pins.pinned(time.perf_counter() - started)
        self._check_generation()
        self._pinned(keys, acquired)

    # ---- helpers --------------------------------------------------------------------------------

    def _reached(self) -> Client:
        """The client, where the view is synced (so the daemon was reached)."""
        if self.client is None:
            raise RuntimeError("ecd was never reached: nothing may be sent")
        return self.client

    def _current_generation(self, client: Client) -> tuple[str, str]:
        """Our pins and PENDING entries live as long as our session and the pool file: a new
        session (daemon restarted, or our lease ran out) or a new pool UUID voids them."""
        return client.session_id, client.pool_info(self.config.pool).pool_uuid

    def _check_generation(self) -> None:
        if self.client is None:
            return
        generation = self._current_generation(self.client)
        if generation == self._generation:
            return
        self._generation = generation
        failed = self.loads.void()
        self.saves.void()
        self._unavailable |= failed
        log.warning(
            "ecd session or pool %s is new (daemon restart, lease lost, pool recreated): pins "
            "and unfinished saves are void; %d request(s) with loads in flight fail",
            self.config.pool,
            len(failed),
        )

    def _admit(self, request_id: str, needed: list[str], wait_s: float) -> bool:
        return self.loads.admit(
            request_id,
            needed,
            self._ready,
            time.monotonic(),
            wait_s,
            pending=self._pending,
            pending_wait_s=self.config.pending_wait_s,
        )

    def _ready(self, key: str) -> bool:
        return self.view.has(key.encode())

    def _pending(self, key: str) -> bool:
        return self.view.pending(key.encode())

    def _loadable(self, spec: TensorSpec) -> bool:
        """Encoder outputs are (rows, width) in the model dtype; anything else is not ours."""
        return len(spec.shape) == 2 and spec.dtype == self.config.dtype

    def _save_spec(self, feature: MultiModalFeatureSpec) -> TensorSpec | None:
        try:
            width = get_encoder_output_width(self._vllm_config, feature.modality)
        except ValueError as error:
            if feature.modality not in self._no_width:
                self._no_width.add(feature.modality)
                log.warning("not saving %s outputs: %s", feature.modality, error)
            return None
        shape = (feature.mm_position.get_num_embeds(), width)
        return TensorSpec(shape, self.config.dtype, tensor_nbytes(shape, self.config.dtype))
