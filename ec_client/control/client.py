"""Client: the synchronous control client (one session, one shared channel per process).

    with Client("unix:///run/ecd/ecd.sock", name="encoder-0") as c:   # opens a session
        info = c.open_pool("qwen-vl-node1", block_size_bytes=7168, capacity_bytes=8 << 30)

A background thread keeps the session alive (every lease TTL / 3). Every call follows the
recovery rules of `_session` (backoff while the daemon is unreachable, a new session and the
pools reopened after a restart or a lost lease); this module only performs their I/O.

Two things serve the hot path of Producer, Consumer and the vLLM scheduler side (docs/design.md
§12):
- `outbox` (ec_client/control/outbox.py), the client's one background mechanism: what is owed with
  nobody waiting for it (a Commit once its bytes landed, a Release once its load landed, an Abort)
  rides on the next Step to its pool or goes from its thread, and `outbox.step_soon` sends a Step
  from that thread for a caller that must not wait on it; `flush()` waits for all of it so far.
- `view(engine_id)`: the pool's READY keys, followed through Watch (ReadyView), so that a miss
  costs no round trip.

What a call can answer: batched calls return one result per item, in order, whose `status` is
one of those the method lists; a call fails as a whole with `EcdError`, whose `.code` is
INVALID_ARGUMENT (a malformed engine_id, a batch over the limit), NOT_FOUND (unknown pool; an
unknown session is recovered from, not raised), PERMISSION_DENIED (the session's role or the
token's grants do not allow the call), UNAUTHENTICATED (no or a wrong token), RESOURCE_EXHAUSTED
(batch or message over the limit) or UNAVAILABLE (the daemon unreachable past the connect
timeout).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from ec_client.control import _wire
from ec_client.control._base import BaseClient
from ec_client.control._connection import (
    UNREACHED,
    Options,
    await_daemon,
    connection_problem,
    shared_channel,
)
from ec_client.control._session import Done, Pause, Plan, Probe, Reopen, Send, advance
from ec_client.control.outbox import OutboxBatch
from ec_client.control.ready_view import ReadyView
from ec_client.control.tls import TLSFiles
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_protocol.errors import EcdError
from ec_protocol.types import (
    AcquireResult,
    AllocateItem,
    AllocateResult,
    EntryInfo,
    ItemResult,
    Key,
    LeaseResult,
    LookupResult,
    PoolInfo,
    Role,
    Stats,
    StepResult,
    WatchEvent,
)

T = TypeVar("T")


def check_health(
    target: str | None = None,
    *,
    timeout_s: float = 5.0,
    token: str | None = None,
    tls: TLSFiles | None = None,
    service: str = "",
) -> str:
    """The daemon's standard gRPC health status ("SERVING", "NOT_SERVING", ...), without a
    session: cheap enough for probes. EcdError (UNAVAILABLE) if it cannot be reached within
    timeout_s, at once when a connection shows why (no socket there, TLS refused); its message
    names the address and the reason."""
    options = Options.make(target, "health", Role.ADMIN, timeout_s, timeout_s, token, tls)
    # A one-off probe looks at the connection first, so that a missing socket or a refused
    # handshake fails at once rather than after timeout_s of waiting for the daemon.
    problem = connection_problem(options)
    if problem is not None:
        raise options.unreachable(problem)
    return _health(shared_channel(options), options, service)


def _health(channel: grpc.Channel, options: Options, service: str) -> str:
    """One Health.Check on the channel; a daemon not reached is named with the reason a
    connection shows."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            _wire.health_request(service),
            timeout=options.connect_timeout_s,
            metadata=options.metadata,
            wait_for_ready=True,
        )
    except grpc.RpcError as exc:
        error = EcdError.from_rpc(exc)
        if error.code in UNREACHED:
            raise options.unreachable(connection_problem(options)) from None
        raise error from None
    return _wire.health_status(reply)


class WatchStream:
    """An open Watch call. Iterating it yields the events; `cancel()`, from any thread, ends the
    iteration quietly (as the end of the stream); any other failure raises EcdError."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            for event in self._call:
                yield _wire.watch_event(event)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise EcdError.from_rpc(exc) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class Client(BaseClient):
    # Its constructor and what never waits on the daemon are BaseClient's (`_base`).

    def _begin(self, keepalive: bool) -> None:
        self._channel = shared_channel(self.options)
        self._stub = pb_grpc.EncoderCacheStub(self._channel)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        await_daemon(self.options, self.options.wait_for_daemon_s)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.options.connect_timeout_s)
        except grpc.FutureTimeoutError:
            raise self.options.unreachable(connection_problem(self.options)) from None
        self._drive(self._state.open())
        self._keepalive: threading.Thread | None = None
        if keepalive:
            self._keepalive = threading.Thread(
                target=self._keep_alive_loop, name="ecd-keepalive", daemon=True
            )
            self._keepalive.start()

    # ---- session -------------------------------------------------------------------------------

    def keep_alive(self) -> float:
        """Renew the lease now; returns the lease TTL in seconds."""
        return self._run(_wire.keep_alive())

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Finish the background calls (within flush_timeout_s), stop following pools, close
        the session: the daemon aborts its PENDING entries and releases its pins."""
        if self._closed.is_set():
            return
        with contextlib.suppress(TimeoutError):
            self.flush(flush_timeout_s)
        self._closed.set()
        self.outbox.close()
        self._views.close()
        with contextlib.suppress(EcdError):
            self._drive(self._state.close())

    # ---- what is owed and the views of pools ---------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything owed now, and wait until it and every Step asked of `outbox.step_soon`
        so far have been answered (TimeoutError if not within timeout_s)."""
        self.outbox.flush(timeout_s)

    def view(self, engine_id: str) -> ReadyView:
        """The READY keys of a pool this client opened, followed from now on (one Watch stream
        per pool per client, until close)."""
        return self._views.get(engine_id)

    def known_ready(self, engine_id: str, keys: Sequence[Key]) -> None:
        """This client committed `keys`: its view of the pool (if it follows one) has them READY
        before the daemon's events come back."""
        self._views.known_ready(engine_id, keys)

    def reopen_pool(self, engine_id: str) -> PoolInfo:
        """OpenPool again with what this client opened it with (after a restart, or a pool file
        replaced): attaches, or makes again a pool the daemon lost (a refused file removed, say),
        but never one dropped while this client had it open (FAILED_PRECONDITION, reason
        pool_dropped): only `open_pool` makes that again."""
        return self._drive(self._state.reopen_pool(engine_id))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pools ---------------------------------------------------------------------------------

    def open_pool(
        self,
        engine_id: str,
        block_size_bytes: int = 0,
        capacity_bytes: int = 0,
        compat_key: str = "",
        ephemeral: bool = False,
        max_entries: int = 0,
        cluster_namespace: str = "",
    ) -> PoolInfo:
        """Create the pool, or attach to it if it exists with the same geometry and compat_key.
        With no geometry (`open_pool("name")`), only attach, whatever the pool's geometry and
        compat_key: a consumer need not know them. The client remembers the call and makes it
        again after a daemon restart.

        `ephemeral`: the pool lives only as long as the sessions that opened it; the daemon drops
        it when the last of them ends, closed or killed (its lease runs out). For a name nobody
        else knows, whose pool would otherwise outlive a client killed before it dropped it.

        `max_entries`: how many entries the pool holds at once (its slot table, 512 bytes of
        file each); 0 takes the daemon's default (--entries-per-pool, or one per 32 KiB of
        capacity). A pool of entries smaller than that evicts to free slots with blocks to spare
        (Stats' evictions_for_entries): ask for more. At most one per block and the daemon's
        limit (RESOURCE_EXHAUSTED over it); given, it must match an existing pool's.

        `cluster_namespace`: share the pool's entries with other nodes through the daemon's
        Mooncake Store, under this namespace (vLLM's, for a pool vLLM engines share too:
        docs/design.md §13). The first OpenPool that names one sets it; another one is
        FAILED_PRECONDITION; empty leaves the pool as it is.

        Raises INVALID_ARGUMENT (bad name or sizes), NOT_FOUND (attaching to a pool that does
        not exist), FAILED_PRECONDITION (it exists with another geometry, compat_key or
        cluster_namespace, or its file was refused), RESOURCE_EXHAUSTED (over the budget, the
        per-pool limit, or the shm directory is full)."""
        call, again = _wire.open_pool_calls(
            engine_id,
            block_size_bytes,
            capacity_bytes,
            compat_key,
            ephemeral,
            max_entries,
            cluster_namespace,
        )
        return self._drive(self._state.open_pool(call, again))

    def drop_pool(self, engine_id: str, force: bool = False) -> int:
        """Delete the pool and its file; returns the entries dropped. FAILED_PRECONDITION while
        entries are PENDING or pinned, unless forced."""
        return self._drive(self._state.drop_pool(engine_id, force))

    # ---- entries -------------------------------------------------------------------------------

    def allocate(self, engine_id: str, items: Sequence[AllocateItem]) -> list[AllocateResult]:
        """Reserve blocks for new entries (PENDING until committed). Per item: ALLOCATED (write
        the extents, then commit), EXISTS (READY already), PENDING (another producer is writing
        it), NO_SPACE (full of PENDING or pinned entries), INVALID_ARGUMENT (bad key or spec,
        or larger than the whole pool), FAILED_PRECONDITION (allocated before with another
        spec)."""
        return self._run(_wire.allocate(engine_id, items))

    def commit(
        self,
        engine_id: str,
        keys: Sequence[Key],
        checksums: Sequence[int] | None = None,
        allocations: Sequence[int] | None = None,
    ) -> list[ItemResult]:
        """Make PENDING entries READY (call only once their bytes landed). `allocations`: the
        `AllocateResult.allocation` each key's bytes were written into, so that a key deleted
        and allocated again meanwhile is not made READY before its new bytes are written
        (without them, whatever allocation of the key this session has PENDING). Per item: OK,
        NOT_FOUND (never allocated, aborted, the lease ran out, or allocated again since),
        FAILED_PRECONDITION (READY already, or another session's), INVALID_ARGUMENT (bad
        key)."""
        return self._run(_wire.commit(engine_id, keys, checksums, allocations))

    def abort(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        """Drop this session's PENDING entries. Per item: as commit."""
        return self._run(_wire.abort(engine_id, keys))

    def acquire(self, engine_id: str, keys: Sequence[Key], wait_ms: int = 0) -> list[AcquireResult]:
        """Pin READY entries for reading. With wait_ms, a key PENDING or not there yet is
        waited for until it is READY (the call returns at its commit) or wait_ms runs out. Per
        item: HIT (read the extents, then release the lease), MISS (not there, after waiting
        wait_ms for it), PENDING (a producer was still writing it when wait_ms ran out: it is
        coming, wait more or encode it yourself), INVALID_ARGUMENT (bad key). Consumer.get
        answers None for both MISS and PENDING; this call tells them apart."""
        return self._run(_wire.acquire(engine_id, keys, wait_ms))

    def release(self, lease_ids: Sequence[int]) -> list[LeaseResult]:
        """Drop pins (call only once the reads landed). Per item: OK, NOT_FOUND (released
        already, never issued, or another session's)."""
        return self._run(_wire.release(lease_ids))

    def step(
        self,
        engine_id: str,
        *,
        releases: Sequence[int] = (),
        commits: Sequence[Key] = (),
        checksums: Sequence[int] | None = None,
        aborts: Sequence[Key] = (),
        acquires: Sequence[Key] = (),
        allocates: Sequence[AllocateItem] = (),
        local_only: bool = False,
    ) -> StepResult:
        """Release, Commit, Abort, Acquire (without waiting) and Allocate in one round trip, in
        that order (releases and aborts free space first; commits are visible to the acquires;
        the acquires pin their entries before the allocations could evict them). Each part's
        results are what its own call answers. It also carries what this client owes the pool
        (see `outbox`; a Commit of a key it acquires or allocates, or an Abort of one it
        allocates, that another Step carries is answered first); the results returned are those
        of the parts given here. In a pool shared through a cluster store, an acquire of a key
        the node lacks is read from the store (a remote hit, docs/design.md §13), unless
        `local_only` (then it is a miss, as for a get with no wait_ms)."""
        own_commits = _wire.commit_items(commits, checksums)  # refused before anything is taken
        batch = self.outbox.take(engine_id, reading=acquires, writing=[i.key for i in allocates])
        call = batch.step(engine_id, releases, own_commits, aborts, acquires, allocates, local_only)
        return self._send_batch(batch, call)

    def lookup(self, engine_id: str, keys: Sequence[Key]) -> list[LookupResult]:
        """State (ABSENT, PENDING, READY), size and pins of each key; pins nothing."""
        return self._run(_wire.lookup(engine_id, keys))

    def evict(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        """Drop READY unpinned entries. Per item: OK, NOT_FOUND, FAILED_PRECONDITION (PENDING or
        pinned: use delete), INVALID_ARGUMENT."""
        return self._run(_wire.evict(engine_id, keys))

    def delete(self, engine_id: str, keys: Sequence[Key]) -> list[ItemResult]:
        """Drop entries in any state (a pinned one keeps its blocks until its last release).
        Per item: OK, NOT_FOUND, INVALID_ARGUMENT."""
        return self._run(_wire.delete(engine_id, keys))

    def list_entries(
        self, engine_id: str, limit: int = 0, start_after: Key = b""
    ) -> tuple[list[EntryInfo], bool]:
        """One page of entries in key order, and whether more follow."""
        return self._run(_wire.list_entries(engine_id, limit, start_after))

    def iter_entries(self, engine_id: str, page: int = 1000) -> Iterator[EntryInfo]:
        """Every entry of a pool in key order, a page per RPC."""
        start_after: bytes | None = b""
        while start_after is not None:
            entries, truncated = self.list_entries(engine_id, page, start_after)
            yield from entries
            start_after = _wire.next_page(entries, truncated)

    # ---- observation ---------------------------------------------------------------------------

    def stats(self, engine_id: str = "") -> Stats:
        """Daemon figures and those of one pool (or every pool)."""
        return self._run(_wire.stats(engine_id))

    def health(self, service: str = "") -> str:
        """The daemon's health status name, e.g. SERVING or NOT_SERVING: one round trip on this
        client's channel (the baseline `ecd bench` measures against)."""
        self._state.check_open()
        return _health(self._channel, self.options, service)

    def watch(
        self,
        engine_id: str = "",
        snapshot: bool = False,
        include_pending: bool = False,
    ) -> Iterator[WatchEvent]:
        """Events of one pool (or all) as they happen; with snapshot, first every READY key and
        then a SYNCED event; with include_pending, also PENDING events (in the snapshot too):
        entries allocated whose producer is writing them. Stop early by closing the returned
        generator."""
        return iter(self.open_watch(engine_id, snapshot, include_pending))

    def open_watch(
        self,
        engine_id: str = "",
        snapshot: bool = False,
        include_pending: bool = False,
    ) -> WatchStream:
        """Like watch, as a stream that another thread can end with `cancel()`."""
        self._state.check_open()
        return WatchStream(
            self._stub.Watch(
                _wire.watch_request(engine_id, snapshot, include_pending),
                metadata=self.options.metadata,
            )
        )

    # ---- the I/O of plans ------------------------------------------------------------------------

    def _run(self, call: _wire.Call[T]) -> T:
        return self._drive(self._state.call(call))

    def _send_batch(self, batch: OutboxBatch, call: _wire.Call[StepResult]) -> StepResult:
        return self._drive(self._state.step(batch, call))

    _send_batch_from_thread = _send_batch  # any thread drives a plan with blocking calls

    def _follow(self, engine_id: str) -> ReadyView:
        return ReadyView(self, engine_id, lambda: self.reopen_pool(engine_id))

    def _drive(self, plan: Plan[T]) -> T:
        """Carry out a plan's steps with blocking calls until it returns."""
        reply: Any = None
        error: EcdError | None = None
        while not isinstance(step := advance(plan, reply, error), Done):
            reply, error = None, None
            try:
                reply = self._do(step)
            except EcdError as exc:
                error = exc
            except BaseException:
                plan.close()  # a Step's ops hear that it was interrupted (_session.interrupted)
                raise
        result: T = step.value
        return result

    def _do(self, step: Send | Pause | Probe | Reopen) -> Any:
        if isinstance(step, Send):
            call = step.call
            try:
                return getattr(self._stub, call.method)(
                    call.build(step.session_id),
                    timeout=self.options.call_timeout_s + call.extra_timeout_s,
                    metadata=self.options.metadata,
                )
            except grpc.RpcError as exc:
                raise EcdError.from_rpc(exc) from None
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Probe):
            return connection_problem(self.options)
        with self._lock:
            if self._state.generation != step.generation:
                return None  # another thread reopened the session meanwhile
            self._drive(self._state.reopen())
        self._state.tell_restart()
        return None

    def _keep_alive_loop(self) -> None:
        while not self._closed.wait(max(self._state.lease_ttl_s / 3, 0.05)):
            try:
                self.keep_alive()
            except EcdError:
                continue  # daemon down: the next round retries, and reopens when it is back
