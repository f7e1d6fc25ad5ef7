"""The gRPC service ecd.v1.EncoderCache: validate, translate, call the store, translate back.

No cache logic lives here. Whole-request failures become gRPC errors with the status code of the
CoreError, its message, and trailing metadata `ecd-reason` (what clients act on, such as
unknown_session) and `ecd-boot-epoch`; per-item failures become per-item statuses. Each value of
`ec_client.types` the store answers with is turned into its message by one function below.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from ec_client import types as api
from ec_client._proto.ecd.v1 import ecd_pb2 as pb
from ec_client._proto.ecd.v1 import ecd_pb2_grpc as pb_grpc
from ec_daemon import validate
from ec_daemon.auth import Action, Guard
from ec_daemon.errors import Code, CoreError, Reason
from ec_daemon.events import EventHub, StreamEnd
from ec_daemon.remote import Remote
from ec_daemon.store import Store

log = logging.getLogger("ecd.service")

T = TypeVar("T")
R = TypeVar("R")
Request = TypeVar("Request")
Reply = TypeVar("Reply")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext[Any, Any]], Awaitable[Reply]]

GRPC_CODE = {code: getattr(grpc.StatusCode, code.value) for code in Code}
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
            self.authorize(method.__name__, request, context)
            return await method(self, request, context)
        except CoreError as exc:
            code = exc.code.value
            await abort(self.store, context, exc)
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


async def abort(store: Store, context: grpc.aio.ServicerContext[Any, Any], exc: CoreError) -> None:
    context.set_trailing_metadata(
        (("ecd-reason", exc.reason.value), ("ecd-boot-epoch", store.boot_epoch))
    )
    await context.abort(GRPC_CODE[exc.code], exc.message)


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


def checked_specs(items: Sequence[pb.AllocateItem]) -> list[tuple[bytes, api.TensorSpec] | str]:
    return [
        spec if isinstance(spec, str) else (item.key, spec)
        for item in items
        for spec in (validate.tensor_spec(item.key, item.tensor),)
    ]


def checked_commits(items: Sequence[pb.CommitItem]) -> list[tuple[bytes, int] | str]:
    return [
        (item.key, item.checksum) if isinstance(key, bytes) else key
        for item, key in zip(items, checked_keys([i.key for i in items]), strict=True)
    ]


def step_actions(request: pb.StepRequest) -> tuple[Action, ...]:
    """What a Step does, part by part, for the access lists."""
    actions = [Action.SESSION]
    if request.commits or request.aborts or request.allocates:
        actions.append(Action.PRODUCE)
    if request.acquires:
        actions.append(Action.CONSUME)
    return tuple(actions)


def checked_keys(keys: Sequence[bytes]) -> list[bytes | str]:
    return [key if (problem := validate.key_problem(key)) is None else problem for key in keys]


# ---- from ec_client.types to messages, one function per value ---------------------------------

STATUS_PB: dict[api.Status, pb.ItemStatus] = {s: getattr(pb, "ITEM_" + s.name) for s in api.Status}
STATE_PB: dict[api.EntryState, pb.EntryState] = {
    s: getattr(pb, "ENTRY_" + s.name) for s in api.EntryState
}
EVENT_PB: dict[api.EventType, pb.EventType] = {
    t: getattr(pb, "EVENT_" + t.name) for t in api.EventType
}
ROLES: dict[pb.Role, api.Role] = {
    pb.ROLE_UNSPECIFIED: api.Role.BOTH,  # clients that do not say are trusted with both
    pb.ROLE_PRODUCER: api.Role.PRODUCER,
    pb.ROLE_CONSUMER: api.Role.CONSUMER,
    pb.ROLE_BOTH: api.Role.BOTH,
    pb.ROLE_ADMIN: api.Role.ADMIN,
}


def extents_pb(extents: Sequence[api.Extent]) -> list[pb.Extent]:
    return [pb.Extent(start=e.start, count=e.count) for e in extents]


def runs_pb(extents: Sequence[api.Extent]) -> list[int]:
    """Extents packed as start, count pairs (a Step's replies): no message per extent."""
    return [n for e in extents for n in (e.start, e.count)]


def spec_pb(spec: api.TensorSpec) -> pb.TensorSpec:
    return pb.TensorSpec(shape=spec.shape, dtype=spec.dtype, nbytes=spec.nbytes)


# Results are filled into messages added to their reply (`reply.results.add()`): a third of the
# cost of building each one with keywords and handing it over, on the per-item hot path.


def put_item_result(into: pb.ItemResult, r: api.ItemResult) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message


def put_extents(
    into: pb.AllocateResult | pb.AcquireResult, extents: tuple[api.Extent, ...], packed: bool
) -> None:
    """A Step's reply packs them as `runs`; Allocate's and Acquire's keep `extents` messages."""
    if packed:
        into.runs.extend(runs_pb(extents))
    else:
        into.extents.extend(extents_pb(extents))


def put_allocate_result(into: pb.AllocateResult, r: api.AllocateResult, packed: bool) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message
    put_extents(into, r.extents, packed)


def put_acquire_result(into: pb.AcquireResult, r: api.AcquireResult, packed: bool) -> None:
    into.key, into.status, into.message = r.key, STATUS_PB[r.status], r.message
    if r.spec is not None:
        into.lease_id, into.checksum = r.lease_id, r.checksum
        put_extents(into, r.extents, packed)
        tensor = into.tensor
        tensor.shape.extend(r.spec.shape)
        tensor.dtype, tensor.nbytes = r.spec.dtype, r.spec.nbytes


def put_lease_result(into: pb.LeaseResult, r: api.LeaseResult) -> None:
    into.lease_id, into.status, into.message = r.lease_id, STATUS_PB[r.status], r.message


def lookup_result_pb(r: api.LookupResult) -> pb.LookupResult:
    return pb.LookupResult(key=r.key, state=STATE_PB[r.state], nbytes=r.nbytes, pins=r.pins)


def entry_info_pb(e: api.EntryInfo) -> pb.EntryInfo:
    return pb.EntryInfo(
        **mirrored(e, "state", "spec", "extents"),
        state=STATE_PB[e.state],
        tensor=spec_pb(e.spec),
        extents=extents_pb(e.extents),
    )


def mirrored(value: Any, *skip: str) -> dict[str, Any]:
    """A value's fields by name, for the message whose fields are declared to match
    (tests/unit/test_types.py), less those the message keeps elsewhere."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name not in skip}


def pool_info_pb(p: api.PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(**mirrored(p, "created"))  # `created` travels in OpenPoolReply


def stats_pb(s: api.Stats) -> pb.StatsReply:
    return pb.StatsReply(
        **mirrored(s, "pools", "peers"),
        pools=[pb.PoolStats(**mirrored(p)) for p in s.pools],
        peers=[pb.PeerStats(**mirrored(p)) for p in s.peers],
    )


def watch_event_pb(e: api.WatchEvent) -> pb.WatchEvent:
    return pb.WatchEvent(
        boot_epoch=e.boot_epoch,
        type=EVENT_PB[e.type],
        engine_id=e.engine_id,
        key=e.key,
        nbytes=e.nbytes,
        remote=e.remote,
    )


def invalid_item(key: bytes, message: str) -> api.ItemResult:
    return api.ItemResult(key, api.Status.INVALID_ARGUMENT, message)


def invalid_allocate(key: bytes, message: str) -> api.AllocateResult:
    return api.AllocateResult(key, api.Status.INVALID_ARGUMENT, message, ())


def invalid_acquire(key: bytes, message: str) -> api.AcquireResult:
    return api.AcquireResult(key, api.Status.INVALID_ARGUMENT, message, 0, (), None, 0)


class EncoderCacheService(pb_grpc.EncoderCacheServicer):
    def __init__(
        self,
        store: Store,
        hub: EventHub,
        limits: validate.Limits,
        observe: Callable[[str, str, float], None] = lambda method, code, seconds: None,
        guard: Guard | None = None,
        remote: Remote | None = None,
    ) -> None:
        """remote: pulls from peer daemons, with --peer."""
        self.store = store
        self.hub = hub
        self.limits = limits
        self.observe = observe
        self.guard = guard or Guard(None, None)
        self.remote = remote

    def authorize(
        self, rpc: str, request: object, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        engine_id = getattr(request, "engine_id", "")
        actions: tuple[Action, ...] = ()
        if isinstance(request, pb.StepRequest):
            actions = step_actions(request)
        elif isinstance(request, pb.OpenPoolRequest) and self.creates(request):
            actions = (Action.PRODUCE,)
        self.guard.check(rpc, engine_id, tuple(context.invocation_metadata() or ()), actions)

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
        if request.role not in ROLES:
            raise CoreError(
                Code.INVALID_ARGUMENT,
                f"unknown role {request.role}: expected one of {sorted(ROLES)} (ecd.v1.Role)",
            )
        name = validate.client_name(request.client_name)
        session_id = self.store.open_session(name, request.pid, ROLES[request.role])
        log.info(
            "session opened", extra={"session": session_id, "client": name, "pid": request.pid}
        )
        return pb.OpenSessionReply(
            boot_epoch=self.epoch, session_id=session_id, lease_ttl_ms=self.lease_ttl_ms
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
                "session": end.session_id,
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
        validate.pool_request(request.block_size_bytes, request.capacity_bytes, request.compat_key)
        try:
            info = self.store.open_pool(
                request.session_id,
                engine_id,
                request.block_size_bytes,
                request.capacity_bytes,
                request.compat_key,
            )
        except CoreError as exc:
            peer_has_it = (
                self.remote.not_here(engine_id)
                if exc.reason is Reason.UNKNOWN_POOL and self.remote is not None
                else None
            )
            raise peer_has_it or exc from None

        return pb.OpenPoolReply(
            boot_epoch=self.epoch, created=info.created, pool=pool_info_pb(info)
        )

    @rpc
    async def DropPool(
        self, request: pb.DropPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DropPoolReply:
        dropped = self.store.drop_pool(validate.engine_id(request.engine_id), request.force)
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
            lambda: checked_specs(request.items),
            lambda engine_id, items: self.store.allocate(request.session_id, engine_id, items),
            invalid_allocate,
            lambda r: put_allocate_result(reply.results.add(), r, packed=False),
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
            lambda: checked_commits(request.items),
            lambda engine_id, items: self.store.commit(request.session_id, engine_id, items),
            invalid_item,
            lambda r: put_item_result(reply.results.add(), r),
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
            lambda: checked_keys(keys),
            run,
            invalid_item,
            lambda r: put_item_result(into.add(), r),
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
        checked = checked_keys(keys)
        # One deadline for both waits: a pull's wait counts against wait_ms.
        deadline = asyncio.get_running_loop().time() + wait_ms / 1000
        if self.remote is not None:  # keys only peers hold: pulled, and waited for
            await self.remote.fetch(request.session_id, engine_id, valid(checked), wait_ms)
        if wait_ms:
            await self._wait_ready(request.session_id, engine_id, valid(checked), deadline)
        results = per_item(
            keys,
            checked,
            lambda valid: self.store.acquire(request.session_id, engine_id, valid),
            invalid_acquire,
        )
        reply = pb.AcquireReply(boot_epoch=self.epoch)
        for r in results:
            put_acquire_result(reply.results.add(), r, packed=False)
        return reply

    async def _wait_ready(
        self, session_id: str, engine_id: str, keys: list[bytes], deadline: float
    ) -> None:
        """Wait until every key is READY or the deadline (the event loop's time) has passed. A
        key PENDING or not there yet is waited for; one aborted meanwhile is waited for again
        (another producer may take it over). Each round's lookup and its waiters' registration
        happen in one synchronous step (wait_settled registers before it first awaits), so no
        commit slips between them. Pins are taken only after the wait, so a caller that gives up
        while waiting holds nothing, and a wait the daemon's shutdown ends is UNAVAILABLE, safe
        to retry."""
        loop = asyncio.get_running_loop()
        while (waits := self.store.keys_to_wait_for(session_id, engine_id, keys)) and (
            left := deadline - loop.time()
        ) > 0:
            await self.hub.wait_settled(engine_id, waits, left)
            if self.hub.waits_ended:
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
            put_lease_result(reply.results.add(), r)
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
        commits, aborts = checked_commits(request.commits), checked_keys(request.aborts)
        acquires, allocates = checked_keys(request.acquires), checked_specs(request.allocates)
        result = self.store.step(
            request.session_id,
            engine_id,
            request.releases,
            valid(commits),
            valid(aborts),
            valid(acquires),
            valid(allocates),
        )
        if self.remote is not None:  # acquires only peers can answer: pulled, and waited for
            result = await self.remote.step(request.session_id, engine_id, valid(acquires), result)
        reply = pb.StepReply(boot_epoch=self.epoch)
        for lease in result.releases:
            put_lease_result(reply.releases.add(), lease)
        commit_keys = [i.key for i in request.commits]
        for item in reinsert(commit_keys, commits, result.commits, invalid_item):
            put_item_result(reply.commits.add(), item)
        for item in reinsert(request.aborts, aborts, result.aborts, invalid_item):
            put_item_result(reply.aborts.add(), item)
        for hit in reinsert(request.acquires, acquires, result.acquires, invalid_acquire):
            put_acquire_result(reply.acquires.add(), hit, packed=True)
        allocate_keys = [i.key for i in request.allocates]
        for new in reinsert(allocate_keys, allocates, result.allocates, invalid_allocate):
            put_allocate_result(reply.allocates.add(), new, packed=True)
        return reply

    @rpc
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupReply:
        engine_id = validate.engine_id(request.engine_id)
        validate.batch(len(request.keys), self.limits)
        results = self.store.lookup(engine_id, request.keys)
        return pb.LookupReply(boot_epoch=self.epoch, results=[lookup_result_pb(r) for r in results])

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
            entries=[entry_info_pb(e) for e in entries],
        )

    # ---- observation ---------------------------------------------------------------------------

    @rpc
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatsReply:
        engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
        return stats_pb(self.store.stats(engine_id))

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchEvent]:
        try:
            self.authorize("Watch", request, context)
            engine_id = validate.engine_id(request.engine_id) if request.engine_id else ""
            if engine_id:
                self.store.pool_info(engine_id)  # NOT_FOUND for a pool that does not exist
            # Snapshot and subscription in one synchronous step, so no event falls between.
            remote = self.remote if request.include_remote else None
            snapshot = self.store.ready_snapshot(engine_id) if request.snapshot else []
            if remote is not None and request.snapshot:
                snapshot += remote.snapshot(engine_id)
            subscription = self.hub.subscribe(engine_id, include_remote=remote is not None)
        except CoreError as exc:
            await abort(self.store, context, exc)
            return
        try:
            if request.snapshot:
                for ready in snapshot:
                    yield watch_event_pb(ready)
                yield pb.WatchEvent(
                    boot_epoch=self.epoch, type=pb.EVENT_SYNCED, engine_id=engine_id
                )
            while True:
                event = await subscription.queue.get()
                if event is StreamEnd.SHUTDOWN:
                    return
                if event is StreamEnd.OVERFLOW:
                    await abort(
                        self.store,
                        context,
                        CoreError(
                            Code.RESOURCE_EXHAUSTED,
                            f"watcher fell more than {subscription.limit} events behind; "
                            "resubscribe with snapshot=true",
                        ),
                    )
                    return
                yield watch_event_pb(event)
        finally:
            self.hub.unsubscribe(subscription)


def add_to_server(service: EncoderCacheService, server: grpc.aio.Server) -> None:
    """Register the service, parsing request bodies here rather than in grpc: a body that is not
    a valid message is the client's mistake (INVALID_ARGUMENT), where grpc would answer UNKNOWN."""
    descriptor = pb.DESCRIPTOR.services_by_name["EncoderCache"]
    handlers = {}
    for method in descriptor.methods:
        request_type = getattr(pb, method.input_type.name)
        serialize = getattr(pb, method.output_type.name).SerializeToString
        implementation = getattr(service, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _parsed_stream(service.store, request_type, implementation),
                response_serializer=serialize,
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsed_unary(service.store, request_type, implementation),
                response_serializer=serialize,
            )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
    )


async def _parse(
    store: Store, request_type: Any, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        await abort(
            store,
            context,
            CoreError(
                Code.INVALID_ARGUMENT,
                f"request body is not a valid {request_type.DESCRIPTOR.full_name}: {exc}",
            ),
        )


def _parsed_unary(
    store: Store, request_type: Any, implementation: Callable[..., Awaitable[Any]]
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await implementation(await _parse(store, request_type, raw, context), context)

    return handle


def _parsed_stream(
    store: Store, request_type: Any, implementation: Callable[..., AsyncIterator[Any]]
) -> Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        async for reply in implementation(await _parse(store, request_type, raw, context), context):
            yield reply

    return handle
