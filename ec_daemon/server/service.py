"""The gRPC service ecd.v1.EncoderCache: check the caller, validate, call the store, answer.

No cache logic lives here, and no translation: `wire.py` turns messages into the store's inputs
and its answers into messages. Whole-request failures become gRPC errors with the status code of
the CoreError, its message, and trailing metadata `ecd-reason` (what clients act on, such as
unknown_session) and `ecd-boot-epoch`; per-item failures become per-item statuses, one bad item
never sinking the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from ec_daemon.cluster.tier import Cluster
from ec_daemon.core.errors import Code, CoreError, Reason
from ec_daemon.core.sessions import tag
from ec_daemon.core.store import Store
from ec_daemon.core.waits import For, Outcome
from ec_daemon.server import validate, wire
from ec_daemon.server.auth import Action, Changes, Guard, identity
from ec_daemon.server.events import EventHub, StreamEnd, Subscription
from ec_daemon.server.fd_channel import Tickets
from ec_protocol import types as api
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc

log = logging.getLogger("ecd.service")

T = TypeVar("T")
R = TypeVar("R")
Request = TypeVar("Request")
Reply = TypeVar("Reply")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext[Any, Any]], Awaitable[Reply]]
Metadata = tuple[tuple[str, str | bytes], ...]

# The identity of the caller of the RPC being handled (ec_daemon.server.auth.identity), set by `rpc`
# before the handler runs, in the handler's own task: what OpenSession binds its session to.
CALLER: contextvars.ContextVar[bytes] = contextvars.ContextVar("ecd_caller")

DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 100_000


def rpc(method: Handler[Request, Reply]) -> Handler[Request, Reply]:
    """Check the caller's token and grants, turn CoreError into a gRPC error, time the call."""

    @functools.wraps(method)
    async def handle(
        self: EncoderCacheService, request: Request, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Reply:
        started = time.perf_counter()
        code = "OK"  # the status the call ends with, for the count of RPCs by method and code
        try:
            CALLER.set(self.authorize(method.__name__, request, context))
            return await method(self, request, context)
        except CoreError as exc:
            code = exc.code.value
            await wire.abort(self.store, context, exc)
            raise AssertionError("context.abort returned") from exc
        except asyncio.CancelledError:
            code = "CANCELLED"  # the client went away, or the daemon is stopping
            raise
        except Exception:
            code = "UNKNOWN"  # grpc answers an exception that escapes a handler so
            raise
        finally:
            self.observe(method.__name__, code, time.perf_counter() - started)

    return handle


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> Metadata:
    return tuple(context.invocation_metadata() or ())


def valid(checked: Sequence[T | str]) -> list[T]:
    """The items that passed their checks (a str is an item's reason for failing them)."""
    return [c for c in checked if not isinstance(c, str)]


def reinsert(
    keys: Sequence[bytes],
    checked: Sequence[T | str],
    results: list[R],
    invalid: Callable[[bytes, str], R],
) -> list[R]:
    """The results of the valid items with the invalid ones put back in order: one bad item
    never sinks the others."""
    answers = iter(results)
    return [
        invalid(key, c) if isinstance(c, str) else next(answers)
        for key, c in zip(keys, checked, strict=True)
    ]


def per_item(
    keys: Sequence[bytes],
    checked: Sequence[T | str],
    run: Callable[[list[T]], list[R]],
    invalid: Callable[[bytes, str], R],
) -> list[R]:
    """Run the valid items as one batch and put the invalid ones back in order."""
    return reinsert(keys, checked, run(valid(checked)), invalid)


def step_actions(request: pb.StepRequest) -> tuple[Action, ...]:
    """What a Step does, part by part, for the access lists. Hits and misses a client answered
    itself are a consumer's to owe: they move the pool's counters and its eviction order."""
    actions = [Action.SESSION]
    if request.commits or request.aborts or request.allocates:
        actions.append(Action.PRODUCE)
    if request.acquires or request.hits or request.misses:
        actions.append(Action.CONSUME)
    return tuple(actions)


class EncoderCacheService(pb_grpc.EncoderCacheServicer):
    def __init__(
        self,
        store: Store,
        hub: EventHub,
        limits: validate.Limits,
        observe: Callable[[str, str, float], None] = lambda method, code, seconds: None,
        guard: Guard | None = None,
        cluster: Cluster | None = None,
        tickets: Tickets | None = None,
    ) -> None:
        """cluster: the daemon's part in a Mooncake Store, with --store-master. tickets: those
        of the fd channel, None without one (OpenPool then issues none)."""
        self.store = store
        self.hub = hub
        self.limits = limits
        self.observe = observe
        self.guard = guard or Guard(None, None)
        self.cluster = cluster
        self.tickets = tickets
        # The open Watch streams: each one's pool and its caller's metadata, checked again when
        # the token file and access list are reloaded (update_guard).
        self._watches: dict[Subscription, tuple[str, Metadata]] = {}

    def update_guard(self, new: Guard) -> Changes:
        """Take a reloaded token file and access list. Each later call is checked against them;
        a Watch stream, checked only when it began, is ended now when they no longer allow its
        caller, with the error its next call would get (UNAUTHENTICATED for a token removed)."""
        changes = self.guard.update(new)
        for subscription, (engine_id, metadata) in self._watches.items():
            try:
                self.guard.check("Watch", engine_id, metadata)
            except CoreError as exc:
                subscription.end(exc)
        return changes

    def authorize(
        self, rpc: str, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """Check the caller's token and grants; a call naming a session must come from the
        session's opener (answered as an unknown session otherwise, before anything else about
        the request is looked at, so the answer is the same whether the session exists). Returns
        the caller's identity."""
        engine_id = getattr(request, "engine_id", "")
        actions: tuple[Action, ...] = ()
        if isinstance(request, pb.StepRequest):
            actions = step_actions(request)
        elif isinstance(request, pb.OpenPoolRequest) and self.creates(request):
            actions = (Action.PRODUCE,)
        caller = self.guard.check(rpc, engine_id, metadata_of(context), actions)
        who = identity(caller, context.auth_context())
        session_id = getattr(request, "session_id", None)  # None: a request without the field
        if isinstance(session_id, str):
            self.store.owned(session_id, who)
        return who

    def creates(self, request: pb.OpenPoolRequest) -> bool:
        """Whether this OpenPool would create its pool (it gives a geometry and there is none).

        Nothing awaits between this check and the handler, so the answer still holds there."""
        return request.block_size_bytes != 0 and not self.store.has_pool(request.engine_id)

    @property
    def epoch(self) -> str:
        return self.store.boot_epoch

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.store.lease_ttl_s * 1000)

    # ---- sessions ------------------------------------------------------------------------------

    @rpc
    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionReply:
        if request.role not in wire.ROLES:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"unknown role {request.role}: expected one of {sorted(wire.ROLES)} (ecd.v1.Role)",
            )
        name = validate.client_name(request.client_name)
        session_id = self.store.open_session(
            name, request.pid, wire.ROLES[request.role], CALLER.get()
        )
        log.info(
            "session opened", extra={"session": tag(session_id), "client": name, "pid": request.pid}
        )
        return pb.OpenSessionReply(
            boot_epoch=self.epoch,
            session_id=session_id,
            lease_ttl_ms=self.lease_ttl_ms,
            max_batch=self.limits.max_batch,
        )

    @rpc
    async def KeepAlive(
        self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.KeepAliveReply:
        self.store.keep_alive(request.session_id)
        return pb.KeepAliveReply(boot_epoch=self.epoch, lease_ttl_ms=self.lease_ttl_ms)

    @rpc
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionReply:
        end = self.store.close_session(request.session_id)
        log.info(
            "session closed",
            extra={
                "session": tag(end.session_id),
                "client": end.client,
                "aborted": end.aborted,
                "released": end.released,
            },
        )
        return pb.CloseSessionReply(
            boot_epoch=self.epoch, aborted=end.aborted, released=end.released
        )

    # ---- pools ---------------------------------------------------------------------------------

    @rpc
    async def OpenPool(
        self, request: pb.OpenPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenPoolReply:
        engine_id = validate.engine_id(request.engine_id)
        r = request
        validate.pool_request(r.block_size_bytes, r.capacity_bytes, r.compat_key, r.max_entries)
        info = self.store.open_pool(
            request.session_id,
            engine_id,
            request.block_size_bytes,
            request.capacity_bytes,
            request.compat_key,
            request.ephemeral,
            request.max_entries,
            request.reopen,
            validate.cluster_namespace(request.cluster_namespace),
        )
        # The caller passed the pool's access list (authorize): a ticket to its file, if it can
        # redeem one (only on this machine: on the Unix socket).
        ticket = ""
        if self.tickets is not None and context.peer().startswith("unix:"):
            ticket = self.tickets.issue(request.session_id, engine_id, info.pool_uuid)
        return pb.OpenPoolReply(
            boot_epoch=self.epoch,
            created=info.created,
            pool=wire.pool_info_pb(info),
            fd_ticket=ticket,
        )

    @rpc
    async def DropPool(
        self, request: pb.DropPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DropPoolReply:
        engine_id = validate.engine_id(request.engine_id)
        dropped = self.store.drop_pool(engine_id, request.force, request.session_id)
        return pb.DropPoolReply(boot_epoch=self.epoch, entries_dropped=dropped)

    # ---- entries -------------------------------------------------------------------------------

    @rpc
    async def Allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AllocateReply:
        reply = pb.AllocateReply(boot_epoch=self.epoch)
        self._batch(
            request.engine_id,
            [item.key for item in request.items],
            lambda: wire.checked_specs(request.items),
            lambda engine_id, items: self.store.allocate(request.session_id, engine_id, items),
            wire.invalid_allocate,
            lambda r: wire.put_allocate_result(reply.results.add(), r, packed=False),
        )
        return reply

    @rpc
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CommitReply:
        reply = pb.CommitReply(boot_epoch=self.epoch)
        self._batch(
            request.engine_id,
            [item.key for item in request.items],
            lambda: wire.checked_commits(request.items),
            lambda engine_id, items: self.store.commit(request.session_id, engine_id, items),
            wire.invalid_item,
            lambda r: wire.put_item_result(reply.results.add(), r),
        )
        return reply

    @rpc
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortReply:
        reply = pb.AbortReply(boot_epoch=self.epoch)
        self._keyed(
            request.engine_id,
            request.keys,
            lambda engine_id, keys: self.store.abort(request.session_id, engine_id, keys),
            reply.results,
        )
        return reply

    @rpc
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EvictReply:
        reply = pb.EvictReply(boot_epoch=self.epoch)
        self._keyed(request.engine_id, request.keys, self.store.evict, reply.results)
        return reply

    @rpc
    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteReply:
        reply = pb.DeleteReply(boot_epoch=self.epoch)
        self._keyed(request.engine_id, request.keys, self.store.delete, reply.results)
        return reply

    def _keyed(
        self,
        engine_id: str,
        keys: Sequence[bytes],
        run: Callable[[str, list[bytes]], list[api.ItemResult]],
        into: Any,
    ) -> None:
        """A batch of keys against one pool, answered with ItemResults `into` the reply."""
        self._batch(
            engine_id,
            keys,
            lambda: wire.checked_keys(keys),
            run,
            wire.invalid_item,
            lambda r: wire.put_item_result(into.add(), r),
        )

    def _batch(
        self,
        engine_id: str,
        keys: Sequence[bytes],
        check: Callable[[], Sequence[T | str]],
        run: Callable[[str, list[T]], list[R]],
        invalid: Callable[[bytes, str], R],
        put: Callable[[R], None],
    ) -> None:
        """A batch of items against one pool: check the pool's name and the batch's size (the
        whole call fails on those), then each item (one failing alone), run the valid ones, and
        `put` every result into the reply in the items' order."""
        engine_id = validate.engine_id(engine_id)
        validate.batch(len(keys), self.limits)
        for result in per_item(keys, check(), lambda valid: run(engine_id, valid), invalid):
            put(result)

    @rpc
    async def Acquire(
        self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AcquireReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.keys), self.limits)
        wait_ms = validate.wait_ms(request.wait_ms)
        keys = list(request.keys)
        checked = wire.checked_keys(keys)
        # One deadline for both waits: a fetch's wait counts against wait_ms.
        deadline = self.hub.waits.deadline(wait_ms / 1000)
        if self.cluster is not None:  # keys of a shared pool the store has: fetched, waited for
            await self.cluster.fetch(request.session_id, engine_id, valid(checked), wait_ms)
        if wait_ms:
            await self._wait_ready(request.session_id, engine_id, valid(checked), deadline)
        results = per_item(
            keys,
            checked,
            lambda valid: self.store.acquire(request.session_id, engine_id, valid),
            wire.invalid_acquire,
        )
        reply = pb.AcquireReply(boot_epoch=self.epoch)
        for r in results:
            wire.put_acquire_result(reply.results.add(), r, packed=False)
        return reply

    async def _wait_ready(
        self, session_id: str, engine_id: str, keys: list[bytes], deadline: float
    ) -> None:
        """Wait until every key is READY or the deadline (the waits' clock) has passed. A key
        PENDING or not there yet is waited for; one aborted meanwhile is waited for again
        (another producer may take it over). Each round's lookup and its wait's registration
        happen in one synchronous step (EventHub.wait_for registers before it first awaits), so
        no commit slips between them. Pins are taken only after the wait, so a caller that gives
        up while waiting holds nothing, and a wait the daemon's shutdown ends is UNAVAILABLE,
        safe to retry."""
        while waits := self.store.keys_to_wait_for(session_id, engine_id, keys):
            ended = await self.hub.wait_for(For.ENTRY, engine_id, waits, deadline)
            if ended is Outcome.EXPIRED:
                return
            if ended is Outcome.SHUT_DOWN:
                raise CoreError(
                    Code.UNAVAILABLE,
                    "ecd is shutting down: the wait ended before its time and nothing was pinned; "
                    "retry (the client library does) once it is back",
                    Reason.SHUTTING_DOWN,
                )

    @rpc
    async def Release(
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReleaseReply:
        validate.batch(len(request.lease_ids), self.limits)
        results = self.store.release(request.session_id, request.lease_ids)
        reply = pb.ReleaseReply(boot_epoch=self.epoch)
        for r in results:
            wire.put_lease_result(reply.results.add(), r)
        return reply

    @rpc
    async def Step(
        self, request: pb.StepRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StepReply:
        engine_id = validate.engine_id(request.engine_id)
        for part in (
            request.releases,
            request.commits,
            request.aborts,
            request.acquires,
            request.allocates,
        ):
            validate.batch(len(part), self.limits)
        validate.answered(len(request.hits), request.misses)
        commits, aborts = wire.checked_commits(request.commits), wire.checked_keys(request.aborts)
        acquires, allocates = (
            wire.checked_keys(request.acquires),
            wire.checked_specs(request.allocates),
        )
        # A local_only Step's acquires are answered by this node alone (a get with no wait_ms).
        cluster = None if request.local_only else self.cluster

        def local(count_misses: bool) -> api.StepResult:
            return self.store.step(
                request.session_id,
                engine_id,
                request.releases,
                valid(commits),
                valid(aborts),
                valid(acquires),
                valid(allocates),
                count_misses=count_misses,
                hits=request.hits,
            )

        if cluster is None:
            result = local(True)
        else:  # acquires the store can answer: fetched, waited for, its misses counted
            result = await cluster.step(request.session_id, engine_id, valid(acquires), local)
        # Counted last, with nothing left to fail or wait for: a Step that raises left them to
        # the client's next one, so they are counted once (the hits were refreshed for eviction
        # in store.step, ahead of its allocations).
        self.store.count_misses(engine_id, request.misses)
        self.store.count_hits(engine_id, request.hits)
        reply = pb.StepReply(boot_epoch=self.epoch, pool_uuid=result.pool_uuid)
        for lease in result.releases:
            wire.put_lease_result(reply.releases.add(), lease)
        commit_keys = [i.key for i in request.commits]
        for item in reinsert(commit_keys, commits, result.commits, wire.invalid_item):
            wire.put_item_result(reply.commits.add(), item)
        for item in reinsert(request.aborts, aborts, result.aborts, wire.invalid_item):
            wire.put_item_result(reply.aborts.add(), item)
        for hit in reinsert(request.acquires, acquires, result.acquires, wire.invalid_acquire):
            wire.put_acquire_result(reply.acquires.add(), hit, packed=True)
        allocate_keys = [i.key for i in request.allocates]
        for new in reinsert(allocate_keys, allocates, result.allocates, wire.invalid_allocate):
            wire.put_allocate_result(reply.allocates.add(), new, packed=True)
        return reply

    @rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.keys), self.limits)
        results = self.store.lookup(engine_id, request.keys)
        return pb.LookupReply(
            boot_epoch=self.epoch, results=[wire.lookup_result_pb(r) for r in results]
        )

    @rpc
    async def ListEntries(
        self, request: pb.ListEntriesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListEntriesReply:
        engine_id = validate.engine_id(request.engine_id)
        limit = min(request.limit or DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT)
        entries, truncated = self.store.list_entries(engine_id, request.start_after, limit)
        return pb.ListEntriesReply(
            boot_epoch=self.epoch,
            truncated=truncated,
            entries=[wire.entry_info_pb(e) for e in entries],
        )

    # ---- observation ---------------------------------------------------------------------------

    @rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatsReply:
        engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
        return wire.stats_pb(self.store.stats(engine_id))

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchEvent]:
        try:
            self.authorize("Watch", request, context)
            engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
            if engine_id:
                self.store.pool_info(engine_id)  # NOT_FOUND for a pool that does not exist
            # Snapshot and subscription in one synchronous step, so no event falls between.
            pending = request.include_pending
            snapshot = self.store.ready_snapshot(engine_id, pending) if request.snapshot else []
            subscription = self.hub.subscribe(engine_id, pending, call=asyncio.current_task())
        except CoreError as exc:
            await wire.abort(self.store, context, exc)
            return
        self._watches[subscription] = (request.engine_id, metadata_of(context))
        try:
            if request.snapshot and not subscription.ended:  # none for a stream the stop ended
                for ready in snapshot:
                    yield wire.watch_event_pb(ready)
                yield pb.WatchEvent(
                    boot_epoch=self.epoch, type=pb.EVENT_SYNCED, engine_id=engine_id
                )
            while True:
                event = await subscription.queue.get()
                if event is StreamEnd.SHUTDOWN:
                    return
                if isinstance(event, CoreError):
                    await wire.abort(self.store, context, event)
                    return
                if event is StreamEnd.OVERFLOW:
                    await wire.abort(
                        self.store,
                        context,
                        CoreError(
                            Code.RESOURCE_EXHAUSTED,
                            f"watcher fell more than {subscription.limit} events behind; "
                            "resubscribe with snapshot=true",
                        ),
                    )
                    return
                yield wire.watch_event_pb(event)
        finally:
            del self._watches[subscription]
            self.hub.unsubscribe(subscription)
